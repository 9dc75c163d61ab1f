"""A generation request: its prompt, sampling parameters, output so far, KV pages and timings (what the engine
schedules), and the checks `Engine.add` runs on what a caller passes."""

from __future__ import annotations

import math
import numbers
import operator

import attrs

import fgraph

PENDING = -1  # an output token whose value the device has not given yet (Engine.run_overlapped); never in a result
SEED_MAX = 2**64  # seeds are unsigned 64-bit, as vLLM's SamplingParams.seed


class RequestError(fgraph.FgraphError):
    """A request the engine cannot serve as given (a parameter of the wrong type or range, or too long)."""


@attrs.define(eq=False)
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0  # with the position of a token, what its sample draws on (sampling.uniform)
    output: list[int] = attrs.Factory(list)
    pages: list[int] = attrs.Factory(list)
    computed: int = 0  # tokens (prompt + output) whose k/v are in the cache
    t_arrive: float = 0.0
    t_first: float | None = None
    t_done: float | None = None
    finish_reason: str | None = None  # "eos" | "length"

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def ttft(self) -> float:
        return self.t_first - self.t_arrive

    @property
    def tpot(self) -> float | None:  # mean time per output token after the first
        return (self.t_done - self.t_first) / (len(self.output) - 1) if len(self.output) > 1 else None


def integer(value, what: str, low: int, high: int | None = None, fix: str | None = None) -> int:
    """`value` as an int in [low, high) (bools, floats and strings are refused, numpy / torch integers taken)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)
    except TypeError:
        raise RequestError(f"{what}={value!r} is not an integer", f"pass an int >= {low}") from None
    if n < low or (high is not None and n >= high):
        span = f"[{low}, {high if high is not None else 'inf'})"
        raise RequestError(f"{what}={n} is out of range {span}", fix or f"pass an int in {span}")
    return n


def real(value, what: str, low: float, high: float, low_open: bool = False) -> float:
    """`value` as a finite float in [low, high] ((low, high] with low_open); bools and strings are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RequestError(f"{what}={value!r} is not a number", f"pass a float in [{low}, {high}]")
    x = float(value)
    if not math.isfinite(x) or x > high or x < low or (low_open and x == low):
        lo = "(" if low_open else "["
        raise RequestError(f"{what}={x!r} is out of range {lo}{low}, {high}]", "pass a finite float in that range")
    return x


def token_ids(values, what: str, vocab_size: int | None) -> list[int]:
    """`values` as a list of token ids in [0, vocab_size) (numpy / torch integers taken, as from a tokenizer)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise RequestError(f"{what}={values!r:.60} is not a sequence of token ids", "pass a list of ints")
    ids = list(values)
    fast = all(type(t) is int for t in ids)  # the usual case, checked at C speed (a per-id call costs ~1 us)
    if not fast or (ids and (min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size))):
        tokenize = "tokenize with the model's own tokenizer"
        ids = [integer(t, f"{what}[{i}]", 0, vocab_size, tokenize) for i, t in enumerate(ids)]
    return ids


def check(prompt, max_new_tokens, temperature, top_p, seed, *, vocab_size: int | None) -> tuple:
    """The parameters of a new request, checked and normalised: (prompt ids, max_new_tokens, temperature, top_p,
    seed or None). Lengths against the cache are the engine's to check."""
    ids = token_ids(prompt, "prompt", vocab_size)
    if not ids:
        raise RequestError("empty prompt", "pass at least one prompt token")
    return (
        ids,
        integer(max_new_tokens, "max_new_tokens", 1),
        real(temperature, "temperature", 0.0, 1e4),
        real(top_p, "top_p", 0.0, 1.0, low_open=True),
        None if seed is None else integer(seed, "seed", 0, SEED_MAX),
    )
