"""A dsr1d plugin whose ``before_write`` hook raises (RuntimeError) at the Nth knob write
(``DSR1D_RAISE_AT=N``, 0-based, journal writes not counted): a third-party plugin with a bug."""

from __future__ import annotations

import os

from dsr1d.contract.hookspecs import hookimpl

_knob_writes = 0


@hookimpl
def before_write(target: str, key: str, value: str) -> None:
    global _knob_writes
    if target != "knob":
        return
    n = _knob_writes
    _knob_writes += 1
    if str(n) == os.environ.get("DSR1D_RAISE_AT", "").strip():
        raise RuntimeError(f"plugin bug at knob write {n}")
