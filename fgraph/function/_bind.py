"""A call's arguments bound to its function's parameters by name, cheaply: the replay path's bind.

`Jitted.bind` binds with inspect (thorough: its TypeError names what is wrong) once per call the slow path serves,
and the keys it learns derive from that `Call`. The replay path and the key of a call that makes donated state must
not pay inspect's bind on every call, so they bind here: the same rules for the calls a plain Python call accepts,
and None for any other (which the slow path then binds, and refuses as Python would)."""

from __future__ import annotations

import inspect

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class Binder:
    """A function's parameters: those a call may pass by position, the defaults, and its `**kwargs` if any."""

    def __init__(self, signature: inspect.Signature):
        params = signature.parameters
        kinds = {p.kind for p in params.values()}
        kw = [k for k, p in params.items() if p.kind is p.VAR_KEYWORD]
        self.varkw = kw[0] if kw else None  # `**kwargs`: the keywords no parameter names, as one dict
        self.names = [k for k in params if k != self.varkw]  # every named parameter, in order
        self.positional = sum(p.kind in _POSITIONAL for p in params.values())  # the first ones, by position
        self.by_position_only = {k for k, p in params.items() if p.kind is p.POSITIONAL_ONLY}
        self.defaults = {k: params[k].default for k in self.names}
        # `*args` is left to inspect (a call's extra positionals are one tuple)
        self.simple = inspect.Parameter.VAR_POSITIONAL not in kinds

    def arguments(self, args: tuple, kwargs: dict) -> dict | None:
        """{parameter: value} for every parameter, defaults included (`**kwargs` as one dict), or None where Python
        would refuse the call or this binder does not bind it (`*args`)."""
        if len(args) > self.positional or not self.simple:
            return None
        names, defaults = self.names, self.defaults
        bound = dict(zip(names, args))
        extra = None
        for k, v in kwargs.items():
            if k in bound:
                return None  # passed twice
            if k not in defaults or k in self.by_position_only:
                if self.varkw is None:
                    return None  # no such parameter
                if extra is None:
                    extra = {}
                extra[k] = v
                continue
            bound[k] = v
        if len(bound) < len(names):
            for k in names:
                if k not in bound:
                    d = defaults[k]
                    if d is inspect.Parameter.empty:
                        return None  # missing
                    bound[k] = d
        if self.varkw is not None:
            bound[self.varkw] = {} if extra is None else extra
        return bound
