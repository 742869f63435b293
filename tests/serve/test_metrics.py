"""Tests for seq2seq/serve/metrics.py: /metrics as Prometheus parses it (prometheus_client.parser), its counts
matching what the server was sent, refusals by reason, behind a token; off unless asked for."""

from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from serving import SENTENCES, Running

from seq2seq.inference.translator import Translator
from seq2seq.serve.app import create_app
from seq2seq.serve.metrics import Metrics, endpoint_of


@pytest.fixture(scope="module")
def server(trained: Path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    translator = Translator.from_checkpoint(trained, precision="fp32")
    running = Running(create_app(translator, max_wait=0.01, max_request_tokens=2000, max_body_size=4000,
                                 metrics=Metrics(token="s3cret")))
    yield running
    running.stop()
    torch.set_num_threads(threads)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    answer = httpx.get(url + "/metrics", headers={"authorization": "Bearer s3cret"})
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(answer.text) for sample in family.samples}


def test_metrics_count_what_was_served(server: Running):
    url = server.url
    before = scrape(url)
    for sentence in SENTENCES[:3]:
        assert httpx.post(url + "/translate", json={"q": sentence, "source": "en", "target": "de"}).status_code == 200
    assert httpx.post(url + "/v1/translate", json={"q": SENTENCES[3:5]}).status_code == 200
    costly = httpx.post(url + "/v1/translate", json={"q": ["a b c"] * 100, "beam_size": 4})
    assert costly.status_code == 400 and "max-request-tokens" in costly.json()["error"]
    assert httpx.post(url + "/translate", content=b"x" * 5000, headers={"content-type": "application/json"}
                      ).status_code == 413
    assert httpx.post(url + "/translate", json={"q": "x", "source": "en", "target": "xx"}).status_code == 400
    assert httpx.get(url + "/no/such/path/" + "z" * 50).status_code == 404
    after = scrape(url)

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("seq2seq_http_requests_total", endpoint="/translate", status="200") == 3
    assert grew("seq2seq_http_requests_total", endpoint="/translate", status="413") == 1
    assert grew("seq2seq_http_requests_total", endpoint="/v1/translate", status="400") == 1
    assert grew("seq2seq_http_requests_total", endpoint="other", status="404") == 1  # never the raw path
    assert grew("seq2seq_rejections_total", reason="cost") == 1
    assert grew("seq2seq_rejections_total", reason="body_size") == 1
    assert grew("seq2seq_rejections_total", reason="bad_request") == 1
    assert grew("seq2seq_http_request_duration_seconds_count", endpoint="/translate") == 5
    model = "en-de"
    assert grew("seq2seq_sentences_decoded_total", model=model) == 5
    calls = grew("seq2seq_decoder_calls_total", model=model)
    assert 1 <= calls <= 4 and grew("seq2seq_batch_sentences_count", model=model) == calls
    assert grew("seq2seq_batch_sentences_sum", model=model) == 5
    assert grew("seq2seq_tokens_decoded_total", model=model) >= 5
    assert grew("seq2seq_decoder_busy_seconds_total", model=model) > 0
    assert after[("seq2seq_queue_depth", (("model", model),))] == 0
    assert after[("seq2seq_http_requests_in_flight", (("endpoint", "/metrics"),))] == 1  # (this scrape)
    health = httpx.get(url + "/health").json()
    assert health["sentences"] == after[("seq2seq_sentences_decoded_total", (("model", model),))]


def test_metrics_need_their_token(server: Running):
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
        answer = httpx.get(server.url + "/metrics", headers=headers)
        assert answer.status_code == 401 and "--metrics-token" in answer.json()["error"]


def test_metrics_are_off_unless_asked_for(trained: Path):
    translator = Translator.from_checkpoint(trained, precision="fp32")
    running = Running(create_app(translator))
    try:
        assert httpx.get(running.url + "/metrics").status_code == 404
    finally:
        running.stop()


def test_endpoint_labels_are_bounded():
    assert endpoint_of("/download_file/abc.srt") == "/download_file"
    assert endpoint_of("/static/app.js") == "/static"
    assert {endpoint_of(f"/x{i}") for i in range(100)} == {"other"}
