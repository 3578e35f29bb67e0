"""The plugin contract of dsr1d (pluggy project name ``dsr1d``).

Built-in plugins (``dsr1d.plugins.*``) and third-party ones (entry-point group ``dsr1d``, or
modules named in ``DSR1D_PLUGINS``) implement these hooks alike. Hooks are called with keyword
arguments; an implementation may accept only the arguments it needs.
"""

from __future__ import annotations

from typing import Callable

import pluggy

hookspec = pluggy.HookspecMarker("dsr1d")
hookimpl = pluggy.HookimplMarker("dsr1d")


@hookspec
def register_tunables(register: Callable[[object], None]) -> None:
    """Register the tunables this plugin provides.

    Called once when the plugin manager is built.

    :param register: call it with each tunable object (see :class:`dsr1d.contract.tunable.Tunable`);
        registering a second tunable with a name already taken is an error.
    """


@hookspec
def before_write(target: str, key: str, value: str) -> None:
    """Called just before the core writes the journal or a knob.

    For audit logs, and for tests that stop the process at every step of an apply. An
    implementation must not raise and should return quickly: the write waits for it.

    :param target: ``"journal"`` (the state file is about to be replaced) or ``"knob"``.
    :param key: the knob's journal key (``select:sys/kernel/mm/transparent_hugepage/enabled``),
        or the journal's path when ``target`` is ``"journal"``.
    :param value: the value about to be written (empty for the journal).
    """


@hookspec
def register_telemetry_sources(register: Callable[[object], None]) -> None:
    """Register the telemetry sources this plugin provides.

    Called once when the plugin manager is built. A source has ``name``, ``probe(root)`` ->
    ``Support`` (available here or not, and why), ``start(root)`` / ``stop()`` for sources that
    own a subprocess or file handles, and ``read(root, now)`` -> ``{key_with_unit: value}``
    with what it measured since the last read; a value it cannot measure is left out, never
    invented (see :mod:`dsr1d.contract.telemetry`).

    :param register: call it with each source object; a second source with a name already
        taken is an error.
    """
