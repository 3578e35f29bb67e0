"""The plugin manager: built-in plugins, entry-point plugins, and ``DSR1D_PLUGINS``.

``DSR1D_TRACE_PLUGINS=1`` prints every hook call and result to stderr.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Mapping, Sequence

import pluggy

from dsr1d.contract import hookspecs
from dsr1d.contract.tunable import Tunable

DEFAULT_PLUGINS = (
    "dsr1d.plugins.epb",
    "dsr1d.plugins.cstate",
    "dsr1d.plugins.prefetcher",
    "dsr1d.plugins.thp",
    "dsr1d.plugins.powerlimit",
    "dsr1d.plugins.turbo",
    "dsr1d.plugins.cpufreq",
    "dsr1d.plugins.uncore",
    "dsr1d.plugins.turbostat",
    "dsr1d.plugins.rapl",
    "dsr1d.plugins.thermal",
    "dsr1d.plugins.procstat",
)
ENTRY_POINT_GROUP = "dsr1d"


class PluginError(Exception):
    """A plugin could not be loaded or broke the contract."""


def make_manager(extra: tuple[str, ...] = ()) -> pluggy.PluginManager:
    """A plugin manager with the built-ins, entry points, ``DSR1D_PLUGINS`` and ``extra``."""
    pm = pluggy.PluginManager("dsr1d")
    pm.add_hookspecs(hookspecs)
    env = tuple(m for m in os.environ.get("DSR1D_PLUGINS", "").split(",") if m.strip())
    for name in dict.fromkeys(n.strip() for n in DEFAULT_PLUGINS + env + extra):
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise PluginError(f"cannot load plugin {name!r}: {exc}") from exc
        if pm.is_registered(module):
            continue
        pm.register(module, name=name)
    pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(str(exc)) from exc
    if os.environ.get("DSR1D_TRACE_PLUGINS"):
        _enable_tracing(pm)
    return pm


def _enable_tracing(pm: pluggy.PluginManager) -> None:
    def before(hook_name: str, impls: Sequence[pluggy.HookImpl],
               kwargs: Mapping[str, Any]) -> None:
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        names = ", ".join(impl.plugin_name for impl in impls)
        print(f"dsr1d trace: {hook_name}({args}) -> [{names}]", file=sys.stderr)

    def after(outcome: pluggy.Result[Any], hook_name: str, impls: Sequence[pluggy.HookImpl],
              kwargs: Mapping[str, Any]) -> None:
        if outcome.exception is not None:
            print(f"dsr1d trace: {hook_name} raised {outcome.exception!r}", file=sys.stderr)

    pm.add_hookcall_monitoring(before, after)


def collect(pm: pluggy.PluginManager, hook: str, what: str,
            required: tuple[str, ...]) -> dict[str, Any]:
    """Call registration hook ``hook``; every object registered by name, once, with
    ``required`` attributes, else PluginError (a broken plugin stops start-up with a reason)."""
    found: dict[str, Any] = {}

    def register(obj: Any) -> None:
        name = getattr(obj, "name", None)
        if not isinstance(name, str) or not name:
            raise PluginError(f"{what} {obj!r} has no name")
        if name in found:
            raise PluginError(f"two plugins register a {what} named {name!r}")
        for attr in required:
            if not hasattr(obj, attr):
                raise PluginError(f"{what} {name!r} lacks {attr!r}")
        found[name] = obj

    getattr(pm.hook, hook)(register=register)
    return found


def collect_tunables(pm: pluggy.PluginManager) -> dict[str, Tunable]:
    """Every registered tunable by name, sorted by name (the order they are applied in)."""
    tunables = collect(pm, "register_tunables", "tunable",
                       ("summary", "options", "probe", "read", "apply"))
    return dict(sorted(tunables.items()))
