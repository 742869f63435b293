"""Translator: load a training checkpoint and translate batches of sentences.

    translator = Translator.from_checkpoint("checkpoints/multi30k/best.ckpt")
    translator.translate(["Ein Hund läuft.", "Zwei Männer."], SearchConfig(beam_size=5))

The checkpoint is read and checked by checkpoint.py (format, config against weights, checksum);
the search options are one SearchConfig, checked when it is built; decoding goes through
search.decode. Without one, a Translator searches with `self.search`: SearchConfig's defaults updated
with what the checkpoint stores as tuned on validation (training's TuneLengthPenalty writes the length
penalty there).

Inputs are batched by a token budget over the sentences sorted by length (little padding, so
little wasted compute), and the results are put back in input order. An empty line translates to
an empty line; a line longer than the model's `max_positions` is truncated, with a warning that
names its line. `translate_stream` does the same over a window of lines at a time, so a long
file's translations can be written as they are made.

The process-wide memory settings the CLI and the server make first (precision.tune_process_memory) are
the program's to make, not the library's: a program translating much through a Translator calls it too.
"""

import copy
import dataclasses
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from seq2seq.checkpoint import inference_model, load_checkpoint, read_inference
from seq2seq.decoding.config import SearchConfig
from seq2seq.decoding.scoring import Forced, force_decode
from seq2seq.decoding.search import decode
from seq2seq.inference.documents import (
    EMPTY,
    Document,
    Translation,
    document_of,
    per_document,
    search_for,
    text_only,
)
from seq2seq.inference.inputs import (
    Inputs,
    as_constraint_lists,
    as_lines,
    check_max_tokens,
    constraint_ids,
    prefix_ids,
    truncated,
    windows,
)
from seq2seq.inference.kept import kept_decoder
from seq2seq.inference.languages import Languages
from seq2seq.inference.outputs import translations as translations_of
from seq2seq.inference.pool import DecoderPool, decoder_threads, length_sorted_batches
from seq2seq.inference.preparation import Compiled, prepare, warn_of_workers_off_the_cpu
from seq2seq.model import Transformer
from seq2seq.model.compiled import CompiledDecoder
from seq2seq.precision import (
    Precision,
)
from seq2seq.text.glossary import Glossary, as_glossary, continues_word
from seq2seq.text.sentences import Paragraphs, model_sentence_spans
from seq2seq.text.tokenizer import Tokenizer

DEFAULT_SEARCH = SearchConfig()  # beam 5


