"""The profile example in docs/tuning.md (once the README's) is a valid profile, verbatim."""

from __future__ import annotations

import re
from pathlib import Path

from dsr1d.core.context import build_core

README = Path(__file__).resolve().parent.parent / "docs" / "tuning.md"


def test_the_readme_profile_example_parses_and_validates(tmp_path: Path) -> None:
    (block,) = re.findall(r"```ini\n(.*?)```", README.read_text(), re.S)
    user = tmp_path / "profiles"
    user.mkdir()
    (user / "example.conf").write_text(block)
    core = build_core(tmp_path / "root", profiles_dir=user)
    profile = core.store.load("example")
    assert profile.summary == "one line shown by `dsr1d list`"
    assert profile.sections["cstate"]["disable"] and profile.sections["engine"]["backend"]
