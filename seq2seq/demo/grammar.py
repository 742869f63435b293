"""A seeded probabilistic grammar of English→German sentence pairs: the corpus behind configs/demo.yaml.

Small enough to learn in minutes on a laptop CPU, yet not word-for-word: German nouns carry gender,
number and case (der/den/dem Hund, mit den Kindern, ein großer Hund, keinen Kaffee), verbs agree with
their subject (du isst, ihr arbeitet), and word order moves the verb — second after a fronted time
adverb ("Heute liest die Frau ein Buch."), last in clauses after weil/dass/obwohl, with the perfect's
participle and a separable prefix at the end of a main clause ("Er ruft die Frau an.").

A sentence is first sampled as a structure (`Sentence`), then rendered into both languages, so the pair
is aligned by construction and `render` lets tests check exact strings for a given structure. Every
English sentence has exactly one German translation (English "you" is always du, "you all" is ihr;
the simple past appears only where "yesterday", "did" or "did not" tells it apart from the present),
so deduplicating on English also keeps validation and test sentences out of training.

    python -m seq2seq.demo.grammar --out seq2seq/demo/data
"""

import argparse
import gzip
import random
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

from seq2seq.demo.lexicon import (
    ADJECTIVE_ENDINGS,
    ADJECTIVES,
    ADVERBS,
    CONJUNCTIONS,
    DEFINITE,
    EIN_ENDINGS,
    EN_BE,
    EN_BE_PAST,
    HABEN,
    NOUNS,
    PREPOSITIONS,
    PRONOUNS,
    SEIN,
    SEIN_PAST,
    VERBS,
    Case,
    nouns_for,
)

Tense = Literal["present", "perfect", "past"]
Order = Literal["main", "inverted", "subordinate"]  # subject-verb-..., verb-subject-..., subject-...-verb

DATA_DIR = Path(__file__).parent / "data"  # the shipped corpus
SPLITS = ("train", "valid", "test")
MIN_WORDS, MAX_WORDS = 4, 16  # per side; longer or shorter samples are drawn again


@dataclass(frozen=True)
class NounPhrase:
    head: str  # a noun ("dog") or a subject pronoun ("I", "you", "you all", "they")
    plural: bool = False
    definite: bool = True
    adjective: str | None = None


@dataclass(frozen=True)
class PrepPhrase:
    preposition: str  # "with", "for", "in" (where: im Park) or "to" (where to: in den Park)
    object: NounPhrase


@dataclass(frozen=True)
class Clause:
    subject: NounPhrase
    verb: str  # English base form ("see", "look for"), or "be" with a `predicate`
    object: NounPhrase | None = None
    predicate: str | None = None  # the adjective after "be"
    prep: PrepPhrase | None = None
    tense: Tense = "present"  # English "past" is rendered as the German perfect (sein: "war")
    negated: bool = False


@dataclass(frozen=True)
class Sentence:
    main: Clause
    adverb: str | None = None  # fronted time adverb ("today"): German inverts subject and verb
    question: bool = False
    conjunction: str | None = None  # "because", "although" or "that", introducing `sub`
    sub: Clause | None = None
    sub_first: bool = False  # "Because ..., ...": German main clause then starts with its verb


# ---------------------------------------------------------------------------------------------
# Rendering


def _person(phrase: NounPhrase) -> int:
    if phrase.head in PRONOUNS:
        return PRONOUNS[phrase.head].person
    return 5 if phrase.plural else 2


def _english_np(phrase: NounPhrase, *, as_object: bool) -> str:
    if phrase.head in PRONOUNS:
        pronoun = PRONOUNS[phrase.head]
        return pronoun.en_object if as_object else pronoun.en_subject
    noun = NOUNS[phrase.head]
    words = [ADJECTIVES[phrase.adjective].en] if phrase.adjective else []
    if phrase.plural:
        assert noun.en_plural is not None, f"{noun.en} is a mass noun: it has no plural"
        words.append(noun.en_plural)
    else:
        words.append(noun.en)
    if phrase.definite:
        words.insert(0, "the")
    elif not phrase.plural and noun.en_plural is not None:  # mass nouns and plurals take no article
        words.insert(0, "an" if words[0][0] in "aeiou" else "a")
    return " ".join(words)


