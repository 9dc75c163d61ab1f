"""fgraph.config.pdl: fgraph's own Triton kernels of a decode step launch with programmatic dependent launch, so a
kernel may start while the one before it runs. Each waits for that kernel (griddepcontrol.wait) before it touches
memory: read from the kernels' source and from the PTX Triton compiles for sm_90, on the CPU; on the GPU, chains of
them inside CUDA graphs give the bits they give without PDL."""

import ast
import os
import pathlib
import types

import pytest
import torch

import fgraph
from fgraph.extend import pdl_args
from fgraph.kernels import _gemv

ROOT = pathlib.Path(fgraph.__file__).parent
# the kernels that take a PDL constexpr, by source file
PDL_KERNELS = {
    "kernels/_gemv_kernels.py": {"gemv", "glu", "add_rms_norm", "gemv_group"},
    "ops/_attn_triton_kernels.py": {"decode", "merge"},
}


def test_pdl_is_off_by_default_and_asks_triton_for_programmatic_launch_on_cuda_only(monkeypatch):
    cuda, cpu = types.SimpleNamespace(is_cuda=True), torch.zeros(1)
    assert fgraph.config.pdl is False and pdl_args(cuda) == {"PDL": False}
    monkeypatch.setattr(fgraph.config, "pdl", True)
    assert pdl_args(cuda) == {"PDL": True, "launch_pdl": True}
    assert pdl_args(cpu) == {"PDL": False}  # (Triton's interpreter: no device-side wait to make)


@pytest.mark.parametrize("path", PDL_KERNELS)
def test_every_pdl_kernel_waits_for_the_kernel_before_it_before_its_first_load_or_store(path):
    """A load or store before the wait could read what the kernel before it has not yet written (or write under its
    reads): the wait is each kernel's first statement, its docstring aside."""
    tree = ast.parse((ROOT / path).read_text())
    jitted = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef) and "PDL" in [a.arg for a in f.args.args]}
    assert set(jitted) == PDL_KERNELS[path]
    for name, f in jitted.items():
        body = f.body[1:] if isinstance(f.body[0], ast.Expr) and isinstance(f.body[0].value, ast.Constant) else f.body
        assert ast.unparse(body[0]) == "after_prior(PDL)", name


def _ptx(fn, types: dict, constexprs: dict, pdl: bool, **options) -> tuple[str, bool]:
    """fn compiled for sm_90 (no GPU needed: Triton's own ptxas) with PDL as given -> (its PTX, launch_pdl)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    constexprs = {**constexprs, "PDL": pdl}
    signature = {
        n: "constexpr" if n in constexprs else types.get(n, "*bf16" if n.endswith("_ptr") else "i32") for n in names
    }
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "launch_pdl": pdl, **options})
    return k.asm["ptx"], k.metadata.launch_pdl


def _first_global_access(ptx: str) -> int:
    return min(i for i in (ptx.find(op) for op in ("ld.global", "st.global", "cp.async", "atom.")) if i >= 0)


GEMV = dict(HAS_BIAS=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, DOT=True, SPLIT=True, MAX_SPLITS=8, GLU=False,
            NORM=True, HAS_RES=True)  # fmt: skip
DECODE = dict(G=7, BLOCK_G=16, D=64, PAGE=16, BLOCK_N=64, SPLITS=16, SPLITS_P2=16, LAST_MERGES=True,
              PART_CACHE=".wt", ROPE=True, PRECISION="tf32", UPCAST=False, PTX=True)  # fmt: skip


GROUP = dict(HAS_BIAS=True, BLOCK_M=1, BLOCK_N=8, BLOCK_K=512, DOT=False)
GROUP_TYPES = {n: "*bf16" for n in ("x_ptr", "w0", "w1", "w2", "b0", "b1", "b2", "y0", "y1", "y2")}


@pytest.mark.parametrize("kernel", ["gemv", "decode", "gemv_group"])
def test_pdl_kernels_compile_for_sm90_with_the_wait_before_any_global_access_and_without_it_when_off(kernel):
    """What the device runs, read from the PTX: on, griddepcontrol.wait precedes every global load, store, async
    copy and atomic (the split's counters), and the launch asks for PDL; off, no griddepcontrol at all."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("Triton's interpreter compiles nothing to PTX")
    from fgraph.kernels import _gemv_kernels
    from fgraph.ops import _attn_triton_kernels

    fn, consts, types = {
        "gemv": (_gemv_kernels.gemv, GEMV, {"eps": "fp32", "ws_ptr": "*fp32", "lock_ptr": "*i32"}),
        "decode": (_attn_triton_kernels.decode, DECODE, {"qk_scale": "fp32", "part_ptr": "*fp32", "lse_ptr": "*fp32",
                   "lock_ptr": "*i32", "seq_lens_ptr": "*i32", "bt_ptr": "*i32", "slot_ptr": "*i64"}),
        "gemv_group": (_gemv_kernels.gemv_group, GROUP, GROUP_TYPES),
    }[kernel]  # fmt: skip
    ptx, launch = _ptx(fn, types, consts, pdl=True)
    assert launch and ptx.find("griddepcontrol.wait") < _first_global_access(ptx)
    assert "griddepcontrol.launch_dependents" in ptx
    ptx, launch = _ptx(fn, types, consts, pdl=False)
    assert not launch and "griddepcontrol" not in ptx


# -- on the GPU ------------------------------------------------------------------------------------------------
def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8])
def test_a_chain_of_fgraph_kernels_with_pdl_replays_the_bits_it_gives_without(rows, monkeypatch):
    """0.5B's MLP as fgraph's kernels, each reading the one before: the norm (with the residual add), gate_up with
    its activation, down with K split over 8 programs (the split's counters and partials), inside one CUDA graph."""
    if _gemv.kernel() is None or not torch.cuda.is_available():
        pytest.skip("needs CUDA and Triton")
    x, r, nw = rand(rows, 896), rand(rows, 896, seed=1), 1 + rand(896, seed=2) / 8
    w13, w2 = rand(2 * 4864, 896, seed=3) / 30, rand(896, 4864, seed=4) / 70
    glu_cfg, down_cfg = (64, 128, 4, 3, True, 1), (64, 128, 4, 3, True, 8)

    def mlp():
        s, h = _gemv.add_rms_norm(x, r, nw, 1e-6)
        g = torch.empty(rows, 4864, dtype=x.dtype, device="cuda")
        _gemv._launch(glu_cfg, h, w13, None, g, glu=True)
        y = torch.empty(rows, 896, dtype=x.dtype, device="cuda")
        _gemv._launch(down_cfg, g, w2, None, y)
        return y + s

    want = []
    for seed in range(3):
        x.copy_(rand(rows, 896, seed=10 + seed))
        want.append(mlp())
    monkeypatch.setattr(fgraph.config, "pdl", True)
    mlp()  # compiles the PDL variants outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mlp()
    for _ in range(2):
        for seed in range(3):
            x.copy_(rand(rows, 896, seed=10 + seed))
            graph.replay()
            torch.testing.assert_close(out, want[seed], rtol=0, atol=0)
