"""One summary of every benchmark part: reads the .jsonl (or, where a part has none, the .json) results under the
given directories, prints one markdown table per model (rows: cells (ctx, batch); columns: the floor, each peer
and fgraph mode in ms with its ratio to the floor, the best peer) followed by one line per target (met / NOT met,
with the number) and, where measured, kernels per layer; then the top kernels of one cell per model, the capture
cost and the serving run, and writes PNG plots (when matplotlib imports).

usage: python3 -m benchmarks.summarize DIR [DIR ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics

from . import kernels

PEERS = ("eager", "graph", "compile")
MODES = ("NONE", "PIECEWISE", "FULL", "FULL+C")
SHORT = {"flash_attn": "fa2", "flashinfer": "fi", "torch": "torch"}
FLOOR_TARGET = {"llama3-8b": 1.2, "qwen2.5-0.5b": 3.0}  # FULL <= this x floor
PEER_SPEEDUP, HOST_US, CAPTURE_S, CAPTURE_GIB, SERVE_GAIN = 1.1, 20.0, 10.0, 0.3, 0.05


# ------------------------------------------------------------------------------------------------ loading
def load(dirs) -> list[dict]:
    """Every row of every part under `dirs`: .jsonl files, and the rows of a .json without a .jsonl twin."""
    rows = []
    for d in dirs:
        files = sorted(glob.glob(os.path.join(d, "**", "*.jsonl"), recursive=True))
        stems = {f[:-1] for f in files}
        files += [f for f in sorted(glob.glob(os.path.join(d, "**", "*.json"), recursive=True)) if f not in stems]
        for f in files:
            rows += _read(f)
    return rows


def _read(path) -> list[dict]:
    try:
        if path.endswith(".jsonl"):
            with open(path) as fh:
                return [json.loads(line) for line in fh if line.strip().startswith("{")]
        with open(path) as fh:
            d = json.load(fh)
    except (OSError, ValueError) as e:
        print(f"(skipping {path}: {e})")
        return []
    if not isinstance(d, dict):
        return []
    out = [{"kind": "info", **d["info"]}] if isinstance(d.get("info"), dict) else []
    rows = d.get("rows") or []
    out += [r for r in rows if isinstance(r, dict)] + [
        {"kind": "capture", **c} for c in d.get("capture", []) if c not in rows
    ]
    return out


def merge_cells(rows) -> list[dict]:
    """Decode rows (several per cell: one per backend pass, floor, compile) merged by (model, ctx, batch)."""
    cells = {}
    for r in rows:
        if r.get("kind") in (None, "decode") and "model" in r and "ctx" in r:
            cells.setdefault((r["model"], r["ctx"], r["batch"]), {}).update(r)
    return [cells[k] for k in sorted(cells)]


# ------------------------------------------------------------------------------------------------ columns
def columns(cells) -> list[str]:
    """Timing columns present, peers first: "eager", "graph", "compile", then "<backend>/<mode>"."""
    keys = {k[:-3] for c in cells for k in c if k.endswith("_ms") and k != "floor_ms"}
    order = {m: i for i, m in enumerate(MODES)}
    fg = sorted(
        (k for k in keys if k.count("/") == 1), key=lambda k: (k.split("/")[0], order.get(k.split("/")[1], 9), k)
    )
    return [p for p in PEERS if p in keys] + fg


def label(col: str) -> str:
    if "/" not in col:
        return col
    b, m = col.split("/")
    return f"{SHORT.get(b, b)} {m}"


def best_peer(c, backend=None) -> tuple[str | None, float | None]:
    """The fastest peer of cell c; with a backend, its own torch.compile peer ("<backend>/compile", the step at
    that backend's page size) is a candidate too."""
    names = [*PEERS, f"{backend}/compile"] if backend else PEERS
    got = [(c[f"{p}_ms"], p) for p in names if isinstance(c.get(f"{p}_ms"), (int, float))]
    return (min(got)[1], min(got)[0]) if got else (None, None)


def cell_text(c, col) -> str:
    v, floor, spread = c.get(f"{col}_ms"), c.get("floor_ms"), c.get(f"{col}_spread")
    if isinstance(v, (int, float)):
        text = f"{v:.2f} ±{spread / 2:.2f}" if isinstance(spread, (int, float)) else f"{v:.2f}"  # median ± half range
        return f"{text} ({v / floor:.1f}x)" if floor else text
    for k in (f"{col}_skipped", f"{col}_error", f"{col.split('/')[0]}_skipped"):
        if k in c:
            return "skipped" if k.endswith("skipped") else "error"
    return "-"


# ------------------------------------------------------------------------------------------------ tables
def decode_table(model, cells) -> list[str]:
    cols = columns(cells)
    head = (
        ["ctx", "B", "floor"] + [label(c) for c in cols] + ["best peer", "FULL / best peer at its page size (speedup)"]
    )
    out = [f"### {model}: decode step, ms (x floor)", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for c in cells:
        if "skipped" in c and "floor_ms" not in c:
            out.append(f"| {c['ctx']} | {c['batch']} | " + " | ".join(["skipped"] * (len(head) - 2)) + " |")
            notes.append(f"ctx {c['ctx']} B {c['batch']}: {c['skipped']}")
            continue
        name, ms = best_peer(c)
        fulls = [
            f"{SHORT.get(b, b)} {best_peer(c, b)[1] / full_ms(c, b):.2f}x"
            for b in sorted(_backends(c))
            if best_peer(c, b)[1] and full_ms(c, b)
        ]
        floor = c.get("floor_ms")
        line = [str(c["ctx"]), str(c["batch"]), f"{floor:.2f}" if floor else "-"]
        line += [cell_text(c, col) for col in cols]
        line += [f"{name} {ms:.2f} ({ms / floor:.1f}x)" if ms and floor else "-", ", ".join(fulls) or "-"]
        out.append("| " + " | ".join(line) + " |")
        if c.get("compile_cudagraph_skips"):
            notes.append(
                f"ctx {c['ctx']} B {c['batch']}: compile ran without CUDA graphs for part of the step "
                f"({c['compile_cudagraph_skips']} cudagraph skips)"
            )
        notes += [
            f"ctx {c['ctx']} B {c['batch']}: {k[: -len('_skipped')] if k.endswith('_skipped') else k}: {v}"
            for k, v in sorted(c.items())
            if (k.endswith("_skipped") or k.endswith("_error")) and k != "skipped"
        ]
    out += [""] + decode_targets(model, cells) + host_lines(cells) + kernels.summary_lines(cells)
    if notes:
        out += ["", "Notes (not measured, skipped, caveats):"] + [f"- {n}" for n in _dedupe(notes)]
    return out


def _dedupe(xs):
    seen, out = set(), []
    for x in xs:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


def verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("met" if ok else "NOT met")


def _backends(c) -> set:
    return {k.split("/")[0] for k in c if k.endswith("/FULL_ms") or k.endswith("/FULL+C_ms")}


def full_ms(c, b):
    """fgraph FULL of backend b in cell c: the faster of FULL and FULL+C (jit(compile=True) is FULL mode too)."""
    xs = [c[k] for k in (f"{b}/FULL_ms", f"{b}/FULL+C_ms") if isinstance(c.get(k), (int, float))]
    return min(xs) if xs else None


def decode_targets(model, cells) -> list[str]:
    """FULL (the faster of FULL and FULL+C) vs floor, vs best peer, host time without plan: per target and backend."""
    out = []
    backends = sorted({b for c in cells for b in _backends(c)})
    limit = FLOOR_TARGET.get(model)
    for b in backends:
        got = [c for c in cells if full_ms(c, b) is not None]
        if limit is not None:
            ratios = [(full_ms(c, b) / c["floor_ms"], c) for c in got if c.get("floor_ms")]
            worst = max(ratios, key=lambda x: x[0]) if ratios else None
            ok = None if not ratios else all(r <= limit for r, _ in ratios)
            out.append(
                f"- target FULL <= {limit}x floor ({b}): {verdict(ok)}"
                + (
                    f": {sum(r <= limit for r, _ in ratios)}/{len(ratios)} cells, worst {worst[0]:.2f}x at ctx "
                    f"{worst[1]['ctx']} B {worst[1]['batch']}"
                    if worst
                    else ""
                )
            )
        sp = [(best_peer(c, b)[1] / full_ms(c, b), c) for c in got if best_peer(c, b)[1]]
        worst = min(sp, key=lambda x: x[0]) if sp else None
        ok = None if not sp else all(s >= PEER_SPEEDUP for s, _ in sp)
        out.append(
            f"- target FULL >= {PEER_SPEEDUP}x faster than the best peer ({b}): {verdict(ok)}"
            + (
                f": {sum(s >= PEER_SPEEDUP for s, _ in sp)}/{len(sp)} cells, worst {worst[0]:.2f}x at ctx {worst[1]['ctx']} "
                f"B {worst[1]['batch']} (best peer {best_peer(worst[1], b)[0]})"
                if worst
                else ""
            )
            + (
                "; torch.compile NOT measured in this run: against eager and graph only"
                if sp and not any(isinstance(c.get("compile_ms"), (int, float)) for _, c in sp)
                else ""
            )
        )
        hosted = [(c, m) for c in cells for m in host_modes([c], b)]  # FULL and FULL+C: the same host path
        host, plan, tot = ([c[f"{b}/{m}/{k}"] for c, m in hosted] for k in ("noplan_us", "plan_us", "host_us"))
        ok = None if not host else max(host) <= HOST_US
        out.append(
            f"- target host time per FULL decode call <= {HOST_US:g} us excluding plan ({b}): {verdict(ok)}"
            + (
                f": entry->launch minus plan median {statistics.median(host):.1f} us (max {max(host):.1f}) over {len(host)} "
                f"cells x modes; plan {statistics.median(plan):.1f} us; entry->return {statistics.median(tot):.1f} us"
                if host
                else ""
            )
        )
    return out


def host_modes(cells, backend) -> list[str]:
    """The FULL modes (FULL, FULL+C) with a host time for this backend in these cells."""
    return sorted(
        {
            k.split("/")[1]
            for c in cells
            for k, v in c.items()
            if k.startswith(f"{backend}/") and k.endswith("/launch_us") and isinstance(v, (int, float))
        }
    )


def host_lines(cells) -> list[str]:
    """Host µs per FULL decode call per cell and backend: entry -> launch, of which plan, and entry -> return."""
    cols = [
        f"{b}/{m}"
        for b in sorted({k.split("/")[0] for c in cells for k in c if k.endswith("/launch_us")})
        for m in host_modes(cells, b)
    ]
    if not cols:
        return []
    out = [
        "",
        "Host time per FULL decode call, us (median, GPU kept busy; the modes of a cell in alternating rounds "
        "entry->launch = plan + the rest; entry->return",
        "",
        "| ctx | B | "
        + " | ".join(
            f"{SHORT.get(k.split('/')[0], k.split('/')[0])} {k.split('/')[1]} launch (plan + rest) / return"
            for k in cols
        )
        + " |",
        "|" + "---|" * (2 + len(cols)),
    ]
    for c in cells:
        if not any(isinstance(c.get(f"{k}/launch_us"), (int, float)) for k in cols):
            continue
        txt = [
            f"{c[f'{k}/launch_us']:.0f} ({c[f'{k}/plan_us']:.0f} + {c[f'{k}/noplan_us']:.0f}) / {c[f'{k}/host_us']:.0f}"
            if isinstance(c.get(f"{k}/launch_us"), (int, float))
            else "-"
            for k in cols
        ]
        out.append(f"| {c['ctx']} | {c['batch']} | " + " | ".join(txt) + " |")
    return out


def capture_lines(caps, firsts=()) -> list[str]:
    if not caps:
        return []
    out = [
        "### capture: 2 routines x default buckets, FULL_AND_PIECEWISE",
        "",
        "| model | backend | seconds | signatures | graphs | traces | pool GiB | decode s / GiB | mixed s / GiB "
        "| target (<= 10 s, <= 0.3 GiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in caps:
        if "capture_s" not in c:
            out.append(f"| {c.get('model')} | {c.get('backend')} | skipped: {c.get('skipped', '?')} | | | | | | | |")
            continue
        ok = c["capture_s"] <= CAPTURE_S and c["pool_GiB"] <= CAPTURE_GIB
        target = (
            f"{verdict(ok)} ({c['capture_s']:.1f} s, {c['pool_GiB']:.2f} GiB)"
            if c["model"] == "qwen2.5-0.5b"
            else "(stated for 0.5B)"
        )
        out.append(
            f"| {c['model']} | {c['backend']} | {c['capture_s']:.1f} | {c['signatures']} | {c['graphs']} | "
            f"{c.get('traces', '-')} | {c['pool_GiB']:.2f} | {routine_cost(c, 'decode')} | "
            f"{routine_cost(c, 'mixed')} | {target} |"
        )
    out += [
        f"\nThe process's first trace ({f['model']} run), paid once before these captures: one-off imports of "
        f"make_fx's symbolic machinery, {f['first_trace_s']:.1f} s."
        for f in firsts
    ]
    out += [
        f"Importing {c['backend']} before its capture ({c['model']}): {c['import_s']:.1f} s (once per process)."
        for c in caps
        if c.get("import_s") is not None
    ]
    return out + [""]


def routine_cost(c, routine) -> str:
    per = [p for p in c.get("per_signature", []) if p.get("routine") == routine]
    if not per:
        return "-"
    return f"{sum(p['capture_s'] for p in per):.1f} / {sum(p['pool_MiB'] for p in per) / 1024:.2f}"


def _serve_gain(r, rows) -> float:
    """Output throughput over PIECEWISE's: the median of paired per-round ratios where the run has them (rows of
    without paired repeats: the ratio of the two single runs)."""
    if r.get("mode") == "PIECEWISE":
        return 0.0
    if "gain_paired" in r:
        return r["gain_paired"]
    base = next(
        (
            x
            for x in rows
            if x.get("backend") == r["backend"] and x.get("mode") == "PIECEWISE" and "throughput_tok_s" in x
        ),
        None,
    )
    return r["throughput_tok_s"] / base["throughput_tok_s"] - 1 if base else float("nan")


def serve_lines(rows) -> list[str]:
    if not rows:
        return []
    out = [
        "### continuous batching (greedy, fixed-seed synthetic workload; medians over runs, modes alternating)",
        "",
        "| model | backend | mode | setup s | runs | elapsed s | output tok/s (min-max) | TTFT p50 ms | TPOT p50 ms |"
        " host waiting for the device | vs PIECEWISE | mismatches |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "throughput_tok_s" not in r:
            what = f"skipped: {r['skipped']}" if "skipped" in r else f"error: {r.get('error', '?')}"
            out.append(f"| {r.get('model', '')} | {r.get('backend')} | {r.get('mode')} | {what} | | | | | | | | |")
            continue
        tput = r.get("throughput_runs", [r["throughput_tok_s"]])
        wait = f"{r['waiting_share']:.0%}" if "waiting_share" in r else "-"  # (older rows: not measured)
        out.append(
            f"| {r.get('model', '')} | {r['backend']} | {r['mode']} | {r['setup_s']:.1f} | {len(tput)} | "
            f"{r['elapsed_s']:.1f} | {r['throughput_tok_s']:.0f} ({min(tput):.0f}-{max(tput):.0f}) | "
            f"{r['ttft_p50_ms']:.0f} | {r['tpot_p50_ms']:.2f} | {wait} | {_serve_gain(r, rows):+.1%} | "
            f"{r.get('mismatched_requests', '-')} |"
        )
    out.append("")
    for b in sorted({r["backend"] for r in rows if "throughput_tok_s" in r}):
        pw = next(
            (r for r in rows if r.get("backend") == b and r.get("mode") == "PIECEWISE" and "throughput_tok_s" in r),
            None,
        )
        fp = next(
            (
                r
                for r in rows
                if r.get("backend") == b and r.get("mode") == "FULL_AND_PIECEWISE" and "throughput_tok_s" in r
            ),
            None,
        )
        if pw is None or fp is None:
            out.append(
                f"- target FULL_AND_PIECEWISE >= +{SERVE_GAIN:.0%} output throughput over PIECEWISE ({b}): not measured"
            )
            continue
        gain, same = _serve_gain(fp, rows), fp.get("mismatched_requests") == 0
        out.append(
            f"- target FULL_AND_PIECEWISE >= +{SERVE_GAIN:.0%} output throughput over PIECEWISE with identical "
            f"greedy tokens ({b}): {verdict(gain >= SERVE_GAIN and same)}: {gain:+.1%}, "
            f"{fp.get('mismatched_requests', '?')} of {fp.get('requests', '?')} requests differ"
        )
    for r in rows:  # a "+C" mode: its base mode serving Inductor-compiled pieces, on fewer buckets
        if r.get("mode", "").endswith("+C") and "throughput_tok_s" in r:
            over = r.get("gain_over_uncompiled")
            out.append(
                f"- {r['mode']} ({r['backend']}; Inductor-compiled pieces, buckets {r.get('buckets', '?')}): "
                + (f"{over:+.1%} over {r['mode'].removesuffix('+C')}" if over is not None else "base mode not run")
                + f", {r.get('mismatched_requests', '?')} of {r.get('requests', '?')} requests' tokens differ from "
                f"{r.get('compared_with', 'the first mode')}"
            )
    return out + [""]


def report(rows) -> str:
    """The whole summary as markdown: decode tables and targets per model, capture, serving."""
    cells = merge_cells(rows)
    out = []
    for info in [r for r in rows if r.get("kind") == "info"]:
        out.append(
            f"- part {info.get('part', '?')}: {info.get('device', info.get('gpu', '?'))}, torch "
            f"{info.get('torch', '?')}"
            + (f", copy {info['copy_TBps']:.2f} TB/s" if "copy_TBps" in info else "")
            + f": `{info.get('command', '')}`"
        )
    out.append("")
    models = _dedupe([c["model"] for c in cells])
    for model in models:
        out += decode_table(model, [c for c in cells if c["model"] == model]) + [""]
    for model in models:
        out += kernels.top_lines(model, [c for c in cells if c["model"] == model])
    out += capture_lines(
        [r for r in rows if r.get("kind") == "capture"], [r for r in rows if r.get("kind") == "process"]
    )
    out += serve_lines([r for r in rows if r.get("kind") == "serve"])
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ plots
def plot_decode(cells, path) -> None:
    """Bars of each column's ratio to the floor per cell, one panel per model (log scale; 1 = the floor)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(matplotlib not installed: no plot {path})")
        return
    cells = [c for c in cells if c.get("floor_ms")]
    models = _dedupe([c["model"] for c in cells])
    if not models:
        return
    cols = columns(cells)
    fig, axes = plt.subplots(
        len(models),
        1,
        figsize=(max(8, 1.4 * max(len([c for c in cells if c["model"] == m]) for m in models)), 4.2 * len(models)),
        squeeze=False,
    )
    w = 0.8 / max(len(cols), 1)
    for ax, model in zip(axes[:, 0], models):
        mc = [c for c in cells if c["model"] == model]
        for k, col in enumerate(cols):
            ys = [
                c[f"{col}_ms"] / c["floor_ms"] if isinstance(c.get(f"{col}_ms"), (int, float)) else float("nan")
                for c in mc
            ]
            ax.bar([i + k * w for i in range(len(mc))], ys, w, label=label(col))
        ax.set_xticks(
            [i + 0.4 - w / 2 for i in range(len(mc))], [f"ctx {c['ctx']}\nB {c['batch']}" for c in mc], fontsize=8
        )
        ax.set_yscale("log")
        ax.axhline(1.0, color="k", lw=0.8)
        if model in FLOOR_TARGET:
            ax.axhline(FLOOR_TARGET[model], color="r", lw=0.8, ls="--", label=f"target {FLOOR_TARGET[model]}x")
        ax.set_title(f"{model}: decode step / floor")
        ax.legend(fontsize=6, ncol=4)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dirs", nargs="+", help="result directories (searched recursively)")
    ap.add_argument("--out", default=None, help="where summary.md and summary.png go (default: the first DIR)")
    a = ap.parse_args(argv)
    rows = load(a.dirs)
    if not rows:
        print(f"no results under {a.dirs}")
        return 1
    text = report(rows)
    print(text)
    out = a.out or a.dirs[0]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "summary.md"), "w") as fh:
        fh.write(text + "\n")
    plot_decode(merge_cells(rows), os.path.join(out, "summary.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
