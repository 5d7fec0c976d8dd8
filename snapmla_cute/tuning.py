"""Which compiled kernel an API call runs: the table of compiled calls every API module
fetches its kernels from (``launcher``), and the decode's tuning (``DECODE_TUNING``:
DecodeConfig fields beyond the shape, part of every decode step's compile key).

The hot paths look their compiled steps up by shape alone, in tables made by ``hot_table``;
any change of ``DECODE_TUNING`` empties those tables, so the next call compiles anew.
"""

from __future__ import annotations

_launchers: dict = {}
_hot_tables: list = []  # the hot paths' tables of compiled steps (``hot_table``)


def launcher(compile_fn, key: tuple = (), make_config=None):
    """The compiled TVM-FFI callable of a kernel module's ``compile``, looked up once per
    ``key``; ``make_config`` builds its config on the first call (default config without it)."""
    fn = _launchers.get((compile_fn, key))
    if fn is None:
        compiled = compile_fn(make_config()) if make_config is not None else compile_fn()
        fn = _launchers[(compile_fn, key)] = compiled.fn
    return fn


def hot_table() -> dict:
    """A new, empty table of a hot path's compiled steps, keyed without the tuning: every
    change of ``DECODE_TUNING`` empties it."""
    table: dict = {}
    _hot_tables.append(table)
    return table


class _Tuning(dict):
    """DecodeConfig fields beyond the shape (tile/schedule choices, profiling skips). Any
    change drops the hot paths' tables of compiled steps (``hot_table``: dense and
    sparse), so the next call recompiles."""

    def _changed(self):
        for table in _hot_tables:
            table.clear()

    def __setitem__(self, k, v):
        super().__setitem__(k, v)
        self._changed()

    def __delitem__(self, k):
        super().__delitem__(k)
        self._changed()

    def update(self, *a, **kw):
        super().update(*a, **kw)
        self._changed()

    def clear(self):
        super().clear()
        self._changed()

    def pop(self, *a):
        r = super().pop(*a)
        self._changed()
        return r

    def popitem(self):
        r = super().popitem()
        self._changed()
        return r

    def setdefault(self, k, default=None):
        r = super().setdefault(k, default)
        self._changed()
        return r

    def __ior__(self, other):
        self.update(other)
        return self


DECODE_TUNING = _Tuning()
