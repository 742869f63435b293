"""Request bodies as LibreTranslate's clients send them (JSON, url-encoded or multipart forms), read
and checked with each problem a BadRequest of one line."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from python_multipart import MultipartParser
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header
from starlette.requests import Request

MAX_FORM_FIELDS = 1000  # as Starlette's request.form() allows


class BadRequest(Exception):
    """A client error: answered 400 with this message."""


class TooCostly(BadRequest):
    """A request over one of the server's bounds on its cost (characters, decoder tokens, beam, glossary): a 400
    that /metrics counts as a rejection for its cost."""


@dataclass(frozen=True)
class Upload:
    """A file part of a multipart form (/translate_file's `file`): its name as the client gave it, and
    its text."""

    filename: str
    text: str


def shown(value: Any, limit: int = 100) -> str:
    """`value`'s repr for a message, cut to `limit` characters: a client's value may be megabytes."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


async def read_body(request: Request) -> dict[str, Any]:
    """JSON or form fields as a dict; a repeated form field `q` becomes a list."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    fields: dict[str, list[Any]] | None = None
    if content_type == "application/x-www-form-urlencoded":
        # Parsed here: Starlette (python-multipart) reads bytes that are not percent-encoded as
        # latin-1, but `curl -d q=Männer` sends them as raw UTF-8, which LibreTranslate accepts.
        try:
            text = (await request.body()).decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest("the form body is not UTF-8; send UTF-8 text (percent-encoded or raw)") from None
        try:
            fields = urllib.parse.parse_qs(text, keep_blank_values=True, max_num_fields=MAX_FORM_FIELDS)
        except ValueError:
            raise BadRequest(too_many_fields()) from None
    elif content_type == "multipart/form-data":
        fields = await read_multipart(request)
    if fields is not None:
        return {key: values if len(values) > 1 else values[0] for key, values in fields.items()}
    raw = await request.body()
    if not raw:
        raise BadRequest("the request has no body; send JSON (or form fields) with q, source and target")
    example = '{"q": "text", "source": "de", "target": "en"}'
    try:
        body = json.loads(raw)
    except RecursionError:  # json's C parser counts its depth against the recursion limit: no crash
        raise BadRequest(f"the JSON body is nested too deeply; send a flat object such as {example}") from None
    except UnicodeDecodeError:
        raise BadRequest(f"the body is not UTF-8 text; send JSON such as {example}") from None
    except json.JSONDecodeError as error:
        raise BadRequest(f"the body is not valid JSON ({error}); send e.g. {example}") from None
    except ValueError:  # an integer of more than sys.get_int_max_str_digits() (4300) digits
        raise BadRequest("the JSON body holds a number too long to read (over 4300 digits)") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the JSON body must be an object with q, source and target, not a {type(body).__name__}")
    return body


def too_many_fields() -> str:
    return f"the form has more than {MAX_FORM_FIELDS} fields; send fewer sentences per request"


async def read_multipart(request: Request) -> dict[str, list[str | Upload]]:
    """A multipart/form-data body's fields, each name and value UTF-8 (else a BadRequest).

    Parsed with python-multipart here rather than by Starlette's request.form(), which reads a field
    that is not UTF-8 as latin-1 (a url-encoded body is refused then), answers a missing boundary with
    an HTTPException of its own, and spools file parts to temporary files.
    """
    _, params = parse_options_header(request.headers.get("content-type"))
    boundary = params.get(b"boundary")
    if not boundary:
        raise BadRequest("the multipart body has no boundary in its Content-Type; let the HTTP client build "
                         "the form, or send JSON")
    parts: list[tuple[bytes, bytearray, bytes | None]] = []  # name, value, file name (of a file part)
    header = [b"", b""]  # name, value of the part header being read
    disposition = [b""]

    def on_header_end() -> None:
        if header[0].strip().lower() == b"content-disposition":
            disposition[0] = header[1]
        header[:] = [b"", b""]

    def on_headers_finished() -> None:
        if len(parts) >= MAX_FORM_FIELDS:
            raise BadRequest(too_many_fields())
        options = parse_options_header(disposition[0])[1]
        name = options.get(b"name")
        if name is None:
            raise BadRequest("a multipart part has no name in its Content-Disposition; send q, source and target "
                             "as named form fields")
        parts.append((name, bytearray(), options.get(b"filename")))
        disposition[0] = b""

    def add(index: int) -> Callable[[bytes, int, int], None]:
        return lambda data, start, end: header.__setitem__(index, header[index] + data[start:end])

    parser = MultipartParser(boundary, {
        "on_header_field": add(0), "on_header_value": add(1), "on_header_end": on_header_end,
        "on_headers_finished": on_headers_finished,
        "on_part_data": lambda data, start, end: parts[-1][1].extend(data[start:end])})
    try:
        async for chunk in request.stream():
            parser.write(chunk)
        parser.finalize()
    except FormParserError as error:
        raise BadRequest(f"the multipart body is malformed ({error}); let the HTTP client build the form, or "
                         "send JSON") from None
    fields: dict[str, list[str | Upload]] = {}
    for name, value, filename in parts:
        try:
            key = name.decode("utf-8")
            if filename is None:
                fields.setdefault(key, []).append(value.decode("utf-8"))
                continue
            shown_name = filename.decode("utf-8", errors="replace")
            try:
                text = value.decode("utf-8-sig")  # a BOM, as Windows editors write, is not text
            except UnicodeDecodeError:
                raise BadRequest(f"the file {shown(shown_name)} is not UTF-8 text; save it as UTF-8") from None
            fields.setdefault(key, []).append(Upload(filename=shown_name, text=text))
        except UnicodeDecodeError:
            raise BadRequest("the form body is not UTF-8; send UTF-8 text") from None
    return fields


def texts_of(body: dict[str, Any], *, char_limit: int, keep_layout: bool = False) -> tuple[list[str], bool]:
    """The `q` field as a list of strings, and whether it was a single string; with `keep_layout` as
    given (the caller splits them into sentences), else each made one line with single spaces."""
    if "q" not in body:
        raise BadRequest("missing field q: the text to translate (a string or a list of strings)")
    q = body["q"]
    single = isinstance(q, str)
    texts = [q] if single else q
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise BadRequest("q must be a string or a list of strings")
    if not texts or not any(t.strip() for t in texts):
        raise BadRequest("q is empty: give the text to translate")
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest("q holds a lone surrogate (\\ud800-\\udfff without its pair), which is not text; "
                             "send valid Unicode") from None
    chars = sum(len(t) for t in texts)
    if chars > char_limit:
        raise TooCostly(f"q has {chars} characters, more than this server's limit of {char_limit}; "
                         "split the text over several requests")
    if keep_layout:
        return list(texts), single
    # One request line is one sentence to the model: newlines inside would be translated as one.
    return [" ".join(t.split()) for t in texts], single


def int_field(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name, default)
    number = None
    if not isinstance(value, bool):  # JSON true is not a count
        try:
            number = int(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: 1e999 in JSON is infinity
            pass
    if number is None or (isinstance(value, float) and value != number):
        raise BadRequest(f"{name} must be a whole number, got {shown(value)}")
    return number


def api_key(request: Request, body: dict[str, Any]) -> str | None:
    """The request's API key: an `Authorization: Bearer` header, or LibreTranslate's `api_key` field ("" is none);
    None without one. A header of another scheme, or two different keys, is a BadRequest."""
    header = request.headers.get("authorization")
    given = body.get("api_key")
    if given is not None and not isinstance(given, str):
        raise BadRequest("api_key must be a string: the API key")
    if header is not None:
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise BadRequest("the Authorization header must be \"Bearer\" and the API key")
        if given and given != token.strip():
            raise BadRequest("the Authorization header and api_key hold different keys; send one")
        return token.strip()
    return given or None
