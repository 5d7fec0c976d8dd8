"""Run a kernel's @cute.jit helpers as plain Python on ints (CPU, no compile): the device
code itself, not a mirror of it. ``on_host(obj)`` returns a proxy whose @cute.jit methods
(static or bound) are their bodies as written, bound to the proxy so their calls of each
other stay on the host; inside ``python_loops()`` the DSL's ``cutlass.range`` is Python's
``range`` and a module's own @cute.jit functions are their bodies too. Works for
straight-line integer code with ``if``/``while`` (a Python ``if`` on a DSL Int32 holding a
Python value is a Python branch); anything that emits IR (shared memory, shuffles, barriers)
does not run here.

The bodies are compiled anew from the modules' sources with their decorators left off: once
a kernel that uses a helper has been compiled in the process, the DSL's wrapper holds the
preprocessed body (control flow rewritten into IR builders), not the one written.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import sys
import types

import cutlass
from cutlass.base_dsl.typing import Numeric


def as_int(x) -> int:
    """A Python int from an int or a DSL integer holding a Python value."""
    return int(x.value) if isinstance(x, Numeric) else int(x)


@functools.lru_cache(maxsize=None)
def written_function(module_name: str, qualname: str):
    """The function ``qualname`` of ``module_name`` as its source writes it, undecorated,
    its globals the module's (so a name patched there is seen)."""
    module = sys.modules[module_name]
    node = ast.parse(inspect.getsource(module))
    for part in qualname.split("."):
        node = next(n for n in node.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == part)
    node.decorator_list = []
    code = compile(ast.Module(body=[node], type_ignores=[]), module.__file__, "exec")
    space: dict = {}
    exec(code, module.__dict__, space)
    return space[node.name]


class _OnHost:
    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name):
        cls = type(self._obj)
        static = inspect.getattr_static(cls, name, None)
        owner = next((c for c in cls.__mro__ if name in vars(c)), None)
        jit = isinstance(static, staticmethod) and hasattr(static.__func__, "__wrapped__")
        if jit or (static is not None and hasattr(static, "__wrapped__")):
            f = written_function(owner.__module__, f"{owner.__qualname__}.{name}")
            return f if isinstance(static, staticmethod) else types.MethodType(f, self)
        return getattr(self._obj, name)


def on_host(obj):
    """``obj`` with its @cute.jit methods run as Python (see the module docstring)."""
    return _OnHost(obj)


@contextlib.contextmanager
def python_loops(*modules_with_jit_functions):
    """``cutlass.range`` as Python's ``range``, and each named module's module-level @cute.jit
    functions as their written bodies, for the duration."""
    saved = cutlass.range
    patched = []
    cutlass.range = lambda *a, **kw: range(*(as_int(x) for x in a))
    try:
        for mod in modules_with_jit_functions:
            for name, f in list(vars(mod).items()):
                if isinstance(f, types.FunctionType) and hasattr(f, "__wrapped__") and f.__module__ == mod.__name__:
                    patched.append((mod, name, f))
                    setattr(mod, name, written_function(mod.__name__, name))
        yield
    finally:
        cutlass.range = saved
        for mod, name, f in patched:
            setattr(mod, name, f)
