"""What the replay path proves of a callable's lifted tensors (a module's parameters and buffers, globals, cells).

The slow path reads them afresh on every call (`Lifted.values`: a walk over every submodule). The replay path reads
each one where it lives (`module._parameters[name]`: one dict lookup) and proves it is the tensor the last slow call
read, over the same memory. It compares the submodules' training flags and the sizes of their submodule dicts (a
deletion fires no hook; a deleted parameter or buffer is a missing key), and a watched module registering a
parameter, buffer or submodule (torch's global registration hooks) ends every proof.
"""

from __future__ import annotations

import operator
import weakref

import torch
from torch.nn.modules import module as _module

from .._signature import static_key
from ._callable import Lifted
from ._places import reader

_generation = [0]  # bumped whenever a watched module registers a parameter, buffer or submodule
_watched = weakref.WeakSet()  # every module a LiftedView proves (a lifted module and its submodules)
_hooked = []
_getitem, _data_ptr = operator.getitem, torch.Tensor.data_ptr
# a module's training flag, read from its instance dict (Module.__init__ puts it there, train() and `m.training =`
# set it there): an item of a dict, not an attribute found past the class's MRO (half the time a call)
_flag = operator.itemgetter("training")


class _Attr:
    """A module whose `training` is not in its instance dict, read as an attribute where _flag reads an item."""

    __slots__ = ("module",)

    def __init__(self, module):
        self.module = module

    def __getitem__(self, name):
        return getattr(self.module, name, None)


def _bump(module, name, value):
    # Under torch.compile dynamo traces this hook too: transformers' forward slices a ModuleList (a new list, its
    # layers registered into it) each call, and a guard on the counter would recompile that code after every eager
    # registration anywhere. A module no view proves changes no proof.
    if torch.compiler.is_dynamo_compiling() or module not in _watched:
        return
    _generation[0] += 1


def _hook_registrations() -> None:
    if not _hooked:
        _hooked.append(_module.register_module_parameter_registration_hook(_bump))
        _hooked.append(_module.register_module_buffer_registration_hook(_bump))
        _hooked.append(_module.register_module_module_registration_hook(_bump))


class LiftedView:
    """The lifted tensors as the last slow call read them, and a cheap proof that they are unchanged.

    leaves: that call's lifted leaves (as `Lifted.values` gave them, detached), in its order."""

    def __init__(self, lifted: Lifted, leaves: list):
        _hook_registrations()
        # (not the Lifted itself: it holds the function, and a function's cache must not keep it alive)
        self.leaves, self.generation = leaves, _generation[0]
        self.key = None  # the replay path's key part for these leaves' layout (FastPath.remember sets it)
        self.dicts, self.keys = [], []  # per module leaf: the dict holding it, its key there
        for o in lifted.names.values():
            if o.key is None:
                continue
            owner, _, local = o.key.rpartition(".")
            sub = lifted.modules[o.index].module.get_submodule(owner)
            self.dicts.append(sub._parameters if local in sub._parameters else sub._buffers)
            self.keys.append(local)
        self.slots = list(lifted.slots)  # (Place: where each lives)
        # the containers the slots and guards live in, each where it was found (a rebound one: the slow path rescans)
        self.container_readers = [reader(p.kind, p.holder, p.key) for p, _, _ in lifted.containers]
        self.container_values = [v for _, v, _ in lifted.containers]
        self.slot_readers = [reader(p.kind, p.holder, p.key) for p in self.slots]  # (C partials, as the guards')
        # the guarded Python values (Lifted.guards) as the slow call read them, by type and value (static_key)
        self.guards = list(lifted.guards)
        self.guard_readers = [reader(g.kind, g.holder, g.key) for g in self.guards]
        self.guard_values = [read() for read in self.guard_readers]  # the very objects read: proven by identity
        self.guard_keys = list(map(static_key, self.guard_values))
        self.tensors = self._tensors()
        self.slot_values = list(map(operator.call, self.slot_readers))
        self.modules = [sub for lm in lifted.modules for sub in lm.module.modules()]
        _watched.update(self.modules)
        self.flags = [vars(m) for m in self.modules]  # (where each training flag lives)
        try:
            self.training = list(map(_flag, self.flags))
        except KeyError:  # a module whose `training` is not an instance attribute (a property): read as one
            self.flags = [_Attr(m) for m in self.modules]
            self.training = list(map(_flag, self.flags))
        # `del module.sub`, `del layers[i]`, ModuleList.insert: no registration hook; each changes a dict's size
        self.children = [m._modules for m in self.modules]
        self.sizes = list(map(len, self.children))
        # what it re-reads must be what the slow call read, leaf for leaf, each with an address (a tensor subclass
        # may have none): else the caller serves no replay path
        self.whole = len(self.tensors) == len(leaves)
        try:
            self.ptrs = list(map(_data_ptr, self.tensors))
        except Exception:  # noqa: BLE001 (whatever a subclass raises: no proof, so no replay path)
            self.ptrs, self.whole = [], False

    def _tensors(self) -> list:
        """The lifted tensors where they live now (Parameters themselves, not detached)."""
        now = list(map(_getitem, self.dicts, self.keys))
        return now + [v for v in map(operator.call, self.slot_readers) if isinstance(v, torch.Tensor)]

    def proven(self) -> bool:
        """Whether every lifted tensor is the one last read, over the same memory, with the same training flags.

        `.data =`, `.to()` and `.half()` keep a Parameter and put new memory under it: its data_ptr tells.

        Each read is a `map` of a C callable over its objects (one C loop, no bytecode per object: ~600 objects a
        call for a 24-layer HF model); the tensors' pointers are read once their identity is proven."""
        if self.generation != _generation[0]:
            return False
        if self.container_readers and not all(
            map(operator.is_, map(operator.call, self.container_readers), self.container_values)
        ):
            return False
        if self.guards:  # the same objects, else equal by type and value (a float recomputed, an int past 256)
            now = list(map(operator.call, self.guard_readers))
            if not all(map(operator.is_, now, self.guard_values)) and list(map(static_key, now)) != self.guard_keys:
                return False
        if not (self.tensors or self.modules or self.slots):  # (guarded Python values only: nothing more to prove)
            return True
        is_ = operator.is_
        try:
            if not all(map(is_, map(_getitem, self.dicts, self.keys), self.tensors)):
                return False
        except KeyError:  # a parameter deleted
            return False
        if self.slots and not all(map(is_, map(operator.call, self.slot_readers), self.slot_values)):
            return False
        if list(map(_data_ptr, self.tensors)) != self.ptrs:
            return False
        try:
            flags = list(map(_flag, self.flags))
        except KeyError:  # `del m.training`
            return False
        return flags == self.training and list(map(len, self.children)) == self.sizes

    def requires_grad(self) -> bool:
        """Whether any lifted tensor requires grad now (read per call only under grad mode)."""
        return any(t.requires_grad for t in self.tensors)
