"""The man pages the unit and README point at exist, render, and name every command and key."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dsr1d.core.config import API_SCHEMA, DAEMON_SCHEMA

REPO = Path(__file__).resolve().parent.parent
PAGES = {"dsr1d.8": "dsr1d", "dsr1ctl.1": "dsr1ctl", "dsr1d.conf.5": "dsr1d.conf",
         "dsr1d-profiles.5": "dsr1d-profiles"}


def render(page: str) -> str:
    if shutil.which("man") is None:
        pytest.fail("man is needed to render the pages (Debian package man-db)")
    proc = subprocess.run(["man", "-l", str(REPO / "man" / page)], capture_output=True,
                          text=True, timeout=30, env={"MANWIDTH": "200", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("page, name", PAGES.items())
def test_each_page_renders_with_its_name(page: str, name: str) -> None:
    text = render(page)
    assert re.search(rf"^NAME\n\s+{re.escape(name)} - ", text, re.M), text[:300]


def test_the_unit_documents_pages_that_exist() -> None:
    unit = (REPO / "systemd/dsr1d.service").read_text()
    for name, section in re.findall(r"man:([\w.-]+)\((\d)\)", unit):
        assert (REPO / "man" / f"{name}.{section}").is_file()


def test_the_config_page_names_every_key() -> None:
    text = render("dsr1d.conf.5")
    assert [k for k in [*DAEMON_SCHEMA, *API_SCHEMA] if k not in text] == []


def test_every_mitigation_setting_is_in_the_profiles_page() -> None:
    from dsr1d.core.efficiency import settings

    text = render("dsr1d-profiles.5")
    for name, *_rest in settings():
        assert re.search(rf"^\s*{name}\b", text, re.M), name
