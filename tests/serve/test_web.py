"""The translation page (seq2seq/serve/web/) in a real browser: headless Chromium (Debian's `chromium` package,
driven by Playwright; nothing is downloaded) against a real server on loopback with the demo-sized models (the
demo's en→de and the small multilingual model's other directions). What the page shows is checked against what the
server's API answers for the same request, so no test depends on what the models translate.

The page's screenshot for the docs: SEQ2SEQ_SCREENSHOT=docs/images/web-ui.png pytest tests/serve/test_web.py -k shot
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import srt
import torch
from serving import Running, start_process

from seq2seq.inference.translator import Translator
from seq2seq.serve.access import Gate
from seq2seq.serve.app import create_app
from seq2seq.serve.keys import main as keys_main

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.xdist_group("browser")  # one browser for the module, in one worker
playwright = pytest.importorskip("playwright.sync_api")


def chromium() -> str | None:
    """Debian's Chromium (its binary, not the /usr/bin/chromium wrapper script), or $SEQ2SEQ_CHROMIUM."""
    for path in (os.environ.get("SEQ2SEQ_CHROMIUM"), "/usr/lib/chromium/chromium", shutil.which("chromium"),
                 shutil.which("chromium-browser")):
        if path and Path(path).is_file():
            return path
    return None


@pytest.fixture(scope="module")
def browser():
    path = chromium()
    if path is None:
        if os.environ.get("SEQ2SEQ_REQUIRE_BROWSER"):  # .ci/run installs it: missing there fails, never skips
            pytest.fail("no Chromium: apt-get install chromium (.ci/run does)")
        pytest.skip("no Chromium here: apt-get install chromium")
    with playwright.sync_playwright() as driver:
        launched = driver.chromium.launch(executable_path=path, args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def models(trained: Path, multilingual_run: Path) -> list[Translator]:
    return [Translator.from_checkpoint(trained, precision="fp32"),
            Translator.from_checkpoint(multilingual_run / "checkpoints" / "best.ckpt", precision="fp32")]


@pytest.fixture(scope="module")
def server(models: list[Translator]):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    running = Running(create_app(models, max_wait=0.01))
    yield running
    running.stop()
    torch.set_num_threads(threads)


@pytest.fixture
def page(browser, server: Running):
    """A fresh page. Playwright's wait_for_function evaluates its strings, which the page's Content-Security-Policy
    forbids: these pages bypass it, and test_hostile_text_stays_text runs the page under it."""
    context = browser.new_context(viewport={"width": 1280, "height": 800}, bypass_csp=True)
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda error: errors.append(str(error)))
    opened.on("dialog", lambda dialog: errors.append(f"a dialog: {dialog.message}"))
    yield opened
    context.close()
    assert not errors, errors  # no script error, and nothing a hostile text could pop up


def open_page(page, url: str, query: str = "") -> None:
    page.goto(url + "/" + query)
    page.wait_for_selector("body[data-ready=true]")


