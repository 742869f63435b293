"""The threads a Translator decodes on: `workers` decoder threads of `threads` intra-op threads each, the batches
shared out among them in parts where one would otherwise wait on another, and the results given in order.

Threads rather than processes: the model's weights are shared, and a decoding step's Python holds the GIL only
between kernels, which run without it. A worker sets its own intra-op thread count (torch keeps it per thread).
"""

import heapq
import itertools
import math
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice
from typing import TypeVar

import torch

R = TypeVar("R")
PART_ROWS = 32  # see shared_out
BALANCE = 1.2  # see shared_out
WIDE_WORK = 5e8  # see DecoderPool.wide


class DecoderPool:
    """`workers` threads of `threads` intra-op threads each (None: the caller's threads shared among the workers;
    with one worker, the batches decode on the caller's own thread). `row_work`: a decoder row's multiply-adds in
    the output projection a step (d_model x vocabulary), for `wide`; `widen`: whether a lone wide batch may take
    every worker's threads (not for a compiled step: dynamo compiles every kind again for another thread count)."""

    def __init__(self, *, workers: int = 1, threads: int | None = None, row_work: int, widen: bool = True) -> None:
        self.threads = decoder_threads(workers=workers, threads=threads)
        self.workers = workers
        self.own_threads = threads is not None  # else one worker decodes on the caller's thread, with its threads
        self.row_work = row_work
        self.widen = widen
        self._executors: dict[str, ThreadPoolExecutor] = {}  # executor(), each made on first use
        self.decoded: Counter[tuple[int, int]] = Counter()
        """Batches decoded so far (parts of one counted apart), by the (workers, intra-op threads each) they
        ran on: what a run's end-of-run line names (a lone wide batch runs on one worker with all threads). A
        tally for reading, not a lock: calls from several threads at once may lose a count."""

    @property
    def on_the_caller(self) -> bool:
        """Whether batches decode on the calling thread, one after another (one worker, no threads of its own)."""
        return self.workers == 1 and not self.own_threads

    def threads_for(self, *, seeded: bool) -> tuple[int, int]:
        """(workers, intra-op threads each) a search decodes with: seeded sampling decodes its batches one at a
        time on the calling thread, with its thread count (a draw must not depend on the workers); any other
        search on the workers (one batch too small to cut but wide, `wide`, on one of them with all their
        threads)."""
        return (1, torch.get_num_threads()) if seeded else (self.workers, self.threads)

    def wide(self, rows: int) -> bool:
        """Whether a batch of `rows` decoder rows pays for several threads on it: its output projection
        takes at least WIDE_WORK multiply-adds a step."""
        return rows * self.row_work >= WIDE_WORK

    def decode(self, translate_batch: Callable[[list[int]], list[R]], batches: list[list[int]], *, rows: int,
               work: Sequence[int], in_order: bool = False) -> Iterator[R]:
        """translate_batch over `batches` (sentence indices), the results batch by batch in order: on the caller's
        thread where `in_order` (seeded sampling) or `on_the_caller`; else shared out among the workers
        (`shared_out`, `rows` decoder rows a sentence, `work[i]` sentence i's share)."""
        if in_order or self.on_the_caller:
            for batch in batches:
                self.decoded[1, torch.get_num_threads()] += 1
                yield from translate_batch(batch)
            return
        parts = shared_out(batches, workers=self.workers, rows=rows, work=work)
        if len(parts) == 1 and self.workers > 1 and self.widen and self.wide(len(parts[0]) * rows):
            # Too few rows to cut, enough for every core's threads on one batch
            self.decoded[1, self.workers * self.threads] += 1
            wide = self.executor("wide", 1, self.workers * self.threads)
            yield from wide.submit(translate_batch, parts[0]).result()
        elif parts:
            self.decoded[min(self.workers, len(parts)), self.threads] += len(parts)
            yield from self._in_parallel(translate_batch, parts)

    def on_a_thread_of(self, threads: int | None, work: Callable[[], R]) -> R:
        """`work` on a new daemon thread of `threads` intra-op threads (default: the workers'), or on the caller's
        thread where the pool decodes there and no count is named: what must run with the decoder threads'
        thread count (dynamo compiles a graph per count). A daemon thread, so that Ctrl-C in the caller ends the
        process at once (a pool's thread is waited for at exit)."""
        if threads is None and self.on_the_caller:
            return work()
        outcome: list[R | BaseException] = []

        def run() -> None:
            start_decoder_thread(threads or self.threads)
            try:
                outcome.append(work())
            except BaseException as error:  # raised again in the caller's thread
                outcome.append(error)

        thread = threading.Thread(target=run, name="decoder-compile", daemon=True)
        thread.start()
        thread.join()
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    def executor(self, name: str, workers: int, threads: int) -> ThreadPoolExecutor:
        """The decoder threads `name` (made on first use): `workers` threads of `threads` intra-op threads."""
        if name not in self._executors:
            self._executors[name] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"decoder-{name}",
                                                       initializer=start_decoder_thread, initargs=(threads,))
        return self._executors[name]

    def _in_parallel(self, translate_batch: Callable[[list[int]], list[R]], batches: list[list[int]]) -> Iterator[R]:
        """translate_batch over the batches on the workers, two per worker in flight (the next is ready
        when one finishes), the results given in the batches' order."""
        pool = self.executor("workers", self.workers, self.threads)
        pending: deque[Future[list[R]]] = deque()
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


def decoder_threads(*, workers: int, threads: int | None) -> int:
    """The intra-op threads of each of `workers` decoder threads: `threads`, else the caller's over the workers; a
    ValueError for a count that is not a positive number."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive number of threads, got {workers!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive number of threads per worker, got {threads!r}")
    return threads if threads is not None else max(1, torch.get_num_threads() // workers)


def start_decoder_thread(threads: int) -> None:
    """A decoder worker thread's set-up (the Translator's workers, the server's decoder threads): its own intra-op thread count (torch keeps it per thread), and
    denormals flushed (a per-thread CPU flag, as Translator.__init__ sets for the caller's)."""
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)


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

    The workers take the parts in order, each the next one as it becomes free (`DecoderPool._in_parallel`, whose
    window of 2W parts in flight can hold a part back behind a slow one: contrived inputs, not length-sorted
    ones), and `work[i]` is sentence i's share of the decoding (its source tokens: targets grow with them). Each batch is
    cut into k equal parts, the same k for all, but no more parts than it has sentences, nor than it has
    PART_ROWS decoder rows (`rows` is the rows a sentence takes: the beam); k is the least, up to `workers`, that
    leaves the busiest worker no more than BALANCE times its share of the whole work (else the k that leaves it
    the least). So an input of fewer batches than workers is cut for the idle workers, and so is one of two
    batches of unequal work for two workers: 500 Multi30k sentences make one batch of long sentences and one of
    short ones, which would leave one of two workers idle for much of the run (docs/performance/threads.md#parts).
    Batches that
    already keep the busiest worker within BALANCE of its share stay whole (the 3 batches of 1,000 Multi30k
    sentences for two workers).

    Parts rather than a lone batch on several threads: a decoding step's parallel regions are too small
    to share, two batches are not. Below PART_ROWS a part no longer pays for the Python its steps run,
    which the workers take turns at (the GIL; docs/performance/threads.md#parts).
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
