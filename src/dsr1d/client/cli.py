"""``dsr1ctl``: the client people and scripts type, talking to the running daemon over D-Bus.

Exit status: 0 done; 1 the daemon could not do it (a write failed, drift found); 2 bad input
(usage, unknown profile, wrong arguments); 3 the daemon is not reachable; 4 access denied;
5 the engine is unavailable (no model, loading, restarting).
``hold`` exits with the status of the command it ran.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from dbus_fast import BusType, Message, MessageFlag, MessageType, Variant
from dbus_fast.aio import MessageBus

from dsr1d import __version__
from dsr1d.constants import (BUS_NAME, BUSY_MHZ, CPU_MHZ, ENGINE, ENGINE_PATH, ENGINE_TOKENS_PER_S,
                             LOAD_1M, MANAGER, PATH, PKG_POWER_W, PKG_TEMP_C)
from dsr1d.table import render

EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_DENIED = 1, 2, 3, 4
_USAGE_ERRORS = ("UnknownProfile", "InvalidProfile", "InvalidArgs", "NoSuchHold", "NotHolder",
                 "InvalidArgument")
EXIT_ENGINE = 5


class ClientError(Exception):
    """A D-Bus error reply, with the exit status it maps to."""

    def __init__(self, name: str, message: str) -> None:
        self.name = name
        self.message = message
        super().__init__(message)

    @property
    def exit_code(self) -> int:
        short = self.name.rsplit(".", 1)[-1]
        if short == "AccessDenied":
            return EXIT_DENIED
        if short in _USAGE_ERRORS:
            return EXIT_USAGE
        if short in ("ServiceUnknown", "NameHasNoOwner", "NoReply", "Disconnected"):
            return EXIT_UNREACHABLE
        if short == "EngineUnavailable":
            return EXIT_ENGINE
        return EXIT_FAILED


class Client:
    """A thin D-Bus client of ``org.dsr1d``."""

    def __init__(self, bus: MessageBus) -> None:
        self.bus = bus

    # Like systemctl: someone at a terminal may be asked for a password by a polkit agent.
    flags = (MessageFlag.ALLOW_INTERACTIVE_AUTHORIZATION if sys.stdin.isatty()
             else MessageFlag.NONE)

    @classmethod
    async def connect(cls, address: str | None) -> Client:
        bus = MessageBus(bus_address=address) if address else MessageBus(bus_type=BusType.SYSTEM)
        return cls(await bus.connect())

    async def call(self, member: str, signature: str = "", *body: Any,
                   interface: str = MANAGER, path: str = PATH,
                   destination: str = BUS_NAME) -> list[Any]:
        reply = await self.bus.call(Message(destination=destination, path=path,
                                            interface=interface, member=member,
                                            signature=signature, body=list(body),
                                            flags=self.flags))
        if reply.message_type == MessageType.ERROR:
            text = reply.body[0] if reply.body else reply.error_name
            raise ClientError(reply.error_name, str(text))
        return reply.body

    async def properties(self) -> dict[str, Any]:
        (values,) = await self.call("GetAll", "s", MANAGER,
                                    interface="org.freedesktop.DBus.Properties")
        return {k: v.value for k, v in values.items()}

    async def telemetry(self) -> dict[str, Any]:
        (values,) = await self.call("GetTelemetry")
        return {k: v.value if isinstance(v, Variant) else v for k, v in values.items()}


def _mean(values: list[float]) -> str:
    return f"{sum(values) / len(values):.0f}" if values else "-"


def _telemetry_line(t: dict[str, Any]) -> str:
    """What was measured, never a placeholder for what was not."""
    parts = []
    if LOAD_1M in t:
        parts.append(f"load {t['load_1m']:.2f}")
    if t.get("cpu_util_percent"):
        parts.append(f"cpu {_mean(t['cpu_util_percent'])}%")
    mhz = t.get(BUSY_MHZ) or (t.get(CPU_MHZ) and sum(t[CPU_MHZ]) / len(t[CPU_MHZ]))
    if mhz:
        parts.append(f"{mhz:.0f} MHz")
    for key, unit in ((PKG_TEMP_C, "°C"), (PKG_POWER_W, "W"),
                      (ENGINE_TOKENS_PER_S, "tok/s")):
        if key in t:
            parts.append(f"{t[key]:.1f} {unit}")
    return ", ".join(parts) or "nothing measured here"


def _unwrap(value: Any) -> Any:
    if isinstance(value, Variant):
        return _unwrap(value.value)
    if isinstance(value, dict):
        return {k: _unwrap(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_unwrap(v) for v in value]
    return value


def _print_json(data: Any) -> None:
    print(json.dumps(_unwrap(data), indent=1, sort_keys=True, default=str))


async def cmd_status(client: Client, args: argparse.Namespace) -> int:
    props = await client.properties()
    if args.json:
        engine = await client.call("GetAll", "s", ENGINE,
                                   interface="org.freedesktop.DBus.Properties", path=ENGINE_PATH)
        _print_json({"manager": props, "telemetry": await client.telemetry(),
                     "engine": {k: v.value for k, v in engine[0].items()}})
        return 0
    print(f"profile:    {props['ActiveProfile']}")
    holds = props.get("Holds", [])
    print(f"holds:      {len(holds) or 'none'}")
    for cookie, profile, reason, app in holds:
        print(f"  #{cookie} {profile} by {app or '?'}: {reason}")
    print(f"throttle:   {props['ThrottleState']}"
          + (f" ({', '.join(props['Mitigations'])})" if props["Mitigations"] else ""))
    print(f"telemetry:  {_telemetry_line(await client.telemetry())}")
    engine = await client.call("GetAll", "s", ENGINE, interface="org.freedesktop.DBus.Properties",
                               path=ENGINE_PATH)
    e = {k: v.value for k, v in engine[0].items()}
    if e["State"] == "unconfigured":
        print("engine:     no model configured")
    else:
        print(f"engine:     {e['State']}, model {e['Model']}, {e['Threads']} threads, "
              f"last decode {e['TokensPerSecond']:.2f} tokens/s")
    print(f"version:    {props['Version']}")
    print()
    print(render(("TUNABLE", "SUPPORTED", "DETAIL"),
                 [(n, "yes" if ok else "no", detail) for n, ok, detail in props["Tunables"]]))
    return 0


async def cmd_list(client: Client, args: argparse.Namespace) -> int:
    (profiles,) = await client.call("ListProfiles")
    active = (await client.properties())["ActiveProfile"]
    if args.json:
        _print_json([{"name": n, "summary": s, "active": n == active} for n, s in profiles])
        return 0
    print(render(("", "PROFILE", "SUMMARY"),
                 [("*" if n == active else "", n, s) for n, s in profiles]))
    return 0


async def cmd_profile(client: Client, args: argparse.Namespace) -> int:
    await client.call("SwitchProfile", "s", args.name)
    print(f"profile: {args.name}")
    return 0


async def cmd_verify(client: Client, args: argparse.Namespace) -> int:
    ok, drift = await client.call("Verify")
    if args.json:
        _print_json({"ok": ok, "drift": [{"knob": k, "wanted": w, "actual": a}
                                         for k, w, a in drift]})
        return 0 if ok else EXIT_FAILED
    if ok:
        print("every knob holds its value")
        return 0
    print(f"{len(drift)} knob(s) drifted")
    print(render(("KNOB", "WANTED", "ACTUAL"), drift))
    return EXIT_FAILED


async def cmd_hold(client: Client, args: argparse.Namespace) -> int:
    command = args.command_line
    if not command:
        print("dsr1ctl: hold needs a command: dsr1ctl hold PROFILE -- COMMAND…", file=sys.stderr)
        return EXIT_USAGE
    reason = args.reason or " ".join(command)
    (cookie,) = await client.call("HoldProfile", "sss", args.profile, reason, "dsr1ctl")
    # Handlers go in before the command starts, so no signal can orphan it.
    pending: list[int] = []
    started: list[asyncio.subprocess.Process] = []
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda s=sig: started[0].send_signal(s) if started
                                else pending.append(s))
    try:
        proc = await asyncio.create_subprocess_exec(*command)
    except OSError as exc:
        await client.call("ReleaseProfile", "u", cookie)
        print(f"dsr1ctl: cannot run {command[0]}: {exc.strerror}", file=sys.stderr)
        return 127
    started.append(proc)
    for sig in pending:
        proc.send_signal(sig)
    code = await proc.wait()
    try:
        await client.call("ReleaseProfile", "u", cookie)
    except ClientError as exc:  # a manual switch may have cancelled it already
        print(f"dsr1ctl: note: {exc.message}", file=sys.stderr)
    return code if code >= 0 else 128 - code


async def cmd_watch(client: Client, args: argparse.Namespace) -> int:
    tty = sys.stdout.isatty()
    count = 0
    while args.count is None or count < args.count:
        props, t = await client.properties(), await client.telemetry()
        stamp = time.strftime("%H:%M:%S")
        holds = f" (held: {props['Holds'][-1][1]})" if props["Holds"] else ""
        line = (f"{stamp}  profile {props['ActiveProfile']}{holds}  "
                f"throttle {props['ThrottleState']}  {_telemetry_line(t)}")
        if tty:
            per_cpu = t.get("cpu_util_percent", [])
            mhz = t.get(CPU_MHZ, [None] * len(per_cpu))
            rows = [(f"cpu{i}", f"{u:.0f}%", f"{m:.0f}" if m else "-")
                    for i, (u, m) in enumerate(zip(per_cpu, mhz))]
            sys.stdout.write("\033[H\033[2J" + line + "\n\n"
                             + render(("CPU", "UTIL", "MHZ"), rows) + "\n")
        else:
            print(line)
        sys.stdout.flush()
        count += 1
        if args.count is None or count < args.count:
            await asyncio.sleep(args.interval)
    return 0


DIM, RESET = "\033[2m", "\033[0m"


def _generation_options(args: argparse.Namespace) -> dict[str, Variant]:
    options: dict[str, Variant] = {}
    if args.max_new_tokens is not None:
        options["max_new_tokens"] = Variant("u", args.max_new_tokens)
    if args.temperature is not None:
        options["temperature"] = Variant("d", args.temperature)
    if args.top_p is not None:
        options["top_p"] = Variant("d", args.top_p)
    if args.greedy:
        options["greedy"] = Variant("b", True)
    if args.seed is not None:
        options["seed"] = Variant("t", args.seed)
    if args.ignore_eos:
        options["ignore_eos"] = Variant("b", True)
    return options


class _Printer:
    """Prints streamed pieces as they arrive: reasoning dimmed (or marked), then the answer.

    The daemon sends a model's reasoning between two pieces that are exactly ``<think>`` and
    ``</think>`` (the engine's own split, see ``engine_host``); everything else is answer."""

    def __init__(self, tty: bool, show_reasoning: bool) -> None:
        self.tty = tty
        self.show_reasoning = show_reasoning
        self.kind = ""
        self.in_reasoning = False

    def feed(self, text: str, final: bool = False) -> None:
        if text in ("<think>", "</think>"):
            self.in_reasoning = text == "<think>"
            return
        kind = "reasoning" if self.in_reasoning else "answer"
        if not text or (kind == "reasoning" and not self.show_reasoning):
            return
        if kind != self.kind:
            self._switch(kind)
        sys.stdout.write(text)
        sys.stdout.flush()

    def _switch(self, kind: str) -> None:
        if self.tty:
            sys.stdout.write(DIM if kind == "reasoning" else RESET + ("\n" if self.kind else ""))
        else:
            sys.stdout.write(f"[{kind}]\n" if not self.kind else f"\n[{kind}]\n")
        self.kind = kind

    def close(self) -> None:
        if self.tty and self.kind == "reasoning":
            sys.stdout.write(RESET)
        sys.stdout.write("\n")


async def cmd_generate(client: Client, args: argparse.Namespace) -> int:
    printer = _Printer(sys.stdout.isatty(), not args.no_reasoning)
    done: asyncio.Future = asyncio.get_running_loop().create_future()
    job_id: list[int] = []
    early: list[Message] = []

    def on_signal(msg: Message) -> None:
        if msg.message_type != MessageType.SIGNAL or msg.path != ENGINE_PATH:
            return
        if not job_id:
            early.append(msg)  # a signal that raced the Submit reply
            return
        if msg.body[0] != job_id[0]:
            return
        if msg.member == "Token":
            printer.feed(msg.body[1])
        elif msg.member == "Finished" and not done.done():
            done.set_result({k: v.value for k, v in msg.body[1].items()})

    client.bus.add_message_handler(on_signal)
    await client.call("AddMatch", "s", f"type='signal',sender='{BUS_NAME}',path='{ENGINE_PATH}'",
                      interface="org.freedesktop.DBus", destination="org.freedesktop.DBus",
                      path="/org/freedesktop/DBus")
    (job,) = await client.call("Submit", "sa{sv}", args.prompt, _generation_options(args),
                               interface=ENGINE, path=ENGINE_PATH)
    job_id.append(job)
    for msg in early:
        on_signal(msg)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, lambda: loop.create_task(
        client.call("Cancel", "t", job, interface=ENGINE, path=ENGINE_PATH)))
    stats = await done
    printer.feed("", final=True)
    printer.close()
    if "error" in stats:
        print(f"dsr1ctl: {stats['error']}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:  # the stats as one JSON object on stderr, after the streamed text
        print(json.dumps(_unwrap(stats), sort_keys=True, default=str), file=sys.stderr)
        return 0
    print(f"-- {stats['new_tokens']} tokens ({stats['prompt_tokens']} prompt), first token "
          f"{stats['first_token_latency_s'] * 1000:.0f} ms, {stats['decode_tokens_per_s']:.2f} "
          f"tokens/s decode, reasoning {stats['reasoning_chars']} chars, answer "
          f"{stats['answer_chars']} chars, {stats['dtype']} on {stats.get('backend', 'torch')}, "
          f"{stats['threads']} threads, "
          f"stop: {stats['finish_reason']}", file=sys.stderr)
    return 0


async def cmd_record(client: Client, args: argparse.Namespace) -> int:
    from dsr1d.client.plot import RecordWriter, flatten, progress_line

    if not (args.seconds > 0 and 0 < args.interval < float("inf")):  # NaN fails too
        print("dsr1ctl: record: --seconds and --interval must be positive", file=sys.stderr)
        return EXIT_USAGE
    try:
        writer = RecordWriter(args.file)
    except OSError as exc:
        print(f"dsr1ctl: cannot write {args.file}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    tty = sys.stdout.isatty()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)  # Ctrl-C ends the recording early, kept
    start = time.monotonic()
    try:
        tick = 0
        while not stop.is_set():
            now = time.monotonic() - start
            props, t = await client.properties(), await client.telemetry()
            row = flatten(now, props, t)
            writer.add(row)
            if tty:
                print(progress_line(row), flush=True)
            tick += 1
            if tick * args.interval > args.seconds + 1e-9:
                break
            delay = start + tick * args.interval - time.monotonic()
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, delay))
            except asyncio.TimeoutError:
                pass
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        writer.close()
    elapsed = float(writer.rows[-1]["time_s"]) if writer.rows else 0.0
    print(f"{args.file}: {len(writer.rows)} samples over {elapsed:.1f} s"
          + (" (stopped early)" if stop.is_set() else ""))
    return 0


