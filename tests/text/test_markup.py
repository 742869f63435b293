"""seq2seq/text/markup.py and seq2seq/text/placement.py: HTML split into sentences and put back with its markup, as a
browser reads it. The placement is tested with translations written by hand (their words and alignments
chosen), the safety properties with hostile markup and hostile translations read back by JustHTML's own
tree (the WHATWG algorithm, apart from the BeautifulSoup tree markup.py edits and its writing), and the whole path with the demo model."""

import gzip
import random
from pathlib import Path

import pytest
from browser_reading import added, browser, elements, live, normal, text, within
from conftest import DEMO_DATA

from seq2seq.decoding.config import SearchConfig
from seq2seq.inference.documents import Translation
from seq2seq.inference.translator import Translator
from seq2seq.text.markup import HtmlDocument
from seq2seq.text.sentences import sentence_spans


def split(text: str) -> list[tuple[int, int]]:
    return sentence_spans(text, language="en")


def said(text: str, alignment: list[tuple[int, int]] | None = None) -> Translation:
    return Translation(text=text, score=0.0, tokens=[], alignment=alignment)


def identity(sentence: str) -> Translation:
    words = sentence.split(" ")
    return said(sentence, [(i, i) for i in range(len(words))])


def test_block_elements_are_segments_and_inline_ones_join_the_sentence():
    html = ("<h1>A title</h1><p>A <b>big</b> dog runs. Two <i>men</i> play.</p>"
            "<ul><li>One</li><li>Two <a href='/x'>links</a></li></ul>line one<br>line two")
    document = HtmlDocument(html, split=split)
    assert document.sentences == ["A title", "A big dog runs.", "Two men play.", "One", "Two links", "line one",
                                  "line two"]
    assert document.needs_alignments


def test_the_identity_translation_gives_the_input_back():
    html = ("<div class='x'><p>A <b>big <i>brown</i></b> dog runs <a href=\"/m?a=1&amp;b=2\" title='T'>across the "
            "meadow</a>. It <em>barks</em>!</p>\n  <p>Tail &amp; head &lt;ok&gt;</p></div>")
    document = HtmlDocument(html, split=split)
    out = document.render([identity(s) for s in document.sentences])
    assert out == normal(html) == ('<div class="x"><p>A <b>big <i>brown</i></b> dog runs <a href="/m?a=1&amp;b=2" '
                                   'title="T">across the meadow</a>. It <em>barks</em>!</p>\n  '
                                   "<p>Tail &amp; head &lt;ok&gt;</p></div>")


def test_an_inline_element_follows_its_words_where_the_translation_moves_them():
    document = HtmlDocument("<p>I see a <b>red</b> house.</p>", split=split)
    # Translation word 3 ("rouge") aligned to source word 3 ("red"), in another place
    out = document.render([said("Je vois une maison rouge.", [(0, 0), (1, 1), (2, 2), (4, 3), (3, 4)])])
    assert out == "<p>Je vois une maison <b>rouge</b>.</p>"  # the full stop stays outside, as it was


def test_words_aligned_to_nothing_take_what_their_neighbours_share():
    document = HtmlDocument("<p>See <b>the big house</b> now.</p>", split=split)
    out = document.render([said("Voir la très grande maison maintenant.", [(0, 0), (1, 1), (2, 3), (3, 4), (4, 5)])])
    assert out == "<p>Voir <b>la très grande maison</b> maintenant.</p>"


def test_an_element_the_translation_spreads_apart_stays_one_over_the_words_between():
    document = HtmlDocument('<p><b id="k" class="c">one two</b> three</p>', split=split)
    out = document.render([said("un trois deux", [(0, 0), (2, 1), (1, 2)])])
    assert out == '<p><b id="k" class="c">un trois deux</b></p>'  # once: its id is still one


def test_an_element_no_word_is_aligned_to_is_placed_by_position():
    document = HtmlDocument("<p>one <a href='/x'>two</a> three four</p>", split=split)
    for alignment in ([], None):  # alignments that miss it, and none at all (the documented fallback)
        out = document.render([said("eins zwei drei vier", alignment)])
        assert out == '<p>eins <a href="/x">zwei</a> drei vier</p>'