def v1(url: str, q: list[str], source: str, target: str, **extra) -> list[list[dict]]:
    """The answer the page gets for these sentences: the same body it sends (nbest 4, alignments)."""
    settings = httpx.get(url + "/frontend/settings").json()
    nbest = min(4, settings["maxAlternatives"] + 1)
    body = {"q": q, "source": source, "target": target, "alignments": True, "nbest": nbest,
            "beam_size": max(nbest, settings["beamSize"]), **extra}
    answer = httpx.post(url + "/v1/translate", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["translations"]


def translate(page, text: str) -> None:
    page.fill("#source-text", text)
    page.click("#translate")
    page.wait_for_function("document.querySelectorAll('#output .sentence').length > 0 && "
                           "document.getElementById('status').textContent === ''")


SOURCE = "A dog runs across the meadow . The children sing .\n\nA woman reads a book ."


def test_type_translate_and_see_the_layout_kept(page, server: Running):
    open_page(page, server.url, "?source=en&target=de")
    assert page.input_value("#source") == "en" and page.input_value("#target") == "de"
    translate(page, SOURCE)
    expected = v1(server.url, ["A dog runs across the meadow .", "The children sing .", "A woman reads a book ."],
                  "en", "de")
    best = [hyps[0]["text"] for hyps in expected]
    assert page.text_content("#output") == f"{best[0]} {best[1]}\n\n{best[2]}"
    assert page.locator("#output .sentence").count() == 3
    page.fill("#source-text", "People stand outside .")  # Ctrl+Enter translates at once
    page.press("#source-text", "Control+Enter")
    page.wait_for_function("document.getElementById('output').textContent.length > 0 && "
                           "document.querySelectorAll('#output .sentence').length === 1")
    assert page.text_content("#output") == v1(server.url, ["People stand outside ."], "en", "de")[0][0]["text"]


def test_the_language_choice_is_kept_in_the_url(page, server: Running):
    open_page(page, server.url, "?source=en&target=de")
    page.select_option("#target", "fr")
    assert "source=en" in page.url and "target=fr" in page.url
    open_page(page, server.url, "?source=de&target=en")
    assert page.input_value("#source") == "de" and page.input_value("#target") == "en"
    options = page.eval_on_selector_all("#target option", "options => options.map(o => o.value)")
    assert options == ["en"]  # only what the server translates de into


def test_swap_translates_the_translation_back(page, server: Running):
    open_page(page, server.url, "?source=en&target=de")
    translate(page, "A dog runs across the meadow .")
    translated = page.text_content("#output")
    page.click("#swap")
    page.wait_for_function("document.getElementById('source').value === 'de'")
    assert page.input_value("#target") == "en" and page.input_value("#source-text") == translated
    page.wait_for_function("document.getElementById('status').textContent === '' && "
                           "document.querySelectorAll('#output .sentence').length > 0")
    expected = v1(server.url, [" ".join(translated.split())], "de", "en")[0][0]["text"]
    assert page.text_content("#output") == expected


def test_auto_shows_the_language_it_detected(page, server: Running):
    open_page(page, server.url, "?source=auto&target=en")
    german = "Ein Hund läuft über die Wiese, und die Kinder spielen im Garten."
    translate(page, german)
    assert page.text_content("#detected") == "Detected: German"
    assert page.text_content("#output") == v1(server.url, [german], "de", "en")[0][0]["text"]


def test_alternatives_to_click(page, server: Running):
    open_page(page, server.url, "?source=en&target=de")
    translate(page, "A man rides a bike in the city while it rains .")
    nbest = v1(server.url, ["A man rides a bike in the city while it rains ."], "en", "de")[0]
    page.click("#output .sentence")
    page.wait_for_selector("#alternatives:not([hidden])")
    shown = page.eval_on_selector_all("#alternatives button.alternative",
                                      "buttons => buttons.map(b => b.firstChild.textContent)")
    assert shown == [h["text"] for h in nbest[1:]] and shown
    page.click("#alternatives button.alternative >> nth=0")
    assert page.text_content("#output") == nbest[1]["text"]


def test_hover_a_word_to_see_its_source_words(page, server: Running):
    open_page(page, server.url, "?source=en&target=de")
    sentence = "Two men play football in the park ."
    translate(page, sentence)
    best = v1(server.url, [sentence], "en", "de")[0][0]
    aligned = {}
    for s, t in best["alignment"]:
        aligned.setdefault(t, set()).add(s)
    assert aligned
    for word in sorted(aligned)[:3]:
        page.hover(f"#output .word[data-w='{word}']")
        marked = page.eval_on_selector_all("#source-view .aligned", "spans => spans.map(s => Number(s.dataset.w))")
        assert set(marked) == aligned[word]
        texts = page.eval_on_selector_all("#source-view .aligned", "spans => spans.map(s => s.textContent)")
        assert texts == [sentence.split(" ")[i] for i in sorted(aligned[word])]
        assert page.get_attribute(f"#output .word[data-w='{word}']", "title").startswith("from: ")
    page.mouse.move(5, 5)
    assert page.locator("#source-view .aligned").count() == 0


def test_edit_the_start_and_the_rest_is_decoded_from_it(page, server: Running):
    open_page(page, server.url, "?source=en&target=de")
    sentence = "A woman reads a book ."
    translate(page, sentence)
    before = page.text_content("#output")
    span = page.locator("#output .sentence").first
    span.click()
    page.keyboard.press("Control+A")  # the sentence's own text (it is its own editing host)
    page.keyboard.type("Zwei")
    page.wait_for_function("(before) => { const s = document.querySelector('#output .sentence');"
                           " return s.textContent !== 'Zwei' && !s.classList.contains('completing') &&"
                           " s.textContent.startsWith('Zwei') && s.querySelector('.word') !== null; }", arg=before)
    expected = v1(server.url, [sentence], "en", "de", target_prefix=["Zwei"])[0][0]["text"]
    assert page.text_content("#output") == expected and expected.startswith("Zwei")
    caret = page.evaluate("() => { const r = document.createRange(); const s = document.querySelector('#output .sentence');"
                          " r.setStart(s, 0); const sel = getSelection(); r.setEnd(sel.focusNode, sel.focusOffset);"
                          " return r.toString(); }")
    assert caret == "Zwei"  # the caret stays where the user's own text ends


def test_upload_a_subtitle_file_and_download_its_translation(page, server: Running, tmp_path: Path):
    subtitles = tmp_path / "clip.srt"
    subtitles.write_text("1\n00:00:01,000 --> 00:00:02,500\nA dog runs across the meadow .\n\n"
                         "2\n00:00:03,000 --> 00:00:04,000\nThe children sing .\n", encoding="utf-8")
    open_page(page, server.url, "?source=en&target=de&mode=files")
    assert page.is_visible("#files-mode") and not page.is_visible("#text-mode")
    page.set_input_files("#file", str(subtitles))
    assert "clip.srt" in page.text_content("#drop-text")
    page.click("#translate-file")
    page.wait_for_selector("#download:not([hidden])")
    assert page.get_attribute("#download", "download") == "clip.de.srt"
    with page.expect_download() as download:
        page.click("#download")
    saved = tmp_path / "downloaded.srt"
    download.value.save_as(saved)
    cues = list(srt.parse(saved.read_text(encoding="utf-8")))
    expected = v1(server.url, ["A dog runs across the meadow .", "The children sing ."], "en", "de")
    assert [c.start.total_seconds() for c in cues] == [1.0, 3.0] and [c.end.total_seconds() for c in cues] == [2.5, 4.0]
    assert all(c.content.strip() for c in cues) and len(expected) == len(cues)


def test_hostile_text_stays_text_under_the_pages_policy(browser, server: Running):
    """The page as a user's browser runs it, under its Content-Security-Policy (any violation of it by our own
    script is a page error): markup in the text or in the translation is shown as text."""
    context = browser.new_context()
    errors: list[str] = []
    try:
        page = context.new_page()
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
        page.on("dialog", lambda dialog: errors.append(f"a dialog: {dialog.message}"))
        open_page(page, server.url, "?source=en&target=de")
        hostile = '<img src=x onerror="alert(1)"> <script>alert(2)</script> A dog runs .'
        page.fill("#source-text", hostile)
        page.click("#translate")
        page.wait_for_selector("#output .sentence")
        assert page.locator("#output img, #output script, #source-view img").count() == 0
        assert page.text_content("#source-view").startswith(hostile)  # the mirror holds the text as text
        assert not errors, errors
    finally:
        context.close()
    headers = httpx.get(server.url + "/").headers
    assert "script-src 'self'" in headers["content-security-policy"]


def test_keyboard_and_labels(page, server: Running):
    open_page(page, server.url, "?source=en&target=de")
    assert not page.is_visible("#api-key")  # no key is needed here
    for control in ("#source", "#target", "#source-text", "#swap", "#theme", "#file"):
        label = page.evaluate("(sel) => { const e = document.querySelector(sel); return e.labels && e.labels.length ?"
                              " e.labels[0].textContent : e.getAttribute('aria-label') || e.textContent; }", control)
        assert label and label.strip(), control
    page.focus("#tab-text")
    page.keyboard.press("ArrowRight")
    assert page.is_visible("#files-mode") and "mode=files" in page.url
    page.click("#theme")
    assert page.get_attribute("html", "data-theme") in ("dark", "light")


def test_a_key_is_asked_for_and_refused_without_it(browser, models: list[Translator], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture):
    db = tmp_path / "keys.db"
    keys_main(["--db", str(db), "add", "--req-limit", "100"])
    key = capsys.readouterr().out.strip()
    running = Running(create_app(models[0], max_wait=0.01, gate=Gate(keys_path=db)))
    context = browser.new_context(bypass_csp=True)
    try:
        page = context.new_page()
        open_page(page, running.url, "?source=en&target=de")
        assert page.is_visible("#api-key")
        page.fill("#source-text", "A dog runs .")
        page.click("#translate")
        page.wait_for_function("document.getElementById('error').textContent.length > 0")
        assert "requires an API key" in page.text_content("#error")
        page.fill("#api-key", key[:-1] + "x")
        page.click("#translate")
        page.wait_for_function("document.getElementById('error').textContent.includes('not valid')")
        page.fill("#api-key", key)
        page.click("#translate")
        page.wait_for_selector("#output .sentence")
        assert page.text_content("#error") == ""
    finally:
        context.close()
        running.stop()


def test_no_web_ui(models: list[Translator]):
    running = Running(create_app(models[0], web_ui=False))
    try:
        assert httpx.get(running.url + "/").status_code == 404
        assert httpx.get(running.url + "/static/app.js").status_code == 404
    finally:
        running.stop()


def test_screenshot_for_the_docs(page, server: Running, tmp_path: Path):
    open_page(page, server.url, "?source=en&target=de")
    translate(page, SOURCE)
    page.click("#output .sentence >> nth=1")
    page.wait_for_selector("#alternatives:not([hidden])")
    page.hover("#output .sentence >> nth=0 >> .word >> nth=1")
    path = Path(os.environ.get("SEQ2SEQ_SCREENSHOT") or tmp_path / "web-ui.png")
    page.screenshot(path=str(path), full_page=True)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_command_serves_the_page(trained: Path):
    """`python serve/server.py` as a user starts it: the page and its assets, with their headers."""
    process, url, _ = start_process([sys.executable, str(REPO / "serve" / "server.py")], trained,
                                    stderr=subprocess.DEVNULL)
    try:
        page = httpx.get(url + "/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<textarea id="source-text"' in page.text and "frame-ancestors 'none'" in page.headers[
            "content-security-policy"]
        script = httpx.get(url + "/static/app.js")
        assert script.status_code == 200 and "javascript" in script.headers["content-type"]
        assert script.headers["x-content-type-options"] == "nosniff"
        assert httpx.get(url + "/static/../server.py").status_code == 404
    finally:
        process.terminate()
        process.wait(timeout=30)
