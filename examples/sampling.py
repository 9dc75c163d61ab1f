"""Next-token choice from a step's logits: greedy, or temperature / top-p sampling."""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, generator=None) -> torch.Tensor:
    """logits [S, V], temperature/top_p [S] -> tokens [S] int64. Rows with temperature 0 are greedy."""
    logits = logits.float()
    greedy = logits.argmax(-1)
    probs = torch.softmax(logits / temperature.clamp_min(1e-5)[:, None], dim=-1)
    sorted_p, idx = probs.sort(-1, descending=True)
    sorted_p[(sorted_p.cumsum(-1) - sorted_p) > top_p[:, None]] = 0.0  # nucleus: keep the smallest set > top_p
    choice = torch.multinomial(sorted_p, 1, generator=generator)  # [S, 1] (multinomial renormalises)
    return torch.where(temperature > 0, idx.gather(-1, choice)[:, 0], greedy)
