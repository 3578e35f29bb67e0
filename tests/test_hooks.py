"""The plugin contract: meta-tests over every hookspec (datasette style) and plugin behaviour.

Every hook in ``dsr1d.contract.hookspecs`` must document each parameter, be documented in the
"Plugin hooks" section of docs/tuning.md, and be exercised by some other test file.
"""

from __future__ import annotations

import inspect
import re
import textwrap
from pathlib import Path
from typing import Any

import pluggy
import pytest

import extra_tunable
from conftest import REPO, TESTS, run_dsr1d
from dsr1d.contract import hookspecs
from dsr1d.contract.hookspecs import hookimpl
from dsr1d.core.context import build_core
from dsr1d.core.plugin_manager import PluginError, collect_tunables, make_manager
from dsr1d.plugins.thp import Thp
from fakeroot import FakeRoot, intel_box

HOOKS = sorted(name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
               if hasattr(fn, "dsr1d_spec"))
JOURNAL = "run/dsr1d/state.json"
SWAPPINESS = extra_tunable.SWAPPINESS
WITH_SWAPPY = {"DSR1D_PLUGINS": "extra_tunable"}


# -- meta-tests --------------------------------------------------------------------------------


def test_hookspecs_are_found() -> None:
    pm = pluggy.PluginManager("dsr1d")
    pm.add_hookspecs(hookspecs)
    assert HOOKS
    assert HOOKS == sorted(name for name in vars(pm.hook) if not name.startswith("_"))


@pytest.mark.parametrize("hook", HOOKS)
def test_plugin_hooks_document_every_parameter(hook: str) -> None:
    spec = getattr(hookspecs, hook)
    doc = inspect.getdoc(spec)
    assert doc, f"hookspec {hook} has no docstring"
    assert doc.splitlines()[0].strip(), f"hookspec {hook}: the docstring starts with a blank line"
    for param in inspect.signature(spec).parameters:
        assert re.search(rf"^:param {param}:\s*\S", doc, re.M), \
            f"hookspec {hook}: no ':param {param}:' in its docstring"


TUNING_DOC = REPO / "docs" / "tuning.md"


def _readme_hooks_section() -> str:
    assert TUNING_DOC.is_file(), "docs/tuning.md does not exist yet"
    text = TUNING_DOC.read_text()
    heading = re.search(r"^(#+)\s*Plugin hooks\s*$", text, re.M)
    assert heading, "docs/tuning.md has no 'Plugin hooks' section"
    level = len(heading.group(1))
    end = re.compile(rf"^#{{1,{level}}}\s", re.M).search(text, heading.end())
    return text[heading.end():end.start() if end else len(text)]


@pytest.mark.parametrize("hook", HOOKS)
def test_plugin_hooks_are_documented(hook: str) -> None:
    assert f"{hook}(" in _readme_hooks_section(), \
        f"docs/tuning.md's 'Plugin hooks' section does not document {hook}("


@pytest.mark.parametrize("hook", HOOKS)
def test_plugin_hooks_have_tests(hook: str) -> None:
    word = re.compile(rf"\b{re.escape(hook)}\b")
    files = [p for p in sorted(TESTS.rglob("test_*.py")) if p.name != "test_hooks.py"]
    assert any(word.search(p.read_text()) for p in files), \
        f"no test file under tests/ (besides test_hooks.py) mentions {hook}"


# -- a third-party tunable through DSR1D_PLUGINS ----------------------------------------------


@pytest.fixture
def swap_root(tmp_path: Path) -> FakeRoot:
    fake = intel_box(tmp_path / "root", cpus=2)
    fake.write(SWAPPINESS, "60\n")
    profiles = fake.path / "etc/dsr1d/profiles"
    profiles.mkdir(parents=True)
    (profiles / "lowswap.conf").write_text(
        "[main]\nsummary = balanced, swap less\ninclude = balanced\n[swappy]\nswappiness = 10\n")
    return fake


