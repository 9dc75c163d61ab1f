"""JAX's own jit tests (tests/api_test.py), translated to fgraph: what jax.jit promises of the jitted object
itself, beside its answers."""

import gc
import weakref

import pytest
import torch

import fgraph

pytestmark = pytest.mark.usefixtures("each_device")  # the CPU, and CUDA on the GPU


def test_jit_reference_dropping():
    """A closed-over tensor lives as long as a function that reads it, plain or jitted, and no longer: the cache of
    a deleted jitted function keeps nothing alive (JAX: test_jit_reference_dropping)."""
    x = torch.ones(10)
    f = (lambda x: lambda: x * 2)(x)  # x in f's closure
    g = fgraph.jit(f)
    x = weakref.ref(x)
    f()
    g()
    g()  # (the replay path's proof of the lifted tensors kept too)
    del f
    gc.collect()
    assert x() is not None  # g still reads it
    torch.testing.assert_close(g(), torch.full((10,), 2.0))
    del g
    gc.collect()
    assert x() is None


def test_jit_wrapped_attributes():
    """The jitted function has the function's name, docstring, annotations and its own attributes, and a jit of it
    again still reads them; its own fields stay its own (JAX: test_jit_wrapped_attributes)."""

    def f(x: torch.Tensor) -> torch.Tensor:
        """docstring of f."""
        return x + 1

    f.some_value = 4
    jf = fgraph.jit(f)
    for attr in ("__doc__", "__name__", "__qualname__", "__module__", "__annotations__"):
        assert getattr(jf, attr) == getattr(f, attr)
    assert jf.some_value == f.some_value == 4
    f.some_value = 5  # read through: what the function holds now
    assert jf.some_value == 5
    jjf = fgraph.jit(jf)
    assert jjf.some_value == 5 and jjf.fn is jf and jjf.options is not jf.options
    assert not hasattr(jf, "missing")
    torch.testing.assert_close(jjf(torch.zeros(2)), torch.ones(2))
