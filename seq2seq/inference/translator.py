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

import dataclasses
import heapq
import itertools
import math
import threading
import warnings
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from seq2seq.checkpoint import load_checkpoint, read_inference
from seq2seq.decoding.constraints import holds
from seq2seq.decoding.scoring import Forced, force_decode
from seq2seq.decoding.search import EncoderDecoder, Hypothesis, SearchConfig, decode
from seq2seq.model import Transformer
from seq2seq.model.compiled import CompiledDecoder, bf16_around_int8, check_compilable, int8_compiled
from seq2seq.model.numerics import PackedLinear, for_inference
from seq2seq.precision import (
    Precision,
    bf16_matmuls_pay,
    few_rows_on_torch,
    one_query_sdpa,
    onednn_linears,
    resolve_precision,
)
from seq2seq.text.glossary import Glossary, as_glossary, unspaced
from seq2seq.text.markup import HtmlDocument
from seq2seq.text.sentences import Paragraphs, model_sentence_spans
from seq2seq.text.subtitles import SrtDocument
from seq2seq.text.tokenizer import Tokenizer

DEFAULT_SEARCH = SearchConfig()  # beam 5


@dataclass(frozen=True)
class Translation:
    text: str
    score: float
    """The search's ranking score (length-normalised log-probability for beam search)."""
    tokens: list[int]
    token_scores: list[float] | None = None
    """SearchConfig.token_scores: the log-probability of each token, then of the final EOS."""
    unmet_constraints: list[str] | None = None
    """With constraints: the phrases this translation lacks; [] when it has them all (a sentence whose phrases
    the constrained search could not place is translated without them, and says so here)."""
    alignment: list[tuple[int, int]] | None = None
    """SearchConfig.alignments: (source word, translation word) pairs, numbered from 0 as `text.split(" ")`
    numbers them (runs of characters other than " "), sorted: Pharaoh's `i-j`. A word may have several partners, or none."""


class Document(Protocol):
    """Text to translate sentence by sentence and put back together: plain paragraphs, HTML, subtitles."""

    sentences: list[str]
    needs_alignments: bool  # render places markup by the sentences' word alignments

    def render(self, translations: Sequence[Translation]) -> str: ...


T = TypeVar("T")
PART_ROWS = 32  # see shared_out
BALANCE = 1.2  # see shared_out
WIDE_WORK = 5e8  # see Translator._wide
EMPTY = Translation(text="", score=0.0, tokens=[])  # what an empty sentence translates to


