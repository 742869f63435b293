"""The demo corpus: reproducible, held out, aligned, and German that keeps its agreement and word order.

The expected German below is written by hand (paradigms, articles, endings), not computed with the
grammar's own tables, so a wrong rule in seq2seq/demo shows up as a mismatch here.
"""

import gzip
import random
from pathlib import Path

import pytest

from seq2seq.demo.grammar import (
    DATA_DIR,
    MAX_WORDS,
    MIN_WORDS,
    SPLITS,
    Clause,
    NounPhrase,
    PrepPhrase,
    Sentence,
    generate_pairs,
    render,
    render_sentence,
    sample_sentence,
    write_corpus,
)
from seq2seq.demo.lexicon import ADJECTIVES, NOUNS, VERBS

FILES = [f"{split}.{language}.gz" for split in SPLITS for language in ("en", "de")]


def read_lines(path: Path) -> list[str]:
    return gzip.decompress(path.read_bytes()).decode("utf-8").splitlines()


@pytest.fixture(scope="module")
def shipped() -> dict[str, list[str]]:
    return {name: read_lines(DATA_DIR / name) for name in FILES}


@pytest.fixture(scope="module")
def sentences() -> list[Sentence]:
    rng = random.Random(1234)
    return [sample_sentence(rng) for _ in range(6000)]


# ---------------------------------------------------------------------------------------------
# Reproducible, held out, aligned


def test_same_seed_gives_the_same_distinct_pairs():
    pairs = generate_pairs(num_pairs=300, seed=1)
    assert pairs == generate_pairs(num_pairs=300, seed=1)
    assert pairs != generate_pairs(num_pairs=300, seed=2)
    assert len({en for en, _ in pairs}) == len(pairs) == 300


def test_writing_twice_gives_identical_bytes(tmp_path):
    for folder in ("a", "b"):
        write_corpus(tmp_path / folder, num_train=300, num_valid=20, num_test=20, seed=3)
    for name in FILES:
        data = (tmp_path / "a" / name).read_bytes()
        assert data == (tmp_path / "b" / name).read_bytes(), name
        assert data[4:8] == b"\0\0\0\0", f"{name}: the gzip header carries a timestamp"


def test_shipped_data_matches_the_code(tmp_path, shipped):
    # Compared after decompression: the deflate bytes can differ between zlib builds (zlib-ng),
    # the sentences cannot. Regenerate with `python -m seq2seq.demo.grammar --out seq2seq/demo/data`.
    write_corpus(tmp_path)
    for name in FILES:
        assert read_lines(tmp_path / name) == shipped[name], f"{name} is stale: regenerate the demo data"


def test_splits_are_aligned_and_sized(shipped):
    sizes = {"train": 40_000, "valid": 500, "test": 500}
    for split in SPLITS:
        en, de = shipped[f"{split}.en.gz"], shipped[f"{split}.de.gz"]
        assert len(en) == len(de) == sizes[split]
        assert all(en) and all(de)


def test_valid_and_test_english_never_occur_in_train(shipped):
    train = set(shipped["train.en.gz"])
    valid, test = set(shipped["valid.en.gz"]), set(shipped["test.en.gz"])
    assert len(train) == 40_000 and len(valid) == 500 and len(test) == 500
    assert not valid & train and not test & train and not valid & test


def test_sentences_are_capitalised_punctuated_and_short(shipped):
    for en, de in zip(shipped["train.en.gz"], shipped["train.de.gz"], strict=True):
        for side in (en, de):
            assert side[0].isupper() and side[-1] in ".?", side
            assert MIN_WORDS <= len(side.split()) <= MAX_WORDS, side
        assert en[-1] == de[-1], (en, de)


# ---------------------------------------------------------------------------------------------
# Exact renderings, checked by hand


