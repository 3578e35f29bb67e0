"""The shipped /etc/dsr1d/dsr1d.conf documents every key, and each example in it is valid."""

from __future__ import annotations

import re
from pathlib import Path

from dsr1d.core.config import API_SCHEMA, DAEMON_SCHEMA, load_config

SHIPPED = Path(__file__).resolve().parent.parent / "etc/dsr1d/dsr1d.conf"


def test_every_config_key_is_in_the_shipped_file() -> None:
    keys = set(re.findall(r"^#?(\w+) =", SHIPPED.read_text(), re.M))
    assert keys == set(DAEMON_SCHEMA) | set(API_SCHEMA)


def test_the_shipped_file_parses_with_every_example_uncommented(tmp_path: Path) -> None:
    text = re.sub(r"^#(\w+ =)", r"\1", SHIPPED.read_text(), flags=re.M)
    path = tmp_path / "dsr1d.conf"
    path.write_text(text)
    config = load_config(path)
    assert config.model and config.model.endswith(".gguf")
    assert config.engine_cpus == list(range(16)) and config.engine_ping_timeout_s == 30
    assert load_config(SHIPPED).model is None  # as shipped: no engine until a model is set
    assert (config.api_tcp, config.api_keys_file) == ("127.0.0.1:8080", "/etc/dsr1d/api-keys")
    assert load_config(SHIPPED).api_tcp == ""  # as shipped: the unix socket only


DOCS = Path(__file__).resolve().parent.parent / "docs"
MITIGATION_PAGE = DOCS / "mitigation.md"
BEGIN, END = "<!-- settings:mitigation begin -->\n", "<!-- settings:mitigation end -->\n"


def mitigation_table() -> str:
    """The ``[mitigation]`` keys as docs/mitigation.md lists them, from the controller's own
    settings (type, range, default and help)."""
    from dsr1d.core.efficiency import settings
    rows = ["| key | default | range | what |", "|---|---|---|---|"]
    for name, kind, default, help, lo, hi, unit in settings():
        shown = ("yes" if default else "no") if kind == "bool" else f"{default:g}"
        span = "yes / no" if kind == "bool" else f"{lo:g}..{hi:g} {unit}".strip()
        rows.append(f"| `{name}` | {shown} | {span} | {help} |")
    return "\n".join(rows) + "\n"


def test_every_config_key_is_in_the_docs() -> None:
    text = " ".join(p.read_text() for p in DOCS.glob("*.md"))
    assert [k for k in [*DAEMON_SCHEMA, *API_SCHEMA] if k not in text] == []


def test_the_mitigation_page_lists_every_setting_as_the_controller_defines_it() -> None:
    """DSR1D_WRITE_DOCS=1 rewrites the table from the code."""
    import os
    page = MITIGATION_PAGE.read_text()
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    want = head + BEGIN + mitigation_table() + END + tail
    if os.environ.get("DSR1D_WRITE_DOCS") == "1":
        MITIGATION_PAGE.write_text(want)
    assert page == want, "docs/mitigation.md's settings table differs from the controller's"


MAN_PROFILES = Path(__file__).resolve().parent.parent / "man/dsr1d-profiles.5"
MAN_HEAD = "The tokens-per-joule controller (every key optional; defaults in brackets):\n"


def mitigation_man() -> str:
    """dsr1d-profiles(5)'s ``[mitigation]`` entries, from the controller's own settings."""
    from dsr1d.core.efficiency import settings
    lines = []
    for name, kind, default, help, lo, hi, unit in settings():
        shown = ("yes" if default else "no") if kind == "bool" else f"{default:g}"
        span = "" if kind == "bool" else f", {lo:g}..{hi:g}" + (f" {unit}" if unit else "")
        lines += [".TP", f".B {name}", f"{help} ({kind}{span}) [{shown}]"]
    return "\n".join(lines) + "\n"


def test_the_profiles_man_page_lists_every_setting_as_the_controller_defines_it() -> None:
    """DSR1D_WRITE_DOCS=1 rewrites the section from the code."""
    import os
    page = MAN_PROFILES.read_text()
    head, rest = page.split(MAN_HEAD, 1)
    tail = rest[rest.index(".SH "):]
    want = head + MAN_HEAD + mitigation_man() + tail
    if os.environ.get("DSR1D_WRITE_DOCS") == "1":
        MAN_PROFILES.write_text(want)
    assert page == want, "dsr1d-profiles(5)'s [mitigation] section differs from the controller's"
