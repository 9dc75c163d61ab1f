"""Next-token choice from a step's logits: greedy, or temperature / top-p sampling driven by a per-request seed.

A sampled token is the inverse CDF of its row's (tempered, nucleus-truncated) distribution at one uniform number,
and that number is a hash of the request's seed and the token's position (`uniform`). So a request's tokens depend
on its logits, its parameters and its seed only: not on the other rows of the batch, their order or count, nor on
how often a step was retried (no generator state advances). The uniforms are made on the host (one small float
per sampled row, moved with the temperatures in one copy); the device does one sort and one search per row.
vLLM's SamplingParams.seed is the model; FlashInfer's sampling kernels draw the same way (a uniform per row).
"""

from __future__ import annotations

import torch

_M64 = (1 << 64) - 1


def mix(z: int) -> int:
    """splitmix64 (Steele et al.; Java's SplittableRandom): a 64-bit integer -> a well-mixed 64-bit integer."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) for the token at `position` of a request seeded `seed`: 24 bits, so exact in
    float32 and < 1 after the cast. (mix is a bijection: distinct positions of one seed never share a number's
    source.)"""
    return (mix(mix(seed) ^ position) >> 40) / (1 << 24)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """logits [S, V], temperature / top_p / u [S] -> tokens [S] int64. Rows with temperature 0 are greedy; the
    others take the token where their nucleus CDF (sorted by probability, the smallest set whose mass exceeds
    top_p, renormalised) first exceeds u."""
    logits = logits.float()
    greedy = logits.argmax(-1)
    probs = torch.softmax(logits / temperature.clamp_min(1e-5)[:, None], dim=-1)
    sorted_p, idx = probs.sort(dim=-1, descending=True, stable=True)  # stable: ties in one order on every run
    sorted_p[(sorted_p.cumsum(-1) - sorted_p) > top_p[:, None]] = 0.0  # the nucleus: a prefix of the sorted row
    cdf = sorted_p.cumsum(-1)  # [S, V], unnormalised
    kept = (sorted_p > 0).sum(-1, keepdim=True)  # >= 1: the most likely token always stays
    choice = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).clamp_max(kept - 1)  # [S, 1]
    return torch.where(temperature > 0, idx.gather(-1, choice)[:, 0], greedy)