@pytest.mark.parametrize(
    ("arguments", "english", "german"),
    [
        (dict(subject="man", verb="see", object="dog", tense="perfect"),
         "The man has seen the dog.", "Der Mann hat den Hund gesehen."),
        (dict(subject="woman", verb="read", object=NounPhrase("book", definite=False), adverb="today"),
         "Today the woman reads a book.", "Heute liest die Frau ein Buch."),
        (dict(subject="child", verb="eat", object="apple", tense="perfect"),
         "The child has eaten the apple.", "Das Kind hat den Apfel gegessen."),
        (dict(subject="I", verb="play", prep="with", prep_object=NounPhrase("child", plural=True)),
         "I play with the children.", "Ich spiele mit den Kindern."),
        (dict(subject=NounPhrase("dog", definite=False, adjective="big"), verb="see",
              object=NounPhrase("cat", adjective="small")),
         "A big dog sees the small cat.", "Ein großer Hund sieht die kleine Katze."),
        (dict(subject="she", verb="buy", object=NounPhrase("car", definite=False, adjective="expensive")),
         "She buys an expensive car.", "Sie kauft ein teures Auto."),
        (dict(subject="we", verb="drink", object=NounPhrase("coffee", definite=False), negated=True),
         "We do not drink coffee.", "Wir trinken keinen Kaffee."),
        (dict(subject="you", verb="call", object="woman", tense="perfect", negated=True),
         "You have not called the woman.", "Du hast die Frau nicht angerufen."),
        (dict(subject="he", verb="tidy", object="kitchen"),
         "He tidies the kitchen.", "Er räumt die Küche auf."),
        (dict(subject="child", verb="go", prep="to", prep_object="house", tense="perfect"),
         "The child has gone to the house.", "Das Kind ist ins Haus gegangen."),
        (dict(subject="woman", verb="drive", prep="to", prep_object="city", tense="perfect"),
         "The woman has driven to the city.", "Die Frau ist in die Stadt gefahren."),
        (dict(subject="boy", verb="sleep", prep="in", prep_object="park"),
         "The boy sleeps in the park.", "Der Junge schläft im Park."),
        (dict(subject="I", verb="help", object="boy"), "I help the boy.", "Ich helfe dem Jungen."),
        (dict(subject="you", verb="read", object="letter", tense="past", question=True),
         "Did you read the letter?", "Hast du den Brief gelesen?"),
        (dict(subject="they", verb="visit", object="city", tense="past", adverb="yesterday"),
         "Yesterday they visited the city.", "Gestern haben sie die Stadt besucht."),
        (dict(subject="you", verb="eat", object=NounPhrase("apple", definite=False)),
         "You eat an apple.", "Du isst einen Apfel."),
        (dict(subject="you all", verb="work", prep="in", prep_object="kitchen"),
         "You all work in the kitchen.", "Ihr arbeitet in der Küche."),
        (dict(subject="she", verb="help", object=NounPhrase("child", plural=True, definite=False),
              negated=True),
         "She does not help children.", "Sie hilft keinen Kindern."),
        (dict(subject="man", verb="see", object="her", negated=True),
         "The man does not see her.", "Der Mann sieht sie nicht."),
        (dict(subject="man", verb="see", object="him", adverb="today"),
         "Today the man sees him.", "Heute sieht ihn der Mann."),
        (dict(subject="man", verb="buy", object=NounPhrase("gift", definite=False),
              prep="for", prep_object="woman"),
         "The man buys a gift for the woman.", "Der Mann kauft ein Geschenk für die Frau."),
        (dict(subject=NounPhrase("girl", plural=True, definite=False), verb="drink",
              object=NounPhrase("milk", definite=False, adjective="cold")),
         "Girls drink cold milk.", "Mädchen trinken kalte Milch."),
        (dict(subject="dog", verb="be", predicate="hungry", tense="past", adverb="yesterday"),
         "Yesterday the dog was hungry.", "Gestern war der Hund hungrig."),
        (dict(subject="dog", verb="be", predicate="hungry", question=True),
         "Is the dog hungry?", "Ist der Hund hungrig?"),
    ],
)
def test_render_simple_sentences(arguments, english, german):
    assert render(**arguments) == (english, german)


def clause(subject: str, verb: str, **fields) -> Clause:
    return Clause(subject=NounPhrase(subject), verb=verb, **fields)


@pytest.mark.parametrize(
    ("sentence", "english", "german"),
    [
        (Sentence(main=clause("child", "laugh"), conjunction="because",
                  sub=clause("man", "see", object=NounPhrase("dog"))),
         "The child laughs because the man sees the dog.", "Das Kind lacht, weil der Mann den Hund sieht."),
        (Sentence(main=clause("man", "be", predicate="happy"), conjunction="because", sub_first=True,
                  sub=clause("he", "call", object=NounPhrase("woman"), tense="perfect")),
         "Because he has called the woman, the man is happy.",
         "Weil er die Frau angerufen hat, ist der Mann glücklich."),
        (Sentence(main=clause("you all", "know"), conjunction="that",
                  sub=clause("dog", "be", predicate="hungry")),
         "You all know that the dog is hungry.", "Ihr wisst, dass der Hund hungrig ist."),
        (Sentence(main=clause("I", "work"), conjunction="although",
                  sub=Clause(subject=NounPhrase("child", plural=True), verb="sleep", negated=True)),
         "I work although the children do not sleep.", "Ich arbeite, obwohl die Kinder nicht schlafen."),
        (Sentence(main=clause("she", "say"), conjunction="that",
                  sub=clause("we", "call", object=NounPhrase("teacher"))),
         "She says that we call the teacher.", "Sie sagt, dass wir den Lehrer anrufen."),
        (Sentence(main=clause("dog", "play", prep=PrepPhrase("in", NounPhrase("garden"))),
                  conjunction="because", sub_first=True, sub=clause("woman", "call", object=NounPhrase("I"))),
         "Because the woman calls me, the dog plays in the garden.",
         "Weil mich die Frau anruft, spielt der Hund im Garten."),
    ],
)
def test_render_clause_combinations(sentence, english, german):
    assert render_sentence(sentence) == (english, german)


