"""The server's queue: requests' sentences gathered into batches as they arrive, one decoder call at a
time per model, each request charged its decoding cost before it is queued."""

from __future__ import annotations

import asyncio
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from seq2seq.decoding.config import SearchConfig
from seq2seq.inference.documents import Translation
from seq2seq.inference.inputs import Inputs
from seq2seq.inference.translator import Translator


class Busy(Exception):
    """The queue is full: answered 429."""


def summary(error: BaseException) -> str:
    """One line for the log: the error's type and the first line of its message."""
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"[:500]



@dataclass
class Job:
    """One request's sentences, waiting for the batcher; `result` resolves to their n-best lists."""

    inputs: Inputs  # the request's texts as Translator.prepare_inputs made them (prefixes, constraints)
    search: SearchConfig
    costs: list[int]  # decoder tokens per sentence (Inputs.costs)
    result: asyncio.Future[list[list[Translation]]]
    generator: torch.Generator | None = None  # seeded sampling: one for all the job's decoder calls
    answers: dict[int, list[Translation]] = field(default_factory=dict)

    @property
    def cost(self) -> int:
        return sum(self.costs)

    def answer(self, index: int, translations: list[Translation]) -> None:
        if not self.search.scores:  # decoded beside a request that asked for them: not what this one asked
            translations = [replace(t, score=math.nan) for t in translations]
        self.answers[index] = translations
        if len(self.answers) == len(self.inputs) and not self.result.done():
            self.result.set_result([self.answers[i] for i in range(len(self.inputs))])


@dataclass
class Stats:
    """What a batcher has done, read by /health and /metrics (seq2seq/serve/metrics.py) when they are asked."""

    batches: int = 0  # decoder calls (translate_nbest), each one length-sorted batch of sentences
    requests: int = 0
    sentences: int = 0
    tokens: int = 0  # output tokens of the best translations (EOS aside)
    busy_seconds: float = 0.0  # decoder-thread time spent in this model's calls
    batch_sizes: dict[int, int] = field(default_factory=dict)  # sentences in a decoder call -> how many calls


