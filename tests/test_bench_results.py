"""bench/results.py, the writer of the results page: a block replaced leaves every other byte of
the page as it was, a missing block is appended, a block names its machine, date and command;
every block in docs/benchmarks.md belongs to a bench that writes it, and every bench offers
``--write`` (checked with ``--help`` only: no bench is run here)."""

from __future__ import annotations

import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
PAGE = REPO / "docs/benchmarks.md"
sys.path.insert(0, str(BENCH))

import results  # noqa: E402

# results.py writes the pages and random_gguf.py writes models: neither measures anything
WRITERS = sorted(p for p in BENCH.glob("*.py") if p.name not in ("results.py", "random_gguf.py"))
BEGIN = re.compile(r"<!-- bench:([^ ]+) begin -->\n")
PAGE_TEXT = ("# Results\n\r\ntyped prose — kept\n\n<!-- bench:one begin -->\nold one\n"
             "<!-- bench:one end -->\nbetween\n<!-- bench:two begin -->\nold two\n"
             "<!-- bench:two end -->\ntail without newline")


def test_replacing_a_block_keeps_every_other_byte(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_bytes(PAGE_TEXT.encode())
    assert results.replace_block(page, "one", "new one\nsecond line\n") is True
    assert page.read_bytes().decode() == PAGE_TEXT.replace("old one\n",
                                                           "new one\nsecond line\n\n")
    assert "old two" in page.read_text()


def test_writing_the_same_block_twice_changes_nothing(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_bytes(PAGE_TEXT.encode())
    results.replace_block(page, "two", "x\n")
    once = page.read_bytes()
    results.replace_block(page, "two", "x\n")
    assert page.read_bytes() == once


def test_a_missing_block_is_appended_and_said(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "page.md"
    page.write_bytes(PAGE_TEXT.encode())
    results.write(page, "three", "| a |\n|---|\n| 1 |")
    text = page.read_bytes().decode()
    assert text.startswith(PAGE_TEXT + "\n\n<!-- bench:three begin -->\n**machine** ")
    assert text.endswith("| 1 |\n\n<!-- bench:three end -->\n")
    assert "had no block 'three'" in capsys.readouterr().err
    assert not [p for p in tmp_path.iterdir() if p.name != "page.md"]   # no temporary left


@pytest.mark.parametrize("text", [
    "<!-- bench:one begin -->\nonly the start\n",
    "<!-- bench:one end -->\n<!-- bench:one begin -->\n",
    "<!-- bench:one begin -->\n<!-- bench:one end -->\n" * 2])
def test_broken_markers_are_refused_and_nothing_written(tmp_path: Path, text: str) -> None:
    page = tmp_path / "page.md"
    page.write_text(text)
    with pytest.raises(ValueError):
        results.replace_block(page, "one", "new\n")
    assert page.read_text() == text


def test_a_rendered_block_names_machine_date_and_command(tmp_path: Path) -> None:
    cpuinfo, meminfo = tmp_path / "cpuinfo", tmp_path / "meminfo"
    cpuinfo.write_text("".join(
        f"processor\t: {n}\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nphysical id\t: 0\n"
        f"core id\t\t: {n // 2}\nflags\t\t: fpu avx2 avx512f avx512_vnni amx_tile\n\n"
        for n in range(4)))
    meminfo.write_text("MemTotal:       16384000 kB\n")
    where = results.machine(str(cpuinfo), str(meminfo))
    assert where == ("Intel(R) Xeon(R) Platinum 8480+, 2 cores, 4 threads, AMX, AVX-512 (VNNI), "
                     "AVX2, 15.6 GiB memory")
    block = results.render("| a |\n|---|\n| 1 |", [".venv/bin/python", "bench/x.py", "--n", "a b"],
                           datetime(2026, 12, 5, 9, 30, tzinfo=timezone.utc), where)
    heading = results.HEADING.fullmatch(block.splitlines()[0])
    assert heading and heading["machine"] == where and heading["date"] == "2026-12-05T09:30:00Z"
    assert heading["command"] == "`.venv/bin/python bench/x.py --n 'a b'`"
    assert block.endswith("\n\n| a |\n|---|\n| 1 |\n")


def test_the_command_is_shown_as_it_was_run() -> None:
    assert results.command().startswith(sys.orig_argv[0])


@pytest.mark.parametrize("page", sorted((REPO / "docs").glob("*.md")), ids=lambda p: p.name)
def test_every_block_in_the_docs_has_a_bench_and_a_heading(page: Path) -> None:
    text = page.read_text()
    names = BEGIN.findall(text)
    if page == PAGE:
        assert names, "docs/benchmarks.md has no bench blocks"
    sources = {p: p.read_text() for p in WRITERS}
    for name in names:
        assert text.count(f"<!-- bench:{name} end -->") == 1, name
        # a bench names its block in its write call, or in quotes where it picks one of several
        assert any(f'write(args.write, "{name}"' in source
                   or (f'"{name}"' in source and "write(args.write, " in source)
                   for source in sources.values()), f"no bench writes {name}"
        heading = text.split(f"<!-- bench:{name} begin -->\n", 1)[1].split("\n", 1)[0]
        found = results.HEADING.match(heading)
        assert found, f"block {name}: no machine/date/command heading: {heading}"
        if "not recorded" in heading:
            assert re.search(r"\(figures from an earlier run; rerun `[^`]*bench/\S+\.py[^`]* "
                             r"--write docs/\S+\.md` to regenerate\)", heading), heading


@pytest.mark.parametrize("bench", WRITERS, ids=lambda p: p.name)
def test_every_bench_offers_write_in_its_help(bench: Path) -> None:
    proc = subprocess.run([sys.executable, str(bench), "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--write PAGE" in proc.stdout
