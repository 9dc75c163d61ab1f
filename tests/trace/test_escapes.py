"""A module that keeps a value on itself while traced (a lazily made attribute, such as transformers' longrope
`long_inv_freq`): the trace's fake never stays there. The module holds after the trace what it held before, traced
or failed, so its eager calls keep working; the EscapeError says so and names the fix. A call that runs eagerly
anyway (it makes a lazily made cache) makes the value for real, and the next call reads it as an input."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import fgraph
from tests.test_semantics import MODES


class Keeps(torch.nn.Module):
    """Makes `self.scale` from its weight on its first call and keeps it (no register_buffer)."""

    def __init__(self, before=None):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        if before is not None:
            self.scale = before

    def forward(self, x):
        if getattr(self, "scale", None) is None or self.scale.shape != (2,):
            self.scale = self.lin.weight.sum(0)
        return self.lin(x) * self.scale


class KeepsThenFails(Keeps):
    def forward(self, x):
        self.scale = self.lin.weight.sum(0)
        if x.sum() > 0:  # a host sync: the trace fails after storing the value
            return x
        return x * 2


@pytest.mark.parametrize("mode", MODES)
def test_a_value_kept_on_a_module_is_put_back_and_the_error_says_so(mode):
    m = Keeps()
    f = fgraph.jit(m, mode=mode)
    with torch.no_grad(), pytest.raises(fgraph.EscapeError, match=r"into self\.scale;.*\(put back: the module") as e:
        f(torch.ones(1, 2))
    assert "call it once before jitting it" in e.value.fix
    assert "scale" not in vars(m)  # as before the call: the module makes it again when called
    with torch.no_grad():
        want = m(torch.ones(1, 2))  # eagerly: the module makes and keeps a real value
        assert not isinstance(m.scale, FakeTensor)
        for _ in range(3):  # the fix: it holds a real tensor now, which the next call reads as an input
            assert torch.equal(f(torch.ones(1, 2)), want)


def test_an_attribute_the_trace_replaced_gets_its_old_value_back():
    old = torch.ones(3)  # the wrong shape: the module replaces it
    m = Keeps(before=old)
    with torch.no_grad(), pytest.raises(fgraph.EscapeError, match=r"self\.scale"):
        fgraph.jit(m, mode="FULL")(torch.ones(1, 2))
    assert m.scale is old


def test_a_failed_trace_puts_back_what_it_stored_too():
    m = KeepsThenFails()
    with torch.no_grad(), pytest.raises(fgraph.TraceError, match=r"needs the tensor's value on the host"):
        fgraph.jit(m, mode="FULL")(torch.ones(1, 2))
    assert "scale" not in vars(m)
    with torch.no_grad(), fgraph.disable_jit():
        assert torch.equal(m(-torch.ones(1, 2)), -2 * torch.ones(1, 2))


def test_values_left_elsewhere_stay_where_they_went():
    """Only a module's own attributes are put back (their state before the trace is known); a fake in a list it
    holds stays, named by the error (tests/test_semantics_sequences.py: every route)."""

    class Appends(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.acts = []

        def forward(self, x):
            self.acts.append(x * 2)
            return x

    m = Appends()
    with pytest.raises(fgraph.EscapeError, match=r"into self\.acts\[0\]") as e:
        fgraph.jit(m, mode="FULL")(torch.ones(2))
    assert "put back" not in str(e.value) and isinstance(m.acts[0], FakeTensor)
