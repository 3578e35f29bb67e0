"""D-Bus control-plane figures: round-trip latency percentiles and the idle daemon's CPU share.

Starts a private system-like bus and the real daemon against a fake root, then times a few
hundred calls of each kind from a dbus-fast client. The baseline, measured in the same run, is
``org.freedesktop.DBus.Peer.Ping`` to the daemon: the bus's own floor. Then a flood: 1,000 reads
(GetTelemetry, a property Get, ListProfiles) sent at once from 50 connections of the unprivileged
user ``nobody`` — how many were answered, latency percentiles, wall time. Prints a table and
JSON; never passes or fails.

Then the switch path's growth with the machine: Ping and SwitchProfile (throughput <->
balanced, every per-CPU knob changing) on fake machines of each ``--scale`` CPU count, one daemon
each. Fake roots go on /dev/shm where there is one: like sysfs, in memory, so the figures are
the daemon's cost and not a disk's.

    .venv/bin/python bench/dbus.py [--calls 300] [--idle-seconds 60] [--flood-conns 50 --flood-calls 20]
                                   [--scale 4,32,128,512 --scale-calls 40]
                                   [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from dbus_fast import Message, MessageType  # noqa: E402
from dbus_fast.aio import MessageBus  # noqa: E402

from fakeroot import intel_box  # noqa: E402
from harness.privbus import PrivateBus  # noqa: E402
from results import add_write_option, markdown_table, write  # noqa: E402

DEST, PATH, IFACE = "org.dsr1d", "/org/dsr1d", "org.dsr1d.Manager1"


def percentile(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


async def time_calls(bus: MessageBus, make, calls: int) -> list[float]:
    samples = []
    for i in range(calls):
        msg = make(i)
        start = time.perf_counter()
        reply = await bus.call(msg)
        samples.append((time.perf_counter() - start) * 1000)
        if reply.message_type == MessageType.ERROR:
            raise RuntimeError(f"{msg.member}: {reply.body}")
    return samples


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


PING = lambda i: Message(destination=DEST, path=PATH,  # noqa: E731
                        interface="org.freedesktop.DBus.Peer", member="Ping")
SWITCH = lambda i: Message(destination=DEST, path=PATH, interface=IFACE,  # noqa: E731
                          member="SwitchProfile", signature="s",
                          body=["throughput" if i % 2 else "balanced"])


async def measure_switch(address: str, calls: int) -> dict[str, list[float]]:
    bus = await MessageBus(bus_address=address).connect()
    results = {"Ping": await time_calls(bus, PING, calls),
               "SwitchProfile": await time_calls(bus, SWITCH, calls)}
    bus.disconnect()
    return results


async def measure(address: str, calls: int) -> dict[str, list[float]]:
    bus = await MessageBus(bus_address=address).connect()
    kinds = {
        "Ping (baseline)": lambda i: Message(destination=DEST, path=PATH,
                                             interface="org.freedesktop.DBus.Peer", member="Ping"),
        "GetTelemetry": lambda i: Message(destination=DEST, path=PATH, interface=IFACE,
                                          member="GetTelemetry"),
        "Get ActiveProfile": lambda i: Message(
            destination=DEST, path=PATH, interface="org.freedesktop.DBus.Properties",
            member="Get", signature="ss", body=[IFACE, "ActiveProfile"]),
        "SwitchProfile": lambda i: Message(destination=DEST, path=PATH, interface=IFACE,
                                           member="SwitchProfile", signature="s",
                                           body=["throughput" if i % 2 else "balanced"]),
    }
    results = {name: await time_calls(bus, make, calls) for name, make in kinds.items()}
    bus.disconnect()
    return results


# Run as nobody: CONNS connections, CALLS reads on each, all sent at once.
FLOOD = """\
import asyncio, json, sys, time
from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

ADDRESS, CONNS, CALLS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
READS = [("org.dsr1d.Manager1", "GetTelemetry", "", []),
         ("org.freedesktop.DBus.Properties", "Get", "ss", ["org.dsr1d.Manager1", "ActiveProfile"]),
         ("org.dsr1d.Manager1", "ListProfiles", "", [])]

