"""serve/: a multilingual model behind the server beside a bilingual one. Every direction of it listed and routed
(the bilingual model taking the pair both have), `source: auto` detecting among the sources of the target asked
for, one batch mixing directions, and the command serving such a checkpoint."""

import asyncio
import dataclasses
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from near_ties import greedy_near_ties, reference_model
from serving import Running, start_process

from seq2seq.decoding.config import SearchConfig
from seq2seq.inference.translator import Translator
from seq2seq.serve.app import create_app, routes
from seq2seq.serve.batcher import Batcher

SEARCH = SearchConfig(beam_size=2, max_len_b=20)
ENGLISH = ["A man is riding a bike.", "Two dogs are playing in the snow."]
GERMAN = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau liest ein Buch."]
FRENCH = ["Un homme fait du vélo.", "Deux chiens jouent dans la neige.", "Une femme lit un livre."]


@pytest.fixture(scope="module")
def multilingual(multilingual_run: Path) -> Translator:
    return Translator.from_checkpoint(multilingual_run / "checkpoints" / "best.ckpt", precision="fp32")


@pytest.fixture(scope="module")
def bilingual(trained: Path) -> Translator:
    return Translator.from_checkpoint(trained, precision="fp32")  # en→de, as the multilingual model has too


@pytest.fixture(scope="module")
def server(multilingual: Translator, bilingual: Translator):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    running = Running(create_app([multilingual, bilingual], SEARCH, max_wait=0.02))  # (the multilingual first)
    yield running
    running.stop()
    torch.set_num_threads(threads)


def test_every_direction_is_listed_and_each_pair_goes_to_its_most_specific_model(server, multilingual, bilingual):
    assert httpx.get(server.url + "/languages").json() == [
        {"code": "de", "name": "German", "targets": ["en"]}, {"code": "en", "name": "English", "targets": ["de", "fr"]},
        {"code": "fr", "name": "French", "targets": ["en"]}]
    url = server.url + "/translate"
    french = httpx.post(url, json={"q": ENGLISH, "source": "en", "target": "fr"}).json()["translatedText"]
    assert french == multilingual.for_target("fr").translate(ENGLISH, SEARCH)
    german = httpx.post(url, json={"q": ENGLISH[0], "source": "en", "target": "de"}).json()["translatedText"]
    assert german == bilingual.translate(ENGLISH[:1], SEARCH)[0]  # the bilingual model, not the multilingual one
    v1 = httpx.post(server.url + "/v1/translate", json={"q": ENGLISH[:1], "source": "en", "target": "fr",
                                                        "alignments": True}).json()
    assert v1["translations"][0][0]["text"] == french[0]
    [[expected]] = multilingual.for_target("fr").translate_nbest(ENGLISH[:1], dataclasses.replace(SEARCH, alignments=True))
    assert v1["translations"][0][0]["alignment"] == [list(pair) for pair in expected.alignment]
    health = httpx.get(server.url + "/health").json()
    assert [m["directions"] for m in health["models"]] == [[["de", "en"], ["en", "fr"], ["fr", "en"]], [["en", "de"]]]
    assert "source" not in health["models"][0] and health["models"][1]["source"] == "en"
    assert health["requests"] == sum(m["requests"] for m in health["models"]) == 3


def test_source_auto_detects_among_the_sources_of_the_target(server, multilingual):
    mixed = [GERMAN[1], FRENCH[1], GERMAN[2], FRENCH[2]]
    reply = httpx.post(server.url + "/translate", json={"q": mixed, "source": "auto", "target": "en"}).json()
    detected = [d["language"] for d in reply["detectedLanguage"]]
    assert detected == ["de", "fr", "de", "fr"]
    english = multilingual.for_target("en")
    assert reply["translatedText"] == [english.translate([text], SEARCH)[0] for text in mixed]
    unserved = httpx.post(server.url + "/translate", json={"q": GERMAN[0], "source": "de", "target": "fr"})
    assert unserved.status_code == 400 and "it translates de to en, en to de, en to fr, fr to en" in unserved.json()["error"]


def test_one_decoder_call_mixes_directions_and_each_sentence_keeps_its_own(multilingual: Translator,
                                                                           multilingual_run: Path):
    """Requests into French and into English queued before the batcher runs are decoded in one call: each source
    carries its target's tag, so each comes out as it does alone (or differs at a near-tie of the model's own)."""
    greedy = SearchConfig(beam_size=1, max_len_b=20)
    french, english = multilingual.for_target("fr"), multilingual.for_target("en")
    jobs = [(french, ENGLISH), (english, GERMAN), (english, FRENCH)]

    async def decode_together() -> tuple[list[list[int]], Batcher]:
        batcher = Batcher(multilingual, max_wait=0.0)
        futures = []
        for translator, texts in jobs:
            inputs = translator.prepare_inputs(texts, greedy)
            futures.append(batcher.submit(inputs, greedy, costs=inputs.costs(greedy, max_positions=128)))
        task = asyncio.create_task(batcher.run())
        results = await asyncio.gather(*futures)
        task.cancel()
        await batcher.drain()
        return [hyps[0].tokens for result in results for hyps in result], batcher

    together, batcher = asyncio.run(decode_together())
    assert batcher.stats.batches == 1 and batcher.stats.sentences == 8
    sources = [ids for translator, texts in jobs for ids in translator.prepare_inputs(texts, greedy).ids]
    alone = [hyps[0].tokens for translator, texts in jobs for hyps in translator.translate_nbest(texts, greedy)]
    tokenizer = multilingual.tokenizer
    reference = reference_model(multilingual_run / "checkpoints" / "best.ckpt")
    assert not greedy_near_ties(reference, sources, together, alone, precision="fp32", bos=tokenizer.bos_id,
                                eos=tokenizer.eos_id)


def test_routes_prefer_the_most_specific_model_and_refuse_what_cannot_be_served(multilingual, bilingual):
    assert routes([multilingual, bilingual]) == {("de", "en"): 0, ("en", "fr"): 0, ("fr", "en"): 0, ("en", "de"): 1}
    assert routes([bilingual, multilingual])[("en", "de")] == 0
    with pytest.raises(ValueError, match=r"two models translate en to de \(the 1\. and 2\. --checkpoint\)"):
        routes([bilingual, bilingual])
    with pytest.raises(ValueError, match=r"the 2\. --checkpoint would serve nothing"):
        routes([multilingual, multilingual])


def test_the_command_serves_every_direction_of_a_multilingual_checkpoint(multilingual_run: Path):
    repo = Path(__file__).resolve().parents[2]
    process, url, _ = start_process([sys.executable, "-m", "seq2seq.serve"], multilingual_run / "checkpoints" /
                                    "best.ckpt", "--beam", "2", cwd=repo, stderr=subprocess.PIPE, text=True)
    try:
        codes = {entry["code"]: entry["targets"] for entry in httpx.get(url + "/languages").json()}
        assert codes == {"de": ["en"], "en": ["de", "fr"], "fr": ["en"]}
        reply = httpx.post(url + "/translate", json={"q": ENGLISH[0], "source": "en", "target": "fr"})
        assert reply.status_code == 200 and reply.json()["translatedText"]
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    assert "en→de, en→fr, de→en, fr→en on http://127.0.0.1" in stderr
    refused = subprocess.run([sys.executable, "-m", "seq2seq.serve", "--checkpoint", "x.ckpt",
                              "--tgt-lang", "fr"], cwd=repo, capture_output=True, text=True)
    assert refused.returncode == 2 and "unrecognized arguments: --tgt-lang fr" in refused.stderr