async def cmd_plot(client: Client | None, args: argparse.Namespace) -> int:
    from dsr1d.client.plot import PlotError, plot_file

    try:
        tl = plot_file(args.file, args.out, args.title, args.baseline)
    except PlotError as exc:
        print(f"dsr1ctl: {exc}", file=sys.stderr)
        return exc.exit_code
    steps = len(tl.changes())
    print(f"{args.out}: {len(tl.time)} samples ({tl.source}), {steps} mitigation change(s)")
    return 0


async def cmd_reload(client: Client, args: argparse.Namespace) -> int:
    await client.call("Reload", "")
    print("reloaded")
    return 0


COMMANDS = {"status": cmd_status, "generate": cmd_generate, "list": cmd_list, "profile": cmd_profile,
            "verify": cmd_verify, "hold": cmd_hold, "watch": cmd_watch, "record": cmd_record,
            "plot": cmd_plot, "reload": cmd_reload}


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="dsr1ctl", description="control the dsr1d daemon")
    top.add_argument("--version", action="version", version=f"dsr1ctl {__version__}")
    top.add_argument("--json", action="store_true",
                     help="machine-readable output of status, list, verify and generate's stats")
    top.add_argument("--bus-address", default=os.environ.get("DSR1D_BUS_ADDRESS"),
                     help="D-Bus address (default: the system bus)")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                         help="machine-readable output")
    sub.add_parser("status", parents=[as_json], help="active profile, holds, tunables, telemetry")
    sub.add_parser("list", parents=[as_json], help="the profiles (* = active)")
    profile = sub.add_parser("profile", help="switch to a profile (cancels holds); the active "
                             "one is re-applied, which repairs drift")
    profile.add_argument("name")
    profile.add_argument("--reapply", action="store_true",
                         help="say it: re-apply even if NAME is active (always done)")
    sub.add_parser("reload", help="re-read the daemon's configuration and profiles")
    sub.add_parser("verify", parents=[as_json], help="compare every knob with the active profile")
    hold = sub.add_parser("hold", help="hold a profile while a command runs")
    hold.add_argument("profile")
    hold.add_argument("--reason", help="shown in status (default: the command)")
    hold.add_argument("command_line", nargs="*", metavar="-- COMMAND…")
    gen = sub.add_parser("generate", parents=[as_json],
                         help="generate with the engine, streaming tokens")
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=int)
    gen.add_argument("--temperature", type=float, help="default 0.6 (DeepSeek's guidance)")
    gen.add_argument("--top-p", type=float, help="default 0.95")
    gen.add_argument("--greedy", action="store_true", help="always the most likely token")
    gen.add_argument("--seed", type=int)
    gen.add_argument("--ignore-eos", action="store_true",
                     help="generate exactly --max-new-tokens (for benchmarks)")
    gen.add_argument("--no-reasoning", action="store_true", help="hide the <think> block")
    watch = sub.add_parser("watch", help="live view of profile and telemetry")
    watch.add_argument("--interval", type=float, default=1.0, help="seconds between updates")
    watch.add_argument("--count", type=int, help="stop after this many updates")
    record = sub.add_parser("record", help="sample telemetry and throttle state into a CSV")
    record.add_argument("--seconds", type=float, required=True, help="how long to record")
    record.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    record.add_argument("file", metavar="FILE")
    plot = sub.add_parser("plot", help="draw a CSV of record or `dsr1d simulate --csv` as a "
                                       "timeline (.png, .svg or .pdf; needs no daemon)")
    plot.add_argument("file", metavar="FILE")
    plot.add_argument("out", metavar="OUT", help="the figure; its suffix names the format")
    plot.add_argument("--title", help="instead of one made from the file")
    plot.add_argument("--baseline", type=Path, metavar="B.csv",
                      help="another run drawn beneath (e.g. dsr1d simulate --policy stock)")
    return top


async def _main(args: argparse.Namespace) -> int:
    if args.command == "plot":  # reads a file: no bus
        return await cmd_plot(None, args)
    try:
        client = await Client.connect(args.bus_address)
    except (OSError, ValueError) as exc:
        print(f"dsr1ctl: cannot reach the bus: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        return await COMMANDS[args.command](client, args)
    except ClientError as exc:
        if exc.exit_code == EXIT_UNREACHABLE:
            print("dsr1ctl: dsr1d is not running (start it: systemctl start dsr1d)", file=sys.stderr)
        elif exc.exit_code == EXIT_DENIED:
            print(f"dsr1ctl: access denied: {args.command} needs root or membership in the "
                  "dsr1d group", file=sys.stderr)
        else:
            print(f"dsr1ctl: {exc.message}", file=sys.stderr)
        return exc.exit_code
    finally:
        client.bus.disconnect()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # argparse mishandles "--" inside a subcommand: everything after it is the held command.
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser().parse_args(argv[:split])
    if split < len(argv):
        args.command_line = argv[split + 1:]
    try:
        code = asyncio.run(_main(args))
        sys.stdout.flush()  # here, where a closed pipe can still be caught
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `dsr1ctl status | head -2`: the reader left, and that is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
