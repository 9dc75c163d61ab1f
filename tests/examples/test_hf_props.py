"""The README's Hugging Face recipe under random generate calls, as research code makes them: a jitted forward
(`model.forward = fgraph.jit(model.forward, donate=["cache"])`) gives eager generate's tokens and its logits at
every step, bit for bit on the CPU (docs/contract.md, "What is bitwise").

Each example draws an architecture (Qwen2, Llama, Mistral, Qwen2-MoE), an attention implementation, a mode, and a
few generate calls of random batch sizes, left-padded prompts of random lengths and token counts, greedy or seeded
sampling; every call is compared with the same call of an eager twin."""

import pytest
import torch

pytest.importorskip("transformers")
hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

from examples import hf_generate as G  # noqa: E402
from tests.test_semantics import MODES  # noqa: E402

PAD = 0
SPECIAL = {"pad_token_id": PAD, "eos_token_id": None, "bos_token_id": None}


def prompts(seed: int, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, max(lengths)] token ids, left-padded with PAD (a tokenizer's padding_side="left"), and their mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids, mask = torch.full((len(lengths), width), PAD), torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(1, 128, (n,), generator=g)
        mask[row, width - n :] = 1
    return ids, mask


call = st.fixed_dictionaries(
    {
        "lengths": st.lists(st.integers(1, 9), min_size=1, max_size=4),
        "new": st.integers(1, 5),
        "sample": st.booleans(),
        "seed": st.integers(0, 2**16),
    }
)


@pytest.mark.parametrize("mode", MODES)
@hypothesis.settings(max_examples=6, deadline=None, derandomize=True, database=None)
@hypothesis.given(
    arch=st.sampled_from(["qwen2", "llama", "mistral", "qwen2_moe"]),
    attention=st.sampled_from(["eager", "sdpa"]),
    calls=st.lists(call, min_size=1, max_size=3),
)
def test_the_recipe_gives_eager_generates_tokens_and_logits(mode, arch, attention, calls):
    eager, jitted = G.tiny(arch, special_tokens=SPECIAL), G.tiny(arch, special_tokens=SPECIAL)
    for m in (eager, jitted):
        m.set_attn_implementation(attention)
    f = G.jit_forward(jitted, mode)
    for c in calls:
        ids, mask = prompts(c["seed"], c["lengths"])
        kw = dict(attention_mask=mask, return_dict_in_generate=True, output_logits=True, do_sample=c["sample"])
        if c["sample"]:
            kw.update(temperature=0.8, top_k=20)
        torch.manual_seed(c["seed"])
        want = G.generate(eager, ids, c["new"], **kw)
        torch.manual_seed(c["seed"])
        got = G.generate(jitted, ids, c["new"], **kw)
        assert torch.equal(got.sequences, want.sequences), c
        assert all(map(torch.equal, got.logits, want.logits)), c
    s = f.stats()
    # each generate's prefill makes its cache (run eagerly); every decode step ran from the trace
    assert s["fallbacks"]["init"] == len(calls) and s["total"]["calls"] == sum(c["new"] - 1 for c in calls)
