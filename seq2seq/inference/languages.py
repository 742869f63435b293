"""What a Translator translates: a bilingual model's language pair, or a multilingual model's directions (its
checkpoint's), the target chosen among them, and where its tags go (`target_tag`: first in the source, what the
encoder reads, or forced as the translation's first token and dropped from what it returns). A Translator holds one
`Languages`; its `for_target` is a Translator holding another, the model shared."""

from __future__ import annotations

from dataclasses import dataclass, replace

from seq2seq.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class Languages:
    src_lang: str = ""
    tgt_lang: str = ""  # a multilingual model's chosen target ("" until one is: `chosen`)
    directions: tuple[tuple[str, str], ...] = ()  # a multilingual model's (src, tgt) pairs; () for a bilingual one
    target_tag: str = "encoder"

    @classmethod
    def of(cls, *, src_lang: str = "", tgt_lang: str = "", directions: tuple[tuple[str, str], ...] = (),
           target_tag: str = "encoder") -> Languages:
        """A model's languages as its checkpoint names them; a multilingual model of one target has it chosen."""
        targets = list(dict.fromkeys(tgt for _, tgt in directions))
        chosen = tgt_lang if not targets else targets[0] if len(targets) == 1 else ""
        return cls(src_lang, chosen, tuple(directions), target_tag)

    @property
    def targets(self) -> list[str]:
        """The languages a multilingual model translates into, in its directions' order; [] for a bilingual one."""
        return list(dict.fromkeys(tgt for _, tgt in self.directions))

    @property
    def pairs(self) -> str:
        """What it translates, as a log line names it: "de→en", or a multilingual model's "de→en, en→fr, ..." (those
        into its chosen target, where one is chosen)."""
        chosen = [(src, tgt) for src, tgt in self.directions if self.tgt_lang in ("", tgt)]
        return ", ".join(f"{src}→{tgt}" for src, tgt in chosen) or f"{self.src_lang}→{self.tgt_lang}"

    def chosen(self, tgt_lang: str, *, src_lang: str = "") -> Languages:
        """These languages translating into `tgt_lang` (from `src_lang`, which only sentence splitting reads).
        ValueError (one line, naming the targets there are) for a language the model does not translate into, or a
        bilingual model's other language."""
        if not self.targets and tgt_lang == self.tgt_lang:  # (a bilingual model asked for its own target)
            return self
        if tgt_lang not in self.targets:
            have = (f"this model translates into {', '.join(self.targets)}" if self.targets
                    else f"this model translates {self.src_lang or '?'}→{self.tgt_lang or '?'} only")
            raise ValueError(f"cannot translate into {tgt_lang!r}: {have}")
        return replace(self, tgt_lang=tgt_lang, src_lang=src_lang or self.src_lang)

    @property
    def tags_on_the_decoder(self) -> bool:
        """Every translation starts with a forced tag (whichever target: one batch may mix them, as a server's does)."""
        return bool(self.directions) and self.target_tag == "decoder"

    @property
    def source_tags(self) -> int:
        """How many tag tokens start every source (whichever target): a position each, no word."""
        return 1 if self.directions and self.target_tag == "encoder" else 0

    def tag(self, tokenizer: Tokenizer) -> list[int]:
        """The chosen target's tag ([] for a bilingual model); ValueError (one line) where a multilingual model has no
        target chosen, wherever its tags go."""
        if not self.directions:
            return []
        if not self.tgt_lang:
            raise ValueError(f"this model translates into {', '.join(self.targets)}: choose the target language "
                             "(tgt_lang=..., --tgt-lang)")
        return [tokenizer.tag_id(self.tgt_lang)]
