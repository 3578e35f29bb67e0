"""Files the daemon reads: regular files only, size-capped, never quoted in errors. A FIFO, a
device, a huge file, a NUL byte or a symlink to a secret gets a clear error and loses nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsr1d.core.profiles import MAX_FILE_BYTES, ProfileError, parse_ini, read_text_file

SECRET = "root:$y$j9T$S3CR3T-HASH:19000:0:99999:7:::"


def test_a_fifo_is_refused_at_once_instead_of_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "dsr1d.conf"
    os.mkfifo(fifo)
    with pytest.raises(ProfileError, match="not a regular file"):
        read_text_file(fifo)


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
def test_a_device_is_refused(device: str) -> None:
    with pytest.raises(ProfileError, match="not a regular file"):
        read_text_file(Path(device))


def test_a_huge_file_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    big = tmp_path / "big.conf"
    with big.open("wb") as f:
        f.truncate(MAX_FILE_BYTES * 3000)  # 3 GB, sparse
    with pytest.raises(ProfileError, match="larger than"):
        read_text_file(big)


def test_a_nul_byte_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "nul.conf"
    path.write_bytes(b"[main]\nsummary = a\x00b\n")
    with pytest.raises(ProfileError, match="NUL byte"):
        parse_ini(path)


def test_a_symlink_to_a_secret_is_never_quoted(tmp_path: Path) -> None:
    secret = tmp_path / "shadow"
    secret.write_text(SECRET + "\n")
    link = tmp_path / "evil.conf"
    link.symlink_to(secret)
    with pytest.raises(ProfileError) as info:
        parse_ini(link)
    assert SECRET not in str(info.value) and "S3CR3T" not in str(info.value)
    assert ":1:" in str(info.value)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dsr1d.edges.admin", *args], capture_output=True,
                          text=True, timeout=30)


def test_the_daemon_with_a_fifo_config_exits_78_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "dsr1d.conf"
    os.mkfifo(fifo)
    proc = _run("run", "--config", str(fifo), "--root", str(tmp_path),
                "--bus-address", "unix:path=/nonexistent")
    assert proc.returncode == 78, proc.stderr
    assert "not a regular file" in proc.stderr


def test_the_daemon_with_dev_zero_as_config_exits_78(tmp_path: Path) -> None:
    proc = _run("run", "--config", "/dev/zero", "--root", str(tmp_path),
                "--bus-address", "unix:path=/nonexistent")
    assert proc.returncode == 78, proc.stderr