async def one(bus, i):
    iface, member, sig, body = READS[i % len(READS)]
    start = time.perf_counter()
    try:
        reply = await asyncio.wait_for(bus.call(Message(
            destination="org.dsr1d", path="/org/dsr1d", interface=iface, member=member,
            signature=sig, body=body)), 60)
    except Exception:
        return None
    ok = reply.message_type == MessageType.METHOD_RETURN
    return (time.perf_counter() - start) * 1000 if ok else None

async def main():
    buses = [await MessageBus(bus_address=ADDRESS).connect() for _ in range(CONNS)]
    start = time.perf_counter()
    results = await asyncio.gather(*(one(b, i) for b in buses for i in range(CALLS)))
    print(json.dumps({"wall_s": time.perf_counter() - start,
                      "latencies_ms": [r for r in results if r is not None],
                      "sent": len(results)}))

asyncio.run(main())
"""


def flood(address: str, conns: int, calls: int) -> dict:
    """The flood as nobody; answered count, latency percentiles, wall time."""
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           sys.executable, "-c", FLOOD, address, str(conns), str(calls)],
                          capture_output=True, text=True, timeout=300, check=True)
    data = json.loads(proc.stdout)
    lat = data["latencies_ms"] or [float("nan")]
    return {"sent": data["sent"], "answered": len(data["latencies_ms"]),
            "p50_ms": statistics.median(lat), "p99_ms": percentile(lat, 99),
            "wall_s": data["wall_s"]}


def wait_for_name(address: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    env = {**os.environ, "DBUS_SYSTEM_BUS_ADDRESS": address}
    while time.monotonic() < deadline:
        if subprocess.run(["busctl", "--system", "status", DEST], env=env,
                          capture_output=True).returncode == 0:
            return
        time.sleep(0.1)
    raise RuntimeError("daemon did not take its bus name")


def fake_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class Daemon:
    """The real daemon on ``address`` against a fake machine of ``cpus`` CPUs."""

    def __init__(self, address: str, cpus: int) -> None:
        self.address, self.cpus = address, cpus

    def __enter__(self) -> "Daemon":
        self.tmp = tempfile.TemporaryDirectory(dir=fake_dir())
        fake = intel_box(Path(self.tmp.name) / "root", cpus=self.cpus)
        config = Path(self.tmp.name) / "dsr1d.conf"
        config.write_text("[daemon]\n")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dsr1d.edges.admin", "run", "--root", str(fake.path),
             "--config", str(config), "--bus-address", self.address],
            stderr=subprocess.DEVNULL)
        wait_for_name(self.address, timeout=120)
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.tmp.cleanup()


def scale(address: str, counts: list[int], calls: int) -> dict[str, dict[str, float]]:
    """SwitchProfile next to Ping on machines of each size."""
    print(f"\nswitch path by machine size ({calls} calls each; Ping in the same daemon):")
    print(f"{'CPUs':>6} {'Ping p50':>9} {'Switch p50':>11} {'Switch p99':>11} {'per CPU':>9}")
    out = {}
    for cpus in counts:
        with Daemon(address, cpus):
            res = asyncio.run(measure_switch(address, calls))
        ping, sw = statistics.median(res["Ping"]), statistics.median(res["SwitchProfile"])
        out[str(cpus)] = {"ping_p50_ms": ping, "switch_p50_ms": sw,
                          "switch_p99_ms": percentile(res["SwitchProfile"], 99),
                          "switch_ms_per_cpu": sw / cpus}
        print(f"{cpus:6d} {ping:9.2f} {sw:11.2f} {out[str(cpus)]['switch_p99_ms']:11.2f} "
              f"{sw / cpus:9.3f}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--idle-seconds", type=float, default=60)
    parser.add_argument("--cpus", type=int, default=16, help="CPUs of the fake machine")
    parser.add_argument("--flood-conns", type=int, default=50)
    parser.add_argument("--flood-calls", type=int, default=20, help="reads per connection")
    parser.add_argument("--scale", default="4,32,128,512", help="CPU counts for the switch path")
    parser.add_argument("--scale-calls", type=int, default=40)
    add_write_option(parser)
    args = parser.parse_args()
    with PrivateBus([REPO / "etc/dbus-1/system.d/org.dsr1d.conf"]) as privbus:
        with Daemon(privbus.address, args.cpus) as daemon:
            results = asyncio.run(measure(privbus.address, args.calls))
            flooded = flood(privbus.address, args.flood_conns, args.flood_calls)
            before, t0 = cpu_seconds(daemon.proc.pid), time.monotonic()
            time.sleep(args.idle_seconds)
            idle_share = (cpu_seconds(daemon.proc.pid) - before) / (time.monotonic() - t0) * 100
        counts = [int(c) for c in args.scale.split(",") if c]
        scaled = scale(privbus.address, counts, args.scale_calls) if counts else {}
    base = statistics.median(results["Ping (baseline)"])
    figures = {}
    print(f"{'call':20} {'p50 ms':>8} {'p99 ms':>8} {'p50/Ping':>9}   ({args.calls} calls, "
          f"fake machine of {args.cpus} CPUs)")
    for name, samples in results.items():
        p50, p99 = statistics.median(samples), percentile(samples, 99)
        figures[name] = {"p50_ms": p50, "p99_ms": p99, "ratio_to_ping": p50 / base}
        print(f"{name:20} {p50:8.2f} {p99:8.2f} {p50 / base:9.1f}")
    print(f"flood as nobody: {flooded['answered']}/{flooded['sent']} reads answered from "
          f"{args.flood_conns} connections in {flooded['wall_s']:.2f} s, p50 "
          f"{flooded['p50_ms']:.1f} ms, p99 {flooded['p99_ms']:.1f} ms")
    figures["flood"] = flooded
    figures["idle_cpu_percent_of_one_core"] = idle_share
    figures["idle_seconds"] = args.idle_seconds
    print(f"daemon CPU share while idle: {idle_share:.3f} % of one core over {args.idle_seconds:.0f} s")
    figures["switch_by_cpus"] = scaled
    print(json.dumps(figures))
    write(args.write, "dbus", page(figures, args))


def page(figures: dict, args: argparse.Namespace) -> str:
    """The figures printed above, as the results page shows them."""
    calls = markdown_table(
        ["call", "p50 ms", "p99 ms", "p50 ÷ Ping"],
        [(name, f"{f['p50_ms']:.2f}", f"{f['p99_ms']:.2f}", f"{f['ratio_to_ping']:.1f}")
         for name, f in figures.items() if isinstance(f, dict) and "ratio_to_ping" in f])
    fl = figures["flood"]
    lines = [f"{args.calls} calls each, fake machine of {args.cpus} CPUs:", "", calls, "",
             f"Flood as nobody: {fl['answered']}/{fl['sent']} reads answered from "
             f"{args.flood_conns} connections in {fl['wall_s']:.2f} s, p50 {fl['p50_ms']:.1f} ms, "
             f"p99 {fl['p99_ms']:.1f} ms. The idle daemon's CPU share: "
             f"{figures['idle_cpu_percent_of_one_core']:.3f} % of one core over "
             f"{args.idle_seconds:.0f} s."]
    if figures["switch_by_cpus"]:
        lines += ["", f"The switch path by machine size ({args.scale_calls} calls each; Ping in "
                  "the same daemon):", "", markdown_table(
                      ["CPUs", "Ping p50 ms", "SwitchProfile p50 ms", "SwitchProfile p99 ms",
                       "ms per CPU"],
                      [(cpus, f"{f['ping_p50_ms']:.2f}", f"{f['switch_p50_ms']:.2f}",
                        f"{f['switch_p99_ms']:.2f}", f"{f['switch_ms_per_cpu']:.3f}")
                       for cpus, f in figures["switch_by_cpus"].items()])]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
