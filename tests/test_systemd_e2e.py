"""End to end under real systemd: a booted container with dsr1d installed by ``make install``.

The container binds the host's THP directory, so a profile switch inside changes a real knob
of this machine, visible from the host, and every stop (clean, or SIGKILL through the unit's
ExecStopPost) must bring it back. A finalizer puts THP back even if a test fails.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from harness.container import Container

REPO = Path(__file__).resolve().parent.parent
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

pytestmark = [
    pytest.mark.container,
    pytest.mark.realknob,
    pytest.mark.skipif(os.geteuid() != 0 or not THP.exists(),
                       reason="needs root and a kernel with THP"),
]

NEVER_PROFILE = """\
[main]
summary = e2e test: THP off, nothing else
[thp]
enabled = never
"""


def thp() -> str:
    text = THP.read_text()
    return text[text.index("[") + 1:text.index("]")]


def eventually(check, timeout: float = 60, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def original_thp():
    before = thp()
    yield before
    if thp() != before:
        THP.write_text(before)
    assert thp() == before


@pytest.fixture(scope="module")
def box(original_thp):
    with Container(REPO, project_writable=True) as container:
        container.exec("sh", "-c", "cd /src && python3 -m venv /tmp/build "
                       "&& make install ENGINE=no PYTHON=/tmp/build/bin/python", timeout=600)
        container.write_file("/etc/dsr1d/profiles/e2e-never.conf", NEVER_PROFILE)
        container.exec("systemctl", "reload", "dbus")
        container.exec("systemctl", "daemon-reload")
        try:
            yield container
        finally:
            print(container.exec("journalctl", "-u", "dsr1d", "--no-pager", check=False).stdout)


def state(box: Container) -> str:
    return box.exec("systemctl", "is-active", "dsr1d", check=False).stdout.strip()


def main_pid(box: Container) -> int:
    return int(box.exec("systemctl", "show", "-P", "MainPID", "dsr1d").stdout.strip())


def busctl(box: Container, *args: str):
    return box.exec("busctl", "--system", *args, check=False)


def test_start_switch_stop_restores_thp(box, original_thp):
    box.exec("systemctl", "start", "dsr1d")
    assert state(box) == "active"                       # Type=notify: READY=1 arrived
    status = box.exec("systemctl", "show", "-P", "StatusText", "dsr1d").stdout
    assert "profile sustained" in status
    assert thp() == "always"                            # the default profile, seen from the host

    call = busctl(box, "call", "org.dsr1d", "/org/dsr1d", "org.dsr1d.Manager1",
                  "SwitchProfile", "s", "e2e-never")
    assert call.returncode == 0, call.stderr
    assert thp() == "never"
    prop = busctl(box, "get-property", "org.dsr1d", "/org/dsr1d", "org.dsr1d.Manager1",
                  "ActiveProfile")
    assert prop.stdout.strip() == 's "e2e-never"'
    assert box.exec("dsr1ctl", "status").stdout.startswith("profile:    e2e-never")

    box.exec("systemctl", "stop", "dsr1d")
    assert thp() == original_thp


def test_unprivileged_caller_is_denied_inside(box):
    box.exec("systemctl", "start", "dsr1d")
    denied = box.exec("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                      "busctl", "--system", "call", "org.dsr1d", "/org/dsr1d",
                      "org.dsr1d.Manager1", "SwitchProfile", "s", "latency", check=False)
    # The bus lets the call through (so that polkit could be asked); the daemon refuses it.
    assert denied.returncode != 0 and "needs root, the dsr1d group or polkit" in denied.stderr, \
        denied.stderr
    allowed = box.exec("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                       "busctl", "--system", "get-property", "org.dsr1d", "/org/dsr1d",
                       "org.dsr1d.Manager1", "ActiveProfile", check=False)
    assert allowed.stdout.strip() == 's "sustained"'
    box.exec("systemctl", "stop", "dsr1d")


POLKIT_RULE = """\
polkit.addRule(function(action, subject) {
    if (action.id.indexOf("org.dsr1d.") == 0 && subject.user == "alice")
        return polkit.Result.YES;
});
"""


def as_user(box: Container, user: str, *argv: str):
    return box.exec("setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv,
                    check=False)


def test_a_polkit_rule_grants_one_user_and_no_other(box, original_thp):
    """The shipped policy reaches the real polkitd, which grants alice (by a rules file) and
    nobody else; the daemon acts on its answer."""
    for user in ("alice", "bob"):
        box.exec("useradd", "--no-create-home", user, check=False)
    box.write_file("/etc/polkit-1/rules.d/50-dsr1d-test.rules", POLKIT_RULE)
    box.exec("systemctl", "restart", "polkit")
    box.exec("systemctl", "start", "dsr1d")
    switch = ("busctl", "--system", "call", "org.dsr1d", "/org/dsr1d", "org.dsr1d.Manager1",
              "SwitchProfile", "s")
    granted = as_user(box, "alice", *switch, "e2e-never")
    assert granted.returncode == 0, granted.stderr
    assert thp() == "never"
    refused = as_user(box, "bob", *switch, "sustained")
    assert refused.returncode != 0 and "needs root, the dsr1d group or polkit" in refused.stderr
    assert thp() == "never"
    by_cli = as_user(box, "alice", "dsr1ctl", "profile", "sustained")
    assert by_cli.returncode == 0, by_cli.stderr
    assert thp() == "always"
    box.exec("systemctl", "stop", "dsr1d")
    assert thp() == original_thp


def test_structured_journal_fields(box):
    box.exec("systemctl", "start", "dsr1d")
    box.exec("systemctl", "stop", "dsr1d")
    lines = box.exec("journalctl", "-u", "dsr1d", "-o", "json", "--no-pager").stdout.splitlines()
    fields = [json.loads(line) for line in lines if line.startswith("{")]
    assert any(f.get("PROFILE") == "sustained" for f in fields), "no PROFILE= field in the journal"


def test_sigkill_restores_through_execstoppost_then_restarts(box, original_thp):
    box.exec("systemctl", "start", "dsr1d")
    first = main_pid(box)
    box.exec("busctl", "--system", "call", "org.dsr1d", "/org/dsr1d", "org.dsr1d.Manager1",
             "SwitchProfile", "s", "e2e-never")
    assert thp() == "never"
    box.exec("systemctl", "kill", "-s", "KILL", "dsr1d")
    # Restart=on-failure brings it back after ExecStopPost restored the knobs.
    eventually(lambda: state(box) == "active" and main_pid(box) not in (0, first),
               what="the restarted dsr1d")
    log = box.exec("journalctl", "-u", "dsr1d", "--no-pager").stdout
    assert "restored" in log.split("Main process exited")[-1], log
    assert thp() == "always"                 # the restarted daemon applied its default again
    box.exec("systemctl", "stop", "dsr1d")
    assert thp() == original_thp


def test_sigkill_without_restart_leaves_the_machine_as_it_was(box, original_thp):
    box.write_file("/etc/systemd/system/dsr1d.service.d/no-restart.conf",
                   "[Service]\nRestart=no\n")
    box.exec("systemctl", "daemon-reload")
    try:
        box.exec("systemctl", "start", "dsr1d")
        assert thp() == "always"
        box.exec("systemctl", "kill", "-s", "KILL", "dsr1d")
        eventually(lambda: state(box) in ("failed", "inactive"), what="dsr1d to be down")
        assert thp() == original_thp
        assert box.exec("test", "-e", "/run/dsr1d/state.json", check=False).returncode != 0
    finally:
        box.exec("rm", "/etc/systemd/system/dsr1d.service.d/no-restart.conf")
        box.exec("systemctl", "daemon-reload")
        box.exec("systemctl", "reset-failed", "dsr1d", check=False)
