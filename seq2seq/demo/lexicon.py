"""The demo language's words: English/German tables and the German inflection they need.

Tables are plain text so that a German speaker can check them at a glance; everything that is a
rule (articles, adjective endings, present-tense endings) is a small function below them, and
everything that is irregular (plurals, participles, vowel changes) is spelled out in a table.
Multi-word English entries use `_` for the space ("look_for").
"""

from dataclasses import dataclass
from functools import cache
from typing import Literal, cast

Gender = Literal["m", "f", "n"]
Case = Literal["nom", "acc", "dat"]

# Person index 0..5: ich, du, er/sie/es, wir, ihr, sie. Noun phrases are 2 (singular) or 5 (plural).
PERSONS = range(6)


@dataclass(frozen=True)
class Noun:
    en: str
    en_plural: str | None  # None: a mass noun ("milk"), never plural, no indefinite article
    de: str
    gender: Gender
    de_plural: str | None
    kind: str  # person, animal, thing, song, food, drink, place: which verbs and adjectives fit
    weak: bool = False  # n-declension masculines: der Junge, den/dem Jungen

    def german(self, *, plural: bool, case: Case) -> str:
        if plural:
            assert self.de_plural is not None, f"{self.en} has no plural"
            # Dative plural adds -n unless the plural already ends in -n or -s (den Kindern, den Autos).
            if case == "dat" and not self.de_plural.endswith(("n", "s")):
                return self.de_plural + "n"
            return self.de_plural
        if self.weak and case != "nom":
            return self.de + ("n" if self.de.endswith("e") else "en")
        return self.de


_NOUNS = """
# english   plural      gender  german      plural      kind
man         men         m       Mann        Männer      person
woman       women       f       Frau        Frauen      person
child       children    n       Kind        Kinder      person
boy         boys        m       Junge       Jungen      person  weak
girl        girls       n       Mädchen     Mädchen     person
teacher     teachers    m       Lehrer      Lehrer      person
doctor      doctors     m       Arzt        Ärzte       person
friend      friends     m       Freund      Freunde     person
father      fathers     m       Vater       Väter       person
mother      mothers     f       Mutter      Mütter      person
sister      sisters     f       Schwester   Schwestern  person
cook        cooks       m       Koch        Köche       person
student     students    m       Student     Studenten   person  weak
dog         dogs        m       Hund        Hunde       animal
cat         cats        f       Katze       Katzen      animal
horse       horses      n       Pferd       Pferde      animal
bird        birds       m       Vogel       Vögel       animal
mouse       mice        f       Maus        Mäuse       animal
book        books       n       Buch        Bücher      thing
letter      letters     m       Brief       Briefe      thing
newspaper   newspapers  f       Zeitung     Zeitungen   thing
car         cars        n       Auto        Autos       thing
table       tables      m       Tisch       Tische      thing
chair       chairs      m       Stuhl       Stühle      thing
ball        balls       m       Ball        Bälle       thing
bag         bags        f       Tasche      Taschen     thing
lamp        lamps       f       Lampe       Lampen      thing
window      windows     n       Fenster     Fenster     thing
door        doors       f       Tür         Türen       thing
picture     pictures    n       Bild        Bilder      thing
song        songs       n       Lied        Lieder      song
gift        gifts       n       Geschenk    Geschenke   thing
key         keys        m       Schlüssel   Schlüssel   thing
bike        bikes       n       Fahrrad     Fahrräder   thing
room        rooms       n       Zimmer      Zimmer      thing
apple       apples      m       Apfel       Äpfel       food
cake        cakes       m       Kuchen      Kuchen      food
soup        soups       f       Suppe       Suppen      food
banana      bananas     f       Banane      Bananen     food
egg         eggs        n       Ei          Eier        food
sausage     sausages    f       Wurst       Würste      food
coffee      -           m       Kaffee      -           drink
tea         -           m       Tee         -           drink
milk        -           f       Milch       -           drink
water       -           n       Wasser      -           drink
juice       -           m       Saft        -           drink
park        parks       m       Park        Parks       place
garden      gardens     m       Garten      Gärten      place
city        cities      f       Stadt       Städte      place
school      schools     f       Schule      Schulen     place
kitchen     kitchens    f       Küche       Küchen      place
forest      forests     m       Wald        Wälder      place
house       houses      n       Haus        Häuser      place
"""


@dataclass(frozen=True)
class Pronoun:
    person: int
    en_subject: str
    en_object: str
    nom: str
    acc: str
    dat: str