def resolve_device(name: str | torch.device) -> torch.device:
    """The device, if this machine has it; a ValueError saying what to use instead if not."""
    try:
        device = torch.device(name)
        torch.empty(0, device=device)  # raises for a device this torch build or machine lacks
    except (RuntimeError, AssertionError, ValueError) as error:
        reason = str(error).strip().split("\n")[0]
        raise ValueError(f"device {str(name)!r} cannot be used here ({reason}); use cpu, or a device this "
                         "machine has (cuda, cuda:1, mps)") from None
    return device


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
        compiled: bool = False,
    ):
        """`precision` (seq2seq/precision.py): auto picks bf16 where bf16 matmuls are fast (a GPU from
        Ampere on, a CPU with AMX or AVX512-BF16), else fp32; int8 is a CPU option that changes outputs
        slightly. The model is converted in place (on a CPU its fp32 or bf16 linear layers are packed for
        oneDNN where precision.onednn_linears times that faster, their few rows in fp32 on torch's own linear
        where precision.few_rows_on_torch times that faster, and bf16 attention at one query a row runs
        SDPA where precision.one_query_sdpa times that faster, a choice made on this model only); `self.precision` says what auto chose. `search`
        is what the translate methods use when given none.

        `workers` > 1 decodes that many batches at once, each in a thread of its own with `threads`
        intra-op threads (default: torch's thread count / workers), as CTranslate2's inter_threads do
        (with one worker and `threads` given, its one thread has that many; with neither, the caller's
        thread decodes with the caller's count):
        a decoding step's parallel regions are too small for several threads to pay, several batches
        are not. The batches are those of one worker, so outputs do not depend on `workers`, except where an
        input's batches would leave workers idle (fewer than the workers, or unequal in work): those are cut
        into parts (shared_out), which can change a bf16 translation slightly (fp32: the same tokens), and a lone batch
        too small to cut but wide enough (_wide) decodes on all the workers' threads (not when `compiled`: its
        graphs are for one worker's thread count); seeded sampling,
        whose draws run through one generator, decodes one batch at a time. On a device other than the CPU
        one worker is faster (several wait on each other's kernels): more are taken, with a warning.

        `compiled`: the searches' decoding steps run compiled (seq2seq/model/compiled.py): at a few rows
        faster on a CPU, where the eager step is mostly per-call overhead (README, "A compiled decoding
        step"), even with the eager step at hundreds of rows; the first batches of each
        kind (one row, several rows, beams) wait while it compiles, tens of seconds each (inductor keeps the
        code on disk for the next process). fp32, bf16 or int8, models with absolute positions; outputs can differ
        from the eager step's in the last bits of a logit, as a different kernel's would. The decoder's linear
        layers stay unpacked (inductor packs its own copy), so teacher-forced scoring runs slower."""
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive number of threads, got {workers!r}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be a positive number of threads per worker, got {threads!r}")
        self.workers = workers
        self.threads = threads if threads is not None else max(1, torch.get_num_threads() // workers)
        self._own_threads = threads is not None  # else one worker decodes on the caller's thread, with its threads
        self._pools: dict[str, ThreadPoolExecutor] = {}  # _pool_of(), each made on first use
        self.decoded: Counter[tuple[int, int]] = Counter()
        """Batches decoded so far (parts of one counted apart), by the (workers, intra-op threads each) they
        ran on: what a run's end-of-run line names (a lone wide batch runs on one worker with all threads). A
        tally for reading, not a lock: calls from several threads at once may lose a count."""
        torch.set_flush_denormal(True)  # denormal floats run ~100x slower on x86 CPUs (see training/module.py)
        self.device = resolve_device(device)
        if workers > 1 and self.device.type != "cpu":
            warnings.warn(f"{workers} decoder workers on {self.device} share one device and wait on each other's "
                          f"kernels: one worker is faster there (README, \"Every core\")", stacklevel=2)
        self.precision = resolve_precision(precision, self.device)
        packed = onednn_linears(self.device, self.precision).pays
        if compiled:
            check_compilable(model.config)
        model = model.to(self.device).fuse_self_attention()
        if self.device.type == "cpu" and self.precision == "bf16":  # the machine's verdict, for this model
            model.attend_one_query_by_matmul(not one_query_sdpa(self.device, self.precision).pays)
        if compiled and self.precision == "int8":  # every linear layer the compiled encoder's and step's int8
            int8_compiled(model.float())
        self.model = for_inference(model, self.precision, packed=packed and not compiled)
        if compiled and self.precision == "int8" and bf16_matmuls_pay(self.device):
            bf16_around_int8(self.model)  # (after for_inference, whose .float() would undo it)
        self.compiled = compiled
        self.decoding: EncoderDecoder[Any] = CompiledDecoder(self.model) if compiled else self.model
        """What the searches decode with: the model, or its compiled decoding step."""
        if packed and self.precision == "fp32":  # a decoding step's few rows on torch's own linear, where faster
            few: dict[tuple[int, int], int] = {}
            for layer in self.model.modules():
                if isinstance(layer, PackedLinear):
                    shape = (layer.in_features, layer.out_features)
                    if shape not in few:
                        few[shape] = few_rows_on_torch(self.device, self.precision, in_features=shape[0],
                                                       out_features=shape[1])
                    layer.run_few_rows_on_torch(few[shape])
        self.tokenizer = tokenizer
        self.src_lang, self.tgt_lang = src_lang, tgt_lang
        self.search = search
        self._continuing: frozenset[int] | None = None  # continuing_ids(), made on first use

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, *, device: str | torch.device = "cpu", precision: Precision = "auto", workers: int = 1,
        threads: int | None = None, compiled: bool = False,
    ) -> "Translator":
        """Raises CheckpointError (one line naming the file) for any checkpoint it cannot trust."""
        loaded = read_inference(path, load_checkpoint(path))
        model = Transformer(loaded.config)
        model.load_state_dict(loaded.weights)  # names and shapes were checked against the config
        tokenizer = Tokenizer.from_bytes(loaded.tokenizer)  # read_inference loaded it once: it loads
        return cls(model=model, tokenizer=tokenizer, src_lang=loaded.src_lang, tgt_lang=loaded.tgt_lang,
                   device=device, precision=precision, search=loaded.search, workers=workers, threads=threads,
                   compiled=compiled)

    def compile_decoding(self, *, threads: int | None = None) -> int:
        """With `compiled`, every kind of decoding step compiled now (seq2seq/model/compiled.py), for decoder threads
        of `threads` intra-op threads (default: its workers' threads; with no threads of its own, the caller's
        thread, with its count): what a tool that answers sentences as they come does first, so that none waits
        the minute or more a kind takes to compile. Dynamo compiles a graph per thread count, so the kinds compile
        on a thread of that count, a daemon thread: Ctrl-C in the caller ends the process at once (a pool's thread
        is waited for at exit, the compiling's minutes). The number of kinds compiled (0 without `compiled`, or
        when all were); CompileError (one line) when inductor cannot compile."""
        decoding = self.decoding
        if not isinstance(decoding, CompiledDecoder):
            return 0
        if threads is None and self.workers == 1 and not self._own_threads:
            return decoding.compile_kinds()
        outcome: list[int | BaseException] = []

        def compile_kinds() -> None:
            start_decoder_thread(threads or self.threads)
            try:
                outcome.append(decoding.compile_kinds())
            except BaseException as error:  # raised again in the caller's thread
                outcome.append(error)

        thread = threading.Thread(target=compile_kinds, name="decoder-compile", daemon=True)
        thread.start()
        thread.join()
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    def translate(self, texts: Iterable[str], search: SearchConfig | None = None, *, max_tokens: int = 8192,
                  prefixes: Iterable[str] | None = None, constraints: Iterable[Sequence[str]] | None = None,
                  glossary: Mapping[str, str] | Glossary | None = None) -> list[str]:
        """One translation per input line, in input order (the best of `search`'s n-best); the options as
        translate_nbest's. Only text comes back, so no scores are computed (`text_only`)."""
        return [hyps[0].text if hyps else ""
                for hyps in self.translate_nbest(texts, text_only(self.search if search is None else search),
                                                 max_tokens=max_tokens, prefixes=prefixes, constraints=constraints,
                                                 glossary=glossary)]

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
        return self.translate_documents([HtmlDocument(text, split=self.sentence_spans) for text in texts], search,
                                        max_tokens=max_tokens, glossary=glossary)

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
        line_numbers: Sequence[int] | None = None,
    ) -> list[list[Translation]]:
        """Per input line its translations, best first (`search.nbest`, one for greedy and sampling); "" gets [].

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
        lines = as_lines(texts, first_line=first_line)
        results: list[list[Translation]] = [[] for _ in lines]
        for i, translations in self._translate_batches(lines, search, max_tokens=max_tokens, first_line=first_line,
                                                       generator=generator, prefixes=prefixes,
                                                       constraints=constraints, glossary=glossary,
                                                       line_numbers=line_numbers):
            results[i] = translations
        return results

    def _translate_batches(
        self, lines: list[str], search: SearchConfig | None, *, max_tokens: int, first_line: int,
        generator: torch.Generator | None, prefixes: Iterable[str] | None = None,
        constraints: Iterable[Sequence[str]] | None = None, glossary: Mapping[str, str] | Glossary | None = None,
        line_numbers: Sequence[int] | None = None,
    ) -> Iterator[tuple[int, list[Translation]]]:
        """(index, translations) of every line: the empty ones ([]) first, then batch by batch (longest first)."""
        search = self.search if search is None else search
        if not isinstance(search, SearchConfig):
            raise TypeError(f"search must be a SearchConfig, e.g. SearchConfig(beam_size=5), not a "
                            f"{type(search).__name__}")
        # before any work, even for no sentence
        search.check_model(vocab_size=self.model.config.vocab_size, max_positions=self.model.config.max_positions)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive number of tokens, got {max_tokens!r}")
        if search.sampling and (constraints is not None or glossary):
            raise ValueError("constraints and glossaries need a search (beam_size >= 1), not sampling")
        glossary = as_glossary(glossary) if glossary else None  # a Mapping compiled once for all the lines
        forced = self._prefix_ids(prefixes, len(lines), first_line=first_line) if prefixes is not None else None
        if glossary:
            found = [glossary.terms_in(text) for text in lines]
            given = as_constraint_lists(constraints) if constraints is not None else [[] for _ in lines]
            # (lists of another length than the texts are left as given: constraint_ids says so)
            constraints = [[*g, *t] for g, t in zip(given, found, strict=True)] if len(given) == len(found) else given
        phrases = (self.constraint_ids(constraints, len(lines), forced=forced, first_line=first_line)
                   if constraints is not None else None)
        numbers = line_numbers if line_numbers is not None else range(first_line, first_line + len(lines))
        ids = self._truncate(self.tokenizer.encode_source([text.strip() for text in lines]), numbers=numbers)
        if generator is None and search.sampling and search.seed is not None:  # one for all the batches
            generator = self._generator(search)
        tokenizer = self.tokenizer
        # Without text tokens (a Marian source keeps its eos; a normalising model may encode text to nothing)
        empty = [i for i, (text, sentence) in enumerate(zip(lines, ids, strict=True))
                 if not text.strip() or tokenizer.source_tokens(sentence) <= 0]
        for i in empty:
            ids[i] = []
        yield from ((i, []) for i in empty)
        continuing = self.continuing_ids() if phrases is not None else frozenset()

        def translate_batch(batch: list[int]) -> list[tuple[int, list[Translation]]]:
            src = pad_batch([ids[i] for i in batch], pad=tokenizer.pad_id, device=self.device)  # (B, S)
            prefix = [forced[i] for i in batch] if forced is not None else None
            bos, eos, pad = tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id
            nbest = decode(self.decoding, src, search, bos=bos, eos=eos, pad=pad, generator=generator, prefix=prefix,
                           constraints=[phrases[i][1] for i in batch] if phrases is not None else None,
                           continuing=continuing)
            return [(i, self._detokenize(sentence_hyps, source=ids[i], phrases=phrases[i] if phrases is not None else None))
                    for i, sentence_hyps in zip(batch, nbest, strict=True)]

        batches = length_sorted_batches(ids, max_tokens=max_tokens)
        if generator is not None or (self.workers == 1 and not self._own_threads):
            for batch in batches:
                self.decoded[1, torch.get_num_threads()] += 1
                yield from translate_batch(batch)
        else:
            rows = 1 if search.sampling else search.beam_size
            parts = shared_out(batches, workers=self.workers, rows=rows, work=[len(sentence) for sentence in ids])
            if len(parts) == 1 and self.workers > 1 and not self.compiled and self._wide(len(parts[0]) * rows):
                # Too few rows to cut, enough for every core's threads on one batch (not compiled: dynamo
                # compiles every kind of step again for another thread count, minutes, mid-run)
                self.decoded[1, self.workers * self.threads] += 1
                wide = self._pool_of("wide", 1, self.workers * self.threads)
                yield from wide.submit(translate_batch, parts[0]).result()
            elif parts:
                self.decoded[min(self.workers, len(parts)), self.threads] += len(parts)
                yield from self._in_parallel(translate_batch, parts)

    @property
    def compiling_seconds(self) -> float:
        """Seconds its decoding has spent compiling so far (`compiled`; 0 without): what a run's end line reports."""
        return self.decoding.compiling_seconds if isinstance(self.decoding, CompiledDecoder) else 0.0

    def decoding_threads(self, search: SearchConfig) -> tuple[int, int]:
        """(workers, intra-op threads each) that `search` decodes with: seeded sampling decodes its batches
        one at a time on the calling thread, with its thread count (a draw must not depend on the workers);
        any other search on the workers (one batch too small to cut but wide, `_wide`, on one of them with
        all their threads)."""
        if search.sampling and search.seed is not None:
            return 1, torch.get_num_threads()
        return self.workers, self.threads

    def _wide(self, rows: int) -> bool:
        """Whether a batch of `rows` decoder rows pays for several threads on it: its output projection
        takes at least WIDE_WORK multiply-adds a step (rows x d_model x vocabulary; README, "Every core")."""
        config = self.model.config
        return rows * config.d_model * config.vocab_size >= WIDE_WORK

    def _pool_of(self, name: str, workers: int, threads: int) -> ThreadPoolExecutor:
        """The decoder threads `name` (made on first use): `workers` threads of `threads` intra-op threads."""
        if name not in self._pools:
            self._pools[name] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"decoder-{name}",
                                                   initializer=start_decoder_thread, initargs=(threads,))
        return self._pools[name]

    def _in_parallel(self, translate_batch: Callable[[list[int]], list[tuple[int, list[Translation]]]],
                     batches: list[list[int]]) -> Iterator[tuple[int, list[Translation]]]:
        """translate_batch over the batches on the workers, two per worker in flight (the next is ready
        when one finishes), the results given in the batches' order."""
        pool = self._pool_of("workers", self.workers, self.threads)
        pending: deque[Future[list[tuple[int, list[Translation]]]]] = deque()
        remaining = iter(batches)
        try:
            for batch in islice(remaining, 2 * self.workers):
                pending.append(pool.submit(translate_batch, batch))
            while pending:
                done = pending.popleft().result()
                following = next(remaining, None)
                if following is not None:
                    pending.append(pool.submit(translate_batch, following))
                yield from done
        finally:  # a caller that stops early (or an error) leaves nothing running for it
            for future in pending:
                future.cancel()

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
        if isinstance(texts, str | bytes):
            as_lines(texts)  # the same TypeError as translate_nbest
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive number of lines, got {window!r}")
        iterator, done = iter(texts), 0
        prefix_iterator = iter(prefixes) if prefixes is not None else None
        if isinstance(constraints, str | bytes):
            as_constraint_lists(constraints)  # the TypeError
        constraint_iterator = iter(constraints) if constraints is not None else None
        search = self.search if search is None else search
        # One generator for the whole stream: a new one per window would replay the same draws.
        generator = self._generator(search) if search.sampling and search.seed is not None else None
        # Compiled once here, not once per window: a large glossary's automaton costs more than matching it
        glossary = as_glossary(glossary) if glossary else None
        while chunk := list(islice(iterator, window)):
            chunk_prefixes = list(islice(prefix_iterator, len(chunk))) if prefix_iterator is not None else None
            if chunk_prefixes is not None and len(chunk_prefixes) < len(chunk):
                raise ValueError(f"the target prefixes end after line {done + len(chunk_prefixes)}, before the texts "
                                 "do: give one per text (an empty one for none)")
            chunk_constraints = (list(islice(constraint_iterator, len(chunk))) if constraint_iterator is not None
                                 else None)
            if chunk_constraints is not None and len(chunk_constraints) < len(chunk):
                raise ValueError(f"the constraints end after line {done + len(chunk_constraints)}, before the texts "
                                 "do: give one list per text (an empty one for none)")
            ready: dict[int, list[Translation]] = {}
            next_line = 0
            for i, translations in self._translate_batches(as_lines(chunk, first_line=done + 1), search,
                                                           max_tokens=max_tokens, first_line=done + 1,
                                                           generator=generator, prefixes=chunk_prefixes,
                                                           constraints=chunk_constraints, glossary=glossary):
                ready[i] = translations
                while next_line in ready:
                    yield ready.pop(next_line)
                    next_line += 1
            assert next_line == len(chunk), "every line of the window is yielded"
            done += len(chunk)
        if prefix_iterator is not None and next(prefix_iterator, None) is not None:
            raise ValueError(f"there are more target prefixes than the {done} texts: give one per text")
        if constraint_iterator is not None and next(constraint_iterator, None) is not None:
            raise ValueError(f"there are more constraint lists than the {done} texts: give one per text")

    def score(self, sources: Iterable[str], targets: Iterable[str], *, max_tokens: int = 8192,
              first_line: int = 1) -> list[Forced | None]:
        """The model's log-probability of each target given its source, token by token (the final EOS
        included), as translation computes them (this Translator's precision and device); batched by
        length. None, with a warning naming the line, where there is nothing to score against: an empty
        source, or a source or target longer than the model reads (`max_positions`)."""
        sources, targets = as_lines(sources, first_line=first_line), as_lines(targets, first_line=first_line)
        if len(sources) != len(targets):
            raise ValueError(f"{len(sources)} sources but {len(targets)} targets: they must be line-aligned")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive number of tokens, got {max_tokens!r}")
        tokenizer, limit = self.tokenizer, self.model.config.max_positions
        src_ids = tokenizer.encode_source([text.strip() for text in sources])
        tgt_ids = tokenizer.encode_target([text.strip() for text in targets])
        scored: list[Forced | None] = [None] * len(sources)
        sizes: list[list[int]] = []  # what a pair costs in padded positions, for batching
        for i, (source, target) in enumerate(zip(src_ids, tgt_ids, strict=True)):
            problem = ("its source is empty" if not sources[i].strip() or tokenizer.source_tokens(source) <= 0 else
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
            for i, f in zip(batch, forced, strict=True):
                scored[i] = f
        return scored

    def _prefix_ids(self, prefixes: Iterable[str], count: int, *, first_line: int) -> list[list[int]]:
        """The target prefixes' ids, one list per line; a ValueError naming the line of one too long to force."""
        prefixes = as_lines(prefixes, first_line=first_line)
        if len(prefixes) != count:
            raise ValueError(f"{len(prefixes)} target prefixes for {count} texts: give one per text (\"\" for none)")
        ids = self.tokenizer.encode_target([prefix.strip() for prefix in prefixes])
        limit = self.model.config.max_positions - 1  # the decoder reads BOS + at most this many tokens
        for i, prefix in enumerate(ids):
            if len(prefix) > limit:
                raise ValueError(f"the target prefix of line {first_line + i} has {len(prefix)} tokens, more than "
                                 f"the model writes ({limit}: max_positions - 1); shorten it")
        return ids

    def continuing_ids(self) -> frozenset[int]:
        """The pieces that continue a word (`continues_word`), specials excepted: what may not follow a
        placed constraint. Computed once."""
        if self._continuing is None:
            tokenizer = self.tokenizer
            specials = {tokenizer.eos_id, tokenizer.pad_id, tokenizer.bos_id, tokenizer.unk_id}
            self._continuing = frozenset(i for i, piece in enumerate(tokenizer.pieces())
                                         if continues_word(piece) and i not in specials)
        return self._continuing

    def constraint_ids(self, constraints: Iterable[Sequence[str]], count: int, *, forced: list[list[int]] | None,
                        first_line: int) -> list[tuple[list[str], list[list[int]]]]:
        """Per line, its phrases (deduplicated) and their ids; a ValueError naming the line of an empty
        phrase, or of phrases (and prefix) that together exceed what the model writes."""
        lines = as_constraint_lists(constraints)
        if len(lines) != count:
            raise ValueError(f"{len(lines)} constraint lists for {count} texts: give one per text ([] for none)")
        limit = self.model.config.max_positions - 1
        out = []
        for i, phrases in enumerate(lines):
            if isinstance(phrases, str | bytes) or not all(isinstance(p, str) for p in phrases):
                raise TypeError(f"the constraints of line {first_line + i} must be a list of strings (phrases)")
            texts = list(dict.fromkeys(" ".join(p.split()) for p in phrases))
            if any(not text for text in texts):
                raise ValueError(f"line {first_line + i} has an empty constraint: every phrase needs some text")
            ids = self.tokenizer.encode_target(texts)
            total = sum(map(len, ids)) + (len(forced[i]) if forced is not None else 0)
            if total > limit:
                raise ValueError(f"the constraints of line {first_line + i} take {total} tokens, more than the model "
                                 f"writes ({limit}: max_positions - 1); shorten or drop some")
            out.append((texts, ids))
        return out

    def _generator(self, search: SearchConfig) -> torch.Generator:
        assert search.seed is not None
        return torch.Generator(device=self.device).manual_seed(search.seed)

    def _detokenize(self, hyps: list[Hypothesis], *, source: list[int],
                    phrases: tuple[list[str], list[list[int]]] | None = None) -> list[Translation]:
        texts = self.tokenizer.decode([h.tokens for h in hyps])
        return [Translation(text=t, score=h.score, tokens=h.tokens, token_scores=h.token_log_probs,
                            alignment=self._word_alignment(source, h),
                            unmet_constraints=None if phrases is None else [
                                text for text, ids in zip(*phrases, strict=True)
                                if not holds(h.tokens, ids, continuing=self.continuing_ids())])
                for t, h in zip(texts, hyps, strict=True)]

    def _word_alignment(self, source: list[int], hyp: Hypothesis) -> list[tuple[int, int]] | None:
        """The hypothesis' token alignment (each token's most attended source position) as word pairs;
        a token that attended to no text token (a Marian source's eos) aligns nothing."""
        if hyp.source_positions is None:
            return None
        source_words = self.tokenizer.word_indices(source[: self.tokenizer.source_tokens(source)])
        target_words = self.tokenizer.word_indices(hyp.tokens)
        # Pieces the text leaves out (a dropped <unk>, spaces a Marian decode collapses) must not point past it
        words = len(self.tokenizer.decode([hyp.tokens])[0].split(" "))
        return sorted({(source_words[p], target_words[j]) for j, p in enumerate(hyp.source_positions)
                       if p < len(source_words) and target_words[j] < words})

    def _truncate(self, ids: list[list[int]], *, numbers: Sequence[int]) -> list[list[int]]:
        limit = self.model.config.max_positions
        for i, sentence in enumerate(ids):
            if len(sentence) > limit:
                warnings.warn(
                    f"input line {numbers[i]} has {len(sentence)} tokens, more than the model's max_positions "
                    f"({limit}); translating its first {limit} tokens only",
                    stacklevel=3,
                )
                ids[i] = self.tokenizer.cut_source(sentence, limit)
        return ids


def document_of(text: str, *, format: str, split: Callable[[str], list[tuple[int, int]]]) -> Document:
    """`text` as a document of `format`: "text" (paragraphs), "html" or "srt"; a ValueError for markup or
    subtitles that cannot be read."""
    if format == "html":
        return HtmlDocument(text, split=split)
    if format == "srt":
        return SrtDocument(text, split=split)
    return Paragraphs(text, split=split)


def text_only(search: SearchConfig) -> SearchConfig:
    """`search` for a caller that returns text alone: a greedy search without scores, which it then does not
    compute (the same tokens; SearchConfig.scores). Other searches compute them anyway and are left as they
    are; anything else is passed on for translate_nbest to refuse."""
    if isinstance(search, SearchConfig) and search.beam_size == 1 and not search.sampling:
        return dataclasses.replace(search, scores=False)
    return search


def search_for(documents: Sequence[Document], search: SearchConfig) -> SearchConfig:
    """`search` for translating `documents`: text only (a rendered document shows no scores), with word
    alignments if any of them places markup by them."""
    search = text_only(search)
    return dataclasses.replace(search, alignments=True) if any(d.needs_alignments for d in documents) else search


def per_document(documents: Sequence[Document], items: Sequence[T]) -> list[Sequence[T]]:
    """`items`, one per sentence of the documents in order, cut into each document's."""
    bounds = list(itertools.accumulate((len(d.sentences) for d in documents), initial=0))
    return [items[a:b] for a, b in itertools.pairwise(bounds)]


def start_decoder_thread(threads: int) -> None:
    """A decoder worker thread's set-up (the Translator's workers, the server's decoder threads): its own intra-op thread count (torch keeps it per thread), and
    denormals flushed (a per-thread CPU flag, as Translator.__init__ sets for the caller's)."""
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)


