"""The journal: original values of every knob dsr1d changed, on disk before the knob changes.

One JSON file (``<root>/run/dsr1d/state.json`` by default), replaced atomically: written to a
temporary file in the same directory, fsynced, renamed over the old one, and the directory
fsynced. It records the root it belongs to, so that a journal made against a test root is never
replayed onto the real machine. A journal that cannot be read is never overwritten.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dsr1d.contract.knobs import knob_from_key

FORMAT = 1


class JournalError(Exception):
    """The journal is corrupt or belongs to another root; it was left untouched."""


class JournalBusy(Exception):
    """Another process (the daemon, or another admin command) owns the journal."""


class OwnerLock:
    """One writer: an exclusive ``flock`` on ``<journal>.lock``, held by the daemon for its
    whole run and by an admin command while it applies or restores. The kernel drops it when
    its holder dies, so a crash never leaves it taken (``ExecStopPost``'s restore gets it).
    The file names its holder, and is removed on release."""

    def __init__(self, journal: Path) -> None:
        self.path = journal.with_name(journal.name + ".lock")
        self._fd: int | None = None

    def acquire(self, who: str) -> None:
        """Take the lock, or JournalBusy naming who holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
                os.close(fd)
                raise JournalBusy(f"{holder or 'another process'} owns "
                                  f"{self.path.with_suffix('')}") from None
            # The holder before us may have removed the file between our open and our lock:
            # then we locked a file nobody else will see; try again on the one at the path.
            if self._same_file(fd):
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{who} (pid {os.getpid()})\n".encode(), 0)
        self._fd = fd

    def _same_file(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def release(self) -> None:
        if self._fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None


@dataclass(frozen=True)
class Original:
    """A knob's value before dsr1d first wrote it."""

    key: str
    tunable: str
    value: str

    @functools.cached_property
    def line(self) -> str:
        """Its line in the journal file (made once: a switch rewrites hundreds of them)."""
        return json.dumps({"key": self.key, "tunable": self.tunable, "value": self.value})


@dataclass
class JournalState:
    """What the journal holds: originals in first-write order, and what is applied now."""

    root: str
    originals: list[Original] = field(default_factory=list)
    profile: str | None = None
    wanted: dict[str, str] = field(default_factory=dict)
    pid: int = 0

    def original(self, key: str) -> Original | None:
        return next((o for o in self.originals if o.key == key), None)

    def copy(self) -> JournalState:
        """An independent copy (originals are immutable, so the list is copied, not them)."""
        return JournalState(self.root, list(self.originals), self.profile, dict(self.wanted),
                            self.pid)

    def to_json(self) -> str:
        """The file's text: one original per line, so that a person can read it in a crisis."""
        head = json.dumps({"format": FORMAT, "root": self.root, "profile": self.profile,
                           "pid": self.pid, "wanted": self.wanted})
        originals = ",\n  ".join(o.line for o in self.originals)
        listed = f"[\n  {originals}\n ]" if self.originals else "[]"
        return f'{head[:-1]},\n "originals": {listed}}}\n'


class Journal:
    """Reads and atomically replaces one journal file."""

    def __init__(self, path: Path, root: Path,
                 before_write: Callable[[str], None] | None = None) -> None:
        self.path = path
        self.root = str(root)
        self._before_write = before_write
        # The state last read or written, and the file's identity then: a switch reads the
        # journal it just wrote without parsing and validating it again.
        self._cached: tuple[tuple[int, int, int], JournalState] | None = None

    def _recover_hint(self) -> str:
        return (f"inspect {self.path}, put the knobs it lists back by hand if needed, then remove "
                f"it (or run `dsr1d restore --discard`)")

    def load(self) -> JournalState | None:
        """The journal's state, None when there is none; JournalError when unusable."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._cached = None
            return None
        except OSError as exc:
            raise JournalError(f"cannot read journal {self.path}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if self._cached and self._cached[0] == _identity(st):
                return self._cached[1].copy()
            raw = _read_all(fd)
        except OSError as exc:
            raise JournalError(f"cannot read journal {self.path}: {exc.strerror}") from None
        finally:
            os.close(fd)
        state = self._parse(raw)
        self._cached = (_identity(st), state.copy())
        return state

    def _parse(self, raw: bytes) -> JournalState:
        try:
            data = json.loads(raw.decode())
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
            state = JournalState(
                root=data["root"],
                originals=[Original(**o) for o in data["originals"]],
                profile=data.get("profile"),
                wanted=dict(data.get("wanted", {})),
                pid=int(data.get("pid", 0)),
            )
            for key in [o.key for o in state.originals] + list(state.wanted):
                knob_from_key(key)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise JournalError(f"journal {self.path} is corrupt ({exc}); it was left as it is: "
                               + self._recover_hint()) from None
        if state.root != self.root:
            raise JournalError(f"journal {self.path} belongs to root {state.root}, not "
                               f"{self.root}; it was left as it is: " + self._recover_hint())
        return state

    def new(self) -> JournalState:
        return JournalState(root=self.root, pid=os.getpid())

    def save(self, state: JournalState) -> None:
        """Replace the journal with ``state``: temporary file, fsync, rename, fsync directory."""
        if self._before_write:
            self._before_write(str(self.path))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._cached = None
        text = state.to_json().encode()
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            written = 0
            while written < len(text):
                written += os.write(fd, text[written:])
            os.fsync(fd)
            identity = _identity(os.fstat(fd))
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        self._cached = (identity, state.copy())
        _fsync_dir(self.path.parent)
        self._remove_stale_temporaries()

    def _remove_stale_temporaries(self) -> None:
        """Temporary files of writers killed between writing and renaming them."""
        for tmp in self.path.parent.glob(f".{self.path.name}.*.tmp"):
            pid = tmp.name.rsplit(".", 2)[-2]
            if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
                tmp.unlink(missing_ok=True)

    def remove(self) -> None:
        """Delete the journal (after everything it lists has been restored)."""
        if self.path.parent.is_dir():
            self._remove_stale_temporaries()
        self._cached = None
        try:
            self.path.unlink()
        except FileNotFoundError:
            return
        _fsync_dir(self.path.parent)


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    # A replace gives the path a new inode, so another writer's journal never matches.
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
