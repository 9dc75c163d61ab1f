"""Generate with continuous batching: `python -m examples.generate [--model DIR | --preset NAME] ...`.

With neither --model nor --preset it runs an embedded tiny random model (preset "tiny"), so it works on a
fresh CPU machine in seconds; on a GPU it uses CUDA, bf16 and captured graphs. A --model directory is loaded
by its architecture: Llama/Qwen2/Mistral (examples/checkpoint.py) or Qwen2-MoE/Mixtral (examples/qwen2_moe.py),
and --preset takes the presets of both. --tp N runs N tensor-parallel ranks (examples/tp.py), one process each:
spawned here, or the processes of `torchrun --nproc-per-node N -m examples.generate --tp N`. Examples:

  python -m examples.generate --json
  python -m examples.generate --preset qwen2.5-0.5b --num-prompts 64 --max-new-tokens 128 --backend flashinfer
  python -m examples.generate --model ~/Qwen2.5-0.5B-Instruct --prompt "The capital of France is" --greedy
  python -m examples.generate --prompt-ids 1,2,3 --prompt-ids 4,5 --mode PIECEWISE --explain
  python -m examples.generate --preset tiny-moe --moe-backend all2all --explain
  python -m examples.generate --preset llama3-8b --tp 2 --num-prompts 64

Errors (a bad flag, checkpoint or request) print one line on stderr and exit non-zero: 2 for a bad command line,
1 otherwise, 130 on Ctrl-C; --debug shows the traceback instead. With a --seed, a prompt's sampled tokens are the
same whatever else runs with it (every request is seeded with it, as vLLM's SamplingParams.seed).
"""

from __future__ import annotations

import os
import signal
import sys

if __name__ == "__main__":  # Ctrl-C while torch imports (seconds): "interrupted" and 130, as main() promises
    signal.signal(signal.SIGINT, lambda *_: (print("interrupted", file=sys.stderr), sys.stderr.flush(), os._exit(130)))

import argparse
import contextlib
import json
import math

import torch
import torch.distributed as dist

import fgraph

from . import checkpoint, engine, llama, qwen2_moe
from . import tp as tensor_parallel