PRONOUNS = {
    p.en_subject: p
    for p in [
        Pronoun(0, "I", "me", "ich", "mich", "mir"),
        Pronoun(1, "you", "you", "du", "dich", "dir"),  # English "you" is always singular here ...
        Pronoun(2, "he", "him", "er", "ihn", "ihm"),
        Pronoun(2, "she", "her", "sie", "sie", "ihr"),
        Pronoun(3, "we", "us", "wir", "uns", "uns"),
        Pronoun(4, "you all", "you all", "ihr", "euch", "euch"),  # ... so that English decides du/ihr
        Pronoun(5, "they", "them", "sie", "sie", "ihnen"),
    ]
}


@dataclass(frozen=True)
class Adjective:
    en: str
    de: str  # predicative: "Der Mann ist müde."
    stem: str  # attributive, before endings: "der müde Mann", "ein teures Auto"
    kinds: frozenset[str]


_ADJECTIVES = """
# english   german      stem        nouns it describes
big         groß        groß        person animal thing place food
small       klein       klein       person animal thing place food
old         alt         alt         person animal thing place song
young       jung        jung        person animal
new         neu         neu         thing place song
beautiful   schön       schön       person animal thing place song
red         rot         rot         thing
fast        schnell     schnell     animal thing
expensive   teuer       teur        thing
tired       müde        müd         person animal
hungry      hungrig     hungrig     person animal
happy       glücklich   glücklich   person animal
friendly    freundlich  freundlich  person animal
clever      klug        klug        person animal
cold        kalt        kalt        drink food
hot         heiß        heiß        drink food
"""


@dataclass(frozen=True)
class Verb:
    en: tuple[str, str, str, str]  # base, third person singular, past, participle
    de: str  # infinitive without a separable prefix: "rufen" for anrufen
    prefix: str  # separable prefix ("an"), or ""
    changed_stem: str  # du/er stem with a vowel change ("sieh", "läuf"), or the regular stem
    participle: str
    auxiliary: Literal["haben", "sein"]
    subjects: frozenset[str]  # noun kinds
    objects: frozenset[str]  # noun kinds or single nouns; empty: intransitive
    object_case: Case
    object_optional: bool
    preps: tuple[str, ...]  # prepositional phrases it may take (keys of PREPOSITIONS)
    prep_required: bool = False
    forms: tuple[str, ...] = ()  # all six present forms, for the truly irregular ones
    takes_that: bool = False  # "I know that ..."

    def present(self, person: int) -> str:
        """German present tense, without the separable prefix."""
        if self.forms:
            return self.forms[person]
        stem = self.de[:-2]
        if person == 0:
            return stem + "e"
        if person in (3, 5):
            return self.de
        base = self.changed_stem if person in (1, 2) else stem
        # An -e- keeps the ending audible after t/d and after a consonant + n (du arbeitest, er öffnet);
        # vowel-changing verbs have no such stems here.
        linking_e = "e" if base.endswith(("t", "d", "ffn")) else ""
        if person == 1:
            # After s/ß/z the -s- of -st merges: du liest, du isst, du tanzt.
            return base + linking_e + ("t" if base.endswith(("s", "ß", "z")) else "st")
        return base + linking_e + "t"


def _verb(en: str, de: str, *, subjects: str, objects: str = "", case: Case = "acc", optional: bool = False,
          preps: str = "", required: bool = False, forms: str = "", that: bool = False) -> Verb:
    """One verb from two compact strings: "see sees saw seen", "sehen sieh gesehen haben"."""
    base, third, past, participle = (word.replace("_", " ") for word in en.split())
    infinitive, changed, de_participle, auxiliary = de.split()
    prefix, _, infinitive = infinitive.rpartition("|")
    assert auxiliary in ("haben", "sein"), de
    return Verb(
        en=(base, third, past, participle), de=infinitive, prefix=prefix,
        changed_stem=infinitive[:-2] if changed == "-" else changed, participle=de_participle,
        auxiliary=cast(Literal["haben", "sein"], auxiliary), subjects=frozenset(subjects.split()), objects=frozenset(objects.split()),
        object_case=case, object_optional=optional, preps=tuple(preps.split()), prep_required=required,
        forms=tuple(forms.split()), takes_that=that,
    )