class Translator:
    def __init__(
        self,
        *,
        model: Transformer,
        tokenizer: Tokenizer,
        src_lang: str = "",
        tgt_lang: str = "",
        device: str | torch.device = "cpu",
        precision: Precision = "auto",
        search: SearchConfig = DEFAULT_SEARCH,
        workers: int = 1,
        threads: int | None = None,
        compiled: Compiled = "auto",
        progress: Callable[[str], None] | None = None,
        served_by: tuple[int, int] | None = None,
        checksum: str | None = None,
        directions: Sequence[tuple[str, str]] = (),
        target_tag: str = "encoder",
    ):
        """`model` is prepared in place for `device` and `precision` (inference/preparation.py's `prepare`: auto
        picks bf16 where bf16 matmuls are fast, else fp32; int8 is a CPU option; the kernels the machine's timed
        verdicts choose); `self.precision` says what auto chose. `search` is what the translate methods use when
        given none.

        `workers` > 1 decodes that many batches at once, each in a thread of its own with `threads` intra-op
        threads (default: torch's thread count / workers), as CTranslate2's inter_threads do (inference/pool.py's
        DecoderPool; with one worker and `threads` given, its one thread has that many; with neither, the
        caller's thread decodes with the caller's count). The batches are those of one worker, so outputs do not
        depend on `workers`, except where an input's batches would leave workers idle: those are cut into parts
        (shared_out), which can change a bf16 translation slightly (fp32: the same tokens). On a device other
        than the CPU one worker is faster: more are taken, with a warning.

        `compiled`: the searches' decoding steps run compiled (seq2seq/model/compiled.py), faster at a few rows on
        a CPU, where the eager step is mostly per-call overhead. On a CPU in fp32 or bf16 the compiled decoder is
        built once per machine and kept (inference/kept.py; `python -m seq2seq.export --to compiled` builds it
        ahead): True uses the kept one, building it first where there is none (minutes; `progress` is told each
        step of it); auto (the default) uses it where it is kept, else decodes eager (`self.kept_at` names where it
        would be); False decodes eager; jit compiles in this process with torch.compile, keeping nothing, as True
        does where no package holds the model (int8, a GPU),
        the first batches of each kind (one row, several rows, beams) waiting while it compiles
        (`compile_decoding` compiles them all first). `served_by`: the (threads, intra-op threads each) of a server's
        decoder threads that call this Translator's methods themselves: the package is theirs (built for their
        count, as many of them running it at once). `checksum`: the checkpoint's verified checksum (from_checkpoint's),
        which names the kept package in place of a hash of the weights. `directions`: a multilingual model's
        (src, tgt) pairs (its checkpoint's), whose sources start with their target language's tag: `tgt_lang`
        picks it (by default the one target where there is one; `for_target` gives another). `target_tag`: where
        its tag goes, `encoder` (first in the source) or `decoder` (forced as the translation's first token, which
        no output shows)."""
        torch.set_flush_denormal(True)  # denormal floats run far slower on x86 CPUs (docs/performance/precision.md)
        runners, threads_each = served_by or (workers, decoder_threads(workers=workers, threads=threads))
        prepared = prepare(model, device=device, precision=precision, compiled=compiled, threads=threads_each,
                           checksum=checksum)
        self.model, self.decoding = prepared.model, prepared.decoding
        self.device, self.precision, self.compiled = prepared.device, prepared.precision, prepared.compiled
        self.package, self.kept_at = prepared.package, prepared.kept_at
        self.decoder_threads = threads_each
        """The intra-op threads of each thread that decodes (its pool's, or `served_by`'s): a package's count."""
        """The kept compiled package the decoding runs (None: eager, or torch.compile), and where this model's would be
        kept on this machine (None where none can hold it)."""
        self.pool = DecoderPool(workers=workers, threads=threads, row_work=model.config.d_model * model.config.vocab_size,
                                widen=not self.compiled)
        """The threads the batches decode on (seq2seq/inference/pool.py)."""
        if self.package is not None and isinstance(self.decoding, CompiledDecoder):  # (its decoder threads' count)
            decoding, folder = self.decoding, self.package
            self.decoding = self.pool.on_a_thread_of(threads_each, lambda: kept_decoder(
                decoding, folder, runners=runners, progress=progress or (lambda _line: None)))
        warn_of_workers_off_the_cpu(workers, self.device)
        self.tokenizer = tokenizer
        self.languages = Languages.of(src_lang=src_lang, tgt_lang=tgt_lang, directions=tuple(directions),
                                      target_tag=target_tag)
        """What it translates (inference/languages.py); `for_target` gives a Translator of other ones."""
        self.search = search
        self._continuing: frozenset[int] | None = None  # continuing_ids(), made on first use

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, *, device: str | torch.device = "cpu", precision: Precision = "auto", workers: int = 1,
        threads: int | None = None, compiled: Compiled = "auto", progress: Callable[[str], None] | None = None,
        served_by: tuple[int, int] | None = None,
    ) -> "Translator":
        """Raises CheckpointError (one line naming the file) for any checkpoint it cannot trust."""
        loaded = read_inference(path, load_checkpoint(path))
        model = inference_model(loaded)
        tokenizer = Tokenizer.from_bytes(loaded.tokenizer)  # read_inference loaded it once: it loads
        return cls(model=model, tokenizer=tokenizer, src_lang=loaded.src_lang, tgt_lang=loaded.tgt_lang,
                   device=device, precision=precision, search=loaded.search, workers=workers, threads=threads,
                   compiled=compiled, progress=progress, served_by=served_by, checksum=loaded.checksum,
                   directions=loaded.directions, target_tag=loaded.target_tag)

    # What it translates: its Languages' (inference/languages.py), read here as a Translator's own.
    @property
    def src_lang(self) -> str:
        return self.languages.src_lang

    @property
    def tgt_lang(self) -> str:
        return self.languages.tgt_lang

    @property
    def directions(self) -> tuple[tuple[str, str], ...]:
        return self.languages.directions

    @property
    def target_tag(self) -> str:
        return self.languages.target_tag

    @property
    def targets(self) -> list[str]:
        return self.languages.targets

    @property
    def pairs(self) -> str:
        return self.languages.pairs

    def for_target(self, tgt_lang: str, *, src_lang: str = "") -> "Translator":
        """This multilingual Translator translating into `tgt_lang` (from `src_lang`, which only sentence
        splitting reads): the same model, decoder threads and settings, shared. ValueError (one line, naming the
        targets there are) for a language it does not translate into, or a bilingual model's other language."""
        languages = self.languages.chosen(tgt_lang, src_lang=src_lang)
        if languages is self.languages:
            return self
        chosen = copy.copy(self)  # (the attributes shared: model, pool, decoder; its languages its own)
        chosen.languages = languages
        return chosen

    def source_tag(self) -> list[int]:
        """What every source starts with: a multilingual model's tag of `tgt_lang` where its tags go on the encoder
        side; nothing for a bilingual one. ValueError (one line) where a multilingual model has no target chosen."""
        tag = self.languages.tag(self.tokenizer)  # (its ValueError wherever the tags go)
        return tag if self.target_tag == "encoder" else []

    def decoder_tag(self) -> list[int]:
        """What every translation starts with, forced and then dropped: the tag of `tgt_lang` where a multilingual
        model's tags go on the decoder side; else nothing."""
        return self.languages.tag(self.tokenizer) if self.target_tag == "decoder" else []

    def compile_decoding(self, *, threads: int | None = None) -> int:
        """With `compiled`, every kind of decoding step compiled now (seq2seq/model/compiled.py), for decoder threads
        of `threads` intra-op threads (default: its workers' threads; with no threads of its own, the caller's
        thread, with its count): what a tool that answers sentences as they come does first, so that none waits
        while a kind compiles (docs/performance/compiled-decoding.md#cost). Dynamo compiles a graph per thread
        count, so the kinds compile on a thread of that count, a daemon thread: Ctrl-C in the caller ends the
        process at once (a pool's thread is waited for at exit, however long the compiling). The number of kinds
        compiled (0 without `compiled`, or when all were); CompileError (one line) when inductor cannot compile."""
        decoding = self.decoding
        if not isinstance(decoding, CompiledDecoder):
            return 0
        return self.pool.on_a_thread_of(threads, decoding.compile_kinds)

    def translate(self, texts: Iterable[str], search: SearchConfig | None = None, *, max_tokens: int = 8192,
                  prefixes: Iterable[str] | None = None, constraints: Iterable[Sequence[str]] | None = None,
                  glossary: Mapping[str, str] | Glossary | None = None, tgt_lang: str | None = None) -> list[str]:
        """One translation per input line, in input order (the best of `search`'s n-best); the options as
        translate_nbest's. Only text comes back, so no scores are computed (`text_only`)."""
        return [hyps[0].text if hyps else ""
                for hyps in self.translate_nbest(texts, text_only(self.search if search is None else search),
                                                 max_tokens=max_tokens, prefixes=prefixes, constraints=constraints,
                                                 glossary=glossary, tgt_lang=tgt_lang)]

    def translate_paragraphs(self, texts: Iterable[str], search: SearchConfig | None = None, *, max_tokens: int = 8192,
                             glossary: Mapping[str, str] | Glossary | None = None, first_line: int = 1) -> list[str]:
        """One translation per text, each text split into sentences (seq2seq/text/sentences.py, the source
        language's rules) and put back together with its own spaces, tabs and newlines between them; all
        the sentences are translated as one batch, each as it would be alone. A text of one sentence
        translates as `translate` translates it, its surrounding whitespace kept; a sentence longer than
        the model reads is cut at spaces into parts that fit, not truncated (a single word too long for it is
        truncated, with a warning naming its text's line: `first_line` is the first text's)."""
        return self.translate_documents([Paragraphs(text, split=self.sentence_spans) for text in as_lines(texts)],
                                        search, max_tokens=max_tokens, glossary=glossary, first_line=first_line)

    def translate_html(self, texts: Iterable[str], search: SearchConfig | None = None, *,
                       max_tokens: int = 8192, glossary: Mapping[str, str] | Glossary | None = None) -> list[str]:
        """Each HTML text (a page or a fragment) with its text translated and its markup kept
        (seq2seq/text/markup.py): word alignments carry the inline elements (<b>, <a href>, ...) to the words
        of the translation."""
        pages = [document_of(text, format="html", split=self.sentence_spans) for text in texts]
        return self.translate_documents(pages, search, max_tokens=max_tokens, glossary=glossary)

    def translate_documents(self, documents: Sequence[Document], search: SearchConfig | None = None, *,
                            max_tokens: int = 8192, glossary: Mapping[str, str] | Glossary | None = None,
                            first_line: int = 1) -> list[str]:
        """Each document (sentences.Paragraphs, markup.HtmlDocument, subtitles.SrtDocument) rendered with
        its translation: the sentences of all of them translated as one batch (with word alignments
        where a document has markup to place), each as it would be alone. Warnings name a sentence by its
        document's number, `first_line` the first's."""
        sentences = [sentence for document in documents for sentence in document.sentences]
        numbers = [first_line + d for d, document in enumerate(documents) for _ in document.sentences]
        best = [hyps[0] if hyps else EMPTY for hyps in self.translate_nbest(
            sentences, search_for(documents, self.search if search is None else search), max_tokens=max_tokens,
            glossary=glossary, line_numbers=numbers)]
        return [d.render(own) for d, own in zip(documents, per_document(documents, best), strict=True)]

    def sentence_spans(self, text: str) -> list[tuple[int, int]]:
        """(start, end) of each sentence of `text` as it is given to the model (seq2seq/text/sentences.py: the
        source language's rules, a sentence too long for the model cut at spaces into parts that fit)."""
        return model_sentence_spans(text, tokenizer=self.tokenizer, language=self.src_lang,
                                    max_positions=self.model.config.max_positions)

    def translate_nbest(
        self, texts: Iterable[str], search: SearchConfig | None = None, *, max_tokens: int = 8192,
        first_line: int = 1, generator: torch.Generator | None = None, prefixes: Iterable[str] | None = None,
        constraints: Iterable[Sequence[str]] | None = None, glossary: Mapping[str, str] | Glossary | None = None,
        line_numbers: Sequence[int] | None = None, tgt_lang: str | None = None,
    ) -> list[list[Translation]]:
        """Per input line its translations, best first (`search.nbest`, one for greedy and sampling); "" gets [].
        `tgt_lang`: a multilingual model's target language (`for_target`; by default `self.tgt_lang`).

        `max_tokens` bounds each batch: rows x (longest source) <= max_tokens, in source tokens; beam
        search then holds beam_size times as many decoder rows. `first_line` is the number warnings
        give the first text (a caller translating a file in pieces passes each piece's position), or
        `line_numbers` each text's (the sentences of documents: their document's line), and
        `generator` the random draws of sampling (default: a new one seeded with `search.seed`).

        `prefixes` (one per text, "" for none): the start each translation must have (autocompletion,
        CTranslate2's target_prefix), tokenised alone and forced, then continued by the search; the
        translations include it. A prefix that ends inside a word forces the pieces that spell it
        alone, which the model may rarely have seen continued: end prefixes at a space where you can.

        `constraints` (one list of phrases per text): target phrases each translation must contain, in
        any order (seq2seq/decoding/constraints.py); each is tokenised alone (with the leading space of a word, as
        sentencepiece marks it) and must appear as exactly those pieces. An empty phrase, or phrases too
        long for the model together, are an error naming the line. `glossary` (source term -> target
        term, or a glossary.Glossary made once for many calls): each term found in a text as a whole word
        (case-sensitive, in NFC; of overlapping terms the leftmost, then the longest) adds its target term
        to that text's constraints.
        """
        check_max_tokens(max_tokens)  # before any work
        if tgt_lang is not None and tgt_lang != self.tgt_lang:
            return self.for_target(tgt_lang).translate_nbest(
                texts, search, max_tokens=max_tokens, first_line=first_line, generator=generator, prefixes=prefixes,
                constraints=constraints, glossary=glossary, line_numbers=line_numbers)
        inputs = self.prepare_inputs(texts, search, first_line=first_line, prefixes=prefixes, constraints=constraints,
                                     glossary=glossary, line_numbers=line_numbers)
        return self.decode_inputs(inputs, search, max_tokens=max_tokens, generator=generator)

    def prepare_inputs(
        self, texts: Iterable[str], search: SearchConfig | None = None, *, first_line: int = 1,
        prefixes: Iterable[str] | None = None, constraints: Iterable[Sequence[str]] | None = None,
        glossary: Mapping[str, str] | Glossary | None = None, line_numbers: Sequence[int] | None = None,
    ) -> Inputs:
        """`texts` made ready to decode with `search` (inference/inputs.py), and every input checked, here once:
        the options as translate_nbest's. A TypeError or ValueError naming the line for what cannot be
        decoded; a warning naming the line of a text cut to the model's max_positions."""
        lines = as_lines(texts, first_line=first_line)
        search = self._checked(search)
        if search.sampling and (constraints is not None or glossary):
            raise ValueError("constraints and glossaries need a search (beam_size >= 1), not sampling")
        glossary = as_glossary(glossary) if glossary else None  # a Mapping compiled once for all the lines
        tokenizer, max_positions = self.tokenizer, self.model.config.max_positions
        tag, decoder_tag = self.source_tag(), self.decoder_tag()
        forced = (prefix_ids(prefixes, len(lines), first_line=first_line, tokenizer=tokenizer,
                             max_positions=max_positions - len(decoder_tag))
                  if prefixes is not None else None)
        if decoder_tag:  # the translation's first token, before any prefix of the caller's
            forced = [[*decoder_tag, *ids] for ids in forced or [[] for _ in lines]]
        if glossary:
            found = [glossary.terms_in(text) for text in lines]
            given = as_constraint_lists(constraints) if constraints is not None else [[] for _ in lines]
            # (lists of another length than the texts are left as given: constraint_ids says so)
            constraints = [[*g, *t] for g, t in zip(given, found, strict=True)] if len(given) == len(found) else given
        phrases = (constraint_ids(constraints, len(lines), forced=forced, first_line=first_line, tokenizer=tokenizer,
                                  max_positions=max_positions)
                   if constraints is not None else None)
        numbers = line_numbers if line_numbers is not None else range(first_line, first_line + len(lines))
        ids = truncated(tokenizer.encode_source([text.strip() for text in lines]), numbers=numbers, tokenizer=tokenizer,
                        max_positions=max_positions - len(tag))
        # Without text tokens (a Marian source keeps its eos; a normalising model may encode text to nothing)
        for i, (text, sentence) in enumerate(zip(lines, ids, strict=True)):
            empty = not text.strip() or self.tokenizer.source_tokens(sentence) <= 0
            ids[i] = [] if empty else [*tag, *sentence]
        return Inputs(ids=ids, forced=forced, phrases=phrases, forced_steps=len(decoder_tag))

    def decode_inputs(self, inputs: Inputs, search: SearchConfig | None = None, *, max_tokens: int = 8192,
                      generator: torch.Generator | None = None) -> list[list[Translation]]:
        """Per text of `inputs` (prepare_inputs') its translations, best first, as translate_nbest gives them."""
        results: list[list[Translation]] = [[] for _ in range(len(inputs))]
        for i, translations in self._decode_batches(inputs, search, max_tokens=max_tokens, generator=generator):
            results[i] = translations
        return results

    def _checked(self, search: SearchConfig | None) -> SearchConfig:
        """`search` (default: `self.search`), checked against this model before any work, even for no sentence."""
        search = self.search if search is None else search
        if not isinstance(search, SearchConfig):
            raise TypeError(f"search must be a SearchConfig, e.g. SearchConfig(beam_size=5), not a "
                            f"{type(search).__name__}")
        search.check_model(vocab_size=self.model.config.vocab_size, max_positions=self.model.config.max_positions)
        return search

    def _decode_batches(self, inputs: Inputs, search: SearchConfig | None, *, max_tokens: int,
                        generator: torch.Generator | None) -> Iterator[tuple[int, list[Translation]]]:
        """(index, translations) of every text: those with nothing to decode ([]) first, then batch by batch
        (longest first)."""
        search = self._checked(search)
        if inputs.forced_steps:  # a forced tag is not the translation's: steps to write it beside the output limit
            search = dataclasses.replace(search, max_len_b=search.max_len_b + inputs.forced_steps)
        check_max_tokens(max_tokens)
        if generator is None and search.sampling and search.seed is not None:  # one for all the batches
            generator = self._generator(search)
        ids, forced, phrases, tokenizer = inputs.ids, inputs.forced, inputs.phrases, self.tokenizer
        yield from ((i, []) for i, sentence in enumerate(ids) if not sentence)
        continuing = self.continuing_ids() if phrases is not None else frozenset()
        source_tags, decoder_tags = self.languages.source_tags, self.languages.tags_on_the_decoder  # (whichever target)

        def translate_batch(batch: list[int]) -> list[tuple[int, list[Translation]]]:
            src = pad_batch([ids[i] for i in batch], pad=tokenizer.pad_id, device=self.device)  # (B, S)
            prefix = [forced[i] for i in batch] if forced is not None else None
            bos, eos, pad = tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id
            nbest = decode(self.decoding, src, search, bos=bos, eos=eos, pad=pad, generator=generator, prefix=prefix,
                           constraints=[phrases[i][1] for i in batch] if phrases is not None else None,
                           continuing=continuing)
            return [(i, translations_of(sentence_hyps, tokenizer=tokenizer, source=ids[i], source_tags=source_tags,
                                     decoder_tag=decoder_tags, continuing=continuing,
                                     phrases=phrases[i] if phrases is not None else None))
                    for i, sentence_hyps in zip(batch, nbest, strict=True)]

        batches = length_sorted_batches(ids, max_tokens=max_tokens)
        yield from self.pool.decode(translate_batch, batches, rows=search.hypotheses,
                                    work=[len(sentence) for sentence in ids], in_order=generator is not None)

    @property
    def compiling_seconds(self) -> float:
        """Seconds its decoding has spent compiling so far (`compiled`; 0 without): what a run's end line reports."""
        return self.decoding.compiling_seconds if isinstance(self.decoding, CompiledDecoder) else 0.0

    @property
    def workers(self) -> int:
        return self.pool.workers

    @property
    def threads(self) -> int:
        return self.pool.threads

    @property
    def decoded(self) -> Counter[tuple[int, int]]:
        """DecoderPool.decoded: batches decoded so far, by the (workers, intra-op threads each) they ran on."""
        return self.pool.decoded

    def decoding_threads(self, search: SearchConfig) -> tuple[int, int]:
        """(workers, intra-op threads each) that `search` decodes with (DecoderPool.threads_for)."""
        return self.pool.threads_for(seeded=search.sampling and search.seed is not None)

    def translate_stream(
        self, texts: Iterable[str], search: SearchConfig | None = None, *, max_tokens: int = 8192,
        window: int = 1000, prefixes: Iterable[str] | None = None, constraints: Iterable[Sequence[str]] | None = None,
        glossary: Mapping[str, str] | Glossary | None = None,
    ) -> Iterator[list[Translation]]:
        """translate_nbest's results, one line at a time and in order, as soon as a line and all lines
        before it are done; `window` lines are read and batched (sorted by length) at a time.

        Memory stays bounded, and a caller can write each line while the rest of its window is
        decoded (an interrupted run keeps what was written). `prefixes` and `constraints`: as
        translate_nbest's, read alongside the texts; a ValueError if they end before the texts, or go on
        after them. `glossary`: as translate_nbest's (a Mapping compiled once for the whole stream).
        """
        search = self.search if search is None else search
        # One generator for the whole stream: a new one per window would replay the same draws.
        generator = self._generator(search) if search.sampling and search.seed is not None else None
        # Compiled once here, not once per window: a large glossary's automaton costs more than matching it
        glossary = as_glossary(glossary) if glossary else None
        for first_line, chunk, chunk_prefixes, chunk_constraints in windows(texts, window=window, prefixes=prefixes,
                                                                            constraints=constraints):
            ready: dict[int, list[Translation]] = {}
            next_line = 0
            inputs = self.prepare_inputs(chunk, search, first_line=first_line, prefixes=chunk_prefixes,
                                         constraints=chunk_constraints, glossary=glossary)
            for i, translations in self._decode_batches(inputs, search, max_tokens=max_tokens, generator=generator):
                ready[i] = translations
                while next_line in ready:
                    yield ready.pop(next_line)
                    next_line += 1
            assert next_line == len(chunk), "every line of the window is yielded"

    def score(self, sources: Iterable[str], targets: Iterable[str], *, max_tokens: int = 8192,
              first_line: int = 1) -> list[Forced | None]:
        """The model's log-probability of each target given its source, token by token (the final EOS
        included), as translation computes them (this Translator's precision and device); batched by
        length. None, with a warning naming the line, where there is nothing to score against: an empty
        source, or a source or target longer than the model reads (`max_positions`)."""
        sources, targets = as_lines(sources, first_line=first_line), as_lines(targets, first_line=first_line)
        if len(sources) != len(targets):
            raise ValueError(f"{len(sources)} sources but {len(targets)} targets: they must be line-aligned")
        check_max_tokens(max_tokens)
        tokenizer, limit, tag, decoder_tag = self.tokenizer, self.model.config.max_positions, self.source_tag(), self.decoder_tag()
        src_ids = [[*tag, *ids] for ids in tokenizer.encode_source([text.strip() for text in sources])]
        tgt_ids = [[*decoder_tag, *ids] for ids in tokenizer.encode_target([text.strip() for text in targets])]
        scored: list[Forced | None] = [None] * len(sources)
        sizes: list[list[int]] = []  # what a pair costs in padded positions, for batching
        for i, (source, target) in enumerate(zip(src_ids, tgt_ids, strict=True)):
            problem = ("its source is empty" if not sources[i].strip() or tokenizer.source_tokens(source) <= len(tag) else
                       f"its source has {len(source)} tokens" if len(source) > limit else
                       f"its target has {len(target) + 1} tokens with EOS" if len(target) + 1 > limit else None)
            if problem is not None:
                warnings.warn(f"line {first_line + i} is not scored: {problem}"
                              + (f", more than the model's max_positions ({limit})" if "tokens" in problem else ""),
                              stacklevel=2)
            sizes.append([] if problem is not None else [0] * max(len(source), len(target) + 1))
        for batch in length_sorted_batches(sizes, max_tokens=max_tokens):
            src = pad_batch([src_ids[i] for i in batch], pad=tokenizer.pad_id, device=self.device)  # (B, S)
            with torch.inference_mode():
                forced = force_decode(self.model, self.model.encode(src), src != tokenizer.pad_id,
                                      [tgt_ids[i] for i in batch], bos=tokenizer.bos_id, eos=tokenizer.eos_id,
                                      pad=tokenizer.pad_id)
            for i, f in zip(batch, forced, strict=True):  # (a decoder-side tag is the model's, not the target's)
                scored[i] = Forced(f.token_log_probs[len(decoder_tag):], f.source_positions and
                                   f.source_positions[len(decoder_tag):]) if decoder_tag else f
        return scored

    def continuing_ids(self) -> frozenset[int]:
        """The pieces that continue a word (text/glossary.py's `continues_word`), specials excepted: what may not follow a
        placed constraint. Computed once."""
        if self._continuing is None:
            tokenizer = self.tokenizer
            specials = {tokenizer.eos_id, tokenizer.pad_id, tokenizer.bos_id, tokenizer.unk_id}
            self._continuing = frozenset(i for i, piece in enumerate(tokenizer.pieces())
                                         if continues_word(piece) and i not in specials)
        return self._continuing

    def _generator(self, search: SearchConfig) -> torch.Generator:
        assert search.seed is not None
        return torch.Generator(device=self.device).manual_seed(search.seed)

def pad_batch(sentences: list[list[int]], *, pad: int, device: torch.device) -> torch.Tensor:
    length = max(len(s) for s in sentences)
    src = torch.full((len(sentences), length), pad, dtype=torch.long, device="cpu")  # filled on the host, sent once
    for row, sentence in enumerate(sentences):
        src[row, : len(sentence)] = torch.tensor(sentence, dtype=torch.long, device="cpu")
    return src.to(device)
