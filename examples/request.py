"""A generation request: its prompt, parameters, output so far, KV pages and timings (what the engine schedules)."""

from __future__ import annotations

import attrs

PENDING = -1  # an output token whose value the device has not given yet (Engine.run_overlapped)


@attrs.define(eq=False)
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
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
