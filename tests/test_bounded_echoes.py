"""Bounded output for unbounded input, on the real daemon and a private bus: a name a caller
sends is echoed cut to a bounded size with its length said, in the reply and in the log; a
refusal repeated many times is logged once per interval with a count; an Engine1 prompt is
refused by its size before anything reads it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.register_assert_rewrite("daemon_fixtures", "engine_fixtures")
from daemon_fixtures import BusClient, ERROR  # noqa: E402
from engine_fixtures import engine, engine_daemon_running  # noqa: E402

pytest_plugins = ["daemon_fixtures", "engine_fixtures"]

HUGE = 1_000_000


def longest_log_line(daemon) -> int:
    return max((len(line) for line in daemon.log().splitlines()), default=0)


def test_an_unknown_profile_name_is_echoed_cut_with_its_length(daemon, bus) -> None:
    client = BusClient(bus.address)
    try:
        reply = client.call("SwitchProfile", "s", "x" * HUGE)
        assert reply.error_name == ERROR + "UnknownProfile"
        (message,) = reply.body
        assert len(message) < 500 and f"({HUGE} characters)" in message
        client.sync()
        assert longest_log_line(daemon) < 1000
    finally:
        client.close()


def test_a_huge_property_name_gets_a_short_error(daemon, bus) -> None:
    client = BusClient(bus.address)
    try:
        reply = client.call("Get", "ss", "org.dsr1d.Manager1", "p" * HUGE,
                            interface="org.freedesktop.DBus.Properties")
        assert reply.error_name == "org.freedesktop.DBus.Error.InvalidArgs"
        assert len(reply.body[0]) < 200 and str(HUGE) in reply.body[0]
        ok = client.ok("Get", "ss", "org.dsr1d.Manager1", "ActiveProfile",
                       interface="org.freedesktop.DBus.Properties")
        assert ok[0].value == "sustained"
    finally:
        client.close()


def test_repeated_refusals_are_logged_once_with_a_count(daemon, bus) -> None:
    client = BusClient(bus.address)
    try:
        before = daemon.log().count("HoldProfile from")
        for _ in range(300):
            reply = client.call("HoldProfile", "sss", "no-such-profile", "r", "app")
            assert reply.error_name == ERROR + "UnknownProfile"
        client.sync()
        logged = daemon.log().count("HoldProfile from") - before
        assert 1 <= logged <= 3, logged
    finally:
        client.close()


def test_an_engine1_prompt_is_refused_by_its_size(tmp_path: Path) -> None:
    with engine_daemon_running(tmp_path, tmp_path / "absent.gguf") as served:
        client = served.client()
        reply = engine(client, "Generate", "sa{sv}", "y" * (5 << 20), {})
        assert reply.error_name == ERROR + "InvalidArgument", reply.body
        assert "bytes; at most" in reply.body[0]
