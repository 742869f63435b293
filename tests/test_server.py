"""Tests for serve/server.py: a real server on 127.0.0.1, called by LibreTranslate's own client,
by httpx with JSON and form bodies, concurrently (batching), and with every kind of bad request."""

import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from libretranslatepy import LibreTranslateAPI

from seq2seq.search import SearchConfig
from seq2seq.translator import Translator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "serve"))
from server import Batcher, Busy, create_app  # noqa: E402

SENTENCES = ["A dog runs across the meadow .", "Two men play football in the park .", "A woman reads a book .",
             "The children sing .", "A man rides a bike in the city while it rains .", "People stand outside ."]
SEARCH = SearchConfig(beam_size=3)


class Running:
    """A uvicorn server in a thread of this process, on a free loopback port."""

    def __init__(self, app):
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def translator(trained: Path) -> Translator:
    """The demo-corpus model (en→de) in float64: a batch's padding cannot flip a near-tie, so results
    must equal those of each sentence alone."""
    loaded = Translator.from_checkpoint(trained, precision="fp32")
    return Translator(model=loaded.model.double(), tokenizer=loaded.tokenizer, src_lang=loaded.src_lang,
                      tgt_lang=loaded.tgt_lang)


@pytest.fixture(scope="module")
def server(translator: Translator):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    running = Running(create_app(translator, SEARCH, max_wait=0.05, char_limit=500))
    yield running
    running.stop()
    torch.set_num_threads(threads)


def alone(translator: Translator, text: str, search: SearchConfig = SEARCH) -> str:
    return translator.translate([text], search)[0]


def test_libretranslate_client(server: Running, translator: Translator):
    client = LibreTranslateAPI(server.url + "/")
    assert client.translate(SENTENCES[0], "en", "de") == alone(translator, SENTENCES[0])
    assert client.languages() == [{"code": "en", "name": "English", "targets": ["de"]},
                                  {"code": "de", "name": "German", "targets": []}]


def test_json_and_form_bodies_lists_and_alternatives(server: Running, translator: Translator):
    url = server.url + "/translate"
    reply = httpx.post(url, json={"q": SENTENCES[:3], "source": "en", "target": "de"})
    assert reply.status_code == 200
    assert reply.json() == {"translatedText": [alone(translator, s) for s in SENTENCES[:3]]}
    form = httpx.post(url, data={"q": SENTENCES[1], "source": "auto", "target": "de", "format": "text"})
    assert form.json() == {"translatedText": alone(translator, SENTENCES[1]),
                           "detectedLanguage": {"confidence": 100.0, "language": "en"}}
    raw = "q=Caf\u00e9 ?&source=en&target=de".encode()  # raw UTF-8, not percent-encoded, as `curl -d` sends it
    reply = httpx.post(url, content=raw, headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert reply.json() == {"translatedText": alone(translator, "Caf\u00e9 ?")}
    multipart = httpx.post(url, files={"q": (None, SENTENCES[3]), "source": (None, "en"), "target": (None, "de")})
    assert multipart.json() == {"translatedText": alone(translator, SENTENCES[3])}
    repeated = httpx.post(url, data={"q": SENTENCES[:2], "source": "en", "target": "de"})
    assert repeated.json()["translatedText"] == [alone(translator, s) for s in SENTENCES[:2]]
    nbest = httpx.post(url, json={"q": SENTENCES[2], "source": "en", "target": "de", "alternatives": 2}).json()
    expected = [t.text for t in translator.translate_nbest([SENTENCES[2]], SearchConfig(beam_size=3, nbest=3))[0]]
    assert [nbest["translatedText"], *nbest["alternatives"]] == expected
    own = httpx.post(server.url + "/v1/translate", json={"q": SENTENCES[:2], "beam_size": 4, "nbest": 2}).json()
    theirs = translator.translate_nbest(SENTENCES[:2], SearchConfig(beam_size=4, nbest=2))
    assert [[h["text"] for h in hyps] for hyps in own["translations"]] == [[t.text for t in hyps] for hyps in theirs]
    assert own["translations"][0][0]["score"] == pytest.approx(theirs[0][0].score)


def test_concurrent_requests_share_decoder_batches(server: Running, translator: Translator):
    before = httpx.get(server.url + "/health").json()
    texts = [f"{SENTENCES[i % len(SENTENCES)]}" if i < 6 else f"A dog and {i} cats ." for i in range(16)]

    def one(text: str) -> str:
        reply = httpx.post(server.url + "/translate", json={"q": text, "source": "en", "target": "de"}, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()["translatedText"]

    with ThreadPoolExecutor(len(texts)) as pool:
        answers = list(pool.map(one, texts))
    after = httpx.get(server.url + "/health").json()
    assert answers == [alone(translator, text) for text in texts]  # each its own, as decoded alone
    assert after["requests"] - before["requests"] == len(texts)
    assert after["batches"] - before["batches"] < len(texts) / 2, (before, after)  # measured: 1 to 3 batches


def test_seeded_sampling_does_not_depend_on_the_other_requests(server: Running):
    """Requests with the same seed are decoded alone: one generator over a shared batch would give
    each request draws that depend on what else arrived."""
    body = {"q": [SENTENCES[0], SENTENCES[1]], "sampling": True, "seed": 7, "temperature": 1.5}
    alone = httpx.post(server.url + "/v1/translate", json=body).json()
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda _: httpx.post(server.url + "/v1/translate", json=body, timeout=60).json(),
                                range(4)))
    assert all(reply == alone for reply in replies)


