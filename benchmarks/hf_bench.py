"""HF generate decode tokens/s: eager, torch.compile's static-cache recipe and fgraph.jit's, side by side.

    python3 -m benchmarks.hf_bench            # GPU: a Qwen2.5-0.5B-shaped random-weight model, bf16, ctx 1024
    python3 -m benchmarks.hf_bench --smoke    # CPU: a tiny model, a few seconds
    python3 -m benchmarks.hf_bench --arch qwen2_moe   # a Qwen2-MoE (Qwen1.5-MoE-A2.7B's layers, 8 of them), and
                                                      # the same through fgraph's MoE primitive (examples/hf_moe.py)

B=1 and B=8. Contenders: HF eager (its default DynamicCache, and the static cache), HF + torch.compile and HF +
fgraph.jit (`model.forward = fgraph.jit(model.forward, donate=[<the cache parameter>])`, the static cache).

torch.compile's contender is transformers' own static-cache recipe by default (`--compile generate`): `generate(...,
cache_implementation="static")` compiles the decode call itself (`torch.compile(model.__call__, mode=
"reduce-overhead")`, its CompileConfig's defaults) and runs the prefill eagerly. `--compile forward` is the older recipe,
`model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`: there the prefill runs compiled
too, and it makes the static cache's tensors lazily inside the compiled graph (transformers' docs ask for
`early_initialization` then); on the H200 (torch 2.11, transformers 5.17) that process segfaults in an Inductor kernel
launch under cudagraph trees (docs/performance.md).

The static-cache contenders pass cache_implementation="static": generate makes the cache (its first prefill, eagerly
for fgraph: the cache's tensors are made lazily) and reuses it, reset, in later calls of no more tokens (the first call
makes the largest); `--cache caller` passes one early-initialised StaticCache per contender and batch instead. Tokens
are checked against eager's before timing (with its DynamicCache, and with the static cache: the same math as the
compiled contenders'; bf16 kernels may differ between the two; the eager static row's own check says whether eager
repeats itself, and `first_different_token` where tokens part); rounds alternate between contenders, after two untimed rounds; decode tokens/s =
B * (N - 1) / (t(N) - t(1)) over generate calls of N and 1 new tokens; median and spread over rounds, and
`vs_compile_paired`: the median of each round's rate over torch.compile's in that round. `--variant
sdpa_decode=False` adds a row: generate's default with fgraph's forward, every generate of it (trace, compile, replay)
under those fgraph.config switches, timed in the same rounds as the row without them (`vs_default_paired`: the
lever's own gain, round by round). One JSON line per
cell to $OUT/hf_bench.jsonl (and stdout), as each is measured.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import statistics
import time

import torch

import fgraph
from benchmarks import kernels
from benchmarks.common import knobs
from examples import hf_generate
from examples.hf_moe import use_fgraph_moe
from fgraph.compile import compiler
from fgraph.kernels import linear_counts, linear_seconds

VARIANT_OF = "hf_fgraph_generate_default"  # the contender a --variant adds a row beside


def make_model(smoke: bool, device: str, dtype, layers: int = 2, arch: str = "qwen2"):
    """A random-weight Qwen2 (`arch` "qwen2") or Qwen2-MoE ("qwen2_moe"): tiny dims (`smoke`, `layers` of them), or a
    real model's shapes: Qwen2.5-0.5B's; for the MoE, Qwen1.5-MoE-A2.7B's layer (60 experts, 4 per token, a shared
    expert) in 8 of its 24 layers."""
    import transformers as tf

    none = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None)
    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256)  # fmt: skip
    if arch == "qwen2_moe":
        if smoke:
            cfg = dict(tiny, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                       shared_expert_intermediate_size=64)  # fmt: skip
        else:
            cfg = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                       num_key_value_heads=16, vocab_size=151936, moe_intermediate_size=1408, num_experts=60,
                       num_experts_per_tok=4, shared_expert_intermediate_size=5632)  # fmt: skip
        config = tf.Qwen2MoeConfig(**cfg, max_position_embeddings=4096, attn_implementation="sdpa", **none)
        cls = tf.Qwen2MoeForCausalLM
    else:
        if smoke:
            cfg = tiny
        else:  # Qwen2.5-0.5B's shapes
            cfg = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)  # fmt: skip
        config = tf.Qwen2Config(**cfg, max_position_embeddings=4096, attn_implementation="sdpa", **none)
        cls = tf.Qwen2ForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config).to(dtype).eval()
    model.generation_config.update(**none)
    return model


def decode_rates(batch: int, new: int, pairs: list[tuple[float, float]]) -> list[float]:
    """Decode tokens/s of each round's (t(1), t(N)) generate times: B * (N - 1) / (t(N) - t(1)). A round whose 1-token
    generate took as long as its N-token one measured no decode time and has no rate (not one of B * (N - 1) / ~0)."""
    return [batch * (new - 1) / (tn - t1) for t1, tn in pairs if tn > t1]


def paired_speedup(pairs: list[tuple[float, float]], peer: list[tuple[float, float]]) -> float | None:
    """The median over rounds of a contender's decode rate over its peer's in the same round: a round's drift (the
    host's load changes between rounds) moves both. Rounds where either has no rate are left out; None if none is
    left."""
    ratios = [(pn - p1) / (tn - t1) for (t1, tn), (p1, pn) in zip(pairs, peer) if tn > t1 and pn > p1]
    return round(statistics.median(ratios), 3) if ratios else None


def main(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.hf_bench", description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, a tiny model, no torch.compile")
    p.add_argument(
        "--arch",
        choices=["qwen2", "qwen2_moe"],
        default="qwen2",
        help="qwen2: Qwen2.5-0.5B's shapes; qwen2_moe: Qwen1.5-MoE-A2.7B's layer, 8 layers (make_model)",
    )
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--ctx", type=int, default=None, help="prompt tokens (default 1024; smoke 32)")
    p.add_argument("--new", type=int, default=None, help="new tokens per timed generate (default 64; smoke 6)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument(
        "--cache",
        choices=["generate", "caller"],
        default="generate",
        help="generate: HF's recipe, cache_implementation='static' (a new StaticCache per generate); caller: one "
        "early-initialised StaticCache per contender and batch, passed to every generate and reset between them",
    )
    p.add_argument("--skip", nargs="*", default=[], help="contenders left out (e.g. one that crashes here)")
    p.add_argument(
        "--compile",
        choices=["generate", "forward"],
        default="generate",
        help="generate: transformers compiles the decode call itself (its static-cache default); forward: "
        "model.forward = torch.compile(model.forward, mode='reduce-overhead', fullgraph=True)",
    )
    p.add_argument(
        "--first-only",
        action="store_true",
        help="start-up: each contender's first generate, then stop (no rounds); run one contender a process, with "
        "fresh TORCHINDUCTOR_CACHE_DIR and TRITON_HOME and no TRITON_CACHE_DIR, for a user's cold start",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="GPU: kernels and kernel time per generated token, per contender (torch.profiler, after the timing)",
    )
    p.add_argument(
        "--profile-top",
        type=int,
        default=kernels.ROW_TOP,
        help="with --profile: the costliest kernels a row lists (more: to compare two rows kernel by kernel)",
    )
    p.add_argument(
        "--config",
        nargs="*",
        default=[],
        metavar="NAME=VALUE",
        help="fgraph.config switches set first, for every contender",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=VALUE[,NAME=VALUE]",
        help="one more contender: generate's default with fgraph's forward, its generates run (traced, compiled, "
        "timed) with these fgraph.config switches, beside the row without them in the same rounds (a lever measured "
        "before it is a default, or a default's own gain: sdpa_decode=False). Repeatable",
    )
    args = p.parse_args(argv)
    for item in args.config:
        for name, value in fgraph_switches(p, item).items():
            setattr(fgraph.config, name, value)
    variants = {f"{VARIANT_OF}+{text}": fgraph_switches(p, text) for text in args.variant}
    smoke = args.smoke or not torch.cuda.is_available()
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    ctx, new = args.ctx or (32 if smoke else 1024), args.new or (6 if smoke else 64)
    rounds = args.rounds or (2 if smoke else 5)
    base = make_model(smoke, device, dtype, arch=args.arch)
    cache_param = hf_generate.cache_parameter(base)  # `cache` or `past_key_values` (older)
    contenders = {"hf_eager": base, "hf_eager_static": base}  # the reference of the static-cache contenders' math

    def copy():
        m = make_model(smoke, device, dtype, arch=args.arch)
        m.load_state_dict(base.state_dict())
        return m

    def jitted(m=None, **options):  # (a copy of base unless m) with the README's recipe
        m = copy() if m is None else m
        hf_generate.jit_forward(m, "FULL_AND_PIECEWISE", buckets=[1, 8], **options)
        return m

    if not smoke:
        m = copy()
        if args.compile == "forward":
            m.forward = torch.compile(m.forward, mode="reduce-overhead", fullgraph=True)
        contenders[PEER] = m
    contenders["hf_fgraph_static"] = jitted(compile=False)  # eager's kernels, graphed
    if not smoke:  # fgraph.jit's default on CUDA: Inductor-compiled pieces (an HF model has no break: one piece)
        contenders["hf_fgraph_static_compiled"] = jitted()
        # the same, through generate as it runs by default: it torch.compiles the call of the jitted forward
        contenders[VARIANT_OF] = jitted()
    for name in variants:  # (compiled when its first generate runs, under its switches: gen)
        contenders[name] = jitted()
    if args.arch == "qwen2_moe":  # the default jit, its MoE blocks through fgraph's MoE primitive (a break)
        m = copy()
        use_fgraph_moe(m)
        contenders["hf_fgraph_moe_primitive"] = jitted(m, compile=not smoke)
    for name in args.skip:
        contenders.pop(name)
    # the contenders generate runs as by default, compiling the decode call itself (of its jitted forward for fgraph's)
    own_compile = (
        set() if smoke else {VARIANT_OF, *variants} | ({"hf_compile_static"} if args.compile == "generate" else set())
    )  # (the CPU's generate compiles nothing)
    out_dir = os.environ.get("OUT", ".")
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for B in args.batches:
        ids = torch.randint(0, base.config.vocab_size, (B, ctx), generator=torch.Generator().manual_seed(B))
        ids = ids.to(device)
        if B != args.batches[0]:
            torch._dynamo.reset()  # torch.compile's recompile limit counts every shape met; each batch starts anew

        caches = {}
        if args.cache == "caller":
            from transformers import StaticCache

            for name, m in contenders.items():
                if name != "hf_eager":
                    # as long as generate's own would be for the longest generate here (loop_us's, or the timed)
                    caches[name] = c = StaticCache(config=m.config, max_cache_len=ctx + max(new, LOOP_TOKENS))
                    heads, dim = m.config.num_key_value_heads, m.config.hidden_size // m.config.num_attention_heads
                    c.early_initialization(B, heads, dim, dtype, device)

        def gen(name, n):
            if name == "hf_eager":
                kw = {}
            elif name in caches:
                caches[name].reset()
                kw = {cache_param: caches[name]}
            else:
                kw = {"cache_implementation": "static"}  # the cache generate makes
            # transformers compiles the decode call itself only for these contenders
            kw["disable_compile"] = name not in own_compile
            with torch.no_grad(), knobs(fgraph.config, variants.get(name, {})):
                # (the eager references run from `base` also when --skip leaves their rows out)
                model = contenders.get(name, base) if name in ("hf_eager", "hf_eager_static") else contenders[name]
                return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)

        want, want_static = gen("hf_eager", new), gen("hf_eager_static", new)
        got, first_s = {}, {}
        for name in contenders:  # (also the warm-up; its time: start-up, traces, captures and compiles included)
            t0 = time.perf_counter()
            got[name] = gen(name, new)
            first_s[name] = round(time.perf_counter() - t0, 2)
        equal = {name: bool(torch.equal(t, want)) for name, t in got.items()}
        equal_static = {name: bool(torch.equal(t, want_static)) for name, t in got.items()}
        if args.first_only:
            for name in contenders:
                row = {"bench": "hf_bench", "arch": args.arch, "B": B, "ctx": ctx, "new_tokens": new, "contender": name,
                       "first_generate_s": first_s[name], "tokens_equal_eager_static": equal_static[name]}  # fmt: skip
                if name.startswith("hf_fgraph"):
                    row["linear"], row["linear_s"] = (
                        dict(linear_counts),
                        {k: round(v, 2) for k, v in linear_seconds.items()},
                    )
                rows.append(row)
                print(json.dumps(row), flush=True)
            continue
        # the first new token that differs from eager's with the static cache (in any row; None: all equal)
        differs = {name: _first_difference(t[:, ctx:], want_static[:, ctx:]) for name, t in got.items()}
        times = {name: {1: [], new: []} for name in contenders}
        for r in range(rounds + WARM_ROUNDS):  # untimed: what the rounds' pattern of calls costs once (torch.compile
            # recompiled in its first timed round: a generate of 1 token between two of `new`; fgraph captures again
            # for the second and third caches generate makes, then adopts each new one)
            for n in (1, new):
                for name in contenders:  # alternating: every contender in every round
                    if device == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    gen(name, n)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    if r >= WARM_ROUNDS:
                        times[name][n].append(time.perf_counter() - t0)
        for name in contenders:
            pairs = list(zip(times[name][1], times[name][new]))
            valid = decode_rates(B, new, pairs)
            rates = valid or [float("nan")]
            row = {
                "bench": "hf_bench", "arch": args.arch, "device": device, "dtype": str(dtype).removeprefix("torch."), "B": B, "ctx": ctx,
                "new_tokens": new, "cache": args.cache, "compile": args.compile, "contender": name, "tokens_equal_eager": equal[name],
                "tokens_equal_eager_static": equal_static[name], "first_different_token": differs[name],
                "decode_tok_s_median": statistics.median(rates), "decode_tok_s_min": min(rates),
                "decode_tok_s_max": max(rates), "rounds": rounds, "invalid_rounds": len(pairs) - len(valid),
                "generate_s": {1: [round(t, 4) for t, _ in pairs], new: [round(t, 4) for _, t in pairs]},
                "first_generate_s": first_s[name],
            }  # fmt: skip
            if name != PEER and PEER in times:
                row["vs_compile_paired"] = paired_speedup(pairs, list(zip(times[PEER][1], times[PEER][new])))
            if name in variants and VARIANT_OF in times:  # the lever's own gain, round by round
                row["vs_default_paired"] = paired_speedup(
                    pairs, list(zip(times[VARIANT_OF][1], times[VARIANT_OF][new]))
                )
            if name.startswith("hf_fgraph"):  # (its counts before the calls below)
                s = contenders[name].forward.stats()
                row["fgraph"] = {"total": s["total"], "fallbacks": s["fallbacks"], "signatures": len(s["signatures"])}
                row["linear"] = dict(linear_counts)  # fgraph::linear's picks so far in this process (all contenders)
                row["sdpa_decode"] = compiler.counts["sdpa"]  # SDPA calls rewritten into it so far (all contenders)
                row["linear_s"] = {k: round(v, 2) for k, v in linear_seconds.items()}  # its tuner's wall time so far
                row["host_us"] = host_us(contenders[name], lambda: gen(name, 8))
                row["host_us"]["find_in_generate"] = find_in_generate_us(
                    contenders[name], lambda: gen(name, LOOP_TOKENS)
                )
            compiled_here = name in own_compile
            row["call_us"] = call_us(
                contenders[name], "_compiled_call" if compiled_here else "forward", lambda: gen(name, 8)
            )
            if name == "hf_eager_static":
                row["loop_us"] = loop_us(base, lambda n: gen(name, n))
            if args.profile and device == "cuda" and name != "hf_eager":
                row["per_token"] = kernels_per_token(lambda n, name=name: gen(name, n), top=args.profile_top)
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(os.path.join(out_dir, "hf_bench.jsonl"), "a") as f:  # per row: a later crash keeps it
                f.write(json.dumps(row) + "\n")
    return rows


def fgraph_switches(p: argparse.ArgumentParser, text: str) -> dict:
    """'NAME=VALUE[,NAME=VALUE]' -> {NAME: value} of fgraph.config switches, each checked by setting it (then put
    back): a misspelt name or a value of the wrong kind is an argument error."""
    out = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name.startswith("_") or not hasattr(fgraph.config, name):
            p.error(f"{item}: fgraph.config has no switch {name!r}")
        try:
            out[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            p.error(f"{item}: {value!r} is not a Python literal (True, False, a number)")
    try:
        with knobs(fgraph.config, out):  # (fgraph.config checks each switch's name and kind as it is set)
            pass
    except fgraph.FgraphError as e:
        p.error(str(e))
    return out


def host_us(model, run, calls: int = 200) -> dict:
    """Host microseconds per decode call for fgraph to find what serves it: the replay path (FastPath.find with the
    jit object's LiftedView) and the slow path's binding (Jitted.bind: flatten, check, lifted values), on the last
    decode call's arguments, the device idle (the median of 5 loops of `calls`)."""
    jitted, seen = model.forward, []
    find = jitted.fastpath.find
    jitted.fastpath.find = lambda a, k, v=None: seen.append((a, k)) or find(a, k, v)
    try:
        run()
    finally:
        jitted.fastpath.find = find
    a, k = seen[-1]
    out = {}
    with torch.no_grad():  # as generate calls it: grad mode is part of the replay path's key
        assert find(a, k, jitted._view) is not None, "the replay path does not serve a decode call"
        paths = {"replay_path": lambda: find(a, k, jitted._view), "slow_bind": lambda: jitted.bind(a, k)}
        for what, fn in paths.items():
            loops = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                loops.append((time.perf_counter() - t0) / calls * 1e6)
            out[what] = round(statistics.median(loops), 1)
    return out


@contextlib.contextmanager
def timed_find(model):
    """FastPath.find of the jitted forward, timed while the block runs: yields the list each call's microseconds
    join."""
    fp, each = model.forward.fastpath, []
    find = fp.find

    def timed(*args):
        t0 = time.perf_counter()
        try:
            return find(*args)
        finally:
            each.append((time.perf_counter() - t0) * 1e6)

    fp.find = timed
    try:
        yield each
    finally:
        fp.find = find


def find_in_generate_us(model, run) -> float:
    """Microseconds of FastPath.find per decode call inside `run` (a generate), the median: the replay path as
    generate calls it, with its arguments new each call and the model's own work between calls (host_us re-calls
    find on one call's arguments, hot in the host's caches)."""
    with timed_find(model) as each:
        run()
    return round(statistics.median(each[1:]), 1)  # the decode calls (the first may be the prefill)


def call_us(obj, attr: str, run) -> float:
    """Microseconds per decode call of `obj.attr` (the model's forward, or the call transformers compiled) in `run`,
    the device synchronised before and after each: what of a generated token's time is the model's."""
    fn, each = getattr(obj, attr), []
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def timed(*args, **kwargs):
        sync()
        t0 = time.perf_counter()
        got = fn(*args, **kwargs)
        sync()
        each.append((time.perf_counter() - t0) * 1e6)
        return got

    setattr(obj, attr, timed)
    try:
        run()
    finally:
        setattr(obj, attr, fn)
    return round(statistics.median(each[1:]), 1)  # the decode calls (the first may be the prefill)


LOOP_TOKENS = 17
WARM_ROUNDS = 2  # untimed rounds before the timed ones
PEER = "hf_compile_static"  # the row each other row's vs_compile_paired is against


def loop_us(model, gen, n: int = LOOP_TOKENS) -> float:
    """Microseconds a generated token costs in generate's own loop (input preparation, logits processing, stopping
    checks), outside the model: its forward answers every decode call with the prefill's output (no model work), a
    generate of n tokens less one of 1, over n - 1. The floor under every contender's time per token."""
    real, first = model.forward, []

    def stub(*args, **kwargs):
        if not first:
            first.append(real(*args, **kwargs))
        return first[0]

    ts = {}
    model.forward = stub
    try:
        for k in (1, n, 1, n):
            first.clear()
            t0 = time.perf_counter()
            gen(k)
            ts.setdefault(k, []).append(time.perf_counter() - t0)
    finally:
        model.forward = real
    return round((min(ts[n]) - min(ts[1])) / (n - 1) * 1e6, 1)


def kernels_per_token(gen, n: int = 9, top: int = kernels.ROW_TOP) -> dict:
    """GPU kernels (and their time) a generated token costs: a generate of n tokens less one of 1, over n - 1; `top`:
    [(name, launches, µs)] a token of the costliest kernels."""
    from torch.profiler import ProfilerActivity, profile

    got = {}
    for k in (1, n):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            gen(k)
            torch.cuda.synchronize()
        got[k] = {
            e.key[: kernels.NAME]: (e.count, e.device_time_total)
            for e in prof.key_averages()
            if e.device_time_total > 0
        }
    names = got[n].keys() | got[1].keys()
    per = {x: [(got[n].get(x, (0, 0))[i] - got[1].get(x, (0, 0))[i]) / (n - 1) for i in (0, 1)] for x in names}
    rows = sorted(((x, round(c, 1), round(us, 1)) for x, (c, us) in per.items()), key=lambda r: -r[2])
    return {
        "kernels": round(sum(r[1] for r in rows), 1),
        "kernel_us": round(sum(r[2] for r in rows), 1),
        "top": rows[:top],
    }


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    cols = (a != b).any(0).nonzero()
    return int(cols[0]) if len(cols) else None


if __name__ == "__main__":
    main()