def test_two_elements_on_one_translation_word_are_both_kept():
    """Two elements aligned to one word: the first has it, the second the nearest word left, or, with none left,
    it is written empty beside it (never dropped, never merged into the other)."""
    document = HtmlDocument("<p>The <b>small</b> <i>mother</i> helps.</p>", split=split)
    assert document.render([said("Omi hilft.", [(1, 0), (2, 0), (3, 1)])]) == "<p><b>Omi</b> <i>hilft</i>.</p>"
    document = HtmlDocument("<p><b>small</b> <i>mother</i></p>", split=split)
    assert document.render([said("Omi", [(0, 0), (1, 0)])]) == "<p><b>Omi</b><i></i></p>"


def test_readable_attributes_are_translated_and_the_rest_kept():
    html = '<img alt="A dog." src="dog.png" title="Look."><a href="/x" title="Home." data-k="v">Go.</a>'
    document = HtmlDocument(html, split=split)
    assert sorted(document.sentences) == ["A dog.", "Go.", "Home.", "Look."]
    out = document.render([said(s.upper()) for s in document.sentences])
    assert out == '<img alt="A DOG." src="dog.png" title="LOOK."><a href="/x" title="HOME." data-k="v">GO.</a>'


def test_code_scripts_and_what_is_marked_untranslated_are_kept_as_they_are():
    html = ("<p>Run <code>ls -l</code> now.</p><pre>keep  this</pre><script>var s = '<b>x</b>';</script>"
            "<style>p { color: red }</style><p translate=\"no\">Brand</p><span class=\"a notranslate\">Name</span>"
            "<!-- a comment --><div><title>Page</title><meta content=\"words\"></div>")
    document = HtmlDocument(html, split=split)
    assert document.sentences == ["Run ls -l now.", "Page"]  # the code is part of its sentence, and kept
    out = document.render([said("RUN LS -L NOW.", [(0, 0), (1, 1), (2, 2), (3, 3)]), said("PAGE")])
    assert out == normal(html).replace("Run ", "RUN ").replace(" now.", " NOW.").replace(">Page<", ">PAGE<")


def test_entities_are_read_as_text_and_written_escaped():
    document = HtmlDocument("<p>Tom &amp; Jerry &lt;3 &eacute;t&eacute;&nbsp;!</p>", split=split)
    assert document.sentences == ["Tom & Jerry <3 été !"]
    assert document.render([said("Tom & Jerry <3 <b>été</b>")]) == "<p>Tom &amp; Jerry &lt;3 &lt;b&gt;été&lt;/b&gt;</p>"


def test_broken_markup_is_read_and_written_as_a_browser_reads_it():
    for html in ["<p>Unclosed <b>bold <i>both", "</b>stray close</i> text", "<p>a<p>b", "<div><span>x</div></span>",
                 "<a href='x>y</a>", "<<b>>double<</b>>", "<p>text <b", "&#xD800; &#0; &bogus; &#99999999;",
                 "<p>a <![ b</p>", "<table><tr><td>cell</td><b>fostered</b></table>", "<b><p>misnested</b> text</p>"]:
        document = HtmlDocument(html, split=split)
        out = document.render([identity(s) for s in document.sentences])
        assert normal(out) == out  # read back, written the same
        assert browser(out) == browser(html), (html, out)


