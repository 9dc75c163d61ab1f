"""fgraph.config: process-wide switches."""


class config:
    """Process-wide switches (JAX's jax_explain_cache_misses / jax_log_compiles are the models)."""

    explain_cache_misses = False  # log, for each new signature, the closest previous one and what differs
    log_captures = False  # log every graph captured
    # FULL graphs copy their batched inputs in themselves (InputBuffers.copy_in_graph): a call pads into pinned
    # memory and replays, with no copy or event of its own: two CUDA calls fewer per call, tens of us of host time
    # each on a busy GPU (docs/performance.md). False: each call copies its inputs and records an event.
    inputs_in_graph = True
    # retraces are bounded and loud (torch's recompile limit is the model): a warning once a function has made this
    # many signatures on its own (capture() not counted), and past max_signatures new ones run eagerly
    warn_signatures = 8
    max_signatures = 64