def _english_clause(clause: Clause, *, question: bool = False) -> str:
    person = _person(clause.subject)
    third_singular = person == 2
    complement = []
    if clause.object is not None:
        complement.append(_english_np(clause.object, as_object=True))
    if clause.predicate is not None:
        complement.append(ADJECTIVES[clause.predicate].en)
    if clause.prep is not None:
        complement += [clause.prep.preposition, _english_np(clause.prep.object, as_object=True)]

    auxiliary = ""  # what moves to the front of a question
    if clause.tense == "perfect":
        auxiliary = "has" if third_singular else "have"
        verb = "been" if clause.verb == "be" else VERBS[clause.verb].en[3]
    elif clause.verb == "be":
        auxiliary, verb = (EN_BE_PAST if clause.tense == "past" else EN_BE)[person], ""
    else:
        base, third, past, _ = VERBS[clause.verb].en
        if clause.negated or question:  # do-support
            auxiliary, verb = ("did" if clause.tense == "past" else "does" if third_singular else "do"), base
        else:
            verb = past if clause.tense == "past" else third if third_singular else base

    subject = _english_np(clause.subject, as_object=False)
    negation = "not" if clause.negated else ""
    words = [auxiliary, subject] if question else [subject, auxiliary]
    return " ".join(word for word in [*words, negation, verb, *complement] if word)


def _german_np(phrase: NounPhrase, *, case: Case, negative: bool = False) -> str:
    """`negative`: an indefinite phrase under negation takes kein ("keinen Hund", "keine Milch")."""
    if phrase.head in PRONOUNS:
        return getattr(PRONOUNS[phrase.head], case)
    noun = NOUNS[phrase.head]
    slot = "pl" if phrase.plural else noun.gender
    if phrase.definite:
        article, declension = DEFINITE[case][slot], "weak"
    elif negative:
        article, declension = "kein" + EIN_ENDINGS[case][slot], "mixed"
    elif phrase.plural or noun.en_plural is None:
        article, declension = "", "strong"
    else:
        article, declension = "ein" + EIN_ENDINGS[case][slot], "mixed"
    adjective = ""
    if phrase.adjective:
        adjective = ADJECTIVES[phrase.adjective].stem + ADJECTIVE_ENDINGS[declension][case][slot]
    words = [article, adjective, noun.german(plural=phrase.plural, case=case)]
    return " ".join(word for word in words if word)


def _german_pp(prep: PrepPhrase) -> str:
    preposition = PREPOSITIONS[prep.preposition]
    text = f"{preposition.de} {_german_np(prep.object, case=preposition.case)}"
    # German contracts in + dem/das before a definite singular noun: im Park, ins Haus.
    for long, short in (("in dem ", "im "), ("in das ", "ins ")):
        if text.startswith(long):
            text = short + text[len(long) :]
    return text


def _german_clause(clause: Clause, *, order: Order) -> str:
    person = _person(clause.subject)
    middle = []  # the middle field, between the finite verb and the verb-final bracket
    kein = False
    if clause.object is not None:
        verb_case = VERBS[clause.verb].object_case
        kein = clause.negated and not clause.object.definite and clause.object.head not in PRONOUNS
        middle.append(_german_np(clause.object, case=verb_case, negative=kein))
    if clause.negated and not kein:
        middle.append("nicht")  # after the object, before a predicate adjective or participle
    if clause.predicate is not None:
        middle.append(ADJECTIVES[clause.predicate].de)
    if clause.prep is not None:
        middle.append(_german_pp(clause.prep))

    final = ""  # the verb-final bracket of a main clause: participle or separable prefix
    if clause.verb == "be":
        finite = (SEIN_PAST if clause.tense == "past" else SEIN)[person]
        final = "gewesen" if clause.tense == "perfect" else ""
    elif clause.tense == "present":
        verb = VERBS[clause.verb]
        finite = verb.present(person)
        if verb.prefix and order == "subordinate":
            finite = verb.prefix + finite  # the prefix rejoins its verb at the end: "weil er sie anruft"
        elif verb.prefix:
            final = verb.prefix
    else:
        verb = VERBS[clause.verb]
        finite = (HABEN if verb.auxiliary == "haben" else SEIN)[person]
        final = verb.participle

    subject = _german_np(clause.subject, case="nom")
    if order == "main":  # the subject stands before the verb, outside the middle field
        words = [subject, finite, *middle, final]
    else:
        # An unstressed pronoun leads the middle field, even before a noun subject:
        # "Heute sieht ihn der Mann."
        pronoun_first = clause.object is not None and clause.object.head in PRONOUNS
        middle.insert(1 if pronoun_first and clause.subject.head not in PRONOUNS else 0, subject)
        words = [finite, *middle, final] if order == "inverted" else [*middle, final, finite]
    return " ".join(word for word in words if word)