def dsr1d(root: FakeRoot, *args: str, env: dict[str, str] | None = None, check: bool = False):
    return run_dsr1d(*args, "--root", str(root), env=env, check=check)


def tmp_plugin(directory: Path, name: str, source: str) -> dict[str, str]:
    """Write a plugin module into ``directory``; the environment that makes it importable."""
    (directory / f"{name}.py").write_text(textwrap.dedent(source))
    return {"PYTHONPATH": f"{TESTS}:{directory}"}


def test_extra_tunable_registers_in_process() -> None:
    tunables = collect_tunables(make_manager(extra=("extra_tunable",)))
    assert list(tunables) == ["cpufreq", "cstate", "epb", "prefetcher", "rapl", "swappy", "thp",
                              "turbo", "uncore"]
    assert isinstance(tunables["swappy"], extra_tunable.Swappy)


def test_extra_tunable_shows_in_probe(swap_root: FakeRoot) -> None:
    proc = dsr1d(swap_root, "probe", env=WITH_SWAPPY, check=True)
    row = next(line for line in proc.stdout.splitlines() if line.startswith("swappy "))
    assert re.split(r"\s{2,}", row) == ["swappy", "yes", "swappiness=60",
                                        f"{swap_root.path.resolve()}/{SWAPPINESS}"]
    plain = dsr1d(swap_root, "probe", check=True)
    assert "swappy" not in plain.stdout


def test_extra_tunable_apply_verify_restore(swap_root: FakeRoot) -> None:
    applied = dsr1d(swap_root, "apply", "lowswap", env=WITH_SWAPPY, check=True)
    assert re.search(r"^\s+swappy\s+set .*/proc/sys/vm/swappiness: 60 -> 10$", applied.stdout,
                     re.M)
    assert swap_root.read(SWAPPINESS) == "10"
    assert swap_root.read("sys/devices/system/cpu/cpu1/power/energy_perf_bias") == "6"
    assert dsr1d(swap_root, "verify", env=WITH_SWAPPY).returncode == 0

    swap_root.write(SWAPPINESS, "30\n")
    drift = dsr1d(swap_root, "verify", env=WITH_SWAPPY)
    assert drift.returncode == 1
    assert re.search(r"^swappy\s+\S+/proc/sys/vm/swappiness\s+10\s+30$", drift.stdout, re.M)

    dsr1d(swap_root, "restore", env=WITH_SWAPPY, check=True)
    assert swap_root.read(SWAPPINESS) == "60"
    assert not (swap_root.path / JOURNAL).exists()


def test_restore_needs_no_plugin(swap_root: FakeRoot) -> None:
    """The journal keeps knobs, not plugins: a restore without the plugin loaded still works."""
    dsr1d(swap_root, "apply", "lowswap", env=WITH_SWAPPY, check=True)
    dsr1d(swap_root, "restore", check=True)
    assert swap_root.read(SWAPPINESS) == "60"


def test_profile_section_without_its_plugin_is_an_error(swap_root: FakeRoot) -> None:
    proc = dsr1d(swap_root, "apply", "lowswap")
    assert proc.returncode == 2
    path = swap_root.path.resolve() / "etc/dsr1d/profiles/lowswap.conf"
    assert proc.stderr.startswith(f"dsr1d: {path}:4: unknown section [swappy]")
    assert swap_root.read(SWAPPINESS) == "60"


# -- broken plugins ----------------------------------------------------------------------------


def test_misspelt_hookimpl_exits_2(tmp_path: Path) -> None:
    fake = intel_box(tmp_path / "root", cpus=1)
    env = tmp_plugin(tmp_path, "misspelt", """
        from dsr1d.contract.hookspecs import hookimpl

        @hookimpl
        def register_tunable(register):
            pass
        """)
    before = fake.read("sys/kernel/mm/transparent_hugepage/enabled")
    proc = dsr1d(fake, "apply", "throughput", env={**env, "DSR1D_PLUGINS": "misspelt"})
    assert proc.returncode == 2
    assert proc.stderr.startswith("dsr1d: unknown hook 'register_tunable' in plugin ")
    assert "misspelt" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert fake.read("sys/kernel/mm/transparent_hugepage/enabled") == before
    assert not (fake.path / JOURNAL).exists()


