"""Profiles: INI files, one section per tunable plus ``[main]``, ``[engine]``, ``[mitigation]``.

Built-in profiles ship inside the package (``etc/dsr1d/profiles``); a user directory
(``/etc/dsr1d/profiles``) overrides them by name or adds new ones. ``[main] include = a, b``
inherits from other profiles (later ones and the including file win, key by key); a profile that
includes its own name gets the one it overrides. Every error is reported as ``file:line: reason``
and rejects the whole profile.
"""

from __future__ import annotations

import os
import re
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsr1d.constants import ENGINE_BACKENDS, ENGINE_DTYPES
from dsr1d.contract.schema import Schema, boolean, choice, integer, option, real, word_list
from dsr1d.core.efficiency import settings
from dsr1d.table import clip

SUFFIX = ".conf"
MAX_FILE_BYTES = 1 << 20
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

MAIN_SCHEMA: Schema = {
    "summary": option(str, "one line shown by `dsr1d list`", "text"),
    "include": option(word_list, "profiles to inherit from, in order", "names"),
}
# [engine] and [mitigation] are read by later parts of the daemon; keys known so far.
ENGINE_SCHEMA: Schema = {
    "threads": option(integer(0, 4096), "decode threads (0 = one per physical core)", "count"),
    "dtype": option(choice(*ENGINE_DTYPES),
                    "weight precision (auto = bf16 where the CPU has native bf16)", "name"),
    "backend": option(choice(*ENGINE_BACKENDS),
                      "auto or llamacpp (llama-server; torch is the numerical reference)",
                      "name"),
    "draft_max": option(integer(0, 64), "tokens drafted per step when the daemon has a "
                        "draft_model (read when the engine starts)", "tokens"),
}


def _mitigation_schema() -> Schema:
    """``[mitigation]``: one key per `EfficiencyConfig` setting, typed and described there."""
    schema: Schema = {}
    for name, kind, _default, help, lo, hi, unit in settings():
        if kind == "bool":
            schema[name] = option(boolean, help, "bool")
        elif lo is None or hi is None:
            raise TypeError(f"[mitigation] {name}: a {kind} setting needs its lo and hi")
        elif kind == "int":
            schema[name] = option(integer(int(lo), int(hi)), help, unit or "count")
        else:
            schema[name] = option(real(lo, hi), help, unit or "number")
    return schema


MITIGATION_SCHEMA = _mitigation_schema()
RESERVED_SCHEMAS = {"engine": ENGINE_SCHEMA, "mitigation": MITIGATION_SCHEMA}


class ProfileError(Exception):
    """A profile is malformed: ``file:line: reason``."""

    def __init__(self, file: str | Path, line: int, reason: str) -> None:
        self.file = str(file)
        self.line = line
        self.reason = reason
        self.profile = Path(file).stem      # the profile it rejects (load_all: the one loaded)
        super().__init__(f"{file}:{line}: {reason}")


class UnknownProfile(Exception):
    """No profile has this name."""

    def __init__(self, name: str, available: list[str]) -> None:
        self.name = name
        self.available = available
        super().__init__(f"unknown profile {clip(name)!r}; available: "
                         f"{', '.join(available) or 'none'}")


@dataclass(frozen=True)
class Entry:
    """A raw value and where it was written."""

    value: str
    file: str
    line: int


Sections = dict[str, dict[str, Entry]]


@dataclass
class Profile:
    """A loaded, merged and validated profile."""

    name: str
    path: Path
    summary: str
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)


def builtin_dir() -> Path:
    """Where the built-in profiles are: the checkout's etc/, else the installed share/."""
    checkout = Path(__file__).resolve().parents[3] / "etc" / "dsr1d" / "profiles"
    if checkout.is_dir():
        return checkout
    return Path(sys.prefix) / "share" / "dsr1d" / "profiles"


def parse_ini(path: Path) -> Sections:
    """Parse an INI file keeping ``file:line`` for every value; ProfileError on bad syntax."""
    sections: Sections = {}
    current: dict[str, Entry] | None = None
    text = read_text_file(path)
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            if not line.endswith("]") or len(line) < 3:
                raise ProfileError(path, number, "malformed section header (expected [name])")
            name = line[1:-1].strip()
            if name in sections:
                raise ProfileError(path, number, f"section [{name}] appears twice")
            current = sections[name] = {}
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ProfileError(path, number, "expected 'key = value' or a [section] (the line "
                                             "is not quoted: it may be a secret)")
        if current is None:
            raise ProfileError(path, number, "a key before any [section]")
        key = key.strip()
        if not key:
            raise ProfileError(path, number, "empty key")
        if key in current:
            raise ProfileError(path, number, f"key {key!r} appears twice in its section")
        current[key] = Entry(value.strip(), str(path), number)
    return sections


