"""Giving back zero-filled pages: on real anonymous memory of this process (residency read back
with mincore), and on the tiny model's KV cache as llama.cpp makes it."""

from __future__ import annotations

import ctypes
import json
import mmap
import subprocess
import sys
from pathlib import Path

import pytest

from dsr1d.engine import pages

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def _resident(addr: int, size: int) -> list[bool]:
    vec = ctypes.create_string_buffer(size // PAGE)
    assert _libc.mincore(addr, size, vec) == 0
    return [bool(b & 1) for b in vec.raw]


@pytest.fixture
def area() -> tuple[mmap.mmap, int]:
    """128 pages of private anonymous memory, every page touched: zeros, with data in pages
    40 and 100..103."""
    size = 128 * PAGE
    mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for page in range(128):
        mem[page * PAGE] = 0        # a write makes the page resident
    mem[40 * PAGE + 7] = 0x5A
    mem[100 * PAGE:104 * PAGE] = bytes(range(256)) * (4 * PAGE // 256)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    yield mem, addr
    mem.close()


def test_zero_pages_are_given_back_and_still_read_as_zeros(area) -> None:
    mem, addr = area
    data = bytes(mem[:])
    assert all(_resident(addr, len(mem)))

    freed = pages.release_zero_pages([(addr, addr + len(mem))])

    resident = _resident(addr, len(mem))
    kept = [i for i, r in enumerate(resident) if r]
    assert kept == [40, 100, 101, 102, 103]     # the pages with data, nothing else
    assert freed == (128 - 5) * PAGE
    assert bytes(mem[:]) == data                # every byte reads as before


def test_short_zero_runs_between_data_stay_resident(area) -> None:
    mem, addr = area
    for page in range(0, 128, 8):               # data every 8th page: zero runs of 7 pages
        mem[page * PAGE + 1] = 1
    pages.release_zero_pages([(addr, addr + len(mem))])
    assert all(_resident(addr, len(mem)))


def test_pages_written_again_after_being_given_back_hold_the_new_data(area) -> None:
    mem, addr = area
    pages.release_zero_pages([(addr, addr + len(mem))])
    mem[5 * PAGE:5 * PAGE + 3] = b"abc"
    assert mem[5 * PAGE:5 * PAGE + 3] == b"abc"
    assert _resident(addr, len(mem))[5]


def test_only_ranges_mapped_in_between_are_new() -> None:
    before = [(0x1000, 0x5000), (0x9000, 0xA000)]
    after = [(0x1000, 0x8000), (0x9000, 0xA000), (0xB000, 0xC000)]
    assert pages.new_ranges(before, after) == [(0x5000, 0x8000), (0xB000, 0xC000)]
    assert pages.new_ranges(after, after) == []


def test_anonymous_ranges_come_from_proc_maps(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "55d0a0000000-55d0a0021000 rw-p 00000000 00:00 0          [heap]\n"
        "7f0000000000-7f0000400000 rw-p 00000000 00:00 0 \n"
        "7f0000400000-7f0000401000 r--p 00000000 00:00 0 \n"
        "7f0000500000-7f0000600000 rw-s 00000000 00:01 7          /dev/zero (deleted)\n"
        "7f0000600000-7f0000700000 rw-p 00001000 08:01 42         /usr/lib/libfoo.so\n"
        "7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0          [stack]\n")
    assert pages.anon_ranges(maps) == [(0x55D0A0000000, 0x55D0A0021000),
                                       (0x7F0000000000, 0x7F0000400000)]
    assert pages.anon_ranges(maps, heap=False) == [(0x7F0000000000, 0x7F0000400000)]
    assert pages.anon_ranges(tmp_path / "missing") == []


def test_a_file_is_mapped_only_where_proc_maps_names_it(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    maps = tmp_path / "maps"
    maps.write_text(f"7f0000000000-7f0000400000 r--p 00000000 08:01 42         {model}\n"
                    f"7f0000600000-7f0000700000 rw-p 00001000 08:01 43         {model}.bak\n")
    assert pages.maps_file(model, maps)
    assert not pages.maps_file(tmp_path / "other.gguf", maps)
    assert not pages.maps_file(model, tmp_path / "missing")
    with model.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ):
        assert pages.maps_file(model)       # this process, as /proc/self/maps shows it


def _zeros(pages_: int) -> tuple[mmap.mmap, int]:
    mem = mmap.mmap(-1, pages_ * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for page in range(pages_):
        mem[page * PAGE] = 0
    return mem, ctypes.addressof(ctypes.c_char.from_buffer(mem))


def test_only_what_making_the_context_mapped_is_given_back() -> None:
    """Weights that happen to be zeros were loaded before the context: they stay resident."""
    pytest.importorskip("llama_cpp")
    from dsr1d.engine.llama_backend import new_context

    weights, weights_addr = _zeros(64)
    made: list[tuple[mmap.mmap, int]] = []

    def make(model: object, params: object) -> str:   # stands in for llama_init_from_model
        made.append(_zeros(64))
        return "ctx"

    ctx, size = new_context(None, None, make)
    kv, kv_addr = made[0]
    assert ctx == "ctx" and size >= 64 * PAGE
    assert not any(_resident(kv_addr, len(kv)))
    assert all(_resident(weights_addr, len(weights)))
    assert new_context(None, None, lambda model, params: None) == (None, 0)


# Run in a process of its own with the worker's environment, as the worker loads a model.
KV_SCRIPT = """
import json, sys
from pathlib import Path
from dsr1d.engine import llama_backend
from dsr1d.engine.llama_batch import Batcher
gen = llama_backend.load(Path(sys.argv[1]), threads=2, context=4096)
info = gen.info
kv = 2 * info.block_count * gen.context * info.head_count_kv * info.head_dim * 2
opts = {"max_new_tokens": 8, "greedy": True}
text = gen.generate("Why is the sky blue?", opts).text
batcher = Batcher(gen, 4)
print(json.dumps({"kv": kv, "own": gen.given_back, "slots": batcher.given_back, "text": text,
                  "again": gen.generate("Why is the sky blue?", opts).text}))
"""


def test_a_new_llama_context_keeps_no_zero_filled_kv_cache_resident(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from dsr1d.edges.engine_host import worker_environment
    from dsr1d.engine.gguf_convert import convert
    from dsr1d.engine.synth import synthesize

    gguf = convert(synthesize("tiny", tmp_path / "tiny"), tmp_path / "tiny.gguf", "int8")
    out = subprocess.run([sys.executable, "-c", KV_SCRIPT, str(gguf)], env=worker_environment(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.splitlines()[-1])
    # f16 K and V of every layer for every token of the context: given back whole
    assert got["own"] >= got["kv"] > 0
    assert got["slots"] >= 4 * got["kv"]
    assert got["again"] == got["text"]      # and the model answers as before