ANIMATE = "person animal"
VERBS = {
    verb.en[0]: verb
    for verb in [
        # transitive, accusative object
        _verb("see sees saw seen", "sehen sieh gesehen haben", subjects=ANIMATE,
              objects="person animal thing place", preps="in"),
        _verb("read reads read read", "lesen lies gelesen haben", subjects="person",
              objects="book letter newspaper", optional=True, preps="in"),
        _verb("eat eats ate eaten", "essen iss gegessen haben", subjects=ANIMATE, objects="food",
              optional=True, preps="in with"),
        _verb("drink drinks drank drunk", "trinken - getrunken haben", subjects=ANIMATE, objects="drink",
              optional=True, preps="in with"),
        _verb("buy buys bought bought", "kaufen - gekauft haben", subjects="person",
              objects="thing food drink", preps="for in"),
        _verb("look_for looks_for looked_for looked_for", "suchen - gesucht haben", subjects=ANIMATE,
              objects="person animal key ball bag book letter", preps="in with"),
        _verb("find finds found found", "finden - gefunden haben", subjects=ANIMATE,
              objects="person animal key ball bag book letter", preps="in"),
        _verb("love loves loved loved", "lieben - geliebt haben", subjects=ANIMATE, objects="person animal"),
        _verb("need needs needed needed", "brauchen - gebraucht haben", subjects=ANIMATE,
              objects="thing drink"),
        _verb("carry carries carried carried", "tragen träg getragen haben", subjects="person",
              objects="bag ball chair table book gift", preps="for to"),
        _verb("take takes took taken", "nehmen nimm genommen haben", subjects="person",
              objects="thing food"),
        _verb("hear hears heard heard", "hören - gehört haben", subjects=ANIMATE,
              objects="person animal song", preps="in"),
        _verb("sing sings sang sung", "singen - gesungen haben", subjects=ANIMATE, objects="song",
              optional=True, preps="for in with"),
        _verb("paint paints painted painted", "malen - gemalt haben", subjects="person",
              objects="picture house person animal", optional=True, preps="for in"),
        _verb("write writes wrote written", "schreiben - geschrieben haben", subjects="person",
              objects="letter book song", optional=True, preps="for"),
        _verb("open opens opened opened", "öffnen - geöffnet haben", subjects="person",
              objects="door window bag letter gift book", preps="for"),
        _verb("visit visits visited visited", "besuchen - besucht haben", subjects="person",
              objects="person city park school", preps="with"),
        _verb("cook cooks cooked cooked", "kochen - gekocht haben", subjects="person",
              objects="soup egg sausage coffee tea", optional=True, preps="for in with"),
        _verb("build builds built built", "bauen - gebaut haben", subjects="person",
              objects="house table chair", preps="for with"),
        _verb("wash washes washed washed", "waschen wäsch gewaschen haben", subjects="person",
              objects="animal car bike table", preps="in"),
        _verb("sell sells sold sold", "verkaufen - verkauft haben", subjects="person",
              objects="car bike book house picture horse"),
        _verb("repair repairs repaired repaired", "reparieren - repariert haben", subjects="person",
              objects="car bike door chair table lamp window", preps="for"),
        _verb("call calls called called", "an|rufen - angerufen haben", subjects="person", objects="person"),
        _verb("tidy tidies tidied tidied", "auf|räumen - aufgeräumt haben", subjects="person",
              objects="room kitchen house", preps="with"),
        _verb("understand understands understood understood", "verstehen - verstanden haben",
              subjects=ANIMATE, objects="person"),
        # dative object
        _verb("help helps helped helped", "helfen hilf geholfen haben", subjects=ANIMATE,
              objects="person animal", case="dat", preps="in"),
        _verb("thank thanks thanked thanked", "danken - gedankt haben", subjects="person",
              objects="person", case="dat"),
        _verb("follow follows followed followed", "folgen - gefolgt sein", subjects=ANIMATE,
              objects="person animal", case="dat", preps="to"),
        # intransitive
        _verb("sleep sleeps slept slept", "schlafen schläf geschlafen haben", subjects=ANIMATE, preps="in"),
        _verb("laugh laughs laughed laughed", "lachen - gelacht haben", subjects="person", preps="in"),
        _verb("play plays played played", "spielen - gespielt haben", subjects=ANIMATE, preps="with in"),
        _verb("work works worked worked", "arbeiten - gearbeitet haben", subjects="person", preps="in with"),
        _verb("wait waits waited waited", "warten - gewartet haben", subjects=ANIMATE, preps="in with"),
        _verb("dance dances danced danced", "tanzen - getanzt haben", subjects="person", preps="with in"),
        _verb("cry cries cried cried", "weinen - geweint haben", subjects="person"),
        _verb("live lives lived lived", "wohnen - gewohnt haben", subjects=ANIMATE, preps="in",
              required=True),
        _verb("go goes went gone", "gehen - gegangen sein", subjects=ANIMATE, preps="to with"),
        _verb("come comes came come", "kommen - gekommen sein", subjects=ANIMATE, preps="to with"),
        _verb("run runs ran run", "laufen läuf gelaufen sein", subjects=ANIMATE, preps="to with"),
        _verb("drive drives drove driven", "fahren fähr gefahren sein", subjects="person", preps="to with"),
        # with a "that" clause
        _verb("know knows knew known", "wissen - gewusst haben", subjects="person", that=True,
              forms="weiß weißt weiß wissen wisst wissen"),
        _verb("say says said said", "sagen - gesagt haben", subjects="person", that=True),
        _verb("think thinks thought thought", "glauben - geglaubt haben", subjects="person", that=True),
        _verb("hope hopes hoped hoped", "hoffen - gehofft haben", subjects="person", that=True),
    ]
}

