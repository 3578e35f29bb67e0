"""The private system-like bus: real busctl as root and as nobody against a dbus-fast service."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.privbus import PrivateBus, make_config, SYSTEM_CONF

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("dbus-daemon") or not shutil.which("busctl"),
    reason="needs root, dbus-daemon and busctl")

NAME, PATH, IFACE = "org.dsr1d.Test", "/org/dsr1d/Test", "org.dsr1d.Test1"
AS_NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")

POLICY = f"""\
<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <policy user="root">
    <allow own="{NAME}"/>
    <allow send_destination="{NAME}"/>
  </policy>
  <policy context="default">
    <allow send_destination="{NAME}" send_interface="{IFACE}" send_member="Get"/>
    <allow send_destination="{NAME}" send_interface="org.freedesktop.DBus.Introspectable"/>
  </policy>
</busconfig>
"""

SERVICE = f"""\
import asyncio
from dbus_fast import BusType, RequestNameReply
from dbus_fast.aio import MessageBus
from dbus_fast.service import ServiceInterface, method

class Test(ServiceInterface):
    def __init__(self):
        super().__init__("{IFACE}")
        self.value = "initial"

    @method()
    def Get(self) -> "s":
        return self.value

    @method()
    def Set(self, value: "s") -> "b":
        self.value = value
        return True

async def main():
    bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
    bus.export("{PATH}", Test())
    assert await bus.request_name("{NAME}") == RequestNameReply.PRIMARY_OWNER
    print("READY", flush=True)
    await bus.wait_for_disconnect()

asyncio.run(main())
"""


@pytest.fixture
def bus(tmp_path: Path):
    policy = tmp_path / "org.dsr1d.Test.conf"
    policy.write_text(POLICY)
    with PrivateBus([policy]) as private:
        yield private


@pytest.fixture
def service(bus: PrivateBus, tmp_path: Path):
    pytest.importorskip("dbus_fast")
    script = tmp_path / "service.py"
    script.write_text(SERVICE)
    proc = subprocess.Popen([sys.executable, str(script)], env=bus.env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = proc.stdout.readline()
        if line.strip() != "READY":
            proc.kill()
            pytest.fail(f"service did not start: {line}{proc.communicate()[1]}\n{bus.log()}")
        yield proc
    finally:
        proc.kill()
        proc.communicate()


def busctl(bus: PrivateBus, *args: str, prefix: tuple[str, ...] = ()):
    return subprocess.run([*prefix, "busctl", "--system", *args], env=bus.env(),
                          capture_output=True, text=True, timeout=30)


def call(bus, member, *args, prefix=()):
    return busctl(bus, "call", NAME, PATH, IFACE, member, *args, prefix=prefix)


def test_config_is_private(tmp_path: Path):
    conf = make_config(SYSTEM_CONF.read_text(), tmp_path)
    assert f"<listen>unix:path={tmp_path}/system_bus_socket</listen>" in conf
    assert f"<includedir>{tmp_path}/system.d</includedir>" in conf
    for gone in ("<user>", "<syslog/>", "servicehelper", "/etc/dbus-1/system.d", "/run/dbus"):
        assert gone not in conf


def test_env_points_at_the_socket(bus: PrivateBus):
    assert bus.env()["DBUS_SYSTEM_BUS_ADDRESS"] == bus.address
    assert bus.address.startswith(f"unix:path={bus.tmpdir}/system_bus_socket")
    proc = busctl(bus, "list", "--no-pager")
    assert proc.returncode == 0, proc.stderr
    assert "org.freedesktop.DBus" in proc.stdout


def test_root_may_get_and_set(service, bus):
    assert call(bus, "Get").stdout.strip() == 's "initial"'
    proc = call(bus, "Set", "s", "changed")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "b true"
    assert call(bus, "Get").stdout.strip() == 's "changed"'


def test_nobody_may_get_but_not_set(service, bus):
    proc = call(bus, "Get", prefix=AS_NOBODY)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == 's "initial"'
    proc = call(bus, "Set", "s", "hacked", prefix=AS_NOBODY)
    assert proc.returncode != 0
    assert "Access denied" in proc.stderr
    # busctl prints the message; the error name itself shows in dbus-send's answer.
    sent = subprocess.run(
        [*AS_NOBODY, "dbus-send", "--system", "--print-reply", f"--dest={NAME}", PATH,
         f"{IFACE}.Set", "string:hacked"], env=bus.env(), capture_output=True, text=True)
    assert "org.freedesktop.DBus.Error.AccessDenied" in sent.stderr
    assert call(bus, "Get").stdout.strip() == 's "initial"'


def test_nobody_may_not_own_the_name(bus):
    proc = subprocess.run(
        [*AS_NOBODY, "dbus-send", "--system", "--print-reply", "--dest=org.freedesktop.DBus",
         "/org/freedesktop/DBus", "org.freedesktop.DBus.RequestName", f"string:{NAME}",
         "uint32:0"], env=bus.env(), capture_output=True, text=True)
    assert "org.freedesktop.DBus.Error.AccessDenied" in proc.stderr


def test_stop_kills_the_daemon(tmp_path: Path):
    with PrivateBus() as private:
        pid, tmpdir = private.pid, private.tmpdir
        assert Path(f"/proc/{pid}").exists()
    state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] \
        if Path(f"/proc/{pid}/stat").exists() else "gone"
    assert state in ("gone", "Z", "X")
    assert not tmpdir.exists()


def test_runs_without_pytest(tmp_path: Path):
    script = Path(__file__).parent / "harness" / "privbus.py"
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("export DBUS_SYSTEM_BUS_ADDRESS=unix:path=")
        address = line.split("=", 1)[1].strip()
        listed = subprocess.run(["busctl", "--system", "list", "--no-pager"], text=True,
                                env={**os.environ, "DBUS_SYSTEM_BUS_ADDRESS": address},
                                capture_output=True)
        assert listed.returncode == 0, listed.stderr
    finally:
        proc.terminate()
        proc.communicate(timeout=10)
    assert proc.returncode == 0