class ProfileStore:
    """Finds, merges and validates profiles from directories in priority order."""

    def __init__(self, dirs: list[Path], schemas: dict[str, Schema]) -> None:
        self.dirs = dirs
        self.schemas = {"main": MAIN_SCHEMA, **RESERVED_SCHEMAS, **schemas}

    def names(self) -> list[str]:
        """Every profile name, user-defined and built-in."""
        found = {p.stem for d in self.dirs if d.is_dir() for p in d.glob(f"*{SUFFIX}")
                 if p.is_file()}
        return sorted(n for n in found if _NAME.match(n))

    def find(self, name: str, after: Path | None = None) -> Path:
        """The file of profile ``name``; with ``after``, only in directories after that one."""
        dirs = self.dirs
        if after is not None and after in dirs:
            dirs = dirs[dirs.index(after) + 1:]
        if _NAME.match(name):
            for directory in dirs:
                candidate = directory / f"{name}{SUFFIX}"
                if candidate.is_file():
                    return candidate
        raise UnknownProfile(name, self.names())

    def load(self, name: str) -> Profile:
        """Load ``name`` with its includes; ProfileError or UnknownProfile."""
        path = self.find(name)
        sections = self._validate(self._merge(path, chain=()))
        main = sections.pop("main", {})
        return Profile(name, path, main.get("summary", ""), sections)

    def load_all(self) -> tuple[dict[str, Profile], list[ProfileError]]:
        """Every loadable profile, and the errors of those that are not."""
        profiles: dict[str, Profile] = {}
        errors: list[ProfileError] = []
        for name in self.names():
            try:
                profiles[name] = self.load(name)
            except ProfileError as exc:
                exc.profile = name              # the error may sit in a profile it includes
                errors.append(exc)
        return profiles, errors

    def _merge(self, path: Path, chain: tuple[Path, ...]) -> Sections:
        sections = parse_ini(path)
        for name, entries in sections.items():
            if name not in self.schemas:
                known = ", ".join(sorted(self.schemas))
                line = section_line(path, name)
                raise ProfileError(path, line, f"unknown section [{name}] (known: {known})")
        include = sections.get("main", {}).get("include")
        merged: Sections = {} if include is None else self._merge_includes(path, include, chain)
        for section, entries in sections.items():
            own = {k: v for k, v in entries.items() if not (section == "main" and k == "include")}
            merged.setdefault(section, {}).update(own)
        merged.get("main", {}).pop("include", None)
        return merged

    def _merge_includes(self, path: Path, include: Entry, chain: tuple[Path, ...]) -> Sections:
        """The profiles ``path`` includes, merged in order (later ones win, key by key)."""
        merged: Sections = {}
        for parent_name in _include_names(include):
            itself = parent_name == path.stem
            try:
                parent = self.find(parent_name, after=path.parent if itself else None)
            except UnknownProfile as exc:
                reason = (f"include cycle: {parent_name} includes itself (no profile of that name "
                          "below this directory to extend)") if itself else f"include: {exc}"
                raise ProfileError(path, include.line, reason) from None
            if parent in chain or parent == path:
                cycle = " -> ".join(p.stem for p in (*chain, path, parent))
                raise ProfileError(path, include.line, f"include cycle: {cycle}")
            for section, entries in self._merge(parent, chain + (path,)).items():
                merged.setdefault(section, {}).update(entries)
        return merged

    def _validate(self, merged: Sections) -> dict[str, dict[str, Any]]:
        return {section: validate_section(section, entries, self.schemas[section])
                for section, entries in merged.items()}


def validate_section(section: str, entries: dict[str, Entry], schema: Schema) -> dict[str, Any]:
    """Typed values of one section, or a ProfileError at the ``file:line`` of the bad entry.

    The one validator of the INI dialect: profiles and ``dsr1d.conf`` both go through it."""
    values: dict[str, Any] = {}
    for key, entry in entries.items():
        if key not in schema:
            known = ", ".join(sorted(schema)) or "none"
            raise ProfileError(entry.file, entry.line,
                               f"[{section}] unknown key {key!r} (known: {known})")
        try:
            values[key] = schema[key].parse(entry.value)
        except ValueError as exc:
            raise ProfileError(entry.file, entry.line, f"[{section}] {key}: {exc}") from None
    return values


def _include_names(include: Entry) -> list[str]:
    try:
        return word_list(include.value)
    except ValueError:
        raise ProfileError(include.file, include.line, "include: expected profile names") from None


def read_text_file(path: Path, limit: int = MAX_FILE_BYTES) -> str:
    """A configuration or profile file's text: a regular file (never a FIFO, a device or a
    directory, which could hang the daemon or feed it forever), at most ``limit`` bytes, UTF-8,
    no NUL byte. ProfileError says what is wrong without quoting the content."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ProfileError(path, 0, f"cannot read: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ProfileError(path, 0, "not a regular file")
        if info.st_size > limit:
            raise ProfileError(path, 0, f"larger than {limit} bytes")
        data = os.read(fd, limit + 1)
    except OSError as exc:
        raise ProfileError(path, 0, f"cannot read: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ProfileError(path, 0, f"larger than {limit} bytes")
    if b"\0" in data:
        raise ProfileError(path, 0, "contains a NUL byte")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProfileError(path, 0, f"not UTF-8 text (byte {exc.start})") from None


def section_line(path: Path, section: str) -> int:
    for number, line in enumerate(read_text_file(path).splitlines(), start=1):
        text = line.strip()
        if text.startswith("[") and text.endswith("]") and text[1:-1].strip() == section:
            return number
    return 0
