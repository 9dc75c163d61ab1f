"""A small serving engine on fgraph.jit: request queue and continuous batching over paged KV blocks.

Each step packs, within `max_batch_tokens`, one token of every running decode, then chunks of prompts
(a long prompt is prefilled over several steps; new requests are admitted while pages and seats last).
A step of single-token rows only runs `routine="decode"`, any other "mixed". Pages are reserved for a
request's whole length at admission and released when it finishes, so a running request never waits for
memory (no preemption). Batches are built on the host as CPU int tensors; fgraph pads them to the bucket
and moves them in one copy. run() builds step n+1's batch while the device runs step n (run_overlapped), so
the host's scheduling and metadata work leaves the critical path. vLLM's scheduler (and its async scheduling, in
part) and gpt-fast's generate.py are the references.
"""

from __future__ import annotations

import collections
import math
import time

import torch
import torch.utils._pytree as pytree

import fgraph
from fgraph.ops import attention as A

from . import llama
from .block_allocator import BlockAllocator
from .report import Report
from .request import PENDING, Request
from .sampling import sample


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
    buckets: padded token counts (default fgraph's, up to and including max_batch_tokens).
    capture: capture every bucket of both routines up front (default: on CUDA, unless mode is NONE/eager).
    overlap: run() builds step n+1's batch on the host while the device runs step n (see run_overlapped).
    compile: Inductor-compiled pieces (fgraph.jit's compile=): the FULL+C step the benchmarks measure. Each
      signature compiles its pieces at capture, so capture takes longer: pass fewer buckets with it.
    """

    overlap_supported = True  # (EPEngine steps through its own agreement: it turns this off)

    def __init__(
        self,
        step_fn,
        params,
        cache: A.KVCache,
        *,
        max_seq_len: int,
        mode: str = "FULL_AND_PIECEWISE",
        max_batch_tokens: int = 256,
        max_seqs: int = 64,
        buckets=None,
        eos_ids=(),
        vocab_size=None,
        seed: int = 0,
        capture: bool | None = None,
        overlap: bool = True,
        compile: bool | dict = False,
    ):
        num_pages, self.page_size = cache.k[0].shape[0], cache.k[0].shape[1]
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
        self.eos_ids, self.vocab_size = frozenset(eos_ids), vocab_size
        self.blocks = BlockAllocator(num_pages)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.requests: list[Request] = []
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.steps, self.waited = 0, 0.0
        self.buckets = sorted(set(buckets or fgraph.default_buckets(max_batch_tokens)) | {max_batch_tokens})
        self.spec = llama.Batch(
            tokens=fgraph.Batched(pad=0), positions=fgraph.Batched(pad=0), meta=A.metadata_batching()
        )
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
                self.step_fn.capture(params, cache, self.example_batch(), routine=["decode", "mixed"])

    # -- requests ------------------------------------------------------------------------------------
    def add(self, prompt, max_new_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0) -> Request:
        prompt = [int(t) for t in prompt]
        if not prompt or max_new_tokens < 1:
            raise fgraph.FgraphError(
                f"request {len(self.requests)}: empty prompt or max_new_tokens < 1",
                "pass at least one prompt token and max_new_tokens >= 1",
            )
        if len(prompt) + max_new_tokens - 1 > self.max_seq_len:
            raise fgraph.FgraphError(
                f"request {len(self.requests)}: {len(prompt)} prompt + {max_new_tokens} new tokens "
                f"exceed max_seq_len={self.max_seq_len}",
                "raise max_seq_len or shorten the request",
            )
        if self.vocab_size is not None and not all(0 <= t < self.vocab_size for t in prompt):
            raise fgraph.FgraphError(
                f"request {len(self.requests)}: a prompt id is outside [0, {self.vocab_size})",
                "tokenize with the model's own tokenizer",
            )
        r = Request(len(self.requests), prompt, max_new_tokens, temperature, top_p, t_arrive=time.perf_counter())
        self.requests.append(r)
        self.waiting.append(r)
        return r

    def _pages_needed(self, r: Request) -> int:
        return math.ceil((len(r.prompt) + r.max_new_tokens - 1) / self.page_size)  # the last token is never fed

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
                if not self.running:
                    raise fgraph.FgraphError(
                        f"request {r.id} needs {self._pages_needed(r)} KV pages, the cache has "
                        f"{len(self.blocks.free)} free",
                        "allocate more pages (num_pages)",
                    )
                break
            r.pages = pages
            self.running.append(self.waiting.popleft())
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

    def choose(self, logits: torch.Tensor, ready: list[Request]) -> list[int]:
        """The next token of each ready request from its logits [S', V] (greedy, or sampled with its settings)."""
        if all(r.temperature == 0 for r in ready):
            return logits.argmax(-1).tolist()
        temp = torch.tensor([r.temperature for r in ready], dtype=torch.float32, device=logits.device)
        top_p = torch.tensor([r.top_p for r in ready], dtype=torch.float32, device=logits.device)
        return sample(logits, temp, top_p, self.generator).tolist()

    def step(self) -> list[Request]:
        """Schedule, run the model once, sample, retire finished requests. Returns those that finished."""
        plan = self.schedule()
        if not plan:
            return []
        return self.advance(plan, self.run_batch(self.make_batch(plan), _routine(plan)))

    def advance(self, plan: list[tuple[Request, int]], logits: torch.Tensor) -> list[Request]:
        """After the model ran `plan` (its rows first in `logits`): sample the ready requests, retire finished ones."""
        rows, ready = self._account(plan)
        return self._settle(ready, self._sample(logits, rows, ready))

    def _sample(self, logits: torch.Tensor, rows: list[int], ready: list[Request]) -> list[int]:
        """The sampled tokens, on the host: a step's one wait for the device, timed into `waited` (a share of a run
        near 0 says the host loop sets the pace, near 1 the device)."""
        t0 = time.perf_counter()
        out = self.choose(_rows(logits, rows), ready) if ready else []
        self.waited += time.perf_counter() - t0
        return out

    def _account(self, plan) -> tuple[list[int], list[Request]]:
        """The model ran `plan`: count its tokens as computed; (logits row, request) of each request that caught up
        (prompt fully prefilled, or a decode), which is sampled."""
        rows, ready, offset = [], [], 0
        for r, n in plan:
            offset += n
            r.computed += n
            if r.computed == r.length:
                rows.append(offset - 1)
                ready.append(r)
        return rows, ready

    def _retire(self, r: Request) -> None:
        self.blocks.release(r.pages)
        self.running.remove(r)

    def _settle(self, ready: list[Request], new: list[int], placed: bool = False) -> list[Request]:
        """The ready requests' new tokens (appended, or `placed` already as PENDING by run_overlapped, which also
        retired those that reach max_new_tokens); finishes and retires requests. Returns those that finished."""
        finished, now = [], time.perf_counter()
        for r, t in zip(ready, new):
            if placed:
                r.output[-1] = t
            else:
                r.output.append(t)
            r.t_first = r.t_first or now
            if t in self.eos_ids or len(r.output) == r.max_new_tokens:
                r.finish_reason, r.t_done = ("eos" if t in self.eos_ids else "length"), now
                if not (placed and len(r.output) == r.max_new_tokens):  # (run_overlapped retired those already)
                    self._retire(r)
                finished.append(r)
        self.steps += 1
        return finished

    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def run_stepwise(self):
        """Yield the requests finished by each step(), one after the other, until none is busy."""
        while self.busy():
            yield self.step()

    def run_overlapped(self):
        """Yield the requests finished by each step, building step n+1's batch while the device runs step n.

        The host work of a step (schedule, batch, metadata) needs only lengths and pages, not the token step n is
        sampling: each request sampled at step n is given a PENDING token and, if that makes max_new_tokens, retired
        as the synchronous loop would; step n+1 is scheduled and built; then the logits are read (the one wait) and
        the real tokens replace PENDING in the outputs and in step n+1's token ids. A request that stops at EOS had
        a row in step n+1: that batch is built again without it, and its pages come back a step later than in
        step()'s loop. Without EOS the batches equal step()'s, so the tokens do too."""
        plan = self.schedule()
        batch = self.make_batch(plan) if plan else None
        while plan:
            logits = self.run_batch(batch, _routine(plan))  # launched: step n
            rows, ready = self._account(plan)
            for r in ready:
                r.output.append(PENDING)
                if len(r.output) == r.max_new_tokens:
                    self._retire(r)  # finishes with this token whatever it is
            nxt = self.schedule()  # step n+1, on the host, while the device runs step n
            nbatch = self.make_batch(nxt) if nxt else None
            finished = self._settle(ready, self._sample(logits, rows, ready), placed=True)
            if any(r.finish_reason == "eos" for r in finished):
                nxt = [(r, n) for r, n in nxt if r.finish_reason is None] or self.schedule()
                nbatch = self.make_batch(nxt) if nxt else None
            elif nbatch is not None and ready:
                sampled, fix, offset = set(map(id, ready)), [], 0
                for r, n in nxt:
                    offset += n
                    if id(r) in sampled:  # a decode of the token just sampled: one row, its last output
                        fix.append((offset - 1, r.output[-1]))
                if fix:
                    at, vals = zip(*fix)
                    nbatch.tokens[list(at)] = torch.tensor(vals, dtype=nbatch.tokens.dtype)
            yield finished
            plan, batch = nxt, nbatch

    def run(self, progress: bool = True) -> Report:
        """Step until every request has finished (run_overlapped, or step() by step() without overlap); report tokens
        and TTFT / TPOT / throughput."""
        from tqdm import tqdm

        t0, steps0, waited0 = time.perf_counter(), self.steps, self.waited
        todo = [r for r in self.requests if r.finish_reason is None]
        steps = self.run_overlapped() if self.overlap else self.run_stepwise()
        with tqdm(total=sum(r.max_new_tokens for r in todo), unit="tok", disable=not progress, leave=False) as bar:
            for finished in steps:
                if progress:  # (counting over every request costs more host time a step than the rest of the loop)
                    for r in finished:
                        bar.total -= r.max_new_tokens - len(r.output)  # stopped early at EOS
                    bar.update(sum(len(r.output) for r in todo) - bar.n)
        return Report(
            tokens=[r.output for r in todo],
            ttft=[r.ttft for r in todo],
            tpot=[r.tpot for r in todo],
            elapsed=time.perf_counter() - t0,
            prompt_tokens=sum(len(r.prompt) for r in todo),
            output_tokens=sum(len(r.output) for r in todo),
            steps=self.steps - steps0,
            waited=self.waited - waited0,
        )

    def explain(self, routine: str = "mixed"):
        return fgraph.explain(self.step_fn, self.params, self.cache, self.example_batch(), routine=routine)


def build(
    cfg: llama.LlamaConfig,
    params: llama.Params,
    *,
    backend: str = "auto",
    max_seqs: int = 64,
    max_seq_len: int = 2048,
    page_size: int | None = None,
    num_pages: int | None = None,
    make_step=llama.make_step,
    cls=None,
    **kw,
) -> Engine:
    """An Engine for a decoder of this package: resolves the attention backend, sizes and allocates the KV cache
    (of `cfg`'s KV heads: a tensor-parallel rank passes its own config) and makes the step with
    `make_step(cfg, backend, max_seq_len)` (llama's; qwen2_moe and tp pass theirs, and tp its Engine class)."""
    device = params.embed.device
    backend = A.resolve_backend(backend, device)
    page_size = page_size or A.page_size_for(backend)
    max_seq_len = min(max_seq_len, cfg.max_seq_len)
    num_pages = num_pages or max_seqs * math.ceil(max_seq_len / page_size) + 1  # + the scratch page
    cache = llama.init_cache(cfg, num_pages, page_size, params.embed.dtype, device)
    step = make_step(cfg, backend, max_seq_len)
    return (cls or Engine)(
        step, params, cache, max_seq_len=max_seq_len, max_seqs=max_seqs, vocab_size=cfg.vocab_size, **kw
    )
