"""One decode step under several variants, side by side in one process, alternating rounds: the attention backend
and Inductor's options (FULL+C) per variant, each checked against eager before timing, with its kernels per step.

  python3 scripts/ab_step.py --variant fa2:backend=flash_attn --variant triton:backend=triton \
      --variant pdl:backend=flash_attn,triton.enable_pdl=1 [--preset qwen2.5-0.5b] [--batches 1 64] [--ctx 1024]

A variant is `name:key=value,...`: `backend` (default flash_attn on CUDA, torch on the CPU) and `mode` (default
FULL+C) are fgraph's; `fuse_rope` (default True) is the model's (RoPE inside the attention break); `triton_attn.NAME`
sets the triton backend's module constant NAME (WAVES, BLOCK_N, DECODE_STAGES, LAST_MERGES, ...) while the variant's
eager oracle runs and its graphs are captured; `config.NAME` sets fgraph.config.NAME the same way (small_m_glu,
small_m_norm, ...), and `small_m.NAME` the matmul rewrite's constant NAME (SMALL_WEIGHT, SPLIT_WEIGHT, SPLIT_COLUMNS:
which weights become fgraph::linear); every other key is an Inductor option for the compiled pieces (values: ints,
floats, True / False, else strings). Each variant's own eager step (its backend's kernels, uncompiled) is its oracle:
rel_err is max |jitted - eager| / max |eager| of the logits. On the CPU: a check of the script (tiny preset, torch
backend).
One JSON line per (variant, batch) row.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.utils._pytree as pytree

import fgraph
from benchmarks import kernels
from benchmarks.common import decode_batch, device_name, jit_step, knobs, time_ms
from examples import llama
from fgraph.compile import _small_m
from fgraph.ops import _attn_triton as T
from fgraph.ops import attention as A


def parse_variant(text: str, dev: str) -> tuple[str, dict]:
    """'name:k=v,...' -> (name, {"backend", "mode", "inductor": {...}, "triton_attn": {...}})."""
    name, _, rest = text.partition(":")
    spec = {"backend": "flash_attn" if dev == "cuda" else "torch", "mode": "FULL+C", "fuse_rope": True}
    spec.update(inductor={}, triton_attn={}, config={}, small_m={})
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key in ("backend", "mode"):
            spec[key] = value
        elif key == "fuse_rope":
            spec[key] = _value(value)
        elif key.startswith("triton_attn."):
            spec["triton_attn"][key.partition(".")[2]] = _value(value)
        elif key.startswith(("config.", "small_m.")):
            spec[key.partition(".")[0]][key.partition(".")[2]] = _value(value)
        else:
            spec["inductor"][key] = _value(value)
    return name, spec


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(text, text)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python3 scripts/ab_step.py", description=__doc__.split("\n")[0])
    p.add_argument("--variant", action="append", required=True, help="name:key=value,... (repeat)")
    p.add_argument("--preset", default=None, help="default qwen2.5-0.5b (CPU: tiny)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-kernels", action="store_true", help="skip the profiler's kernel count per step")
    a = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    preset = a.preset or ("qwen2.5-0.5b" if dev == "cuda" else "tiny")
    cfg = llama.preset(preset)
    params = llama.init_params(cfg, dtype, dev, seed=0)
    variants = dict(parse_variant(v, dev) for v in a.variant)
    caches, batches, eager, jitted = {}, {}, {}, {}
    on = lambda b: pytree.tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, b)  # noqa: E731

    def setup(name, v):  # the variant's cache, batches, eager oracle and captured graphs
        ps = A.page_size_for(v["backend"])
        caches[name] = llama.init_cache(cfg, 1 + max(a.batches) * -(-a.ctx // ps), ps, dtype, dev)
        batches[name] = {B: decode_batch(cfg.vocab_size, B, a.ctx, ps)[0] for B in a.batches}
        step = llama.make_step(cfg, backend=v["backend"], max_seq_len=a.ctx, fuse_rope=v["fuse_rope"])
        with torch.no_grad():
            eager[name] = {B: step(params, caches[name], on(b), "decode")[0].float() for B, b in batches[name].items()}
        jitted[name] = f = jit_step(step, v["mode"], a.batches, v["inductor"])
        f.capture(params, caches[name], batches[name][a.batches[0]], routine="decode", progress=False)

    for name, v in variants.items():
        with knobs(T, v["triton_attn"]), knobs(fgraph.config, v["config"]), knobs(_small_m, v["small_m"]):
            setup(name, v)
    for B in a.batches:
        calls = {
            name: (lambda f=f, n=name: f(params, caches[n], batches[n][B], routine="decode"))
            for name, f in jitted.items()
        }
        errs = {}
        for name, call in calls.items():
            got, want = call()[0].float(), eager[name][B]
            errs[name] = ((got - want).abs().max() / want.abs().max()).item()
        times = {name: [] for name in calls}
        for _ in range(a.rounds):  # alternating: every variant in every round
            for name, call in calls.items():
                times[name].append(time_ms(call, device=dev))
        for name, ts in times.items():
            row = {"B": B, "ctx": a.ctx, "variant": name, **variants[name], "preset": preset,
                   "ms_median": round(statistics.median(ts), 4), "ms_spread": round(max(ts) - min(ts), 4),
                   "rel_err_vs_eager": round(errs[name], 5), "device": device_name(dev)}  # fmt: skip
            if dev == "cuda" and not a.no_kernels:
                t = kernels.kernel_table(calls[name])
                row.update({"kernels_per_step": t["kernels_per_step"], "kernels_per_layer":
                            round(t["kernels_per_step"] / cfg.n_layers, 1), "gpu_us": round(t["gpu_us_per_step"], 1),
                            "top": [(n[:80], c, round(us, 1)) for n, c, us in t["top"][:8]]})  # fmt: skip
            print(json.dumps(row, default=str), flush=True)


if __name__ == "__main__":
    main()
