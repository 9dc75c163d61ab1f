"""fgraph.config: process-wide switches."""

import os

from ._errors import FgraphError


class _Checked(type):
    """Setting a switch checks its name and kind.

    A misspelt name would otherwise set nothing, and a string where a count goes would be a TypeError inside some
    later call."""

    def __setattr__(cls, name, value):
        now = cls.__dict__.get(name)
        if name.startswith("_") or not isinstance(now, (bool, int)):
            raise FgraphError(
                f"fgraph.config has no switch {name!r}",
                f"the switches are {', '.join(k for k, v in vars(cls).items() if k[0] != '_' and isinstance(v, int))}",
            )
        if isinstance(now, bool) and not isinstance(value, bool):
            raise FgraphError(f"fgraph.config.{name} = {value!r}: {name} is a bool", "set it to True or False")
        if not isinstance(now, bool) and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise FgraphError(
                f"fgraph.config.{name} = {value!r}: {name} is a count",
                f"set it to a non-negative int (now {now})",
            )
        super().__setattr__(name, value)


class config(metaclass=_Checked):
    """Process-wide switches (JAX's jax_explain_cache_misses / jax_log_compiles are the models)."""

    explain_cache_misses = False  # log each new signature: the closest previous one and what differs, or first
    log_captures = False  # log every graph captured
    # FULL graphs copy their batched inputs in themselves (InputBuffers.copy_in_graph): a call pads into pinned
    # memory and replays, with no copy or event of its own: two CUDA calls fewer per call, each costly in host
    # time on a busy GPU (docs/performance.md). False: each call copies its inputs and records an event.
    inputs_in_graph = True
    # compiled pieces (jit(compile=...)) of buckets up to this size are compiled for their own static shapes instead
    # of served by the one symbolic compilation (0: none); explain says which (docs/performance.md: what it measures)
    compile_static_max = 0
    # fgraph.jit's default (no compile= given): a CUDA signature's graph pieces are compiled by Inductor before capture
    # (fusions and fgraph::linear: the speed the README's table shows); elsewhere uncompiled graphs. False: the
    # default is uncompiled graphs everywhere, eager's own kernels, bit for bit the plain function
    compile_cuda = True
    # compiled CUDA pieces run their matmuls of a small weight's transpose as fgraph::linear: at <= 16 rows a
    # no-split-K kernel where it times faster than cuBLAS (fgraph/compile/_small_m.py, fgraph/kernels/_gemv.py;
    # docs/performance.md: what it measures)
    small_m_gemv = True
    # with small_m_gemv: a gated MLP's silu(gate) * up after its fused gate_up matmul runs as fgraph::linear_glu, one
    # kernel where it times faster than the matmul and the activation's launch (docs/performance.md)
    small_m_glu = True
    # with small_m_gemv: 2-3 such matmuls over the same rows (an HF attention's q, k and v projections) run as one
    # fgraph::linears, one launch where it times faster than each alone (docs/performance.md)
    small_m_group = True
    # with small_m_gemv: the RMSNorm (and the residual add before it) that a matmul or fgraph::linear_glu reads runs
    # inside it, as fgraph::norm_linear: one kernel where it times faster than the norm's launch and the matmul's.
    # Off until measured in the decode step (docs/performance.md)
    small_m_norm = False
    # compiled CUDA pieces run a one-query SDPA (a Hugging Face model's decode attention) as fgraph::sdpa_decode: each
    # KV head's keys read once for its query heads, split over the GPU (fgraph/compile/_sdpa.py,
    # fgraph/kernels/_sdpa.py); on: faster than the SDPA call it replaces at every
    # decode size measured (docs/performance.md)
    sdpa_decode = True
    # with sdpa_decode: a compiled piece with two or more fgraph::sdpa_decode calls (a Hugging Face model's decode: no
    # break primitive, one piece of every layer) is compiled in parts cut at those calls, one compilation per
    # distinct part: a deep model's layers are one graph over other weights, where Inductor's time grows with a
    # piece's ops (fgraph/compile/_inductor.py, `_parts`); on: a third off an HF model's first generate, at the
    # decode speed of the piece whole (docs/performance.md). False: such a piece compiled whole
    compile_parts = True
    # the tuners' choices are kept on disk beside Inductor's cache, by GPU, CUDA, torch, Triton and kernel source, and
    # read by later processes instead of timing the keys again (fgraph/kernels/_tuned.py). False: each process times
    tune_cache = True
    # worker processes that compile the tuner's candidate kernels, started as a piece is compiled, so that they
    # compile while Inductor does (and Triton's front end, which holds the GIL, off the parent's threads); what no
    # worker has begun when the tuner asks, its threads compile (fgraph/kernels/_workers.py). 0: the tuner's threads
    # alone, at its first call. Half the CPUs, up to 8
    compile_workers = max(1, min(8, (os.cpu_count() or 2) // 2))
    # fgraph's own Triton kernels of a decode step (fgraph::linear's family, the triton attention's decode and merge)
    # launch with programmatic dependent launch: each may start while the kernel before it runs and waits for it
    # (griddepcontrol.wait) before touching memory, so launches overlap the kernels before them (CUDA graphs keep it
    # as a programmatic edge). Off until measured in the decode step (docs/performance.md)
    pdl = False
    # retraces are bounded and loud (torch's recompile limit is the model): a warning once a function has made this
    # many signatures on its own (capture() not counted, nor another bucket of a signature it has: the declared
    # buckets bound those), and past max_signatures new ones run eagerly
    warn_signatures = 8
    max_signatures = 64
    # fgraph's errors show the user's frames and fgraph's message: torch's and fgraph's frames, and the torch error a
    # trace error was made from, are left out (JAX's traceback filtering). False, or FGRAPH_TRACEBACK_FILTERING=off in
    # the environment: the whole traceback and chain (fgraph/_traceback.py)
    traceback_filtering = True


def pdl_args(t) -> dict:
    """The launch arguments of a Triton kernel that honours fgraph.config.pdl, for a launch on t's device: its `PDL`
    constexpr (on: griddepcontrol.wait before the kernel's first load or store, then launch_dependents) and, on,
    Triton's `launch_pdl`. CUDA only: off elsewhere (Triton's interpreter)."""
    return {"PDL": True, "launch_pdl": True} if config.pdl and t.is_cuda else {"PDL": False}
