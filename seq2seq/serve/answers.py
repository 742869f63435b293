"""What the server answers: a translation as /v1's JSON, and every failure as {"error": ...} with its status (a
bad request 400, a key missing 401 or wrong 403, a body too large 413, a limit reached (with Retry-After) or a
full queue 429, a full file store or a timeout 503; a bug of ours or no memory left 500 or 503, saying nothing of
our internals to the client, and one line on stderr that does), and the refusal's reason in the request's state
for /metrics."""

from __future__ import annotations

import math
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from seq2seq.inference.documents import Translation
from seq2seq.serve.access import Refused
from seq2seq.serve.batcher import Busy, summary
from seq2seq.serve.bodies import BadRequest, TooCostly
from seq2seq.serve.documents import (
    StoreFull,
)
from seq2seq.serve.guards import (
    BodyTooLarge,
)


def out_of_memory(error: BaseException) -> bool:
    # torch's CPU allocator raises a RuntimeError ("DefaultCPUAllocator: can't allocate memory"),
    # CUDA's torch.OutOfMemoryError (a RuntimeError too): neither message is for the client.
    return isinstance(error, MemoryError) or (
        isinstance(error, RuntimeError) and any(s in str(error) for s in ("can't allocate memory", "out of memory")))


def translation_json(translation: Translation) -> dict[str, Any]:
    """/v1's answer for one translation: its text and score (null where the request turned scores off:
    JSON has no NaN), and what the request asked for besides: `alignment` ([[source word, translation
    word], ...]) and `token_scores`."""
    score = translation.score if not math.isnan(translation.score) else None
    out: dict[str, Any] = {"text": translation.text, "score": score}
    if translation.alignment is not None:
        out["alignment"] = [list(pair) for pair in translation.alignment]
    if translation.token_scores is not None:
        out["token_scores"] = translation.token_scores
    if translation.unmet_constraints:
        out["unmet_constraints"] = translation.unmet_constraints
    return out




def answer_errors(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """Each failure as {"error": ...} with its status; an unexpected one is a 500 (503: out of memory)
    that says nothing of our internals, and one line on stderr that does."""

    async def handle(request: Request) -> Response:
        try:
            return await endpoint(request)
        except Refused as error:  # a key missing or wrong, a limit reached: /metrics counts it by its reason
            request.state.rejection = error.reason
            if error.__cause__ is not None:  # the key database failed: the operator's to know, not the client's
                print(f"error: {request.method} {request.url.path}: {error.__cause__}", file=sys.stderr, flush=True)
            headers = {"retry-after": str(math.ceil(error.retry_after))} if error.retry_after is not None else {}
            if error.status == 401:
                headers["www-authenticate"] = "Bearer"
            return JSONResponse({"error": str(error)}, status_code=error.status, headers=headers)
        except BadRequest as error:
            request.state.rejection = "cost" if isinstance(error, TooCostly) else "bad_request"
            return JSONResponse({"error": str(error)}, status_code=400)
        except BodyTooLarge as error:  # the rest of the body is not read: the connection cannot be reused
            request.state.rejection = "body_size"
            return JSONResponse({"error": str(error)}, status_code=413, headers={"connection": "close"})
        except Busy as error:
            request.state.rejection = "queue_full"
            return JSONResponse({"error": str(error)}, status_code=429)
        except StoreFull as error:
            request.state.rejection = "files_full"
            return JSONResponse({"error": str(error)}, status_code=503,
                                headers={"retry-after": str(math.ceil(error.retry_after))})
        except TimeoutError as error:
            request.state.rejection = "timeout"
            return JSONResponse({"error": str(error)}, status_code=503)
        except ClientDisconnect:  # no one to answer: uvicorn drops what is sent
            return JSONResponse({"error": "the client disconnected"}, status_code=400)
        except Exception as error:  # noqa: BLE001  # a bug of ours, or no memory left: the client still gets JSON
            print(f"error: {request.method} {request.url.path}: {summary(error)}", file=sys.stderr, flush=True)
            if out_of_memory(error):
                return JSONResponse({"error": "the server ran out of memory for this request; retry later, or send "
                                              "fewer or shorter sentences"}, status_code=503)
            return JSONResponse({"error": "internal error; the server's log has the details"}, status_code=500)

    return handle
