"""The layers of the source tree, read from the code's own imports (docs/architecture.md).

Each folder of ``src/dsr1d/`` (the import package ``dsr1d``) is a layer; a module may import only
the layers listed for its own, and the outside libraries that make a layer heavy or bound to
the world (the bus library, torch, llama.cpp, udev, systemd) only where they belong. This test
reads every ``import`` with :mod:`ast`, including imports inside functions, so a shortcut taken
anywhere fails here with the file, the line and the rule it breaks.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"dsr1d": REPO / "src" / "dsr1d"}

# The shared leaves: small modules any layer may use, importing nothing of dsr1d themselves.
SHARED = {"dsr1d", "dsr1d.constants", "dsr1d.cpu", "dsr1d.numa", "dsr1d.table",
          "dsr1d.textstream", "dsr1d.engine_messages"}

# layer -> the layers it may import (besides itself and the shared leaves).
ALLOWED = {
    "shared": set(),
    "contract": set(),
    "core": {"contract"},
    "sim": {"core"},
    "engine": set(),
    "edges": {"contract", "core", "engine", "sim"},
    "client": set(),
    "plugins": {"contract"},
}

# Outside libraries and the only layers (or modules) that may import them.
HEAVY = {
    "dbus_fast": {"dsr1d.edges.dbus_api", "dsr1d.client.cli"},
    "torch": {"engine"},
    "transformers": {"engine"},
    "llama_cpp": {"engine"},
    "pyudev": {"dsr1d.edges.hotplug"},
    "systemd": {"edges"},
    "asyncio": {"edges", "client", "engine"},
}

# Finer rules inside the edges: the engine host speaks to its processes through messages only, and
# the bus adapter serves the core and the engine host, never the engine itself.
FORBIDDEN_MODULES = {
    "dsr1d.edges.engine_host": {"engine"},
    "dsr1d.edges.dbus_api": {"engine", "sim"},
}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    target: str  # what it imports, dotted and absolute
    line: int
    path: Path


def module_name(path: Path, dirs: dict[str, Path]) -> str:
    for package, folder in dirs.items():
        if path.is_relative_to(folder):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            return ".".join([package, *parts])
    raise ValueError(path)


def imports_of(path: Path, dirs: dict[str, Path]) -> list[Import]:
    name = module_name(path, dirs)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [Import(name, alias.name, node.lineno, path) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append(Import(name, target, node.lineno, path))
            # `from dsr1d import core`-style imports name a layer as an attribute.
            out += [Import(name, f"{target}.{alias.name}", node.lineno, path)
                    for alias in node.names if is_module(f"{target}.{alias.name}", dirs)]
    return out


def is_module(dotted: str, dirs: dict[str, Path]) -> bool:
    for package, folder in dirs.items():
        if dotted == package or dotted.startswith(package + "."):
            rel = dotted[len(package):].lstrip(".").split(".") if dotted != package else []
            base = folder.joinpath(*rel)
            return base.with_suffix(".py").exists() or (base / "__init__.py").exists()
    return False


def layer_of(module: str) -> str:
    if module in SHARED:
        return "shared"
    if module.startswith("dsr1d.plugins"):
        return "plugins"
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in ALLOWED:
        return parts[1]
    raise AssertionError(f"{module} is in no layer: put it in a layer folder, or add it to the "
                         f"shared leaves in tests/test_layers.py and docs/architecture.md")


def sources(dirs: dict[str, Path]) -> list[Path]:
    return sorted(p for folder in dirs.values() for p in folder.rglob("*.py"))


def dsr1d_target(target: str, dirs: dict[str, Path]) -> str | None:
    """The dsr1d module an import names (its package when it names a function or class)."""
    if not (target == "dsr1d" or target.startswith("dsr1d.")):
        return None
    while target and not is_module(target, dirs):
        target = target.rpartition(".")[0]
    return target or None


def violations(dirs: dict[str, Path] = PACKAGE_DIRS, repo: Path = REPO) -> list[str]:
    """Every import that breaks a rule, as ``path:line: what``."""
    found = []
    for path in sources(dirs):
        for imp in imports_of(path, dirs):
            rel = imp.path.relative_to(repo)
            own = layer_of(imp.module)
            target = dsr1d_target(imp.target, dirs)
            if target is not None:
                theirs = layer_of(target)
                if theirs not in {own, "shared"} | ALLOWED[own]:
                    found.append(f"{rel}:{imp.line}: {own} imports {target} ({theirs})")
                forbidden = FORBIDDEN_MODULES.get(imp.module, set())
                if theirs in forbidden:
                    found.append(f"{rel}:{imp.line}: {imp.module} must not import {target}")
                continue
            top = imp.target.split(".")[0]
            if top in HEAVY and own not in HEAVY[top] and imp.module not in HEAVY[top]:
                found.append(f"{rel}:{imp.line}: {own} imports {top} "
                             f"(only {', '.join(sorted(HEAVY[top]))} may)")
    return found


def test_every_module_sits_in_a_layer():
    for path in sources(PACKAGE_DIRS):
        layer_of(module_name(path, PACKAGE_DIRS))


def test_no_layer_reaches_where_it_must_not():
    found = violations()
    assert not found, "layer rules broken:\n" + "\n".join(found)


def test_the_shared_leaves_import_nothing_of_dsr1d():
    for path in sources(PACKAGE_DIRS):
        if module_name(path, PACKAGE_DIRS) in SHARED - {"dsr1d"}:
            targets = [dsr1d_target(i.target, PACKAGE_DIRS) for i in imports_of(path, PACKAGE_DIRS)]
            assert not [t for t in targets if t], (path, targets)


@pytest.mark.parametrize("shortcut, rule", [
    ("from dsr1d.edges.dbus_api import Dispatcher\n", "core imports dsr1d.edges.dbus_api"),
    ("import torch\n", "core imports torch"),
    ("from dbus_fast import Message\n", "core imports dbus_fast"),
    ("def f():\n    from dsr1d.client import cli\n", "core imports dsr1d.client"),
])
def test_a_shortcut_from_the_core_is_caught(tmp_path, shortcut, rule):
    """The checker itself: a module that reaches out of the core is reported, with its line."""
    pkg = tmp_path / "src" / "dsr1d"
    core = pkg / "core"
    core.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (core / "__init__.py").write_text("")
    (core / "bad.py").write_text(shortcut)
    for rel in ("edges/dbus_api.py", "client/cli.py", "client/__init__.py", "edges/__init__.py"):
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text("")
    found = violations({"dsr1d": pkg}, tmp_path)
    assert any(rule in v and "src/dsr1d/core/bad.py:" in v for v in found), found


def test_the_readme_names_every_layer():
    section = (REPO / "docs" / "architecture.md").read_text()
    for layer in ALLOWED:
        if layer not in {"shared", "plugins"}:
            assert f"src/dsr1d/{layer}/" in section, layer
    assert "src/dsr1d/plugins/" in section


# The import names of setup.cfg's distributions, where they differ.
IMPORT_NAMES = {"dbus-fast": "dbus_fast", "systemd-python": "systemd"}
# Outside the engine, an extra's library only in the module that offers it (and says so).
EXTRA_MODULES = {"matplotlib": {"dsr1d.client.plot"}}


def base_requirements(repo: Path = REPO) -> set[str]:
    """The import names ``install_requires`` installs (``make install ENGINE=no``)."""
    import configparser
    import re
    cfg = configparser.ConfigParser()
    cfg.read(repo / "setup.cfg")
    names = set()
    for line in cfg["options"]["install_requires"].split("\n"):
        dist = re.split(r"[<>=!~;\[ ]", line.strip(), maxsplit=1)[0]
        if dist:
            names.add(IMPORT_NAMES.get(dist, dist.replace("-", "_")))
    return names


def unlisted_imports(dirs: dict[str, Path] = PACKAGE_DIRS, repo: Path = REPO) -> list[str]:
    """Imports outside the engine of libraries the base install does not carry."""
    import sys
    allowed = base_requirements(repo) | set(sys.stdlib_module_names) | {"dsr1d"}
    found = []
    for path in sources(dirs):
        for imp in imports_of(path, dirs):
            top = imp.target.split(".")[0]
            if layer_of(imp.module) == "engine" or top in allowed \
                    or imp.module in EXTRA_MODULES.get(top, set()):
                continue
            found.append(f"{imp.path.relative_to(repo)}:{imp.line}: {imp.module} imports {top}, "
                         f"which install_requires does not install")
    return found


def test_the_daemon_runs_on_the_base_install():
    """The systemd container installs without the engine extra: a core import of numpy once
    stopped `systemctl start dsr1d` there."""
    found = unlisted_imports()
    assert not found, "\n".join(found)


def test_an_import_the_base_install_lacks_is_caught(tmp_path):
    pkg = tmp_path / "src" / "dsr1d"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "fit.py").write_text("import numpy as np\n")
    (tmp_path / "setup.cfg").write_text((REPO / "setup.cfg").read_text())
    found = unlisted_imports({"dsr1d": pkg}, tmp_path)
    assert found == ["src/dsr1d/core/fit.py:1: dsr1d.core.fit imports numpy, "
                     "which install_requires does not install"], found