HOSTILE_INPUTS = [
    '<img src=x onerror="alert(1)">Hello there.', "<svg><script>alert(1)</script></svg>text", "<scr<script>ipt>x",
    '<a href="javascript:alert(1)">click</a> me.', "<!-- <script>x</script> -->Seen.", "<![CDATA[<b>x</b>]]>ok",
    '<p style="x:expression(alert(1))">Styled.</p>', "<textarea><b>not a tag</b></textarea>After.",
    "<title><b>t</b></title>Body.", '<iframe srcdoc="<b>x</b>">in</iframe>Out.', "<math><mi>x</mi></math>Formula.",
    "<!-- a --!><img src=x onerror=alert(1)>-->End.", "<b><i><u><s>deep</s></u></i></b> nest.", "<?php echo 1 ?>PHP.",
    # A comment a browser does not end at "-- >" (Python's html.parser did, and let the script out)
    "<!-- --\n><script>alert(document.domain)</script> --><p>The woman sells the book.</p>",
    "<!-- -- ><img src=x onerror=alert(1)> --><p>Text.</p>", "<!--><img src=x onerror=alert(1)>--><p>Text.</p>",
    "<!---><img src=x onerror=alert(2)>--><p>More text.</p>",
    "<noscript><p title=\"</noscript><img src=x onerror=alert(1)>\">Seen.</p></noscript> Text.",
    "<template><script>alert(1)</script><p>Inside.</p></template> Outside.",
    "<svg><style><img src=x onerror=alert(1)></style></svg> Text.", "<svg><style>&lt;img src=x onerror=alert(1)&gt;</style></svg>Text.",
    "<math><mtext><table><mglyph><style><img src=x onerror=alert(1)>", "<xmp><script>alert(1)</script></xmp> Text.",
    "<select><option>One <b>two</b></option></select> Text.", "<p>a</p></p><b><p>b</b></p> Text.",
    "<iframe><script>alert(1)</script></iframe> Framed.", "<svg><![CDATA[<img src=x onerror=alert(1)>]]></svg> Text.",
    "<plaintext><script>alert(1)</script> all text", "<a href=x><table><td>cell <b>bold</a> text",
]
HOSTILE_OUTPUTS = ["<script>alert(1)</script>", '"><img src=x onerror=alert(1)>', "</p><p>", "&lt;b&gt;", "<!--", "]]>",
                   "-->", "--!>", "</noscript><img src=x onerror=alert(1)>", "</style>", "</textarea>", "&", "<"]


def hostile(document: HtmlDocument, rnd: random.Random) -> list[Translation]:
    return [said(" ".join(rnd.choice([*HOSTILE_OUTPUTS, *s.split(" ")]) for _ in range(rnd.randint(1, 6))),
                 [(rnd.randrange(len(s.split(" "))), rnd.randrange(6)) for _ in range(4)])
            for s in document.sentences]


@pytest.mark.parametrize("html", HOSTILE_INPUTS)
def test_hostile_markup_and_hostile_translations_create_no_markup_a_browser_sees(html: str):
    """Whatever the input and whatever the model writes, a browser reads in the output no element, attribute,
    comment or raw text the input lacked (the same as the input's, but where the parse of the input itself
    cannot be written so as to be read back alike: a table's misnested content), nothing runs or loads that did
    not, and the output reads back as itself."""
    rnd = random.Random(html)
    document = HtmlDocument(html, split=split)
    for _ in range(5):
        out = HtmlDocument(html, split=split).render(hostile(document, rnd))
        assert not added(out, html), (html, out)
        assert live(out) <= live(html)
        assert normal(out) == out


def test_the_comment_a_browser_does_not_end_stays_one_inert_comment():
    html = "<!-- --\n><script>alert(document.domain)</script> --><p>The woman sells the book.</p>"
    document = HtmlDocument(html, split=split)
    assert document.sentences == ["The woman sells the book."]
    out = document.render([said("Die Frau verkauft das Buch.")])
    assert out == "<!-- --\n><script>alert(document.domain)</script> --><p>Die Frau verkauft das Buch.</p>"
    assert live(out) == set() and live(html) == set()


