"""A small serving engine on fgraph.jit: request queue and continuous batching over paged KV blocks.

Each step packs, within `max_batch_tokens`, one token of every running decode, then chunks of prompts
(a long prompt is prefilled over several steps; new requests are admitted while pages and seats last).
A step of single-token rows only runs `routine="decode"`, any other "mixed". Pages are reserved for a
request's whole length at admission and released when it finishes, so a running request never waits for
memory (no preemption). Batches are built on the host as CPU int tensors; fgraph pads them to the bucket
and moves them in one copy. run() builds step n+1's batch while the device runs step n (run_overlapped), so
the host's scheduling and metadata work leaves the critical path. vLLM's scheduler (and its async scheduling, in
part) and gpt-fast's generate.py are the references.

Faults. add() refuses what could fail later (types, ranges, a request longer than the model or the cache). A step
is all or nothing: every change it makes to the requests, the queues and the page list is logged as it is made,
and an exception anywhere in it (KeyboardInterrupt included: Ctrl-C while the host waits for the device) undoes
them in reverse before it goes on. The engine is then as it was before the step (the batch run() had built for it
kept), so run() again resumes, and gives the tokens an uninterrupted run gives: the KV the step may have written
is rewritten with the same values, and sampling depends on (seed, position) only (sampling.py). Finished requests
are handed back (by run() in its Report, by step()) and the engine keeps no reference to them.
"""

from __future__ import annotations

import collections
import math
import time

import torch
import torch.utils._pytree as pytree

import fgraph
from fgraph.ops import attention as A