def _check(clause: Clause) -> None:
    phrases = [clause.subject, clause.object, clause.prep.object if clause.prep else None]
    for phrase in filter(None, phrases):
        if phrase.head not in NOUNS and phrase.head not in PRONOUNS:
            raise ValueError(f"unknown noun or pronoun {phrase.head!r}; nouns: {', '.join(NOUNS)}")
        if phrase.plural and phrase.head in NOUNS and NOUNS[phrase.head].en_plural is None:
            raise ValueError(f"{phrase.head!r} is a mass noun and has no plural")
        if phrase.adjective is not None and phrase.adjective not in ADJECTIVES:
            raise ValueError(f"unknown adjective {phrase.adjective!r}; adjectives: {', '.join(ADJECTIVES)}")
    if clause.verb == "be" and clause.predicate not in ADJECTIVES:
        raise ValueError(f"'be' needs a predicate adjective, one of: {', '.join(ADJECTIVES)}")
    if clause.verb != "be" and clause.verb not in VERBS:
        raise ValueError(f"unknown verb {clause.verb!r}; verbs: be, {', '.join(VERBS)}")
    if clause.prep is not None and clause.prep.preposition not in PREPOSITIONS:
        known = ", ".join(PREPOSITIONS)
        raise ValueError(f"unknown preposition {clause.prep.preposition!r}; one of: {known}")


def _sentence_case(text: str, end: str) -> str:
    return text[0].upper() + text[1:] + end


def render_sentence(sentence: Sentence) -> tuple[str, str]:
    """The (English, German) pair for one sentence structure."""
    main = sentence.main
    for clause in filter(None, [main, sentence.sub]):
        _check(clause)
    if sentence.sub is not None:
        conjunction = sentence.conjunction or "because"
        sub_en, sub_de = _english_clause(sentence.sub), _german_clause(sentence.sub, order="subordinate")
        sub_de = f"{CONJUNCTIONS[conjunction]} {sub_de}"
        if sentence.sub_first:  # the whole subordinate clause fills the slot before the verb
            en = f"{conjunction} {sub_en}, {_english_clause(main)}"
            de = f"{sub_de}, {_german_clause(main, order='inverted')}"
        else:
            en = f"{_english_clause(main)} {conjunction} {sub_en}"
            de = f"{_german_clause(main, order='main')}, {sub_de}"
    elif sentence.adverb is not None:
        if sentence.adverb not in ADVERBS[main.tense]:
            raise ValueError(f"adverb {sentence.adverb!r} does not go with the {main.tense} tense; "
                             f"use one of: {', '.join(ADVERBS[main.tense])}")
        en = f"{sentence.adverb} {_english_clause(main)}"
        de = f"{ADVERBS[main.tense][sentence.adverb]} {_german_clause(main, order='inverted')}"
    elif sentence.question:
        en, de = _english_clause(main, question=True), _german_clause(main, order="inverted")
    else:
        en, de = _english_clause(main), _german_clause(main, order="main")
    end = "?" if sentence.question else "."
    return _sentence_case(en, end), _sentence_case(de, end)


def _phrase(value: str | NounPhrase) -> NounPhrase:
    # Tests and examples name object pronouns as they read in English ("him"); the structure keeps
    # one key per pronoun, its subject form.
    objects = {pronoun.en_object: key for key, pronoun in PRONOUNS.items()}
    return NounPhrase(objects.get(value, value)) if isinstance(value, str) else value