FRAGMENTS = ["<b>", "</b>", "<i class=x>", "</i>", "<a href=#y>", "</a>", "<p>", "</p>", "<br>", "<!-- c -->", "<!--",
             "-->", "--!>", "<script>alert(1)</script>", "<style>b{}</style>", "<img src=x alt='A dog.'>",
             "<code>x=1</code>", "<span translate=no>Brand</span>", "<sup>[1]</sup>", "<![CDATA[", "]]>", "<svg>",
             "</svg>", "<math>", "<template>", "</template>", "<noscript>", "</noscript>", "<textarea>", "</textarea>",
             "<table>", "<td>", "</table>", "<select>", "<option>", "<title>", "</title>", "<xmp>", "</xmp>", "&amp;",
             "&lt;", "<", ">", '"', "'", "\n", " ", "The woman", "sells", "the book.", "A dog runs!", "Two men",
             "<div>", "</div>", "<li>", "<q>", "</q>", "<?x ?>", "<!x>", "<em>", "</em>"]


def test_random_hostile_fragments_read_by_a_browser_as_the_input_was():
    """1,500 random pages from hostile pieces, each translated with hostile words and random alignments: a
    browser reads in no output an element, attribute, comment or raw text its input lacked, nor anything live."""
    rnd = random.Random(56)
    for _ in range(1500):
        html = "".join(rnd.choice(FRAGMENTS) for _ in range(rnd.randint(1, 14)))
        document = HtmlDocument(html, split=split)
        out = document.render(hostile(document, rnd))
        assert not added(out, html), (html, out)
        assert live(out) <= live(html), (html, out)


def test_random_documents_keep_their_markup_under_a_shuffling_translation():
    """Random nestings of inline elements over words: with the words reversed and aligned, every element
    of the input is in the output, no other, and each word keeps the elements it had."""
    rnd = random.Random(0)
    tags = ["b", "i", "a", "span", "em"]
    for _ in range(200):
        parts, words = [], []
        for k in range(rnd.randint(2, 8)):
            word = f"w{k}"
            words.append(word)
            depth = rnd.randint(0, 2)
            opened = [rnd.choice(tags) for _ in range(depth)]
            parts.append("".join(f"<{t}>" for t in opened) + word + "".join(f"</{t}>" for t in reversed(opened)))
        html = "<p>" + " ".join(parts) + "</p>"
        document = HtmlDocument(html, split=split)
        (sentence,) = document.sentences
        n = len(sentence.split(" "))
        out = document.render([said(" ".join(reversed(sentence.split(" "))), [(i, n - 1 - i) for i in range(n)])])
        assert browser(out) == browser(html), (html, out)
        for word in words:
            assert within(html, word) == within(out, word), (html, out, word)


def test_every_inline_element_is_written_once_whatever_the_translation():
    """Random nestings of inline elements (with ids) over words, translated by random words of any number (one or
    more) and random alignments or none: every element of the input is in the output exactly once, none added."""
    rnd = random.Random(1)
    tags = ["b", "i", "a", "span", "em"]
    for trial in range(400):
        parts = []
        for k in range(rnd.randint(1, 9)):
            opened = [rnd.choice(tags) for _ in range(rnd.randint(0, 3))]
            punctuation = rnd.choice(["", "", ",", ".", "!"])
            parts.append("".join(f'<{t} id="e{k}{d}">' for d, t in enumerate(opened)) + f"w{k}{punctuation}"
                         + "".join(f"</{t}>" for t in reversed(opened)))
        html = "<p>" + rnd.choice([" ", "  ", "\n"]).join(parts) + "</p>"
        document = HtmlDocument(html, split=split)
        translations = []
        for sentence in document.sentences:
            n, m = len(sentence.split(" ")), rnd.randint(1, 10)
            alignment = rnd.choice([None, [], [(rnd.randrange(n), rnd.randrange(m)) for _ in range(rnd.randint(1, 12))]])
            translations.append(said(" ".join(f"x{j}{rnd.choice(['', '.', ','])}" for j in range(m)), alignment))
        out = document.render(translations)
        assert browser(out) == browser(html), (trial, html, out)