def _since_start() -> float | None:
    """Seconds since this process started (Linux's /proc; None elsewhere): a start-up phase's time includes the
    interpreter's start and the imports."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks since boot
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - started / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _number(kind, low, high=None, low_open=False):
    """An argparse type: `kind` (int or float) in [low, high) for ints, [low, high] for floats ((low, ... with
    low_open); anything else is a usage error (exit 2) naming the range."""

    def parse(text: str):
        try:
            x = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        bad = x < low or (low_open and x == low) or (high is not None and (x >= high if kind is int else x > high))
        if bad or (kind is float and not math.isfinite(x)):
            lo, hi = "(" if low_open else "[", ")" if kind is int else "]"
            raise argparse.ArgumentTypeError(f"{text} is out of range {lo}{low}, {'inf' if high is None else high}{hi}")
        return x

    parse.__name__ = kind.__name__  # (argparse names the type in its messages)
    return parse


def _device(text: str) -> str:
    try:
        dev = torch.device(text)
    except RuntimeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: CUDA is not available here")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text}: there are {torch.cuda.device_count()} CUDA devices")
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text}: only cpu and cuda are supported")
    return text


def _path(text: str) -> str:
    if not text.strip():  # `--model "$DIR"` with DIR unset: not the embedded model, silently
        raise argparse.ArgumentTypeError("an empty path (an unset shell variable?)")
    return text


RANDOM_TOKENS = 1 << 24  # random prompts made up front, in all: past this a typo would fill the host's memory


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not the usage block: `prog: error: message (see --help)`, exit 2
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(
        prog="python -m examples.generate",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", type=_path, help="Hugging Face model directory (config.json + *.safetensors)")
    src.add_argument(
        "--preset",
        choices=sorted(llama.presets) + sorted(qwen2_moe.presets),
        help="random weights of a known shape (dense or MoE)",
    )
    p.add_argument(
        "--prompt-ids", action="append", default=[], metavar="1,2,3", help="a prompt as token ids (repeatable)"
    )
    p.add_argument(
        "--prompt", action="append", default=[], metavar="TEXT", help="a prompt as text (needs tokenizer.json)"
    )
    p.add_argument("--num-prompts", type=_number(int, 1), default=4, help="random prompts when none is given")
    p.add_argument("--prompt-len", type=_number(int, 1), default=16, help="length of the random prompts")
    p.add_argument("--max-new-tokens", type=_number(int, 1), default=32)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (default: temperature / top-p sampling)")
    p.add_argument("--temperature", type=_number(float, 0.0, 1e4), default=0.8, help="0: greedy")
    p.add_argument("--top-p", type=_number(float, 0.0, 1.0, low_open=True), default=0.95)
    p.add_argument(
        "--seed",
        type=_number(int, 0, 2**64),
        default=0,
        help="seeds the random weights, random prompts and every request's sampling",
    )
    p.add_argument(
        "--backend",
        default="auto",
        help="attention backend: auto, torch, flash_attn, flashinfer, triton, or a DECODE/MIXED pair",
    )
    p.add_argument(
        "--mode",
        default="FULL",
        type=str.upper,
        choices=[m.value for m in fgraph.Mode] + ["EAGER"],
        help="capture mode, or EAGER (no fgraph.jit)",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="compile the graph pieces with Inductor before capture (fgraph.jit(compile=True)); default: on CUDA "
        "unless --mode is NONE or EAGER; --no-compile: graphs of eager's own kernels",
    )
    p.add_argument(
        "--capture-all",
        action="store_true",
        help="capture every bucket a step can be padded to before generating, as a server does (default: each "
        "signature on its first use; tensor-parallel runs always capture up front)",
    )
    p.add_argument("--device", type=_device, help="default: cuda when available, else cpu")
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="default: bfloat16 on cuda, float32 on cpu"
    )
    p.add_argument("--max-seqs", type=_number(int, 1), default=128, help="most requests running at once")
    p.add_argument(
        "--max-batch-tokens", type=_number(int, 1), default=256, help="most tokens in one step (the largest bucket)"
    )
    p.add_argument(
        "--moe-backend",
        default="local",
        choices=["local", "allgather", "all2all"],
        help="MoE models: fgraph.ops.moe backend (expert-parallel ones use the default process group)",
    )
    p.add_argument(
        "--tp", type=_number(int, 1), default=1, help="tensor-parallel ranks, one process each (dense models)"
    )
    p.add_argument("--explain", action="store_true", help="print fgraph.explain of the decode and mixed steps")
    p.add_argument("--json", action="store_true", help='print one JSON object: {"tokens": [[...], ...], ...}')
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--allow-unused-weights", action="store_true", help="load a checkpoint even if some of its tensors go unused"
    )
    p.add_argument("--debug", action="store_true", help="on an error, show the traceback")
    args = p.parse_args(argv)
    try:
        args.prompt_ids = [[int(t) for t in ids.split(",") if t.strip()] for ids in args.prompt_ids]
    except ValueError:
        p.error(f"--prompt-ids {args.prompt_ids}: not comma-separated integers (--prompt-ids 1,2,3)")
    _check_combinations(p, args)
    if args.greedy:
        args.temperature = 0.0
    return args


def _check_combinations(p: _Parser, args) -> None:
    """Flags that each parse but do not go together: a usage error, before anything is built."""
    if args.compile and args.mode in ("EAGER", "NONE"):
        p.error(f"--compile with --mode {args.mode}: nothing is captured, so nothing would be compiled")
    if not (args.prompt_ids or args.prompt) and args.num_prompts * args.prompt_len > RANDOM_TOKENS:
        p.error(
            f"--num-prompts {args.num_prompts} x --prompt-len {args.prompt_len}: more than {RANDOM_TOKENS} random "
            "prompt tokens"
        )
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    spawned = args.tp > 1 and not dist.is_initialized() and "WORLD_SIZE" not in os.environ  # as _main spawns them
    if spawned and device.startswith("cuda"):  # a GPU each
        if device != "cuda":
            p.error(f"--device {device} with --tp {args.tp}: each rank takes its own GPU (pass --device cuda)")
        if torch.cuda.device_count() < args.tp:
            p.error(f"--tp {args.tp}: {torch.cuda.device_count()} CUDA device(s) here, one per rank is needed")


def config_of(args):
    """The model's config alone (no weights): from --model's config.json, or the preset."""
    if args.model:
        if checkpoint.architecture(args.model) in qwen2_moe.ARCHITECTURES:
            return qwen2_moe.read_config(args.model, args.moe_backend)
        return checkpoint.read_config(args.model)
    name = args.preset or "tiny"
    return qwen2_moe.preset(name, moe_backend=args.moe_backend) if name in qwen2_moe.presets else llama.preset(name)


def load_model(args, device: str, dtype: torch.dtype, tp=None):
    """(config, params, eos ids, tokenizer or None) from --model (loader picked by its architecture), --preset or
    the embedded tiny default. Under tensor parallelism: the global config and this rank's shard."""
    if args.model:
        if checkpoint.architecture(args.model) in qwen2_moe.ARCHITECTURES:
            cfg, params = qwen2_moe.load(args.model, dtype, device, args.moe_backend, args.allow_unused_weights)
        elif tp is not None:
            cfg, params = tensor_parallel.load(args.model, tp, dtype, device, args.allow_unused_weights)
        else:
            cfg, params = checkpoint.load(args.model, dtype, device, allow_unused=args.allow_unused_weights)
        return cfg, params, checkpoint.eos_token_ids(args.model), checkpoint.load_tokenizer(args.model)
    name = args.preset or "tiny"
    if name in qwen2_moe.presets:
        cfg = qwen2_moe.preset(name, moe_backend=args.moe_backend)
        return cfg, qwen2_moe.init_params(cfg, dtype, device, seed=args.seed), (), None
    cfg = llama.preset(name)
    params = llama.init_params(cfg, dtype, device, seed=args.seed)  # the same on every rank: one seed
    return cfg, params if tp is None else tensor_parallel.shard_params(params, cfg, tp), (), None


def build_engine(cfg, params, tp=None, **kw) -> engine.Engine:
    """The engine for the model's family: a TPEngine per rank, or the dense / MoE step."""
    if tp is not None:
        return tensor_parallel.build(cfg, params, tp, **kw)
    make_step = qwen2_moe.make_step if isinstance(cfg, qwen2_moe.MoEConfig) else llama.make_step
    return engine.build(cfg, params, make_step=make_step, **kw)


def prompts_of(args, cfg, tokenizer) -> list[list[int]]:
    ids = list(args.prompt_ids)
    if args.prompt:
        if tokenizer is None:
            raise fgraph.FgraphError(
                "--prompt needs a tokenizer.json in the --model directory",
                "pass --prompt-ids instead, or a --model directory with tokenizer.json",
            )
        ids += [tokenizer.encode(t).ids for t in args.prompt]
    if not ids:  # benchmark / demo: random prompts
        g = torch.Generator().manual_seed(args.seed)
        ids = [
            torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(args.num_prompts)
        ]
    return ids


def _rank_main(tp, argv):  # one tensor-parallel rank of a spawned run (module level: spawn pickles it)
    return main(argv, quiet=tp.rank != 0)  # rank 0 speaks for all: the ranks run in lockstep, so fail alike


def main(argv=None, quiet: bool = False) -> dict:
    """Run the command line; a user's error ends it (SystemExit) with one line on stderr, unless --debug."""
    args = parse_args(argv)
    try:
        return _main(args, argv)
    except (Exception, KeyboardInterrupt) as e:
        if args.debug:
            raise
        if isinstance(e, KeyboardInterrupt):
            print("interrupted", file=sys.stderr)
            raise SystemExit(130) from None
        if quiet:
            raise SystemExit(1) from None
        what = f"{e.what} (fix: {e.fix})" if isinstance(e, fgraph.FgraphError) and e.fix else getattr(e, "what", e)
        kind = "" if isinstance(e, fgraph.FgraphError) else f"{type(e).__name__}: "
        print(f"error: {kind}{what} [--debug shows the traceback]".replace("\n", " "), file=sys.stderr)
        raise SystemExit(1) from None


def _main(args, argv) -> dict:
    if args.moe_backend != "local" and not isinstance(config_of(args), qwen2_moe.MoEConfig):
        raise fgraph.FgraphError(
            f"--moe-backend {args.moe_backend}: {args.model or args.preset or 'tiny'} is a dense model (no experts)",
            "drop --moe-backend, or run an MoE model (--preset tiny-moe, a Qwen2-MoE or Mixtral --model)",
        )
    if args.tp > 1 and not dist.is_initialized() and "WORLD_SIZE" not in os.environ:  # not under torchrun
        tensor_parallel.local_config(config_of(args), args.tp)  # a split that cannot work: one error, before spawning
        try:
            return tensor_parallel.launch(_rank_main, args.tp, sys.argv[1:] if argv is None else list(argv))
        except torch.multiprocessing.ProcessExitedException as e:
            rank0 = getattr(e, "exit_codes", [None])[0]
            if rank0 in (1, 2, 130):
                raise SystemExit(rank0) from None  # rank 0 said why, in one line
            raise fgraph.FgraphError(
                f"tensor-parallel rank {e.error_index} of {args.tp} exited with code {e.exit_code}",
                "rerun with --debug to see that rank's traceback",
            ) from None
    phases = {"imports": _since_start()}  # each phase's end, seconds since the process started
    tp = tensor_parallel.init() if args.tp > 1 else None
    if tp is not None and tp.world != args.tp:
        raise fgraph.FgraphError(f"--tp {args.tp} in a process group of {tp.world} ranks", f"pass --tp {tp.world}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if tp is not None and device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"  # this rank's GPU (tp.init set it)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
    cfg, params, eos, tokenizer = load_model(args, device, dtype, tp)
    phases["model"] = _since_start()
    prompts = prompts_of(args, cfg, tokenizer)  # the same on every rank (one seed): ranks must run in lockstep
    max_seqs = min(args.max_seqs, len(prompts))
    # A short run needs no bucket larger than all of its prompts together: fewer signatures to capture.
    max_batch_tokens = max(min(args.max_batch_tokens, sum(map(len, prompts))), max_seqs)
    quiet = tp is not None and tp.rank != 0  # rank 0 speaks for all
    log = open(os.devnull, "w") if quiet else contextlib.nullcontext(sys.stderr if args.json else sys.stdout)
    with log as log, contextlib.redirect_stdout(log):  # --json: stdout carries the JSON object only
        eng = build_engine(
            cfg,
            params,
            tp,
            backend=args.backend,
            mode="eager" if args.mode == "EAGER" else args.mode,
            max_seqs=max_seqs,
            max_seq_len=max(map(len, prompts)) + args.max_new_tokens,
            max_batch_tokens=max_batch_tokens,
            eos_ids=eos,
            seed=args.seed,
            compile=args.compile,
            # each signature captured on its first use, as fgraph.jit does: a short run meets a few of the buckets,
            # and capturing every one up front was most of its start. Tensor-parallel ranks capture up front, in
            # step with each other (their collectives are inside the graphs)
            capture=True if args.capture_all else None if tp is not None else False,
        )
        if args.explain:
            if args.mode == "EAGER":
                print("--explain: nothing to explain in EAGER mode (no fgraph.jit)")
            else:
                for routine in ("decode", "mixed"):
                    print(eng.explain(routine))
    phases["engine"] = _since_start()
    for p in prompts:
        eng.add(p, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    report = eng.run(progress=not (args.no_progress or quiet))
    if None not in phases.values():
        phases["first token"] = phases["engine"] + min(report.ttft)
        phases["done"] = _since_start()
        if not quiet:  # where a start's seconds go: startup_bench records this line
            text = ", ".join(f"{k} {v:.1f} s" for k, v in phases.items())
            print(f"start-up, since the process started: {text}", file=sys.stderr)
    if tp is None and not args.capture_all and args.mode != "EAGER":  # (capture() prints its own line)
        total = eng.step_fn.stats()["total"]
        print(
            f"fgraph: captured {total['captures']} graphs for {len(eng.step_fn.entries)} signatures of the step on "
            f"first use, {total['traces']} traces",
            file=sys.stderr,
        )
    out = {
        "tokens": report.tokens,
        "ttft_s": report.ttft,
        "tpot_s": report.tpot,
        "throughput_tok_s": report.throughput,
        "phases_s": phases,
        "elapsed_s": report.elapsed,
        "steps": report.steps,
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "mode": args.mode,
        "model": args.model or args.preset or "tiny",
        "tp": args.tp,
    }
    if tokenizer is not None:
        out["text"] = [tokenizer.decode(t) for t in report.tokens]
    if quiet:
        return out
    if args.json:
        print(json.dumps(out))
    else:
        for i, (p, t) in enumerate(zip(prompts, report.tokens)):
            shown = repr(out["text"][i]) if tokenizer is not None else t
            print(f"[{i}] {len(p)} prompt tokens -> {shown}")
        print(report.summary())
    return out


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # main() answers Ctrl-C itself from here on
    main()