# The two auxiliaries and the copula, in the six persons (sein also in the past: "war" is what
# German uses for "was", where other verbs take the perfect).
HABEN = ("habe", "hast", "hat", "haben", "habt", "haben")
SEIN = ("bin", "bist", "ist", "sind", "seid", "sind")
SEIN_PAST = ("war", "warst", "war", "waren", "wart", "waren")
EN_BE = ("am", "are", "is", "are", "are", "are")
EN_BE_PAST = ("was", "were", "was", "were", "were", "were")


@dataclass(frozen=True)
class Preposition:
    de: str
    case: Case
    kinds: frozenset[str]


PREPOSITIONS = {
    "with": Preposition("mit", "dat", frozenset({"person", "animal"})),
    "for": Preposition("für", "acc", frozenset({"person"})),
    "in": Preposition("in", "dat", frozenset({"place"})),  # where: "im Park"
    "to": Preposition("in", "acc", frozenset({"place"})),  # where to: "in den Park"
}

# Fronted time adverbs by the tense they go with; German puts the verb right after them.
ADVERBS = {
    "present": {"today": "heute", "now": "jetzt", "often": "oft", "sometimes": "manchmal"},
    "perfect": {"today": "heute", "now": "jetzt"},
    "past": {"yesterday": "gestern", "last week": "letzte Woche"},
}

CONJUNCTIONS = {"because": "weil", "although": "obwohl", "that": "dass"}


def _table(text: str) -> list[list[str]]:
    return [line.split() for line in text.strip().splitlines() if not line.startswith("#")]


NOUNS = {
    row[0]: Noun(row[0], None if row[1] == "-" else row[1], row[3], cast(Gender, row[2]), None if row[4] == "-" else row[4],
                 row[5], weak=row[6:] == ["weak"])
    for row in _table(_NOUNS)
}
ADJECTIVES = {row[0]: Adjective(row[0], row[1], row[2], frozenset(row[3:])) for row in _table(_ADJECTIVES)}


@cache
def nouns_for(spec: frozenset[str]) -> list[str]:
    """The nouns a verb or preposition accepts: `spec` names kinds ("food") or single nouns ("key")."""
    return [key for key, noun in NOUNS.items() if key in spec or noun.kind in spec]


# Articles and adjective endings, indexed by case and then by gender or "pl".
DEFINITE = {
    "nom": {"m": "der", "f": "die", "n": "das", "pl": "die"},
    "acc": {"m": "den", "f": "die", "n": "das", "pl": "die"},
    "dat": {"m": "dem", "f": "der", "n": "dem", "pl": "den"},
}
# Endings of ein/kein; "ein" has no plural, "kein" does (keine Hunde, keinen Hunden).
EIN_ENDINGS = {
    "nom": {"m": "", "f": "e", "n": "", "pl": "e"},
    "acc": {"m": "en", "f": "e", "n": "", "pl": "e"},
    "dat": {"m": "em", "f": "er", "n": "em", "pl": "en"},
}
# Weak endings follow der/die/das (the article already shows case and gender); mixed endings follow
# ein/kein, whose bare forms (ein, kein) do not, so the adjective shows it (ein großer Hund);
# strong endings stand in for a missing article (große Hunde, kalte Milch).
ADJECTIVE_ENDINGS = {
    "weak": {
        "nom": {"m": "e", "f": "e", "n": "e", "pl": "en"},
        "acc": {"m": "en", "f": "e", "n": "e", "pl": "en"},
        "dat": {"m": "en", "f": "en", "n": "en", "pl": "en"},
    },
    "mixed": {
        "nom": {"m": "er", "f": "e", "n": "es", "pl": "en"},
        "acc": {"m": "en", "f": "e", "n": "es", "pl": "en"},
        "dat": {"m": "en", "f": "en", "n": "en", "pl": "en"},
    },
    "strong": {
        "nom": {"m": "er", "f": "e", "n": "es", "pl": "e"},
        "acc": {"m": "en", "f": "e", "n": "es", "pl": "e"},
        "dat": {"m": "em", "f": "er", "n": "em", "pl": "en"},
    },
}