def render(*, subject: str | NounPhrase, verb: str, object: str | NounPhrase | None = None,
           predicate: str | None = None, prep: str | None = None, prep_object: str | NounPhrase | None = None,
           tense: Tense = "present", negated: bool = False, adverb: str | None = None,
           question: bool = False) -> tuple[str, str]:
    """One simple sentence; a plain string names a definite singular noun or a pronoun.

    >>> render(subject="man", verb="see", object="dog", tense="perfect")
    ('The man has seen the dog.', 'Der Mann hat den Hund gesehen.')
    """
    prep_phrase = None
    if prep is not None and prep_object is not None:
        prep_phrase = PrepPhrase(prep, _phrase(prep_object))
    clause = Clause(subject=_phrase(subject), verb=verb, object=None if object is None else _phrase(object),
                    predicate=predicate,
                    prep=prep_phrase, tense=tense, negated=negated)
    return render_sentence(Sentence(main=clause, adverb=adverb, question=question))


# ---------------------------------------------------------------------------------------------
# Sampling

CONTENT_VERBS = [key for key, verb in VERBS.items() if not verb.takes_that]
THAT_VERBS = [key for key, verb in VERBS.items() if verb.takes_that]


@cache
def _adjectives_for(kind: str) -> list[str]:
    return [key for key, adjective in ADJECTIVES.items() if kind in adjective.kinds]


def _sample_np(rng: random.Random, *, kinds: frozenset[str], pronoun_probability: float = 0.0,
               plural_probability: float = 0.3, avoid: tuple[NounPhrase | None, ...] = ()) -> NounPhrase:
    avoided = {phrase.head for phrase in avoid if phrase is not None}
    if "person" in kinds and rng.random() < pronoun_probability:
        # "I see me" is not English: keep first and second person pronouns apart.
        groups = {PRONOUNS[head].person % 3 for head in avoided if head in PRONOUNS} - {2}
        pronouns = [key for key, pronoun in PRONOUNS.items() if pronoun.person % 3 not in groups]
        return NounPhrase(rng.choice(pronouns))
    head = rng.choice([key for key in nouns_for(kinds) if key not in avoided])
    noun = NOUNS[head]
    plural = noun.en_plural is not None and rng.random() < plural_probability
    definite = rng.random() < 0.65
    adjectives = _adjectives_for(noun.kind)
    adjective = rng.choice(adjectives) if adjectives and rng.random() < 0.25 else None
    return NounPhrase(head, plural=plural, definite=definite, adjective=adjective)


def _sample_clause(rng: random.Random, *, tenses: tuple[Tense, ...], verbs: list[str] = CONTENT_VERBS,
                   negation: bool = True, prep_probability: float = 0.35, copula_probability: float = 0.1
                   ) -> Clause:
    tense = rng.choice(tenses)
    negated = negation and rng.random() < 0.2
    if tense != "perfect" and rng.random() < copula_probability:  # "has been tired" reads oddly
        predicate = rng.choice(list(ADJECTIVES))
        subject = _sample_np(rng, kinds=ADJECTIVES[predicate].kinds, pronoun_probability=0.3)
        return Clause(subject=subject, verb="be", predicate=predicate, tense=tense, negated=negated)

    verb = VERBS[rng.choice(verbs)]
    subject = _sample_np(rng, kinds=verb.subjects, pronoun_probability=0.3)
    obj = None
    if verb.objects and not (verb.object_optional and rng.random() < 0.3):
        obj = _sample_np(rng, kinds=verb.objects, pronoun_probability=0.15, avoid=(subject,))
    prep = None
    # Negation and a prepositional phrase together would need nicht placed by meaning; keep them apart.
    negated = negated and not verb.prep_required
    if verb.preps and not negated and (verb.prep_required or rng.random() < prep_probability):
        preposition = rng.choice(verb.preps)
        place = preposition in ("in", "to")  # places read best in the singular: "im Park"
        prep_object = _sample_np(rng, kinds=PREPOSITIONS[preposition].kinds, pronoun_probability=0.15,
                                 plural_probability=0.0 if place else 0.3, avoid=(subject, obj))
        prep = PrepPhrase(preposition, prep_object)
    return Clause(subject=subject, verb=verb.en[0], object=obj, prep=prep, tense=tense, negated=negated)


