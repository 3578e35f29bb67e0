"""Benchmark figures into a results page, so that no figure there is typed by hand.

A bench given ``--write PAGE`` renders its table(s) as a block — one heading line naming the
machine, the date (UTC) and the exact command, then the table — and puts it into PAGE between
``<!-- bench:NAME begin -->`` and ``<!-- bench:NAME end -->``. Only that block changes; the rest of
the page is kept byte for byte, and the page is replaced in one rename. A page without the
block gets it appended at its end, with a message saying so (move it where it belongs: the
markers travel with it).

    from results import add_write_option, markdown_table, write
    add_write_option(parser)
    ...
    write(args.write, "NAME", markdown_table(["row", "tok/s"], rows))
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

from dsr1d.cpu import cpu_flags, cpu_model

CPUINFO, MEMINFO = "/proc/cpuinfo", "/proc/meminfo"
NAME = re.compile(r"[a-z0-9][a-z0-9_-]*\Z")
# The labels of a block's heading line: what tests and readers look for.
HEADING = re.compile(r"\*\*machine\*\* (?P<machine>.+) · \*\*date\*\* (?P<date>.+) · "
                     r"\*\*command\*\* (?P<command>`.+`)")


def add_write_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--write", type=Path, metavar="PAGE",
                        help="after the run, also write the table(s) into PAGE (e.g. "
                             "docs/benchmarks.md) between this bench's <!-- bench:NAME --> "
                             "markers, with the machine, date and command")


def cores(path: str = CPUINFO) -> str:
    """``2 cores`` or ``8 cores, 16 threads``: physical cores as (package, core) pairs."""
    pairs, threads, package = set(), 0, ""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = (part.strip() for part in line.partition(":"))
                if key == "processor":
                    threads += 1
                elif key == "physical id":
                    package = value
                elif key == "core id":
                    pairs.add((package, value))
    except OSError:
        pass
    threads = threads or os.cpu_count() or 1
    physical = len(pairs) or threads
    return f"{physical} cores" if physical == threads else f"{physical} cores, {threads} threads"


def isa(path: str = CPUINFO) -> str:
    """The SIMD the kernels care about: AMX, AVX-512 (with VNNI, BF16), AVX2."""
    flags = cpu_flags(path)
    extra = [name for flag, name in (("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16"))
             if flag in flags]
    found = [name for present, name in (
        ("amx_tile" in flags, "AMX"),
        ("avx512f" in flags, "AVX-512" + (f" ({', '.join(extra)})" if extra else "")),
        ("avx2" in flags, "AVX2")) if present]
    return ", ".join(found) or "no AVX2"


def memory(path: str = MEMINFO) -> str:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return f"{int(line.split()[1]) / 2**20:.1f} GiB memory"
    except (OSError, ValueError, IndexError):
        pass
    return "memory unknown"


def machine(cpuinfo: str = CPUINFO, meminfo: str = MEMINFO) -> str:
    """This machine in one line: CPU model, cores, SIMD, memory."""
    return f"{cpu_model(cpuinfo)}, {cores(cpuinfo)}, {isa(cpuinfo)}, {memory(meminfo)}"


def command(argv: Sequence[str] | None = None) -> str:
    """The command line as run, interpreter included as it was typed (``.venv/bin/python``)."""
    if argv is None:
        argv = getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]
    return shlex.join(argv)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def preformatted(text: str) -> str:
    """A fixed-width table as a fenced block."""
    return f"```\n{text.strip(chr(10))}\n```"


def _code(text: str) -> str:
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def render(body: str, argv: Sequence[str] | None = None, now: datetime | None = None,
           where: str | None = None) -> str:
    """A block's content: the heading line (machine, date, command), a blank line, ``body``."""
    date = (now or datetime.now(timezone.utc)).astimezone(timezone.utc)
    heading = (f"**machine** {where or machine()} · **date** {date.strftime('%Y-%m-%dT%H:%M:%SZ')}"
               f" · **command** {_code(command(argv).replace(chr(10), ' '))}")
    return f"{heading}\n\n{body.strip(chr(10))}\n"


def markers(name: str) -> tuple[str, str]:
    if not NAME.match(name):
        raise ValueError(f"block name {name!r}: lower-case letters, digits, - and _ only")
    return f"<!-- bench:{name} begin -->", f"<!-- bench:{name} end -->"


def replace_block(page: Path, name: str, content: str) -> bool:
    """Put ``content`` between NAME's markers in ``page``; True if the block was there, False
    if it was appended. Half a pair, or two of a marker, is an error: nothing is written."""
    begin, end = markers(name)
    text = page.read_bytes().decode() if page.exists() else ""
    if text.count(begin) > 1 or text.count(end) > 1:
        raise ValueError(f"{page}: block {name!r} appears more than once")
    start, stop = text.find(begin), text.find(end)
    if (start < 0) != (stop < 0) or stop < start:
        raise ValueError(f"{page}: the markers of block {name!r} are not a pair in order")
    block = f"{begin}\n{content}\n{end}"
    if start >= 0:
        _atomic_write(page, text[:start] + block + text[stop + len(end):])
        return True
    glue = "" if not text else "\n" if text.endswith("\n") else "\n\n"
    _atomic_write(page, f"{text}{glue}{block}\n")
    return False


def _atomic_write(page: Path, text: str) -> None:
    mode = page.stat().st_mode & 0o7777 if page.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=page.parent, prefix=f".{page.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode())
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, page)
    except BaseException:
        os.unlink(tmp)
        raise


def write(page: Path | None, name: str, body: str) -> None:
    """The bench's table(s) into ``page``'s block ``name``, if a page was given."""
    if page is None:
        return
    if replace_block(page, name, render(body)):
        print(f"wrote block {name!r} into {page}", file=sys.stderr)
    else:
        print(f"{page} had no block {name!r}: appended it at the end; move it (markers "
              f"<!-- bench:{name} begin/end --> included) where it belongs", file=sys.stderr)