@pytest.mark.parametrize("body,message", [
    ({"q": "Hello .", "source": "de", "target": "en"}, "translates en to de only"),
    ({"q": "Hello .", "source": "en", "target": "fr"}, "translates en to de only"),
    ({"q": "", "source": "en", "target": "de"}, "q is empty"),
    ({"q": ["  ", ""], "source": "en", "target": "de"}, "q is empty"),
    ({"q": [], "source": "en", "target": "de"}, "q is empty"),
    ({"q": "x" * 501, "source": "en", "target": "de"}, "501 characters, more than this server's limit of 500"),
    ({"q": 5, "source": "en", "target": "de"}, "q must be a string or a list of strings"),
    ({"q": ["a", 1], "source": "en", "target": "de"}, "q must be a string or a list of strings"),
    ({"source": "en", "target": "de"}, "missing field q"),
    ({"q": "Hi .", "source": "en", "target": "de", "format": "html"}, "format 'html' is not supported"),
    ({"q": "Hi .", "source": "en", "target": "de", "alternatives": "two"}, "alternatives must be a whole number"),
    ({"q": "Hi .", "source": "en", "target": "de", "alternatives": 50}, "alternatives must be between 0 and 9"),
    ({"q": "Hi .", "source": "en", "target": "de", "alternatives": True}, "alternatives must be a whole number"),
    (["q", "source"], "must be an object"),
])
def test_bad_requests_get_400_and_a_message(server: Running, body, message: str):
    reply = httpx.post(server.url + "/translate", json=body)
    assert reply.status_code == 400 and message in reply.json()["error"], reply.text