from . import llama, request
from .block_allocator import BlockAllocator
from .report import Report
from .request import PENDING, Request, RequestError
from .sampling import mix, sample, uniform


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows] ([S', V]): the last row of each ready request. Decodes come first (schedule), one row each, so a
    step of decodes alone, or of decodes and prefills still mid-prompt, reads a prefix; only a step that finishes a
    prompt needs an index, and a list becomes a device tensor by a blocking copy (the host would wait there for the
    step, then launch the gather: it waits at the .tolist() anyway)."""
    return logits[: len(rows)] if rows[-1] == len(rows) - 1 else logits[torch.tensor(rows, device=logits.device)]


def _routine(plan: list[tuple[Request, int]]) -> str:
    """A step of single-token rows runs "decode", any other "mixed"."""
    return "decode" if all(n == 1 for _, n in plan) else "mixed"


class Engine:
    """Continuous batching over a pure `step(params, cache, batch, routine) -> (logits [N, V], cache)`.

    mode: a fgraph.Mode name for fgraph.jit, or "eager" to call `step_fn` directly (the oracle). Eager batches
      are padded to the same buckets as jitted ones, so both run kernels of the same shapes (bit-comparable).
      Default FULL: decode and mixed steps each one graph where the breaks allow (served faster than
      FULL_AND_PIECEWISE with every attention backend: docs/performance.md).
    buckets: padded token counts (default fgraph's, up to and including max_batch_tokens).
    vocab_size: the number of token ids the model takes: add() refuses a prompt outside it (an id the embedding
      cannot look up fails the whole step, and every later step that batches it).
    eos_ids: token ids that end a request (a list, or a numpy / torch array of ints).
    seed: the seed of requests added without one (mixed with the request's id).
    capture: capture both routines' buckets up front (decode's up to max_seqs's), then seal (default: on CUDA,
      unless mode is NONE/eager).
    overlap: run() builds step n+1's batch on the host while the device runs step n (see run_overlapped).
    compile: Inductor-compiled pieces (fgraph.jit's compile=): the FULL+C step the benchmarks measure. Default: on
      CUDA, unless mode is NONE/eager (one compilation per distinct piece, shared by buckets, routines and layers,
      and loaded from Inductor's cache by a later process); False: graphs of eager's own kernels, bit for bit.
    """

    overlap_supported = True  # (EPEngine steps through its own agreement: it turns this off)

    def __init__(
        self,
        step_fn,
        params,
        cache: A.KVCache,
        *,
        max_seq_len: int,
        mode: str = "FULL",
        max_batch_tokens: int = 256,
        max_seqs: int = 64,
        buckets=None,
        eos_ids=(),
        vocab_size: int,
        seed: int = 0,
        capture: bool | None = None,
        overlap: bool = True,
        compile: bool | dict | None = None,
    ):
        num_pages, self.page_size = cache.k[0].shape[0], cache.k[0].shape[1]
        max_seqs = request.integer(max_seqs, "max_seqs", 1)  # (0 admitted nothing: run() returned, all waiting)
        max_batch_tokens = request.integer(max_batch_tokens, "max_batch_tokens", 1)
        if max_seqs > max_batch_tokens:
            raise fgraph.FgraphError(
                f"max_seqs={max_seqs} > max_batch_tokens={max_batch_tokens}: decodes would starve",
                "raise max_batch_tokens or lower max_seqs",
            )
        self.params, self.cache, self.mode = params, cache, mode
        self.overlap = overlap and self.overlap_supported
        self.device = cache.k[0].device
        self.max_seq_len, self.max_pages = max_seq_len, math.ceil(max_seq_len / self.page_size)
        self.max_batch_tokens, self.max_seqs = max_batch_tokens, max_seqs
        self.vocab_size = request.integer(vocab_size, "vocab_size", 1, 2**31 - 1)
        # ints, as sampled tokens are: a tensor of ids (a tokenizer's) made a set of tensors no token equals
        self.eos_ids = frozenset(request.token_ids(eos_ids, "eos_ids", None))
        self.seed = request.integer(seed, "seed", 0, request.SEED_MAX)
        self.blocks = BlockAllocator(num_pages)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []  # finished, not yet handed back (by run() or step())
        self.staged: tuple[list, llama.Batch] | None = None  # the next step's (plan, batch), built by run_overlapped
        self._undo: list | None = None  # while a step runs: how to take back each change it made so far
        self.next_id, self.steps, self.waited = 0, 0, 0.0
        self.unreported = (0.0, 0, 0.0)  # (elapsed, steps, waited) of interrupted run()s: the next report's too
        self.buckets = sorted(set(buckets or fgraph.default_buckets(max_batch_tokens)) | {max_batch_tokens})
        self.spec = llama.Batch(
            tokens=fgraph.Batched(pad=0), positions=fgraph.Batched(pad=0), meta=A.metadata_batching()
        )
        if compile is None:
            compile = self.device.type == "cuda" and mode not in ("NONE", "eager")
        if mode == "eager":
            self.step_fn = step_fn
        else:
            self.step_fn = fgraph.jit(
                step_fn,
                static=["routine"],
                donate=["cache"],
                scratch=["cache"],  # padded rows write only the scratch page (fgraph/ops/attention.py)
                batch={"batch": self.spec},
                buckets=self.buckets,
                mode=mode,
                compile=compile,
                copy_outputs=False,  # zero-copy: outputs are read before the next call
            )
            if capture if capture is not None else (self.device.type == "cuda" and mode != "NONE"):
                # a decode step is one token per running request: never padded past max_seqs's bucket
                top = next(b for b in self.buckets if b >= max_seqs)
                decode = [b for b in self.buckets if b <= top]
                for routine, buckets in (("mixed", None), ("decode", decode)):
                    self.step_fn.capture(params, cache, self.example_batch(), routine=routine, buckets=buckets)

    # -- requests ------------------------------------------------------------------------------------
    def add(
        self, prompt, max_new_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None
    ) -> Request:
        """Queue a request. Every parameter is checked here (RequestError), so none can fail a step later: prompt
        ids in the vocabulary, max_new_tokens >= 1, temperature in [0, 1e4] (0: greedy), top_p in (0, 1], seed an
        unsigned 64-bit int or None (then the engine's seed and the request's id), and the whole request within
        max_seq_len and the KV cache. Its sampled tokens depend on its prompt, parameters and seed only."""
        rid = self.next_id
        try:
            prompt, max_new_tokens, temperature, top_p, seed = request.check(
                prompt, max_new_tokens, temperature, top_p, seed, vocab_size=self.vocab_size
            )
        except RequestError as e:
            raise RequestError(f"request {rid}: {e.what}", e.fix) from None
        if len(prompt) + max_new_tokens - 1 > self.max_seq_len:
            raise RequestError(
                f"request {rid}: {len(prompt)} prompt + {max_new_tokens} new tokens exceed max_seq_len="
                f"{self.max_seq_len}",
                "raise max_seq_len or shorten the request",
            )
        r = Request(rid, prompt, max_new_tokens, temperature, top_p, seed, t_arrive=time.perf_counter())
        if r.seed is None:
            r.seed = mix(self.seed ^ mix(rid))
        if self._pages_needed(r) > self.blocks.num_pages - 1:
            raise RequestError(
                f"request {rid} needs {self._pages_needed(r)} KV pages, the cache has {self.blocks.num_pages - 1} "
                "in all: it could never run",
                "allocate more pages (num_pages) or shorten the request",
            )
        self.next_id += 1
        self.waiting.append(r)
        return r

    def _pages_needed(self, r: Request) -> int:
        return math.ceil((len(r.prompt) + r.max_new_tokens - 1) / self.page_size)  # the last token is never fed

    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def take_finished(self) -> list[Request]:
        """Hand back the requests finished since the last hand-back (submission order); the engine forgets them."""
        out, self.finished = sorted(self.finished, key=lambda r: r.id), []
        return out

    # -- changes a step makes, each with its undo ------------------------------------------------------
    def _did(self, undo) -> None:
        if self._undo is not None:
            self._undo.append(undo)

    def _atomic(self, body):
        """body() all or nothing: if it raises (anything, KeyboardInterrupt too), the changes it made are undone in
        reverse order, so the engine is as before the call, and the exception goes on."""
        self._undo = undo = []
        try:
            return body()
        except BaseException:
            for f in reversed(undo):
                f()
            raise
        finally:
            self._undo = None

    def _admit(self, r: Request, pages: list[int]) -> None:
        self._did(lambda: self._unadmit(r))
        r.pages = pages
        self.running.append(self.waiting.popleft())

    def _unadmit(self, r: Request) -> None:
        self.running.remove(r)
        self.waiting.appendleft(r)
        self.blocks.unalloc(r.pages)
        r.pages = []

    def _retire(self, r: Request) -> None:
        i, pages = self.running.index(r), r.pages
        self._did(lambda: self._unretire(r, i, pages))
        del self.running[i]
        r.pages = []
        self.blocks.release(pages)

    def _unretire(self, r: Request, i: int, pages: list[int]) -> None:
        self.blocks.unrelease(len(pages))
        r.pages = pages
        self.running.insert(i, r)

    def _stage(self, staged) -> None:
        before, self.staged = self.staged, staged
        self._did(lambda: setattr(self, "staged", before))

    # -- scheduling ----------------------------------------------------------------------------------
    def schedule(self) -> list[tuple[Request, int]]:
        """(request, new tokens) for this step: running decodes first, then prompt chunks, then admissions."""
        budget, plan = self.max_batch_tokens, []
        for r in sorted(self.running, key=lambda r: r.computed < len(r.prompt)):  # decodes before prefills
            n = min(r.length - r.computed, budget)
            if n > 0:
                plan.append((r, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            r = self.waiting[0]
            pages = self.blocks.alloc(self._pages_needed(r))
            if pages is None:
                break  # (add() made sure it fits an empty cache: it runs once others finish)
            self._admit(r, pages)
            n = min(len(r.prompt), budget)
            plan.append((r, n))
            budget -= n
        return plan

    def make_batch(self, plan: list[tuple[Request, int]], pad_to: int = 0) -> llama.Batch:
        """Host-side batch (CPU int tensors) for a plan: each request's next `n` tokens, back to back; then, up to
        `pad_to` tokens, one-token sequences on the scratch page (token 0 at position 0: their KV lands there)."""
        tokens, positions, qlens, seqlens, tables = [], [], [], [], []
        for r, n in plan:
            start = r.computed
            src, base = (r.prompt, 0) if start < len(r.prompt) else (r.output, len(r.prompt))  # no chunk spans both
            tokens += src[start - base : start - base + n]
            positions += range(start, start + n)
            qlens.append(n)
            seqlens.append(start + n)
            tables.append(r.pages)
        pad = max(0, pad_to - len(tokens))
        tokens, positions = tokens + [0] * pad, positions + [0] * pad
        qlens, seqlens, tables = qlens + [1] * pad, seqlens + [1] * pad, tables + [[0]] * pad
        meta = A.build_metadata(qlens, seqlens, tables, self.page_size, self.max_pages)
        return llama.Batch(
            tokens=torch.tensor(tokens, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            meta=meta,
        )

    def example_batch(self) -> llama.Batch:
        """One token on the scratch page: a valid batch for capture, explain and warm-up."""
        meta = A.build_metadata([1], [1], [[0]], self.page_size, self.max_pages)
        return llama.Batch(
            tokens=torch.zeros(1, dtype=torch.int64), positions=torch.zeros(1, dtype=torch.int64), meta=meta
        )

    def _pad_eager(self, batch: llama.Batch, n: int) -> llama.Batch:
        """What fgraph does to a batch, done by hand: pad the batched leaves to the bucket, move to the device."""
        bucket = next(b for b in self.buckets if b >= n)
        leaves, tree = pytree.tree_flatten(batch)
        specs = pytree.tree_flatten(self.spec, is_leaf=lambda x: isinstance(x, fgraph.Batched) or x is None)[0]
        leaves = [(x if s is None else s.padded(x, bucket + s.extra)).to(self.device) for x, s in zip(leaves, specs)]
        return pytree.tree_unflatten(leaves, tree)

    def run_batch(self, batch: llama.Batch, routine: str) -> torch.Tensor:
        if self.mode == "eager":
            batch = self._pad_eager(batch, batch.tokens.shape[0])
        logits, self.cache = self.step_fn(self.params, self.cache, batch, routine=routine)
        return logits

    # -- steps ---------------------------------------------------------------------------------------
    def choose(self, logits: torch.Tensor, ready: list[Request]) -> list[int]:
        """The next token of each ready request from its logits [S', V] (greedy, or sampled with its settings and
        the uniform of its seed and this token's position: its last, PENDING, output)."""
        if all(r.temperature == 0 for r in ready):
            return logits.argmax(-1).tolist()
        knobs = torch.tensor(  # [3, S']: one copy to the device
            [
                [r.temperature for r in ready],
                [r.top_p for r in ready],
                [uniform(r.seed, r.length - 1) for r in ready],
            ],
            dtype=torch.float32,
        ).to(logits.device)
        return sample(logits, knobs[0], knobs[1], knobs[2]).tolist()

    def step(self) -> list[Request]:
        """Run one step (the one run_overlapped staged, if any), all or nothing; hand back every finished request
        not handed back yet."""
        self._step()
        return self.take_finished()

    def _step(self) -> list[Request]:
        """Schedule, run the model once, sample, retire finished requests (all or nothing). Returns those that
        finished in it."""

        def body():
            if self.staged is not None:
                plan, batch = self.staged
                self._stage(None)
            else:
                plan = self.schedule()
                if not plan:
                    return []
                batch = self.make_batch(plan)
            return self.advance(plan, self.run_batch(batch, _routine(plan)))

        return self._atomic(body)

    def advance(self, plan: list[tuple[Request, int]], logits: torch.Tensor) -> list[Request]:
        """After the model ran `plan` (its rows first in `logits`): sample the ready requests, retire finished ones."""
        rows, ready = self._account(plan)
        finished = self._settle(ready, self._sample(logits, rows, ready))
        self.steps += 1
        return finished

    def _sample(self, logits: torch.Tensor, rows: list[int], ready: list[Request]) -> list[int]:
        """The sampled tokens, on the host: a step's one wait for the device, timed into `waited` (a share of a run
        near 0 says the host loop sets the pace, near 1 the device)."""
        t0 = time.perf_counter()
        out = self.choose(_rows(logits, rows), ready) if ready else []
        self.waited += time.perf_counter() - t0
        return out

    def _account(self, plan) -> tuple[list[int], list[Request]]:
        """The model ran `plan`: count its tokens as computed; (logits row, request) of each request that caught up
        (prompt fully prefilled, or a decode), which is sampled: its output gets a PENDING token, and it is retired
        now if that token is its last (it finishes with it, whatever it is)."""
        rows, ready, offset = [], [], 0
        for r, n in plan:
            offset += n
            r.computed += n
            if r.computed == r.length:
                rows.append(offset - 1)
                ready.append(r)
                r.output.append(PENDING)
        self._did(lambda: self._unaccount(plan, ready))
        for r in ready:
            if len(r.output) == r.max_new_tokens:
                self._retire(r)
        return rows, ready

    @staticmethod
    def _unaccount(plan, ready) -> None:
        for r, n in plan:
            r.computed -= n
        for r in ready:
            r.output.pop()

    def _settle(self, ready: list[Request], new: list[int]) -> list[Request]:
        """The ready requests' new tokens replace their PENDING ones; requests that reach EOS or max_new_tokens
        finish (those at EOS are retired here, the others were in _account). Returns those that finished."""
        finished, now = [], time.perf_counter()
        first = [r for r in ready if r.t_first is None]  # (an undone step takes their first token's time back too)
        for r, t in zip(ready, new):
            r.output[-1] = t
            r.t_first = r.t_first or now
            if t in self.eos_ids or len(r.output) == r.max_new_tokens:
                r.finish_reason, r.t_done = ("eos" if t in self.eos_ids else "length"), now
                if len(r.output) < r.max_new_tokens:
                    self._retire(r)
                finished.append(r)
        self.finished += finished
        self._did(lambda: self._unsettle(finished, first))
        return finished

    def _unsettle(self, finished: list[Request], first: list[Request]) -> None:
        for r in finished:
            r.finish_reason = r.t_done = None
        for r in first:
            r.t_first = None
        del self.finished[len(self.finished) - len(finished) :]

    def run_stepwise(self):
        """Yield the requests finished by each step, one after the other, until none is busy."""
        while self.busy():
            yield self._step()

    def run_overlapped(self):
        """Yield the requests finished by each step, building step n+1's batch while the device runs step n.

        The host work of a step (schedule, batch, metadata) needs only lengths and pages, not the token step n is
        sampling: each request sampled at step n is given a PENDING token and, if that makes max_new_tokens, retired
        as the synchronous loop would; step n+1 is scheduled and built; then the logits are read (the one wait) and
        the real tokens replace PENDING in the outputs and in step n+1's token ids. A request that stops at EOS had
        a row in step n+1: that batch is built again without it, and its pages come back a step later than in
        step()'s loop. Without EOS the batches equal step()'s, so the tokens do too. Each step is all or nothing;
        the (plan, batch) built for the next one is kept in `staged` until that step has run."""
        while True:
            if self.staged is None:
                self._atomic(lambda: self._stage(self._schedule_and_build()))
            if self.staged is None:
                return
            yield self._atomic(self._overlapped_step)

    def _schedule_and_build(self):
        plan = self.schedule()
        return (plan, self.make_batch(plan)) if plan else None

    def _overlapped_step(self) -> list[Request]:
        plan, batch = self.staged
        logits = self.run_batch(batch, _routine(plan))  # launched: step n
        rows, ready = self._account(plan)
        nxt = self.schedule()  # step n+1, on the host, while the device runs step n
        nbatch = self.make_batch(nxt) if nxt else None
        at, fix, sampled, offset = [], [], set(map(id, ready)), 0  # (before the wait: its rows need no token)
        for r, n in nxt:
            offset += n
            if id(r) in sampled:  # a decode of the token step n samples: one row, its last output
                at.append(offset - 1), fix.append(r)
        finished = self._settle(ready, self._sample(logits, rows, ready))
        if any(r.finish_reason == "eos" for r in finished):
            nxt = [(r, n) for r, n in nxt if r.finish_reason is None] or self.schedule()
            nbatch = self.make_batch(nxt) if nxt else None
        elif at:  # (the host batch's own memory: one write, no tensor made)
            nbatch.tokens.numpy()[at] = [r.output[-1] for r in fix]
        self._stage((nxt, nbatch) if nxt else None)
        self.steps += 1
        return finished

    def run(self, progress: bool = True) -> Report:
        """Step until every request has finished (run_overlapped, or step by step without overlap); hand back the
        finished requests (this run's, and any an interrupted run left) with their tokens and TTFT / TPOT /
        throughput. After an exception (KeyboardInterrupt too) run() again goes on where the engine stood, and its
        report covers the interrupted runs' time and steps too."""
        from tqdm import tqdm

        t0, steps0, waited0 = time.perf_counter(), self.steps, self.waited
        todo = [*self.running, *self.waiting] if progress else []
        steps = self.run_overlapped() if self.overlap else self.run_stepwise()
        try:
            with tqdm(total=sum(r.max_new_tokens for r in todo), unit="tok", disable=not progress, leave=False) as bar:
                for finished in steps:
                    if progress:  # (counting over every request costs more host time a step than the loop's rest)
                        for r in finished:
                            bar.total -= r.max_new_tokens - len(r.output)  # stopped early at EOS
                        bar.update(sum(len(r.output) for r in todo) - bar.n)
        finally:
            # The next report hands back what an interrupted run finished, so it covers that run's time and steps
            # too: else it counted their tokens against its own time alone (4 tokens in 1 step, 4x the rate).
            e, s, w = self.unreported
            self.unreported = (e + time.perf_counter() - t0, s + self.steps - steps0, w + self.waited - waited0)
        (elapsed, steps, waited), self.unreported = self.unreported, (0.0, 0, 0.0)
        return Report.of(self.take_finished(), elapsed=elapsed, steps=steps, waited=waited)

    def explain(self, routine: str = "mixed"):
        return fgraph.explain(self.step_fn, self.params, self.cache, self.example_batch(), routine=routine)


def build(cfg: llama.LlamaConfig, params: llama.Params, *, backend: str = "auto", max_seqs: int = 64,
          max_seq_len: int = 2048, page_size: int | None = None, num_pages: int | None = None,
          make_step=llama.make_step, cls=None, **kw) -> Engine:  # fmt: skip
    """An Engine for a decoder of this package: resolves the attention backend, sizes and allocates the KV cache
    (of `cfg`'s KV heads: a tensor-parallel rank passes its own config) and makes the step with
    `make_step(cfg, backend, max_seq_len)` (llama's; qwen2_moe and tp pass theirs, and tp its Engine class)."""
    device = params.embed.device
    # sizes checked before they size the cache (a float or a str failed inside torch.zeros, a negative page size
    # was reported as a negative num_pages)
    max_seqs, max_seq_len = request.integer(max_seqs, "max_seqs", 1), request.integer(max_seq_len, "max_seq_len", 1)
    page_size = None if page_size is None else request.integer(page_size, "page_size", 1)
    num_pages = None if num_pages is None else request.integer(num_pages, "num_pages", 2)
    # its metadata is declared batched (A.metadata_batching): padded to each bucket, FlashInfer's mixed kernel fits
    backend = A.resolve_backend(backend, device, cfg.head_dim, params.embed.dtype, padded_metadata=True)
    page_size = page_size or A.page_size_for(backend)
    max_seq_len = min(max_seq_len, cfg.max_seq_len)
    num_pages = num_pages or max_seqs * math.ceil(max_seq_len / page_size) + 1  # + the scratch page
    cache = llama.init_cache(cfg, num_pages, page_size, params.embed.dtype, device)
    step = make_step(cfg, backend, max_seq_len)
    return (cls or Engine)(
        step, params, cache, max_seq_len=max_seq_len, max_seqs=max_seqs, vocab_size=cfg.vocab_size, **kw
    )
