"""A thread-count change reaches a running engine, between tokens.

While a job runs, the engine holds ``engine_profile`` (``throughput`` here), and the active
profile's ``[engine] threads`` wins while it is active. Reloading a ``throughput`` that asks for
one thread, in the middle of a job, switches that job to one thread before its next token.
Throttle mitigation's ``engine_threads`` rung caps the same count (``EngineHost.effective_threads``).
"""

from __future__ import annotations

import json

import pytest

pytest.register_assert_rewrite("daemon_fixtures", "engine_fixtures")
from daemon_fixtures import BUS_NAME, MANAGER, PATH, busctl, eventually  # noqa: E402
from engine_fixtures import engine_daemon_running  # noqa: E402

pytest_plugins = ["engine_fixtures"]
ENGINE_PATH, ENGINE = "/org/dsr1d/engine", "org.dsr1d.Engine1"

ONE_THREAD = """\
[main]
summary = throughput, decoding on one thread
include = throughput

[engine]
threads = 1
"""


def test_thread_change_reaches_the_running_job(tiny_model, tmp_path):
    with engine_daemon_running(tmp_path, tiny_model) as served:
        served.wait_state("ready")
        assert served.engine_prop("Threads") == 2
        watcher = served.client()
        watcher.subscribe(f"type='signal',sender='{BUS_NAME}',path='{ENGINE_PATH}'")
        submitted = busctl(served.bus, "--json=short", "call", BUS_NAME, ENGINE_PATH, ENGINE,
                           "Submit", "sa{sv}", "hi", "3", "greedy", "b", "true",
                           "max_new_tokens", "u", "3000", "ignore_eos", "b", "true")
        assert submitted.returncode == 0, submitted.stderr
        job = json.loads(submitted.stdout)["data"][0]
        eventually(lambda: watcher.received("Token", ENGINE), timeout=30, what="the first token")

        profiles = served.fake.path / "etc/dsr1d/profiles"
        profiles.mkdir(parents=True, exist_ok=True)
        (profiles / "throughput.conf").write_text(ONE_THREAD)
        reload = busctl(served.bus, "call", BUS_NAME, PATH, MANAGER, "Reload")
        assert reload.returncode == 0, reload.stderr
        eventually(lambda: served.engine_prop("Threads") == 1, timeout=10,
                   what="Threads == 1 while the job runs")

        finished = eventually(lambda: [m for m in watcher.received("Finished", ENGINE)
                                       if m.body[0] == job], timeout=60, what="Finished")
        stats = {k: v.value for k, v in finished[0].body[1].items()}
        assert stats["finish_reason"] == "length"
        assert stats["threads"] == 1     # the worker's thread count when the job ended
