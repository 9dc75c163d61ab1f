"""Tiny random Hugging Face models for parity tests, built and saved the same way by every test file."""

import torch

# No special tokens: the ids are random here, and transformers' generate must not stop at one
NO_SPECIAL_TOKENS = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None)


def save_tiny(model_cls, config, path: str, seed: int = 0):
    """Build `model_cls(config)` with every weight perturbed (norms near 1, the rest ~0.15), save it to `path`."""
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.eval().save_pretrained(path)
    return model