def sample_sentence(rng: random.Random) -> Sentence:
    """One random sentence structure; the mix of shapes leans towards the ones that reorder."""
    shape = rng.choices(["plain", "adverb", "question", "because", "that"], weights=[30, 18, 10, 25, 17])[0]
    if shape == "plain":
        return Sentence(main=_sample_clause(rng, tenses=("present", "perfect")))
    if shape == "adverb":
        main = _sample_clause(rng, tenses=("present", "perfect", "past"))
        return Sentence(main=main, adverb=rng.choice(list(ADVERBS[main.tense])))
    if shape == "question":
        return Sentence(main=_sample_clause(rng, tenses=("present", "perfect", "past"), negation=False),
                        question=True)
    # Without "yesterday" or "did", English "I read" would be present or past: no simple past here.
    sub = _sample_clause(rng, tenses=("present", "perfect"), prep_probability=0.2)
    if shape == "that":
        main = _sample_clause(rng, tenses=("present",), verbs=THAT_VERBS, negation=False,
                              copula_probability=0)
        return Sentence(main=main, conjunction="that", sub=sub)
    main = _sample_clause(rng, tenses=("present", "perfect"), prep_probability=0.2)
    conjunction = rng.choice(["because", "although"])
    return Sentence(main=main, conjunction=conjunction, sub=sub, sub_first=rng.random() < 0.4)


# ---------------------------------------------------------------------------------------------
# Corpus


def generate_pairs(*, num_pairs: int, seed: int) -> list[tuple[str, str]]:
    """`num_pairs` pairs of 4-16 words a side, distinct in English, the same for the same seed."""
    rng = random.Random(seed)
    pairs: dict[str, str] = {}  # English → German, in order of first appearance
    for _ in range(100 * num_pairs + 1000):
        if len(pairs) == num_pairs:
            break
        en, de = render_sentence(sample_sentence(rng))
        if all(MIN_WORDS <= len(side.split()) <= MAX_WORDS for side in (en, de)):
            # English decides the German; a second German for the same English would be a grammar bug.
            assert pairs.setdefault(en, de) == de, (en, de, pairs[en])
    if len(pairs) < num_pairs:
        raise ValueError(f"the grammar gave only {len(pairs)} distinct pairs of the {num_pairs} asked for")
    return list(pairs.items())


def _write_lines(path: Path, lines: list[str]) -> None:
    # mtime=0 and no file name in the header: the same lines give the same bytes on every run.
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        gz.write("".join(line + "\n" for line in lines).encode("utf-8"))


def write_corpus(folder: Path, *, num_train: int = 40_000, num_valid: int = 500, num_test: int = 500,
                 seed: int = 0) -> None:
    """train/valid/test .en.gz and .de.gz in `folder`; valid and test English never occur in train."""
    pairs = generate_pairs(num_pairs=num_train + num_valid + num_test, seed=seed)
    # Pairs are distinct in English, so slicing one list keeps the held-out splits held out.
    splits = {
        "valid": pairs[:num_valid],
        "test": pairs[num_valid : num_valid + num_test],
        "train": pairs[num_valid + num_test :],
    }
    folder.mkdir(parents=True, exist_ok=True)
    for split, split_pairs in splits.items():
        for index, language in enumerate(("en", "de")):
            _write_lines(folder / f"{split}.{language}.gz", [pair[index] for pair in split_pairs])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DATA_DIR, help="folder for the six .gz files")
    parser.add_argument("--num-train", type=int, default=40_000)
    parser.add_argument("--num-valid", type=int, default=500)
    parser.add_argument("--num-test", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_corpus(args.out, num_train=args.num_train, num_valid=args.num_valid, num_test=args.num_test,
                 seed=args.seed)
    for path in sorted(args.out.glob("*.gz")):
        print(f"{path}  {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
