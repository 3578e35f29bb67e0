"""Giving back the zero-filled pages a new llama.cpp context makes resident and does not use yet.

llama.cpp clears a new context's KV cache to zero (``ggml_backend_buffer_clear``, "to avoid NaNs
in the padding"): the whole configured context, for every slot, becomes resident at once —
28 KiB a token for the 1.5B model, 448 MiB at the default 16,384 tokens, times ``parallel``
for the batcher — long before a prompt fills any of it. A private anonymous page that holds
only zeros reads the same after ``madvise(MADV_DONTNEED)``, so the pages that came with the
context and still hold nothing but zeros are given back; they return one 4 KiB page at a time
as the cache fills (``MADV_NOHUGEPAGE`` keeps khugepaged from filling them in again).

Only ranges mapped while the context was made, and the heap, are looked at: weights loaded
before (large buffers, mappings of their own) that happen to hold zeros stay resident, and a
small context's cache, which malloc may put in a hole of the heap, is still found. libc is
called with the GIL held (``PyDLL``), so no Python thread writes in between the check and the
``madvise``; llama.cpp's own threads are idle outside ``llama_decode``. The peak at load stays
(the clear happens inside llama.cpp); what the worker holds while it serves drops. Linux only;
elsewhere nothing is done.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterator
from pathlib import Path

PAGE = mmap.PAGESIZE
CHUNK = 2 << 20          # checked at once; a whole zero chunk is released in one call
MIN_RUN = 16             # pages: a shorter zero run is not worth splitting a mapping for
MADV_DONTNEED = 4
MADV_NOHUGEPAGE = 15

Range = tuple[int, int]   # [start, end) addresses


def _libc() -> ctypes.PyDLL | None:
    try:
        libc = ctypes.PyDLL(None)   # the GIL stays held during these calls
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def anon_ranges(maps: Path = Path("/proc/self/maps"), heap: bool = True) -> list[Range]:
    """The process's private, writable anonymous mappings (and its heap, unless ``heap`` is
    False); [] where unreadable."""
    out = []
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        if len(fields) < 5 or not fields[1].startswith("rw") or fields[1][3] != "p":
            continue
        if len(fields) == 5 or (heap and fields[5] == "[heap]"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.append((start, end))
    return out


def maps_file(path: Path, maps: Path = Path("/proc/self/maps")) -> bool:
    """Whether the process maps ``path`` (a file it reads through its page cache)."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return False
    name = str(Path(path).resolve())
    return any(line.split(maxsplit=5)[5:] == [name] for line in lines)


def new_ranges(before: list[Range], after: list[Range]) -> list[Range]:
    """The parts of ``after`` that ``before`` does not cover (what was mapped in between)."""
    out = []
    for piece in after:
        pieces = [piece]
        for lo, hi in before:
            pieces = [part for start, end in pieces for part in _minus(start, end, lo, hi)]
        out += pieces
    return out


def _minus(start: int, end: int, lo: int, hi: int) -> list[Range]:
    if hi <= start or lo >= end:
        return [(start, end)]
    return [r for r in ((start, lo), (hi, end)) if r[0] < r[1]]


def release_zero_pages(ranges: list[Range]) -> int:
    """Give back the resident pages of ``ranges`` that hold only zeros (in runs of at least
    `MIN_RUN` pages); returns the bytes given back."""
    if _LIBC is None:
        return 0
    freed = 0
    for start, end in ranges:
        for first, last in _resident_runs(start, end):
            for lo, hi in _zero_runs(start, first, last):
                if hi - lo >= MIN_RUN:
                    addr, size = start + lo * PAGE, (hi - lo) * PAGE
                    _LIBC.madvise(addr, size, MADV_NOHUGEPAGE)
                    if _LIBC.madvise(addr, size, MADV_DONTNEED) == 0:
                        freed += size
    return freed


def _resident_runs(start: int, end: int) -> list[Range]:
    """Runs of resident pages in [start, end), as page indexes from ``start``."""
    count = (end - start) // PAGE
    vec = ctypes.create_string_buffer(count)
    assert _LIBC is not None
    if _LIBC.mincore(start, end - start, vec) != 0:
        return []
    runs, first = [], None
    for i, byte in enumerate(vec.raw):
        if byte & 1 and first is None:
            first = i
        elif not byte & 1 and first is not None:
            runs.append((first, i))
            first = None
    if first is not None:
        runs.append((first, count))
    return runs


def _zero_runs(start: int, first: int, last: int) -> Iterator[Range]:
    """Runs of all-zero pages among pages ``first``..``last`` of ``start``, a chunk at a time."""
    run = None
    for lo in range(first, last, CHUNK // PAGE):
        hi = min(last, lo + CHUNK // PAGE)
        if _is_zero(start + lo * PAGE, (hi - lo) * PAGE):
            run = (run[0] if run else lo, hi)
            continue
        for page in range(lo, hi):
            if _is_zero(start + page * PAGE, PAGE):
                run = (run[0] if run else page, page + 1)
            elif run:
                yield run
                run = None
    if run:
        yield run


def _is_zero(addr: int, size: int) -> bool:
    # every byte equals the next and the first is zero: no zero buffer to hold (and keep resident)
    assert _LIBC is not None
    return ctypes.c_char.from_address(addr).value == b"\0" and \
        _LIBC.memcmp(addr, addr + 1, size - 1) == 0


def give_back_zero_pages(since: list[Range]) -> int:
    """Give back the all-zero pages mapped after ``since`` (an `anon_ranges` taken before the
    context was made, without the heap); returns the bytes given back."""
    return release_zero_pages(new_ranges(since, anon_ranges()))
