"""The man pages the unit and README point at exist, render, and name every command and key;
dsr1d(8) and dsr1ctl(1) agree with the argparse parsers both ways."""

from __future__ import annotations

import importlib.util
import itertools
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dsr1d.core.config import API_SCHEMA, DAEMON_SCHEMA

REPO = Path(__file__).resolve().parent.parent
PAGES = {"dsr1d.8": "dsr1d", "dsr1ctl.1": "dsr1ctl", "dsr1d.conf.5": "dsr1d.conf",
         "dsr1d-profiles.5": "dsr1d-profiles"}
COMMAND_PAGES = {"dsr1d": "dsr1d.8", "dsr1ctl": "dsr1ctl.1"}
# An option as a page writes it: a dash or two, a letter, not inside a word (R1-Distill).
OPTION = re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*")


def render(page: str) -> str:
    if shutil.which("man") is None:
        pytest.fail("man is needed to render the pages (Debian package man-db)")
    # --nh: no hyphenation, so an option is never split across lines
    proc = subprocess.run(["man", "--nh", "-l", str(REPO / "man" / page)], capture_output=True,
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


def command_tree(prog: str) -> Any:
    """``prog``'s command tree exactly as tools/completion.py reaches it (the ``simulate`` and
    ``model synth|convert|check`` parsers grafted in): its ``render`` swapped for the identity."""
    spec = importlib.util.spec_from_file_location("_completion", REPO / "tools/completion.py")
    assert spec is not None and spec.loader is not None
    completion = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = completion  # dataclasses looks its module up there
    try:
        spec.loader.exec_module(completion)
        completion.render = lambda _prog, root, *_rest: root
        return completion.script(prog)
    finally:
        del sys.modules[spec.name]


def commands_and_options(prog: str) -> tuple[set[str], dict[str, str]]:
    """Every command path ("apply", "model synth"), and every option (-h/--help aside) mapped to
    a command path that has it (for the message)."""
    commands: set[str] = set()
    options: dict[str, str] = {}

    def walk(node: Any, path: str) -> None:
        for option in node.options:
            options.setdefault(option, path)
        for name, sub in node.commands.items():
            commands.add(f"{path} {name}".strip())
            walk(sub, f"{path} {name}".strip())

    walk(command_tree(prog), "")
    options.pop("-h", None)
    options.pop("--help", None)
    return commands, options


def sections(text: str) -> dict[str, str]:
    """A rendered page's sections by heading (SYNOPSIS, COMMANDS, ...)."""
    parts = re.split(r"^([A-Z][A-Z ]*)\n", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def page_commands(prog: str, text: str) -> set[str]:
    """The command paths the page lists: the leading words of each ``prog`` line of its SYNOPSIS
    ("dsr1d model synth --preset ..."; "probe|list|verify" is three), and the first word of each
    entry of its COMMANDS section."""
    paths: set[str] = set()
    for line in sections(text).get("SYNOPSIS", "").splitlines():
        words = line.split()
        if words[:1] != [prog]:
            continue
        lead = list(itertools.takewhile(lambda w: re.fullmatch(r"[a-z][\w|-]*", w), words[1:]))
        for i, word in enumerate(lead):
            paths.update(" ".join([*lead[:i], alternative]) for alternative in word.split("|"))
    for line in sections(text).get("COMMANDS", "").splitlines():
        if entry := re.match(r" {7}([a-z][\w-]*)", line):
            paths.add(entry[1])
    return paths


def page_options(prog: str, text: str) -> set[str]:
    """The options ``prog``'s rendered page names, less those it cites of the other command: an
    option right after that command's name and sub-commands ("dsr1d simulate --csv" in
    dsr1ctl(1), also across a line break)."""
    other, = set(COMMAND_PAGES) - {prog}
    return set(OPTION.findall(re.sub(rf"\b{other}(?:\s+[a-z][\w-]*)*\s+{OPTION.pattern}", "",
                                      text)))


@pytest.mark.parametrize("prog", COMMAND_PAGES)
def test_the_page_names_every_command_and_option_of_the_parsers(prog: str) -> None:
    text = render(COMMAND_PAGES[prog])
    commands, options = commands_and_options(prog)
    missing = sorted(f"{prog} {path}" for path in commands - page_commands(prog, text))
    documented = page_options(prog, text)
    missing += [f"{prog} {path} {option}".replace("  ", " ")
                for option, path in options.items() if option not in documented]
    assert missing == [], f"man/{COMMAND_PAGES[prog]} does not document: {missing}"


@pytest.mark.parametrize("prog", COMMAND_PAGES)
def test_every_command_and_option_the_page_documents_is_in_the_parsers(prog: str) -> None:
    text = render(COMMAND_PAGES[prog])
    commands, options = commands_and_options(prog)
    stale = sorted(page_commands(prog, text) - commands)
    stale += sorted(page_options(prog, text) - set(options) - {"-h", "--help"})
    assert stale == [], f"man/{COMMAND_PAGES[prog]} documents what no parser has: {stale}"