def test_a_page_of_one_word_elements_keeps_every_one():
    """5,003 one-word elements on one page (words of its own, each in a <span class=wN>), translated by random
    translations as long, shorter or longer: each element is in the output exactly once."""
    rnd = random.Random(8)
    words = ["The", "woman", "sells", "the", "book", "because", "a", "student", "has", "worked."]
    html = "<p>" + " ".join(f'<span class="w{k}">{words[k % len(words)]}</span>' for k in range(5003)) + "</p>"
    document = HtmlDocument(html, split=split)
    translations = []
    for sentence in document.sentences:
        n = len(sentence.split(" "))
        m = max(1, n + rnd.randint(-3, 3))
        translations.append(said(" ".join(f"t{j}" for j in range(m)),
                                 [(i, min(m - 1, i + rnd.randint(-1, 1))) for i in range(n) if rnd.random() < 0.9]))
    out = document.render(translations)
    assert browser(out) == browser(html)


def test_the_demo_model_translates_pages_as_it_translates_their_sentences(translator: Translator):
    """With the real model: the text of each segment is the translation of its sentences alone, and the
    markup is kept."""
    with gzip.open(DEMO_DATA / "test.en.gz", "rt", encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip()][:12]
    search = SearchConfig(beam_size=3)
    alone = translator.translate(lines, search)
    pages = [f"<p>{lines[0]} {lines[1]}</p><ul><li>{lines[2]}</li><li><b>{lines[3]}</b></li></ul>",
             f"<div title=\"{lines[4]}\"><span>{lines[5]}</span><br>{lines[6]}</div>",
             f"<p>{lines[7]}<sup><a href='#f1'>[1]</a></sup></p><p>{lines[8].replace(' ', chr(10), 2)}</p>"]
    out = translator.translate_html(pages, search)
    first, second, third = out
    assert text(elements(first, "p")[0]) == f"{alone[0]} {alone[1]}"
    assert [text(li) for li in elements(first, "li")] == [alone[2], alone[3]]
    assert elements(first, "li")[1].children[0].name == "b"
    assert elements(second, "div")[0].attrs["title"] == alone[4] and text(elements(second, "span")[0]) == alone[5]
    paragraphs = elements(third, "p")
    assert text(paragraphs[0]) == f"{alone[7]}[1]" and text(paragraphs[1]) == alone[8]  # the marker once, one sentence
    for page, translated in zip(pages, out, strict=True):
        assert browser(translated) == browser(page)


@pytest.fixture(scope="module")
def translator(trained: Path) -> Translator:
    return Translator.from_checkpoint(trained, precision="fp32")


def test_elements_without_text_stay_where_they_are():
    for html in ['<h2><a id="intro"></a>Introduction here.</h2>', '<p><a href="/"><i class="fa fa-home"></i> Home page</a></p>',
                 '<p>Save <span class="icon-save"></span> it.</p><a name="bottom"></a>']:
        document = HtmlDocument(html, split=split)
        assert browser(document.render([said(s.upper()) for s in document.sentences])) == browser(html)
    document = HtmlDocument('<p>Save <span class="icon-save"></span> it now.</p>', split=split)
    assert document.sentences == ["Save it now."]  # one sentence around it
    assert document.render([said("Speichere es jetzt.", [(0, 0), (1, 1), (2, 2)])]) == (
        '<p>Speichere <span class="icon-save"></span> es jetzt.</p>')


def test_footnote_markers_stay_after_their_word_and_are_not_translated():
    """A footnote link after a word or after the full stop, a bracket around a link, an element over part of a
    word: none is lost, none duplicated, and the marker is no sentence of its own."""
    footnote = '<p>The city<sup class="ref"><a href="#n1">[1]</a></sup> is large.</p>'
    assert HtmlDocument(footnote, split=split).sentences == ["The city is large."]
    for alignment in (None, [], [(0, 0), (1, 1), (2, 2), (3, 3)]):
        assert HtmlDocument(footnote, split=split).render([said("Die Stadt ist groß.", alignment)]) == (
            '<p>Die Stadt<sup class="ref"><a href="#n1">[1]</a></sup> ist groß.</p>')
    for html, want in [("<p>The woman sells the book<sup><a href='#f1'>[1]</a></sup>.</p>",
                        '<p>Die Frau verkauft das Buch<sup><a href="#f1">[1]</a></sup>.</p>'),
                       ("<p>The woman sells the book.<sup><a href='#f1'>[1]</a></sup></p>",
                        '<p>Die Frau verkauft das Buch.<sup><a href="#f1">[1]</a></sup></p>')]:
        document = HtmlDocument(html, split=split)
        assert document.sentences == ["The woman sells the book."]
        assert document.render([said("Die Frau verkauft das Buch.", [(i, i) for i in range(5)])]) == want
    assert HtmlDocument("(<a href=x>link</a>)", split=split).render([said("(Verweis)")]) == '(<a href="x">Verweis</a>)'
    assert HtmlDocument("<p><b>un</b>believable</p>", split=split).render([said("unglaublich", [(0, 0)])]) == (
        "<p><b>unglaublich</b></p>")  # the element cannot cover part of a word it does not know: the word


