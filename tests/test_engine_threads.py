"""A thread-count change reaches a running engine, between tokens.

While a job runs, the engine holds ``engine_profile`` (``throughput`` here), and the active
profile's ``[engine] threads`` wins while it is active. Reloading a ``throughput`` that asks for
one thread, in the middle of a job, switches that job to one thread before its next token.
A controller's cap on the same count combines with it in ``EngineHost.effective_threads``
(tests/test_thread_owner.py).
"""

from __future__ import annotations


import pytest

pytest.register_assert_rewrite("daemon_fixtures", "engine_fixtures")
from daemon_fixtures import BUS_NAME, MANAGER, PATH, busctl, eventually  # noqa: E402
from engine_fixtures import engine_daemon_running, options  # noqa: E402

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
        # Submitted on the watcher's own connection: a job's signals reach only its caller,
        # and it lasts only as long as that connection does.
        (job,) = watcher.ok("Submit", "sa{sv}", "hi",
                            options(greedy=True, max_new_tokens=3000, ignore_eos=True),
                            interface=ENGINE, path=ENGINE_PATH)
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
