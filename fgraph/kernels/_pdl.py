"""`after_prior`, the first statement of a Triton kernel that honours fgraph.config.pdl (its launch arguments:
`pdl_args`). Importing this module imports Triton: the kernel modules import it on their first use.

A kernel launched with programmatic dependent launch may start while the kernel before it on its stream still runs;
griddepcontrol.wait holds it until that kernel has finished and its writes are visible, so it comes before any load
or store, and launch_dependents then lets the next kernel launch and start its programs while this one runs. Inside
a CUDA graph the launch is captured as a programmatic edge."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def after_prior(PDL: tl.constexpr):
    """With PDL (fgraph.config.pdl: launched with programmatic dependent launch), wait until the kernel before this
    one has finished and its writes are visible, before any load or store; then let the next kernel launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
