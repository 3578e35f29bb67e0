"""The daemon's edges under a connection flood: what a stranger's idle connections cost.

Starts a private system-like bus and the real daemon against a fake root, the API on its unix
socket and on TCP (with a key). Then, from the unprivileged user ``nobody`` and without a key,
``--flood`` TCP connections opened and left idle. Measured before and during the flood, in the
same run: root's request on the unix socket (``GET /metrics``, p50/p99) and ``SwitchProfile``
over the bus; during it, the descriptors the daemon holds, how many connections it refused at
accept, the lines its log grew by, and how long until the last connection it admitted was
closed (no request header: the header deadline). Prints a table and JSON; never passes or fails.

    .venv/bin/python bench/edges.py [--flood 10000] [--calls 50] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from fakeroot import intel_box  # noqa: E402
from harness.privbus import PrivateBus  # noqa: E402
from results import add_write_option, markdown_table, write  # noqa: E402

KEY = "sk-bench-edges"
FLOODER = (REPO / "tests/test_exhaustion.py").read_text().split('FLOODER = r"""')[1] \
    .split('"""')[0]


def percentile(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p / 100))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_nobody(room: int):
    def drop() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (room, room))
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    return drop


def timed(calls: int, sock: Path, address: str) -> dict[str, float]:
    """p50/p99 ms of root's GET /metrics on the unix socket and of SwitchProfile on the bus."""
    env = {**os.environ, "DBUS_SYSTEM_BUS_ADDRESS": address}
    http, switch = [], []
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://d",
                      timeout=30) as client:
        for i in range(calls):
            t = time.perf_counter()
            assert client.get("/metrics").status_code == 200
            http.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            subprocess.run(["busctl", "--system", "call", "org.dsr1d", "/org/dsr1d",
                            "org.dsr1d.Manager1", "SwitchProfile", "s",
                            ("throughput", "sustained")[i % 2]], env=env, check=True,
                           capture_output=True)
            switch.append((time.perf_counter() - t) * 1000)
    return {"metrics_p50_ms": statistics.median(http), "metrics_p99_ms": percentile(http, 99),
            "switch_p50_ms": statistics.median(switch), "switch_p99_ms": percentile(switch, 99)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--flood", type=int, default=10_000)
    parser.add_argument("--calls", type=int, default=50)
    add_write_option(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, \
            PrivateBus([REPO / "etc/dbus-1/system.d/org.dsr1d.conf"]) as bus:
        fake = intel_box(Path(tmp) / "root", cpus=4)
        keys = Path(tmp) / "keys"
        keys.write_text(KEY + "\n")
        keys.chmod(0o600)
        port = free_port()
        config = Path(tmp) / "dsr1d.conf"
        config.write_text(f"[daemon]\ndefault_profile = sustained\n[api]\n"
                          f"tcp = 127.0.0.1:{port}\napi_keys_file = {keys}\n")
        log = Path(tmp) / "log"
        with open(log, "wb") as err:
            daemon = subprocess.Popen(
                [sys.executable, "-m", "dsr1d.edges.admin", "run", "--root", str(fake.path),
                 "--config", str(config), "--bus-address", bus.address], stderr=err)
        sock = fake.path / "run/dsr1d/api.sock"
        try:
            for _ in range(600):
                if sock.exists():
                    break
                time.sleep(0.1)
            quiet = timed(args.calls, sock, bus.address)
            lines = len(log.read_text().splitlines())
            flooder = subprocess.Popen(["/usr/bin/python3", "-c", FLOODER, str(port),
                                        str(args.flood)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True,
                                       preexec_fn=as_nobody(args.flood + 512))
            t0 = time.monotonic()
            connected = int(flooder.stdout.readline())
            opened_s = time.monotonic() - t0
            held = len(os.listdir(f"/proc/{daemon.pid}/fd"))
            flooded = timed(args.calls, sock, bus.address)
            while True:
                flooder.stdin.write("\n")
                flooder.stdin.flush()
                if int(flooder.stdout.readline()) == connected:
                    break
                time.sleep(0.25)
            closed_s = time.monotonic() - t0
            flooder.kill()
            new = log.read_text().splitlines()[lines:]
            grown = len(new)
            about_flood = sum("API" in line for line in new)
        finally:
            daemon.terminate()
            daemon.wait(timeout=60)
    figures = {"flood": args.flood, "connected": connected, "opened_s": opened_s,
               "daemon_descriptors_during": held, "log_lines_grown": grown,
               "log_lines_about_connections": about_flood,
               "all_closed_after_s": closed_s, "quiet": quiet, "flooded": flooded}
    print(f"{connected}/{args.flood} idle connections from nobody (no key) opened in "
          f"{opened_s:.2f} s; the daemon held {held} descriptors; all closed by it after "
          f"{closed_s:.1f} s; its log grew by {grown} lines, {about_flood} of them about the API's "
          f"connections (the rest: the {args.calls} profile switches)")
    print(f"{'':28} {'quiet':>14} {'flooded':>14}   (p50 / p99 ms, {args.calls} calls)")
    for name, key in (("root GET /metrics (unix)", "metrics"),
                      ("SwitchProfile (busctl)", "switch")):
        q, f = quiet, flooded
        print(f"{name:28} {q[key + '_p50_ms']:6.2f} / {q[key + '_p99_ms']:5.2f} "
              f"{f[key + '_p50_ms']:6.2f} / {f[key + '_p99_ms']:5.2f}   "
              f"ratio {f[key + '_p50_ms'] / q[key + '_p50_ms']:.2f}")
    print(json.dumps(figures))
    write(args.write, "edges", markdown_table(
        [f"while {connected:,} of {args.flood:,} idle TCP connections from `nobody`, no key, "
         f"are open ({args.calls} calls)", "quiet", "flooded"],
        [*((name, f"{quiet[key + '_p50_ms']:.2f} / {quiet[key + '_p99_ms']:.2f} ms",
            f"{flooded[key + '_p50_ms']:.2f} / {flooded[key + '_p99_ms']:.2f} ms")
           for name, key in (("root's `GET /metrics` on the unix socket, p50 / p99", "metrics"),
                             ("`SwitchProfile` with busctl, p50 / p99", "switch"))),
         ("descriptors the daemon holds", "", held),
         ("log lines about the connections", "", about_flood),
         ("until the daemon closed the last one (no header sent)", "",
          f"{closed_s:.1f} s after the first (opening all took {opened_s:.1f} s)")]))


if __name__ == "__main__":
    main()
