"""What Engine.run hands back: the generated tokens and the run's TTFT / TPOT / throughput."""

from __future__ import annotations

import attrs


@attrs.frozen
class Report:
    tokens: list[list[int]]  # generated ids per request, in submission order
    ttft: list[float]  # seconds from submission to first token, per request
    tpot: list[float | None]  # seconds per output token after the first, per request
    elapsed: float
    prompt_tokens: int
    output_tokens: int
    steps: int
    waited: float = 0.0  # seconds of `elapsed` the host spent waiting for sampled tokens (the device's)
    requests: list = attrs.field(factory=list, repr=False)  # the finished Requests handed back (finish_reason, ...)

    @classmethod
    def of(cls, requests: list, *, elapsed: float, steps: int, waited: float) -> Report:
        """The report of these finished requests (in submission order)."""
        return cls(
            tokens=[r.output for r in requests],
            ttft=[r.ttft for r in requests],
            tpot=[r.tpot for r in requests],
            elapsed=elapsed,
            prompt_tokens=sum(len(r.prompt) for r in requests),
            output_tokens=sum(len(r.output) for r in requests),
            steps=steps,
            waited=waited,
            requests=requests,
        )

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.elapsed if self.elapsed > 0 else float("nan")

    def summary(self) -> str:
        def stats(xs, unit=1e3):
            xs = sorted(x * unit for x in xs if x is not None)
            if not xs:
                return "n/a"
            return f"mean {sum(xs) / len(xs):.1f} p50 {xs[len(xs) // 2]:.1f} max {xs[-1]:.1f} ms"

        return (
            f"{len(self.tokens)} requests, {self.prompt_tokens} prompt + {self.output_tokens} generated tokens "
            f"in {self.steps} steps, {self.elapsed:.2f} s: {self.throughput:.1f} tok/s (host waiting for the "
            f"device {self.waited / self.elapsed if self.elapsed > 0 else 0:.0%} of it)\n"
            f"  TTFT {stats(self.ttft)}\n  TPOT {stats(self.tpot)}"
        )
