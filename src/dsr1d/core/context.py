"""Wiring of the core: hardware root, plugins, profiles, journal and tuner, in one place."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pluggy

from dsr1d.contract.sysroot import SysRoot
from dsr1d.contract.tunable import Tunable
from dsr1d.core.plugin_manager import collect_tunables, make_manager
from dsr1d.core.profiles import ProfileStore, builtin_dir
from dsr1d.core.state import Journal
from dsr1d.core.tuning import Tuner

USER_PROFILES = "etc/dsr1d/profiles"
JOURNAL = "run/dsr1d/state.json"


@dataclass
class Core:
    """Everything the admin commands and the daemon share."""

    root: SysRoot
    pm: pluggy.PluginManager
    tunables: dict[str, Tunable]
    store: ProfileStore
    journal: Journal
    tuner: Tuner


def build_core(root: str | Path = "/", journal: str | Path | None = None,
               profiles_dir: str | Path | None = None) -> Core:
    """A core bound to ``root``; the journal and user profiles default to paths below it."""
    sysroot = SysRoot(root)
    pm = make_manager()
    tunables = collect_tunables(pm)
    schemas = {name: t.options for name, t in tunables.items()}
    user_dir = Path(profiles_dir) if profiles_dir else sysroot.path(USER_PROFILES)
    store = ProfileStore([user_dir, builtin_dir()], schemas)

    def before_write(target: str, key: str, value: str) -> None:
        pm.hook.before_write(target=target, key=key, value=value)

    journal_path = Path(journal) if journal else sysroot.path(JOURNAL)
    jrnl = Journal(journal_path, sysroot.root, lambda path: before_write("journal", path, ""))
    tuner = Tuner(sysroot, tunables, jrnl, before_write)
    return Core(sysroot, pm, tunables, store, jrnl, tuner)