@dataclass
class Batcher:
    """The queue of jobs and the task that decodes them in batches, one decoder call at a time."""

    translator: Translator
    max_tokens: int = 8192  # source tokens per encoder batch, as translate_nbest takes them
    max_batch_tokens: int = 8192  # decoder tokens (decoding_cost) per decoder call
    max_wait: float = 0.005  # seconds the first job of a batch waits for others to join it
    batching: bool = True  # False: one request per batch (the benchmark's baseline)
    max_queue: int = 1024
    stats: Stats = field(default_factory=Stats)

    # Where decoder calls run (the event loop keeps accepting meanwhile); shared by the models of one
    # server. None: a thread of its own, shut down by drain().
    executor: ThreadPoolExecutor | None = None

    def __post_init__(self) -> None:
        self.queue: asyncio.Queue[Job] = asyncio.Queue(self.max_queue)
        self.own_executor = self.executor is None
        self.pool = self.executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="decoder")

    def submit(self, inputs: Inputs, search: SearchConfig, *, costs: list[int]) -> asyncio.Future[list[list[Translation]]]:
        """Queue the texts (`inputs`, as Translator.prepare_inputs made them, and what each costs); raises Busy
        when the queue is full. No texts: answered at once (a job of none would never be taken)."""
        if not len(inputs):
            done: asyncio.Future[list[list[Translation]]] = asyncio.get_running_loop().create_future()
            done.set_result([])
            return done
        generator = None
        if search.sampling and search.seed is not None:
            generator = torch.Generator(device=self.translator.device).manual_seed(search.seed)
        job = Job(inputs, search, costs, asyncio.get_running_loop().create_future(), generator)
        try:
            self.queue.put_nowait(job)
        except asyncio.QueueFull:
            raise Busy(f"the server has {self.queue.qsize()} requests queued; retry later") from None
        self.stats.requests += 1
        return job.result

    async def run(self) -> None:
        """Forever: take the first job, gather what joins it within max_wait, decode, answer."""
        loop = asyncio.get_running_loop()
        while True:
            jobs = [await self.queue.get()]
            deadline = loop.time() + self.max_wait
            cost = jobs[0].cost
            while self.batching and cost < self.max_batch_tokens:
                try:
                    job = self.queue.get_nowait() if loop.time() >= deadline else await asyncio.wait_for(
                        self.queue.get(), deadline - loop.time())
                except (asyncio.QueueEmpty, asyncio.TimeoutError):
                    break
                jobs.append(job)
                cost += job.cost
            await self._decode(jobs)

    async def _decode(self, jobs: list[Job]) -> None:
        by_search: dict[SearchConfig, list[Job]] = {}
        for job in jobs:  # with and without scores, one search: decoded with them where any job asks (_decode_call)
            by_search.setdefault(replace(job.search, scores=True), []).append(job)
        groups = [group for search, group in by_search.items() if not (search.sampling and search.seed is not None)]
        # A seeded draw must not depend on what else arrived: such requests are decoded alone.
        groups += [[job] for search, group in by_search.items() if search.sampling and search.seed is not None
                   for job in group]
        for group in groups:
            for call in self._calls(group):
                await self._decode_call(call)

    def _calls(self, group: list[Job]) -> list[list[tuple[Job, int]]]:
        """The group's sentences (job, index) in arrival order, cut into calls of <= max_batch_tokens."""
        calls: list[list[tuple[Job, int]]] = [[]]
        cost = 0
        for job in group:
            for i, sentence_cost in enumerate(job.costs):
                if calls[-1] and cost + sentence_cost > self.max_batch_tokens:
                    calls.append([])
                    cost = 0
                calls[-1].append((job, i))
                cost += sentence_cost
        return calls

    async def _decode_call(self, call: list[tuple[Job, int]]) -> None:
        # A job whose future is done has no one waiting: timed out, disconnected, or failed already.
        call = [(job, i) for job, i in call if not job.result.done()]
        if not call:
            return
        jobs = list({id(job): job for job, _ in call}.values())
        inputs = Inputs.gathered((job.inputs, i) for job, i in call)
        search = replace(jobs[0].search, scores=any(j.search.scores for j in jobs))

        def decode() -> tuple[list[list[Translation]], float]:
            started = time.perf_counter()  # in the decoder thread: the call's own time, not its wait for a thread
            results = self.translator.decode_inputs(inputs, search, max_tokens=self.max_tokens,
                                                    generator=jobs[0].generator)
            return results, time.perf_counter() - started

        try:
            results, seconds = await asyncio.get_running_loop().run_in_executor(self.pool, decode)
        except Exception as error:  # noqa: BLE001  # every waiting request must hear of it
            if len(jobs) == 1:
                if not jobs[0].result.done():
                    jobs[0].result.set_exception(error)
                return
            print(f"error: a decoder call for {len(jobs)} requests failed ({summary(error)}); "
                  "decoding them one at a time", file=sys.stderr, flush=True)
            for job in jobs:  # only the request that fails alone gets the error
                await self._decode_call([(j, i) for j, i in call if j is job])
            return
        self.stats.batches += 1  # (on the event loop: one writer, however many decoder threads)
        self.stats.busy_seconds += seconds
        self.stats.sentences += len(inputs)
        self.stats.tokens += sum(len(translations[0].tokens) for translations in results if translations)
        self.stats.batch_sizes[len(inputs)] = self.stats.batch_sizes.get(len(inputs), 0) + 1
        for (job, i), translations in zip(call, results, strict=True):
            job.answer(i, translations)

    async def drain(self) -> None:
        """Decode what is still queued (at shutdown), then stop the worker."""
        while not self.queue.empty():
            await self._decode([self.queue.get_nowait() for _ in range(self.queue.qsize())])
        if self.own_executor:
            self.pool.shutdown(wait=True)
