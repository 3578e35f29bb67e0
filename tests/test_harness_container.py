"""The booted-systemd container harness: a Type=notify unit starts, the knob binds show through.

Needs root, and builds a cached Debian tree on first use (about a minute, network to the mirror).
Register the marker in setup.cfg: ``container: boots a systemd container (root, slow first run)``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from harness.container import Container

REPO = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.container,
    pytest.mark.skipif(os.geteuid() != 0 or not Path("/proc/self/ns/pid").exists(),
                       reason="needs root and namespaces"),
]

HELLO_UNIT = """\
[Unit]
Description=dsr1d harness test: Type=notify via a raw NOTIFY_SOCKET datagram

[Service]
Type=notify
ExecStart=/usr/bin/python3 /usr/local/bin/hello.py
"""

HELLO_PY = """\
import os, signal, socket

address = os.environ["NOTIFY_SOCKET"]
if address.startswith("@"):
    address = "\\0" + address[1:]
with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
    sock.connect(address)
    sock.sendall(b"READY=1\\nSTATUS=hello from the container")
signal.pause()
"""


@pytest.fixture(scope="module")
def box():
    if not shutil.which("mount"):
        pytest.skip("no mount(8)")
    with Container(REPO) as container:
        yield container


def test_boots_with_systemd_as_pid1(box: Container):
    assert box.state in ("running", "degraded"), box.failed_units()
    assert box.exec("cat", "/proc/1/comm").stdout.strip() == "systemd"
    assert box.exec("systemctl", "is-active", "dbus.service").stdout.strip() == "active"


def test_notify_unit_reaches_active(box: Container):
    box.write_file("/usr/local/bin/hello.py", HELLO_PY, mode=0o755)
    box.write_file("/etc/systemd/system/hello.service", HELLO_UNIT)
    box.exec("systemctl", "daemon-reload")
    box.exec("systemctl", "start", "hello.service", timeout=60)
    assert box.exec("systemctl", "is-active", "hello.service").stdout.strip() == "active"
    status = box.exec("systemctl", "show", "-P", "StatusText", "hello.service").stdout
    assert status.strip() == "hello from the container"
    box.exec("systemctl", "stop", "hello.service")
    assert box.exec("systemctl", "is-active", "hello.service",
                    check=False).stdout.strip() == "inactive"


def test_knob_binds_match_the_host(box: Container):
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if not Path(thp).exists():
        pytest.skip("no THP on this kernel")
    assert box.exec("cat", thp).stdout == Path(thp).read_text()


def test_host_reaches_the_container_bus(box: Container):
    if not shutil.which("busctl"):
        pytest.skip("no busctl on the host")
    proc = subprocess.run(["busctl", f"--address={box.bus_address()}", "list", "--no-pager"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "org.freedesktop.systemd1" in proc.stdout


def test_project_is_bound_read_only(box: Container):
    assert box.exec("test", "-f", "/src/setup.cfg", check=False).returncode == 0
    assert box.exec("touch", "/src/.write-probe", check=False).returncode != 0


def test_power_off_ends_nspawn():
    with Container() as container:
        nspawn = container.nspawn
        leader = container.leader
    assert nspawn.returncode is not None
    assert not Path(f"/proc/{leader}").exists() or \
        Path(f"/proc/{leader}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
