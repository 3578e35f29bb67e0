"""The project's shape: the console script and the import names DESIGN.md fixes."""

import importlib

from conftest import run_dsr1d


def test_import_names():
    assert importlib.import_module("dsr1d").__version__
    assert importlib.import_module("dsr1d.plugins.thp").Thp.name == "thp"


def test_console_script_help():
    proc = run_dsr1d("--help")
    assert proc.returncode == 0
    for command in ("probe", "list", "apply", "verify", "restore"):
        assert command in proc.stdout