def test_bad_bodies_and_options_get_400_and_the_server_keeps_serving(server: Running, translator: Translator):
    url = server.url + "/translate"
    bad_form = httpx.post(url, content=b"q=\xff&source=en&target=de",
                          headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert bad_form.status_code == 400 and "not UTF-8" in bad_form.json()["error"]
    infinite = httpx.post(url, content=b'{"q": "Hi .", "source": "en", "target": "de", "alternatives": 1e999}',
                          headers={"Content-Type": "application/json"})  # Python's json reads 1e999 as inf
    assert infinite.status_code == 400 and "alternatives must be a whole number" in infinite.json()["error"]
    surrogate = httpx.post(url, content=b'{"q": ["ok", "\\ud800"], "source": "en", "target": "de"}',
                           headers={"Content-Type": "application/json"})  # valid JSON, not valid text
    assert surrogate.status_code == 400 and "lone surrogate" in surrogate.json()["error"]
    for content in (b"{not json", b"", "\udcff".encode("utf-8", "surrogatepass")):
        reply = httpx.post(url, content=content, headers={"Content-Type": "application/json"})
        assert reply.status_code == 400 and "error" in reply.json(), reply.text
    v1 = server.url + "/v1/translate"
    for body, message in (({"q": "a", "beam": 3}, "unknown option 'beam'"),
                          ({"q": "a", "beam_size": 0}, "beam_size: must be >= 1"),
                          ({"q": "a", "beam_size": 10**6}, "needs a vocabulary of at least"),
                          ({"q": "a", "length_penalty": "x"}, "length_penalty")):
        reply = httpx.post(v1, json=body)
        assert reply.status_code == 400 and message in reply.json()["error"], reply.text
    assert httpx.get(server.url + "/translate").status_code == 405
    good = httpx.post(url, json={"q": SENTENCES[0], "source": "en", "target": "de"})
    assert good.status_code == 200 and good.json()["translatedText"] == alone(translator, SENTENCES[0])


class Blocking:
    """A Translator stand-in whose decoding waits until released: the queue fills behind it."""

    def __init__(self, translator: Translator):
        self.tokenizer, self.model, self.precision = translator.tokenizer, translator.model, "fp32"
        self.src_lang, self.tgt_lang = translator.src_lang, translator.tgt_lang
        self.release = threading.Event()

    def translate_nbest(self, texts, search, *, max_tokens):
        self.release.wait(timeout=30)
        return [[] for _ in texts]


def test_a_full_queue_answers_429_and_a_slow_one_503(translator: Translator):
    blocking = Blocking(translator)
    running = Running(create_app(blocking, SEARCH, max_queue=1, timeout=1.0, batching=False))
    try:
        url = running.url + "/translate"
        body = {"q": "a", "source": "en", "target": "de"}
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, url, json=body, timeout=30)  # taken by the batcher: decoding
            time.sleep(0.3)
            second = pool.submit(httpx.post, url, json=body, timeout=30)  # waits in the queue (1 place)
            time.sleep(0.3)
            third = httpx.post(url, json=body)
            assert third.status_code == 429 and "queued; retry later" in third.json()["error"]
            assert first.result().status_code == 503 and "no translation within 1 s" in first.result().json()["error"]
            assert second.result().status_code == 503
        blocking.release.set()
        assert httpx.get(running.url + "/health").json()["status"] == "ok"
    finally:
        blocking.release.set()
        running.stop()


def test_batcher_refuses_beyond_its_queue(translator: Translator):
    import asyncio

    async def fill() -> None:
        batcher = Batcher(translator, max_queue=2)
        batcher.submit(["a"], SEARCH)
        batcher.submit(["b"], SEARCH)
        with pytest.raises(Busy):
            batcher.submit(["c"], SEARCH)
        batcher.executor.shutdown()

    asyncio.run(fill())


def test_sigterm_finishes_the_request_in_flight_and_exits_0(trained: Path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, str(REPO / "serve/server.py"), "--checkpoint", str(trained), "--port", str(port),
               "--precision", "fp32", "--threads", "1", "--beam-size", "5"]
    process = subprocess.Popen(command, cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline and process.poll() is None, "the server did not start"
                time.sleep(0.1)
        texts = [f"{s} {s} {s}" for s in SENTENCES] * 5
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, url + "/translate", json={"q": texts, "source": "en", "target": "de"},
                                  timeout=60)
            time.sleep(0.2)
            process.send_signal(signal.SIGTERM)
            reply = pending.result()
        assert reply.status_code == 200 and len(reply.json()["translatedText"]) == len(texts)
        assert process.wait(timeout=60) == 0
        assert "Traceback" not in process.stderr.read()
    finally:
        process.kill()