def test_a_line_break_inside_a_paragraph_is_a_space_and_comments_and_untranslated_spans_stay_inside():
    html = "<p>The woman does not sell the book\nbecause a student has worked.</p>"
    assert HtmlDocument(html, split=split).sentences == ["The woman does not sell the book because a student has worked."]
    crlf = HtmlDocument("<p>The woman\r\nsells the book.</p>\r\n<p>A dog runs.</p>\r\n", split=split)
    assert crlf.sentences == ["The woman sells the book.", "A dog runs."]
    assert crlf.render([said("Die Frau verkauft das Buch."), said("Ein Hund rennt.")]) == (
        "<p>Die Frau verkauft das Buch.</p>\r\n<p>Ein Hund rennt.</p>\r\n")  # the file's line ends kept
    commented = HtmlDocument("<p>The woman <!-- a note --> sells the book.</p>", split=split)
    assert commented.sentences == ["The woman sells the book."]
    assert commented.render([said("Die Frau verkauft das Buch.", [(i, i) for i in range(5)])]) == (
        "<p>Die Frau <!-- a note --> verkauft das Buch.</p>")
    brand = HtmlDocument('<p>Click <span translate="no">Save Now</span> to keep it.</p>', split=split)
    assert brand.sentences == ["Click Save Now to keep it."]
    out = brand.render([said("Klicken Sie auf Speichern Jetzt, um es zu behalten.",
                             [(0, 0), (1, 3), (2, 4), (3, 5), (4, 8), (5, 7)])])
    assert out == '<p>Klicken Sie auf <span translate="no">Save Now</span>, um es zu behalten.</p>'


def test_a_nested_element_no_word_takes_is_placed_by_position():
    document = HtmlDocument("<p>one <b>two <a href=u>three</a></b></p>", split=split)
    for alignment in (None, [(0, 0), (1, 0), (2, 0)]):
        assert browser(document.render([said("EINS ZWEI DREI", alignment)])) == browser(document.html)


def test_a_body_the_parser_puts_inside_an_unclosed_head_is_translated():
    document = HtmlDocument("<html><head><title>A dog</title><body><p>A man rides a bike.</p>", split=split)
    assert document.sentences == ["A dog", "A man rides a bike."]


def test_a_page_stays_a_page_and_a_fragment_a_fragment():
    page = "<!DOCTYPE html>\n<html lang=en><head><title>A dog</title></head><body><p>Runs.</p></body></html>"
    assert normal(page) == '<!DOCTYPE html><html lang="en"><head><title>A dog</title></head><body><p>Runs.</p></body></html>'
    assert normal("<style>p {}</style><p>Runs.</p>") == "<style>p {}</style><p>Runs.</p>"  # not moved into a head


@pytest.mark.parametrize("html, message", [("<b>" * 400 + "Hello", "nests elements more than 256 deep"),
                                           ("".join(f"<b a={i}>x<p>y" for i in range(2000)), "formatting tags .* open")])
def test_markup_that_cannot_be_read_is_a_value_error(html: str, message: str):
    """Too deep to walk, and formatting tags left open that the parser would copy into every later block
    (hundreds of thousands of elements from 30 KB, in time that grows with the square of the page)."""
    with pytest.raises(ValueError, match=message):
        HtmlDocument(html, split=split)