def as_constraint_lists(constraints: Iterable[Sequence[str]]) -> list[Sequence[str]]:
    if isinstance(constraints, str | bytes):
        raise TypeError("constraints is a single string; pass one list of phrases per text")
    return list(constraints)


def continues_word(piece: str) -> bool:
    """Whether a piece goes on with the word before it: no leading "▁", and a letter or digit first (or
    a byte of a character the vocabulary lacks); punctuation does not, nor a letter of a script written
    without spaces (`unspaced`: に after 東京 is the next word)."""
    return not piece.startswith("\u2581") and ((piece[:1].isalnum() and not unspaced(piece[0]))
                                              or piece.startswith("<0x"))


def as_lines(texts: Iterable[str], *, first_line: int = 1) -> list[str]:
    """Any iterable of str as a list; a bare string (which would translate character by character) is refused.

    A bad item is named by its index in the whole input (`first_line` is the first text's number).
    """
    if isinstance(texts, str | bytes):
        raise TypeError("texts is a single string; pass a list of sentences, e.g. [text]")
    lines = list(texts)
    for i, text in enumerate(lines):
        if not isinstance(text, str):
            raise TypeError(f"texts[{first_line - 1 + i}] is a {type(text).__name__}, not a str")
    return lines


def length_sorted_batches(ids: list[list[int]], *, max_tokens: int) -> list[list[int]]:
    """Indices of the non-empty sentences, longest first, cut into batches of <= max_tokens padded tokens.

    Longest first: the first batch is the largest, so running out of memory happens at once, not
    at the end of a long file.
    """
    order = sorted((i for i, s in enumerate(ids) if s), key=lambda i: -len(ids[i]))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = len(ids[current[0]]) if current else len(ids[i])
        if current and (len(current) + 1) * longest > max_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def shared_out(batches: list[list[int]], *, workers: int, rows: int, work: Sequence[int]) -> list[list[int]]:
    """The batches, cut into consecutive parts where the workers would otherwise wait on one of them, in order.

    The workers take the parts in order, each the next one as it becomes free (`Translator._in_parallel`, whose
    window of 2W parts in flight can hold a part back behind a slow one: contrived inputs, not length-sorted
    ones), and `work[i]` is sentence i's share of the decoding (its source tokens: targets grow with them). Each batch is
    cut into k equal parts, the same k for all, but no more parts than it has sentences, nor than it has
    PART_ROWS decoder rows (`rows` is the rows a sentence takes: the beam); k is the least, up to `workers`, that
    leaves the busiest worker no more than BALANCE times its share of the whole work (else the k that leaves it
    the least). So an input of fewer batches than workers is cut for the idle workers, and so is one of two
    batches of unequal work for two workers: 500 Multi30k sentences make one batch of long sentences and one of
    short ones, which left one of two workers idle for a third of the run (README, "Every core"). Batches that
    already keep the busiest worker within BALANCE of its share stay whole (the 3 batches of 1,000 Multi30k
    sentences for two workers).

    Parts rather than a lone batch on several threads: a decoding step's parallel regions are too small
    to share, two batches are not. Below PART_ROWS a part no longer pays for the Python its steps run,
    which the workers take turns at (the GIL): measured in the README, "Every core".
    """

    def cut(k: int) -> list[list[int]]:
        parts = []
        for batch in batches:
            count = max(1, min(k, len(batch) * rows // PART_ROWS, len(batch)))
            cuts = [len(batch) * j // count for j in range(count + 1)]
            parts += [batch[a:b] for a, b in itertools.pairwise(cuts)]
        return parts

    def busiest(parts: list[list[int]]) -> int:  # the most work one worker gets
        loads = [0] * workers  # a heap: the worker free first on top
        for part in parts:
            heapq.heapreplace(loads, loads[0] + sum(work[i] for i in part))
        return max(loads)

    share = sum(work[i] for batch in batches for i in batch) / workers
    best: list[list[int]] = batches
    least, previous = math.inf, -1
    for k in range(1, workers + 1):
        parts = cut(k)
        if len(parts) == previous:
            break  # every batch as finely cut as it can be
        previous, load = len(parts), busiest(parts)
        if load <= BALANCE * share:
            return parts
        if load < least:
            best, least = parts, load
    return best


def pad_batch(sentences: list[list[int]], *, pad: int, device: torch.device) -> torch.Tensor:
    length = max(len(s) for s in sentences)
    src = torch.full((len(sentences), length), pad, dtype=torch.long, device="cpu")  # filled on the host, sent once
    for row, sentence in enumerate(sentences):
        src[row, : len(sentence)] = torch.tensor(sentence, dtype=torch.long, device="cpu")
    return src.to(device)
