"""Run a kernel's @cute.jit helpers as plain Python on ints (CPU, no compile): the device
code itself, not a mirror of it. ``on_host(obj)`` returns a proxy whose @cute.jit methods
(static or bound) are their undecorated bodies, bound to the proxy so their calls of each
other stay on the host; inside ``python_loops()`` the DSL's ``cutlass.range`` is Python's
``range``. Works for straight-line integer code with ``if``/``while`` (a Python ``if`` on a
DSL Int32 holding a Python value is a Python branch); anything that emits IR (shared memory,
shuffles, barriers) does not run here."""

from __future__ import annotations

import contextlib
import inspect
import types

import cutlass
from cutlass.base_dsl.typing import Numeric


def as_int(x) -> int:
    """A Python int from an int or a DSL integer holding a Python value."""
    return int(x.value) if isinstance(x, Numeric) else int(x)


def _raw(f):
    return getattr(f, "__wrapped__", f)


class _OnHost:
    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name):
        static = inspect.getattr_static(type(self._obj), name, None)
        if isinstance(static, staticmethod):
            return _raw(static.__func__)
        if static is not None and hasattr(static, "__wrapped__"):
            return types.MethodType(static.__wrapped__, self)
        return getattr(self._obj, name)


def on_host(obj):
    """``obj`` with its @cute.jit methods run as Python (see the module docstring)."""
    return _OnHost(obj)


@contextlib.contextmanager
def python_loops(*modules_with_jit_functions):
    """``cutlass.range`` as Python's ``range``, and each named module's module-level @cute.jit
    functions as their bodies, for the duration."""
    saved = cutlass.range
    patched = []
    cutlass.range = lambda *a, **kw: range(*(as_int(x) for x in a))
    try:
        for mod in modules_with_jit_functions:
            for name, f in list(vars(mod).items()):
                if isinstance(f, types.FunctionType) and hasattr(f, "__wrapped__"):
                    patched.append((mod, name, f))
                    setattr(mod, name, f.__wrapped__)
        yield
    finally:
        cutlass.range = saved
        for mod, name, f in patched:
            setattr(mod, name, f)
