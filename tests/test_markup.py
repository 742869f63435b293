"""seq2seq/markup.py: HTML split into sentences and put back with its markup. The placement is tested with
translations written by hand (their words and alignments chosen), the safety properties with hostile
markup and hostile translations, and the whole path with the demo model."""

import gzip
import random
import re
from pathlib import Path

import pytest
from bs4 import BeautifulSoup
from conftest import DEMO_DATA

from seq2seq.markup import HtmlDocument
from seq2seq.search import SearchConfig
from seq2seq.sentences import sentence_spans
from seq2seq.translator import Translation, Translator


def split(text: str) -> list[tuple[int, int]]:
    return sentence_spans(text, language="en")


def said(text: str, alignment: list[tuple[int, int]] | None = None) -> Translation:
    return Translation(text=text, score=0.0, tokens=[], alignment=alignment)


def identity(sentence: str) -> Translation:
    words = sentence.split(" ")
    return said(sentence, [(i, i) for i in range(len(words))])


def normal(html: str) -> str:
    """html as the parser writes it back (quotes, entities, closed tags): the form the output comes in."""
    return str(BeautifulSoup(html, "html.parser"))


def markup(html: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """Every element as (name, its attributes), as the parser reads them."""
    return {(tag.name, tuple(sorted((k, " ".join(v) if isinstance(v, list) else v) for k, v in tag.attrs.items())))
            for tag in BeautifulSoup(html, "html.parser").find_all(True)}


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
    assert document.render([identity(s) for s in document.sentences]) == normal(html)


def test_an_inline_element_follows_its_words_where_the_translation_moves_them():
    document = HtmlDocument("<p>I see a <b>red</b> house.</p>", split=split)
    # Translation word 3 ("rouge") aligned to source word 3 ("red"), in another place
    out = document.render([said("Je vois une maison rouge.", [(0, 0), (1, 1), (2, 2), (4, 3), (3, 4)])])
    assert out == "<p>Je vois une maison <b>rouge</b>.</p>"  # the full stop stays outside, as it was


def test_words_aligned_to_nothing_take_what_their_neighbours_share():
    document = HtmlDocument("<p>See <b>the big house</b> now.</p>", split=split)
    out = document.render([said("Voir la très grande maison maintenant.", [(0, 0), (1, 1), (2, 3), (3, 4), (4, 5)])])
    assert out == "<p>Voir <b>la très grande maison</b> maintenant.</p>"


def test_an_element_the_translation_splits_is_written_per_stretch_with_its_id_once():
    document = HtmlDocument('<p><b id="k" class="c">one two</b> three</p>', split=split)
    out = document.render([said("un trois deux", [(0, 0), (2, 1), (1, 2)])])
    assert out == '<p><b class="c" id="k">un</b> trois <b class="c">deux</b></p>'


def test_an_element_no_word_is_aligned_to_is_placed_by_position():
    document = HtmlDocument("<p>one <a href='/x'>two</a> three four</p>", split=split)
    for alignment in ([], None):  # alignments that miss it, and none at all (the documented fallback)
        out = document.render([said("eins zwei drei vier", alignment)])
        assert out == '<p>eins <a href="/x">zwei</a> drei vier</p>'


def test_readable_attributes_are_translated_and_the_rest_kept():
    html = '<img alt="A dog." src="dog.png" title="Look."><a href="/x" title="Home." data-k="v">Go.</a>'
    document = HtmlDocument(html, split=split)
    assert sorted(document.sentences) == ["A dog.", "Go.", "Home.", "Look."]
    out = document.render([said(s.upper()) for s in document.sentences])
    assert out == '<img alt="A DOG." src="dog.png" title="LOOK."/><a data-k="v" href="/x" title="HOME.">GO.</a>'


def test_code_scripts_and_what_is_marked_untranslated_are_kept_as_they_are():
    html = ("<p>Run <code>ls -l</code> now.</p><pre>keep  this</pre><script>var s = '<b>x</b>';</script>"
            "<style>p { color: red }</style><p translate=\"no\">Brand</p><span class=\"a notranslate\">Name</span>"
            "<!-- a comment --><head><title>Page</title><meta content=\"words\"></head>")
    document = HtmlDocument(html, split=split)
    assert document.sentences == ["Run", "now.", "Page"]
    out = document.render([said(s.upper()) for s in document.sentences])
    assert out == normal(html).replace("Run ", "RUN ").replace(" now.", " NOW.").replace(">Page<", ">PAGE<")


def test_entities_are_read_as_text_and_written_escaped():
    document = HtmlDocument("<p>Tom &amp; Jerry &lt;3 &eacute;t&eacute;&nbsp;!</p>", split=split)
    assert document.sentences == ["Tom & Jerry <3 été !"]
    assert document.render([said("Tom & Jerry <3 <b>été</b>")]) == "<p>Tom &amp; Jerry &lt;3 &lt;b&gt;été&lt;/b&gt;</p>"


def test_broken_markup_gives_well_formed_output():
    for html in ["<p>Unclosed <b>bold <i>both", "</b>stray close</i> text", "<p>a<p>b", "<div><span>x</div></span>",
                 "<a href='x>y</a>", "<<b>>double<</b>>", "<p>text <b", "&#xD800; &#0; &bogus; &#99999999;"]:
        document = HtmlDocument(html, split=split)
        out = document.render([identity(s) for s in document.sentences])
        assert normal(out) == out  # read back, written the same: every tag closed, every text escaped
        assert markup(out) <= markup(html)


HOSTILE_INPUTS = [
    '<img src=x onerror="alert(1)">Hello there.', "<svg><script>alert(1)</script></svg>text", "<scr<script>ipt>x",
    '<a href="javascript:alert(1)">click</a> me.', "<!-- <script>x</script> -->Seen.", "<![CDATA[<b>x</b>]]>ok",
    '<p style="x:expression(alert(1))">Styled.</p>', "<textarea><b>not a tag</b></textarea>After.",
    "<title><b>t</b></title>Body.", '<iframe srcdoc="<b>x</b>">in</iframe>Out.', "<math><mi>x</mi></math>Formula.",
    "<!-- a --!><img src=x onerror=alert(1)>-->End.", "<b><i><u><s>deep</s></u></i></b> nest.", "<?php echo 1 ?>PHP.",
]
HOSTILE_OUTPUTS = ["<script>alert(1)</script>", '"><img src=x onerror=alert(1)>', "</p><p>", "&lt;b&gt;", "<!--", "]]>"]


@pytest.mark.parametrize("html", HOSTILE_INPUTS)
def test_hostile_markup_and_hostile_translations_create_no_markup(html: str):
    """Whatever the input and whatever the model writes, the output has no element or attribute the input
    lacked, and reads back as itself."""
    rnd = random.Random(html)
    document = HtmlDocument(html, split=split)
    for _ in range(5):
        translations = [said(" ".join(rnd.choice([*HOSTILE_OUTPUTS, *s.split(" ")]) for _ in range(rnd.randint(1, 6))),
                             [(rnd.randrange(len(s.split(" "))), rnd.randrange(6)) for _ in range(4)])
                        for s in document.sentences]
        out = HtmlDocument(html, split=split).render(translations)
        assert markup(out) <= markup(html), out
        assert normal(out) == out


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
        source, target = BeautifulSoup(html, "html.parser"), BeautifulSoup(out, "html.parser")
        for word in words:
            within = lambda soup, w=word: [t.name for t in soup.find(string=re.compile(rf"\b{w}\b")).parents][:-2]  # noqa: E731
            assert within(source) == within(target), (html, out)


def test_the_demo_model_translates_pages_as_it_translates_their_sentences(translator: Translator):
    """With the real model: the text of each segment is the translation of its sentences alone, and the
    markup is kept."""
    with gzip.open(DEMO_DATA / "test.en.gz", "rt", encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip()][:12]
    search = SearchConfig(beam_size=3)
    alone = translator.translate(lines, search)
    pages = [f"<p>{lines[0]} {lines[1]}</p><ul><li>{lines[2]}</li><li><b>{lines[3]}</b></li></ul>",
             f"<div title=\"{lines[4]}\"><span>{lines[5]}</span><br>{lines[6]}</div>"]
    out = translator.translate_html(pages, search)
    first, second = (BeautifulSoup(page, "html.parser") for page in out)
    assert first.p.get_text() == f"{alone[0]} {alone[1]}"
    assert [li.get_text() for li in first.find_all("li")] == [alone[2], alone[3]]
    assert first.find("li").find_next("li").b is not None
    assert second.div["title"] == alone[4] and second.span.get_text() == alone[5]
    assert markup(out[0]) == markup(pages[0])


@pytest.fixture(scope="module")
def translator(trained: Path) -> Translator:
    return Translator.from_checkpoint(trained, precision="fp32")


def test_elements_without_text_stay_where_they_are():
    for html in ['<h2><a id="intro"></a>Introduction here.</h2>', '<p><a href="/"><i class="fa fa-home"></i> Home page</a></p>',
                 '<p>Save <span class="icon-save"></span> it.</p><a name="bottom"></a>']:
        document = HtmlDocument(html, split=split)
        assert markup(document.render([said(s.upper()) for s in document.sentences])) == markup(html)


def test_marks_inside_a_word_keep_their_elements():
    """A footnote link after a word, brackets around a link, an element over part of a word: none is lost,
    aligned or not."""
    footnote = '<p>The city<sup class="ref"><a href="#n1">[1]</a></sup> is large.</p>'
    for alignment in (None, [], [(0, 0), (1, 1), (2, 2), (3, 3)]):
        assert HtmlDocument(footnote, split=split).render([said("Die Stadt ist groß.", alignment)]) == (
            '<p>Die Stadt<sup class="ref"><a href="#n1">[1]</a></sup> ist groß.</p>')
    echoed = HtmlDocument(footnote, split=split).render([said("Die Stadt[1] ist groß.", [(1, 1)])])
    assert echoed == '<p>Die Stadt<sup class="ref"><a href="#n1">[1]</a></sup> ist groß.</p>'  # not twice
    assert HtmlDocument("(<a href=x>link</a>)", split=split).render([said("(Verweis)")]) == '(<a href="x">Verweis</a>)'
    assert HtmlDocument("<p><b>un</b>believable</p>", split=split).render([said("unglaublich", [(0, 0)])]) == (
        "<p><b>unglaublich</b></p>")  # the element cannot cover part of a word it does not know: the word


def test_a_nested_element_no_word_takes_is_placed_by_position():
    document = HtmlDocument("<p>one <b>two <a href=u>three</a></b></p>", split=split)
    for alignment in (None, [(0, 0), (1, 0), (2, 0)]):
        assert markup(document.render([said("EINS ZWEI DREI", alignment)])) == markup(document.html)


def test_a_body_the_parser_puts_inside_an_unclosed_head_is_translated():
    document = HtmlDocument("<html><head><title>A dog</title><body><p>A man rides a bike.</p>", split=split)
    assert document.sentences == ["A dog", "A man rides a bike."]


@pytest.mark.parametrize("html, message", [("<p>a <![ b</p>", "the HTML parser cannot read this markup"),
                                           ("<b>" * 400 + "Hello", "nests elements more than 256 deep")])
def test_markup_that_cannot_be_read_is_a_value_error(html: str, message: str):
    with pytest.raises(ValueError, match=message):
        HtmlDocument(html, split=split)


def test_random_documents_keep_every_element_even_without_alignments():
    """With no alignments, a translation with a word for each source word (or more) holds every element
    (one shorter may not: two words with elements of their own cannot both sit on one word)."""
    rnd = random.Random(1)
    tags = ["b", "i", "a", "span", "em"]
    for _ in range(200):
        parts = []
        for k in range(rnd.randint(2, 8)):
            opened = [rnd.choice(tags) for _ in range(rnd.randint(0, 3))]
            parts.append("".join(f'<{t} class="c{k}{d}">' for d, t in enumerate(opened)) + f"w{k}"
                         + "".join(f"</{t}>" for t in reversed(opened)))
        html = "<p>" + " ".join(parts) + "</p>"
        document = HtmlDocument(html, split=split)
        n = len(document.sentences[0].split(" "))
        out = document.render([said(" ".join(f"x{k}" for k in range(n + rnd.randint(0, 2))), rnd.choice([None, []]))])
        assert markup(out) == markup(html), (html, out)