def test_missing_plugin_module_exits_2(fake: FakeRoot) -> None:
    proc = dsr1d(fake, "probe", env={"DSR1D_PLUGINS": "no_such_dsr1d_plugin"})
    assert proc.returncode == 2
    assert proc.stderr.startswith("dsr1d: cannot load plugin 'no_such_dsr1d_plugin'")
    assert "Traceback" not in proc.stderr


def test_two_plugins_with_one_tunable_name_exit_2(tmp_path: Path) -> None:
    fake = intel_box(tmp_path / "root", cpus=1)
    env = tmp_plugin(tmp_path, "other_swappy", """
        from dsr1d.contract.hookspecs import hookimpl
        from extra_tunable import Swappy

        @hookimpl
        def register_tunables(register):
            register(Swappy())
        """)
    proc = dsr1d(fake, "probe", env={**env, "DSR1D_PLUGINS": "extra_tunable,other_swappy"})
    assert proc.returncode == 2
    assert proc.stderr.strip() == "dsr1d: two plugins register a tunable named 'swappy'"


class _Registers:
    """A plugin object registering ``tunable``."""

    def __init__(self, tunable: Any) -> None:
        self.tunable = tunable

    @hookimpl
    def register_tunables(self, register: Any) -> None:
        register(self.tunable)


def test_a_second_builtin_name_is_an_error() -> None:
    pm = make_manager()
    pm.register(_Registers(Thp()))
    with pytest.raises(PluginError, match="two plugins register a tunable named 'thp'"):
        collect_tunables(pm)


class _Nameless:
    summary, options = "", {}


class _Incomplete:
    name, summary, options = "half", "", {}

    def probe(self, root: Any) -> None: ...


@pytest.mark.parametrize("tunable, message", [
    (_Nameless(), "has no name"),
    (_Incomplete(), "tunable 'half' lacks 'read'"),
])
def test_malformed_tunables_are_errors(tunable: Any, message: str) -> None:
    pm = make_manager()
    pm.register(_Registers(tunable))
    with pytest.raises(PluginError, match=message):
        collect_tunables(pm)


@pytest.mark.parametrize("plugins", ["dsr1d.plugins.thp", "extra_tunable,extra_tunable"])
def test_a_plugin_named_twice_is_not_a_traceback(fake: FakeRoot, plugins: str) -> None:
    proc = dsr1d(fake, "probe", env={"DSR1D_PLUGINS": plugins})
    assert "Traceback" not in proc.stderr
    assert proc.returncode in (0, 2)


# -- hooks called by the core ------------------------------------------------------------------


class _Recorder:
    """Takes only some of the hook's arguments, as implementations may."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    @hookimpl
    def before_write(self, target: str, key: str) -> None:
        self.calls.append((target, key))


def test_before_write_sees_journal_before_every_knob(tmp_path: Path) -> None:
    fake = intel_box(tmp_path / "root", cpus=2)
    core = build_core(fake.path)
    recorder = _Recorder()
    core.pm.register(recorder)
    plan = core.tuner.switch(core.store.load("powersave"))
    journal = str(core.journal.path)
    assert recorder.calls[0] == ("journal", journal)
    knobs = [key for target, key in recorder.calls if target == "knob"]
    assert knobs == [change.key for change in plan.writes]
    assert "select:sys/kernel/mm/transparent_hugepage/defrag" in knobs

    recorder.calls.clear()
    restored, errors = core.tuner.restore()
    assert errors == []
    assert [key for target, key in recorder.calls if target == "knob"] == \
           [change.key for change in restored]
