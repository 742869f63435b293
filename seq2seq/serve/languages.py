"""The server's languages: their names, and `source: auto`, which finds the language of a text among
those the server translates from.

Detection is lingua's (lingua-language-detector): its n-gram models ship in the wheel, so nothing is
downloaded at run time, and it is the most accurate on short inputs of the packaged identifiers we
measured (docs/serving.md). Only the languages the server has models
from are loaded (about 40 MB of memory each, at start so that the first request does not wait).
"""

from __future__ import annotations

from collections.abc import Iterable

from lingua import IsoCode639_1, Language, LanguageDetectorBuilder

NAMES = {"ar": "Arabic", "cs": "Czech", "da": "Danish", "de": "German", "el": "Greek", "en": "English",
         "es": "Spanish", "fi": "Finnish", "fr": "French", "hu": "Hungarian", "it": "Italian", "ja": "Japanese",
         "ko": "Korean", "nl": "Dutch", "pl": "Polish", "pt": "Portuguese", "ro": "Romanian", "ru": "Russian",
         "sv": "Swedish", "tr": "Turkish", "uk": "Ukrainian", "zh": "Chinese"}


def lingua_language(code: str) -> Language | None:
    """lingua's Language for an ISO 639-1 code (a checkpoint's src_lang), None if it has none."""
    try:
        return Language.from_iso_code_639_1(getattr(IsoCode639_1, code.upper()))
    except (AttributeError, ValueError):
        return None


class Detector:
    """Finds a text's language among `languages` (ISO 639-1 codes); those lingua does not know are
    never detected, and a text lingua cannot place (digits, punctuation) goes to the first candidate
    with confidence 0."""

    def __init__(self, languages: Iterable[str]) -> None:
        self.known = {code: language for code in languages if (language := lingua_language(code)) is not None}
        self.detector = (LanguageDetectorBuilder.from_languages(*self.known.values()).with_preloaded_language_models()
                         .build() if len(self.known) >= 2 else None)

    def rank(self, text: str, *, among: list[str]) -> list[tuple[str, float]]:
        """Every language of `among` with lingua's confidence (0-100) that `text` is in it, best first."""
        if self.detector is None:
            return [(code, 100.0 if len(among) == 1 else 0.0) for code in among]
        values = {value.language: value.value for value in self.detector.compute_language_confidence_values(text)}
        scores = [(code, values.get(self.known[code], 0.0) if code in self.known else 0.0) for code in among]
        return [(code, round(100.0 * score, 2)) for code, score in sorted(scores, key=lambda item: -item[1])]

    def detect(self, text: str, *, among: list[str]) -> tuple[str, float]:
        """The language of `text` among the codes `among` (not empty), and lingua's confidence (0-100)
        in it among all the languages the server translates from: low when the text looks like one the
        request's target cannot be reached from."""
        candidates = [code for code in among if code in self.known]
        if self.detector is None or not candidates:
            return among[0], 100.0 if len(among) == 1 else 0.0
        return self.rank(text, among=candidates)[0]