def test_render_names_the_problem():
    with pytest.raises(ValueError, match="cow"):
        render(subject="cow", verb="sleep")
    with pytest.raises(ValueError, match="yesterday"):
        render(subject="man", verb="sleep", adverb="yesterday")
    with pytest.raises(ValueError, match="mass noun"):
        render(subject="man", verb="drink", object=NounPhrase("milk", plural=True))


# Present tense, ich du er wir ihr sie, written out by hand.
PARADIGMS = {
    "see": "sehe siehst sieht sehen seht sehen",
    "read": "lese liest liest lesen lest lesen",
    "eat": "esse isst isst essen esst essen",
    "take": "nehme nimmst nimmt nehmen nehmt nehmen",
    "find": "finde findest findet finden findet finden",
    "open": "öffne öffnest öffnet öffnen öffnet öffnen",
    "work": "arbeite arbeitest arbeitet arbeiten arbeitet arbeiten",
    "dance": "tanze tanzt tanzt tanzen tanzt tanzen",
    "wash": "wasche wäschst wäscht waschen wascht waschen",
    "drive": "fahre fährst fährt fahren fahrt fahren",
    "run": "laufe läufst läuft laufen lauft laufen",
    "help": "helfe hilfst hilft helfen helft helfen",
    "live": "wohne wohnst wohnt wohnen wohnt wohnen",
    "call": "rufe rufst ruft rufen ruft rufen",
    "know": "weiß weißt weiß wissen wisst wissen",
}


@pytest.mark.parametrize("verb", sorted(PARADIGMS))
def test_present_tense_paradigms(verb):
    assert [VERBS[verb].present(person) for person in range(6)] == PARADIGMS[verb].split()


# ---------------------------------------------------------------------------------------------
# Rules over many sampled sentences

PERSON = {"I": 0, "you": 1, "he": 2, "she": 2, "we": 3, "you all": 4, "they": 5}
AUXILIARIES = [{"habe", "bin", "war"}, {"hast", "bist", "warst"}, {"hat", "ist", "war"},
               {"haben", "sind", "waren"}, {"habt", "seid", "wart"}, {"haben", "sind", "waren"}]
PRESENT_ENDINGS = {0: "e", 2: "t", 3: "en", 4: "t", 5: "en"}  # du: see agrees()


def person_of(phrase: NounPhrase) -> int:
    return PERSON.get(phrase.head, 5 if phrase.plural else 2)


def agrees(finite: str, clause: Clause) -> bool:
    """Whether `finite` is the clause's finite verb in its subject's person (present: by its ending)."""
    person = person_of(clause.subject)
    if clause.tense != "present" or clause.verb == "be":
        return finite in AUXILIARIES[person]
    if person == 1:  # du: -st, merged into -t after s/ß/z (du isst, du tanzt)
        return finite.endswith("st") or (finite.endswith("t") and finite[-2] in "sßz")
    return finite.endswith(PRESENT_ENDINGS[person]) and not any(finite in forms for forms in AUXILIARIES)


def test_subordinate_clauses_end_with_an_agreeing_finite_verb(sentences):
    checked = 0
    for sentence in sentences:
        if sentence.sub is None:
            continue
        _, german = render_sentence(sentence)
        if sentence.sub_first:
            sub = german.split(", ")[0]
        else:
            sub = german[:-1].split(", ")[1]
        words = sub.split()
        assert words[0] in ("Weil", "Obwohl", "weil", "obwohl", "dass"), german
        assert agrees(words[-1], sentence.sub), german
        checked += 1
    assert checked > 1000


def test_shipped_subordinate_clauses_end_with_a_finite_verb(shipped):
    finite_forms = set().union(*AUXILIARIES) | {
        verb.prefix + verb.present(person) for verb in VERBS.values() for person in range(6)
    }
    clauses = [line[:-1].rsplit(", ", 1)[1] for line in shipped["train.de.gz"]
               if any(f", {conjunction} " in line for conjunction in ("weil", "obwohl", "dass"))]
    assert len(clauses) > 10_000
    for clause in clauses:
        assert clause.split()[-1] in finite_forms, clause


