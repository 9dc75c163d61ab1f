"""The kernels of one call, from torch.profiler's CUDA activity: how many a decode step launches, where its GPU time
goes, and how many of them repeat once per layer (what fusing a layer's work reduces). Used by decode_bench
--kernels (numbers in the rows), summarize (their tables) and scripts/diagnose_gpu.py kernels (printed tables).

Every GPU activity the profiler reports counts as a kernel, memcpy and memset included: a node of a CUDA graph
costs its launch whatever it does."""

from __future__ import annotations

import math

TOP = 25  # kernels listed by kernel_table, the most GPU time first
NAME = 110  # characters kept of a kernel's name (C++ template names run to thousands)
ROW_TOP = 12  # kernels kept in a benchmark row
KERNELS_PER_LAYER = 6  # target: per-layer kernels of a FULL decode step


def profile_calls(fn, steps: int = 20):
    """torch.profiler's record of `steps` back-to-back calls of fn (CUDA activity), after 3 unprofiled ones."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return prof


def kernel_table(fn, steps: int = 20, top: int = TOP) -> dict:
    """Profile `steps` calls of fn (after 3 unprofiled ones): kernels_per_step, gpu_us_per_step, `top` = [(name,
    launches per step, GPU µs per step)] of the `top` costliest kernels, and `rows` = the same for every kernel."""
    prof = profile_calls(fn, steps)
    rows = sorted(
        (
            (e.key[:NAME], e.count / steps, e.device_time_total / steps)
            for e in prof.key_averages()
            if e.device_time_total > 0
        ),
        key=lambda r: -r[2],
    )
    return {
        "kernels_per_step": sum(r[1] for r in rows),
        "gpu_us_per_step": sum(r[2] for r in rows),
        "top": rows[:top],
        "rows": rows,
    }


def layer_counts(rows, n_layers: int) -> dict:
    """Per-layer kernel counts of one step from its kernel rows [(name, launches per step, µs per step)]:
    kernels_per_step; kernels_per_layer = kernels_per_step / n_layers (rounded to 0.1: what the embedding, the
    head and copies done once per step add to each layer's share); layer_kernels = the launches that repeat with
    the layers, floor(launches / n_layers) per kernel name, so a kernel once per step adds none and one shared by
    every layer and the final norm (2 * n_layers + 1 launches) adds 2."""
    total = sum(n for _, n, _ in rows)
    return {
        "kernels_per_step": round(total, 1),
        "kernels_per_layer": round(total / n_layers, 1),
        "layer_kernels": sum(math.floor(n / n_layers + 1e-6) for _, n, _ in rows),
    }


def contender_kernels(calls: dict, n_layers: int, device) -> dict:
    """Row entries for each contender {name: call} (an already warm, timed call): <name>_kernels_per_step,
    _kernels_per_layer, _layer_kernels, _gpu_us and _top (ROW_TOP kernels), or _kernels_error; off CUDA,
    kernels_skipped."""
    if not str(device).startswith("cuda"):
        return {"kernels_skipped": "needs CUDA"}
    row = {}
    for name, call in calls.items():
        try:
            t = kernel_table(call)
        except Exception as e:  # a profiler failure costs this count, not the run's other results
            row[f"{name}_kernels_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        row.update({f"{name}_{k}": v for k, v in layer_counts(t["rows"], n_layers).items()})
        row[f"{name}_gpu_us"] = round(t["gpu_us_per_step"], 1)
        row[f"{name}_top"] = [[k, round(n, 2), round(us, 1)] for k, n, us in t["top"][:ROW_TOP]]
    return row


def table_lines(label: str, t: dict, n_layers: int | None = None) -> list[str]:
    """kernel_table's result as text: a heading line (with n_layers, layer_counts too), then one line per kernel."""
    head = f"--- {label}: {t['kernels_per_step']:.0f} kernels, {t['gpu_us_per_step']:.1f} us GPU per step"
    if n_layers:
        per = layer_counts(t["rows"], n_layers)
        head += f"; {per['layer_kernels']} per layer ({per['kernels_per_layer']:.1f} all / {n_layers} layers)"
    return [head] + [f"  {us:8.1f} us {n:6.1f}x  {name}" for name, n, us in t["top"]]


# ------------------------------------------------------------------------------------------------ summary
def profiled(cells) -> list[str]:
    """Contenders with kernel counts in these cells, in summarize's column order."""
    from .summarize import columns

    return [c for c in columns(cells) if any(f"{c}_kernels_per_layer" in x for x in cells)]


def summary_lines(cells) -> list[str]:
    """A model's kernel counts per cell and contender (decode_bench --kernels), with the target on its FULL graphs
    (FULL+C where measured, else FULL), then the top kernels of its first profiled cell; [] without counts."""
    from .summarize import SHORT, label, verdict

    cols = profiled(cells)
    if not cols:
        return []
    got = [c for c in cells if any(f"{k}_kernels_per_layer" in c for k in cols)]
    out = [
        "",
        "Kernels per layer of a decode step (torch.profiler): per-layer kernels (launches repeating with the layers) / "
        "all kernels per step ÷ layers "
        "(all kernels per step)",
        "",
        "| ctx | B | " + " | ".join(label(k) for k in cols) + " |",
        "|" + "---|" * (2 + len(cols)),
    ]
    for c in got:
        txt = [
            f"{c[f'{k}_layer_kernels']} / {c[f'{k}_kernels_per_layer']:.1f} ({c[f'{k}_kernels_per_step']:.0f})"
            if f"{k}_layer_kernels" in c
            else "-"
            for k in cols
        ]
        out.append(f"| {c['ctx']} | {c['batch']} | " + " | ".join(txt) + " |")
    out.append("")
    for b in sorted({k.split("/")[0] for k in cols if "/" in k}):
        mode = next((m for m in ("FULL+C", "FULL") if f"{b}/{m}" in cols), None)
        if mode is None:
            continue
        n = [(c[f"{b}/{mode}_layer_kernels"], c) for c in got if f"{b}/{mode}_layer_kernels" in c]
        worst = max(n, key=lambda x: x[0])
        out.append(
            f"- target kernels per layer <= {KERNELS_PER_LAYER} ({SHORT.get(b, b)} {mode}, per-layer kernels): "
            f"{verdict(worst[0] <= KERNELS_PER_LAYER)}: {sum(k <= KERNELS_PER_LAYER for k, _ in n)}/{len(n)} cells, "
            f"most {worst[0]} at ctx {worst[1]['ctx']} B {worst[1]['batch']}"
        )
    return out


def top_lines(model, cells) -> list[str]:
    """The top kernels of a model's first profiled cell, per contender (a section of its own: long names)."""
    from .summarize import label

    c = next((c for c in cells if any(k.endswith("_top") for k in c)), None)
    if c is None:
        return []
    out = [f"### {model}: top kernels per step, ctx {c['ctx']} B {c['batch']} (GPU us, launches per step, name)", ""]
    for k in profiled([c]):
        out += [f"{label(k)}:", "```"]
        out += [f"{us:8.1f} us {n:6.1f}x  {name}" for name, n, us in c.get(f"{k}_top", [])]
        out += ["```", ""]
    return out