def test_fronted_adverbs_and_subordinate_clauses_put_the_verb_second(sentences):
    checked = 0
    for sentence in sentences:
        _, german = render_sentence(sentence)
        if sentence.adverb is not None:
            finite = german.split()[len(sentence.adverb.split())]  # "last week" = "letzte Woche"
        elif sentence.sub_first:
            finite = german.split(", ")[1].split()[0]
        else:
            continue
        assert agrees(finite, sentence.main), german
        checked += 1
    assert checked > 500


def test_perfect_main_clauses_end_with_the_participle(sentences):
    checked = 0
    for sentence in sentences:
        main = sentence.main
        if sentence.sub is None and main.tense != "present" and main.verb != "be":
            words = render_sentence(sentence)[1][:-1].split()
            assert words[-1] == VERBS[main.verb].participle, words
            assert any(agrees(word.lower(), main) for word in words[:-1]), words  # "Hat er ...?"
            checked += 1
    assert checked > 500


def padded(text: str) -> str:
    """Words between single spaces, punctuation dropped, so " den Hund " matches whole words only."""
    return " " + " ".join(text.replace(",", " ").rstrip(".?").split()) + " "


def expected_object(phrase: NounPhrase, *, negated: bool) -> str:
    """A masculine singular accusative object, spelled out by hand: den/einen/keinen (adjective-en) noun."""
    noun = NOUNS[phrase.head]
    mass = noun.en_plural is None
    article = "den" if phrase.definite else "keinen" if negated else "" if mass else "einen"
    adjective = ADJECTIVES[phrase.adjective].stem + "en" if phrase.adjective else ""
    name = {"boy": "Jungen", "student": "Studenten"}.get(phrase.head, noun.de)
    return " ".join(word for word in (article, adjective, name) if word)


def test_masculine_accusative_objects_take_den_einen_keinen(sentences):
    checked = 0
    for sentence in sentences:
        _, german = render_sentence(sentence)
        for part in filter(None, [sentence.main, sentence.sub]):
            phrase = part.object
            masculine = phrase is not None and phrase.head in NOUNS and NOUNS[phrase.head].gender == "m"
            if not masculine or phrase.plural or VERBS[part.verb].object_case != "acc":
                continue
            assert f" {expected_object(phrase, negated=part.negated)} " in padded(german), german
            checked += 1
    assert checked > 300


DATIVE_PLURALS = {
    "man": "Männern", "woman": "Frauen", "child": "Kindern", "boy": "Jungen", "girl": "Mädchen",
    "teacher": "Lehrern", "doctor": "Ärzten", "friend": "Freunden", "father": "Vätern", "mother": "Müttern",
    "sister": "Schwestern", "cook": "Köchen", "student": "Studenten", "dog": "Hunden", "cat": "Katzen",
    "horse": "Pferden", "bird": "Vögeln", "mouse": "Mäusen",
}


def expected_with(phrase: NounPhrase) -> str:
    """ "with ..." spelled out by hand: mit dem/der/einem/einer/den, adjectives in -en, dative plural -n."""
    noun = NOUNS[phrase.head]
    if phrase.plural:
        article, name = "den" if phrase.definite else "", DATIVE_PLURALS[phrase.head]
    else:
        article = {"m": "dem", "f": "der", "n": "dem"}[noun.gender]
        article = article if phrase.definite else "ein" + article[1:]
        name = {"boy": "Jungen", "student": "Studenten"}.get(phrase.head, noun.de)
    adjective = ADJECTIVES[phrase.adjective].stem + "en" if phrase.adjective else ""
    return " ".join(word for word in ("mit", article, adjective, name) if word)


def test_mit_takes_the_dative(sentences):
    checked = 0
    for sentence in sentences:
        _, german = render_sentence(sentence)
        for part in filter(None, [sentence.main, sentence.sub]):
            if part.prep is not None and part.prep.preposition == "with" and part.prep.object.head in NOUNS:
                assert f" {expected_with(part.prep.object)} " in padded(german), german
                checked += 1
    assert checked > 200


def test_negation_uses_kein_for_indefinite_objects_and_nicht_otherwise(sentences):
    checked = 0
    for sentence in sentences:
        main = sentence.main
        if sentence.sub is not None or not main.negated:
            continue
        words = render_sentence(sentence)[1][:-1].split()
        indefinite = main.object is not None and not main.object.definite and main.object.head in NOUNS
        assert any(word.startswith("kein") for word in words) == indefinite, words
        assert ("nicht" in words) != indefinite, words
        checked += 1
    assert checked > 200
