"""``dsr1d``: the daemon's local admin commands (root, no bus needed).

Exit status: 0 done; 1 the machine disagreed (a write failed, drift found, a knob not restored);
2 bad input (usage, unknown or malformed profile); 3 the journal was refused (corrupt or
belonging to another root) and left untouched.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from dsr1d import __version__
from dsr1d.contract.sysroot import KnobError, SysRoot
from dsr1d.core.config import DEFAULT_PATH as DEFAULT_CONFIG
from dsr1d.core.config import load_config, with_overrides
from dsr1d.core.context import Core, build_core
from dsr1d.core.plugin_manager import PluginError
from dsr1d.core.profiles import ProfileError, UnknownProfile
from dsr1d.core.state import JournalBusy, JournalError, OwnerLock
from dsr1d.core.tuning import ApplyFailed, Plan, TuningError
from dsr1d.table import render

EXIT_FAILED, EXIT_USAGE, EXIT_JOURNAL, EXIT_BUSY = 1, 2, 3, 4


def _json(data: object) -> int:
    print(json.dumps(data, indent=1, sort_keys=True))
    return 0


def cmd_probe(core: Core, args: argparse.Namespace) -> int:
    if getattr(args, "json", False):
        return _json({"tunables": [{"name": i.name, "supported": i.support.supported,
                                    "detail": i.support.detail, "current": i.current}
                                   for i in core.tuner.probe()],
                      "engine": engine_line(core.root).splitlines()})
    rows = []
    for info in core.tuner.probe():
        current = " ".join(f"{k}={v}" for k, v in info.current.items()) or "-"
        rows.append((info.name, "yes" if info.support.supported else "no", current,
                     info.support.detail))
    print(render(("TUNABLE", "SUPPORTED", "CURRENT", "DETAIL"), rows))
    print()
    print(engine_line(core.root))
    return 0


def engine_line(root: SysRoot) -> str:
    """The engine's llama-server and its build, the reference llama.cpp binding, and where a
    plan would put the decode threads."""
    from dsr1d.core.placement import describe, plan, read_topology
    from dsr1d.edges.engine_command import find_binary, version
    from dsr1d.engine import llama_build

    placement = describe(plan(read_topology(root), None, 0))
    binary = find_binary()
    server = f"{binary} ({version(binary)})" if binary else \
        "llama-server is not installed (make setup builds it)"
    reference = llama_build.build_info() if llama_build.installed() else \
        "llama-cpp-python is not installed"
    return f"engine: {server}\nreference binding: {reference}\nplacement: {placement}"


def cmd_list(core: Core, args: argparse.Namespace) -> int:
    profiles, errors = core.store.load_all()
    active = core.tuner.active()
    if getattr(args, "json", False):
        _json([{"name": n, "summary": p.summary, "active": n == active}
               for n, p in profiles.items()])
        for error in errors:
            print(f"dsr1d: skipped broken profile: {error}", file=sys.stderr)
        return 0
    rows = [("*" if name == active else "", name, p.summary) for name, p in profiles.items()]
    print(render(("", "PROFILE", "SUMMARY"), rows))
    for error in errors:
        print(f"dsr1d: skipped broken profile: {error}", file=sys.stderr)
    return 0


def _print_plan(plan: Plan, dry_run: bool) -> None:
    verb = "would set" if dry_run else "set"
    for change in plan.releases:
        print(f"  {change.tunable:10} {'would restore' if dry_run else 'restored'} "
              f"{change.where}: {change.current} -> {change.wanted}")
    for change in plan.changes:
        print(f"  {change.tunable:10} {verb} {change.where}: {change.current} -> {change.wanted}")
    if plan.unchanged:
        print(f"  ({len(plan.unchanged)} knob(s) already as wanted)")
    for name, why in plan.unsupported.items():
        print(f"  {name:10} skipped: unsupported here: {why}")
    for skip in plan.skips:
        print(f"  {skip.tunable:10} skipped {skip.option}: {skip.reason}")


def cmd_apply(core: Core, args: argparse.Namespace) -> int:
    profile = core.store.load(args.profile)
    if args.dry_run:
        plan = core.tuner.plan(profile)
        print(f"dry run: applying {profile.name} would make {len(plan.writes)} write(s):")
        _print_plan(plan, dry_run=True)
        return 0
    with owning(core, "dsr1d apply"):
        plan = core.tuner.switch(profile)
    print(f"applied {profile.name}: {len(plan.writes)} write(s)")
    _print_plan(plan, dry_run=False)
    if any(key.startswith("pmqos:") for key in plan.wanted):
        print("dsr1d: note: the PM QoS latency request (cstate max_latency_us) lasts only as long "
              "as the process that made it: it ended when this command exited. Run the daemon "
              "(`dsr1d run`, or `systemctl start dsr1d`) to hold it.", file=sys.stderr)
    return 0


@contextmanager
def owning(core: Core, who: str) -> Iterator[None]:
    """Hold the journal's writer lock (JournalBusy while the daemon or another command has it)."""
    lock = OwnerLock(core.journal.path)
    lock.acquire(who)
    try:
        yield
    finally:
        lock.release()


def cmd_verify(core: Core, args: argparse.Namespace) -> int:
    result = core.tuner.verify()
    if getattr(args, "json", False):
        _json({"profile": result.profile, "notes": result.notes,
               "drift": [{"tunable": d.tunable, "knob": d.where, "wanted": d.wanted,
                          "actual": d.actual} for d in result.drift]})
        return EXIT_FAILED if result.drift else 0
    if result.profile is None:
        print("no profile applied (no journal)")
        return 0
    for note in result.notes:
        print(f"note: {note}")
    if not result.drift:
        print(f"{result.profile}: every knob holds its value")
        return 0
    print(f"{result.profile}: {len(result.drift)} knob(s) drifted")
    print(render(("TUNABLE", "KNOB", "WANTED", "ACTUAL"),
                 [(d.tunable, d.where, d.wanted, d.actual) for d in result.drift]))
    return EXIT_FAILED


def cmd_restore(core: Core, args: argparse.Namespace) -> int:
    with owning(core, "dsr1d restore"):
        if args.discard:
            return _discard(core)
        restored, errors = core.tuner.restore()
    for change in restored:
        print(f"  {change.tunable:10} restored {change.where}: {change.current} -> {change.wanted}")
    for knob in core.tuner.vanished:
        print(f"dsr1d: note: {knob} no longer exists (a CPU unplugged?): nothing to restore "
              f"there", file=sys.stderr)
    for error in errors:
        print(f"dsr1d: {error}", file=sys.stderr)
    if errors:
        print(f"dsr1d: {len(errors)} knob(s) not restored; the journal keeps them: "
              f"{core.journal.path}", file=sys.stderr)
        return EXIT_FAILED
    print(f"restored {len(restored)} knob(s)" if restored else "nothing to restore")
    return 0


def _discard(core: Core) -> int:
    path = core.journal.path
    if not path.exists():
        print("no journal")
        return 0
    aside = path.with_name(f"{path.name}.discarded-{int(time.time())}")
    path.rename(aside)
    print(f"moved {path} aside to {aside}; nothing was restored")
    return 0


COMMANDS: dict[str, Callable[[Core, argparse.Namespace], int]] = {
    "probe": cmd_probe, "list": cmd_list, "apply": cmd_apply,
    "verify": cmd_verify, "restore": cmd_restore,
}


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", default=argparse.SUPPRESS,
                        help="hardware root (default /; a fake tree in tests)")
    common.add_argument("--journal", default=argparse.SUPPRESS,
                        help="journal path (default <root>/run/dsr1d/state.json)")
    common.add_argument("--profiles-dir", default=argparse.SUPPRESS,
                        help="user profile directory (default <root>/etc/dsr1d/profiles)")
    common.add_argument("--config", default=argparse.SUPPRESS,
                        help="the daemon's configuration, whose root, journal and profiles_dir "
                             "are the defaults here (default /etc/dsr1d/dsr1d.conf)")
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                         help="machine-readable output (probe, list, verify)")
    top = argparse.ArgumentParser(prog="dsr1d", parents=[common, as_json],
                                  description="dsr1d admin commands (run as root)")
    top.add_argument("--version", action="version", version=f"dsr1d {__version__}")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("probe", parents=[common, as_json],
                   help="which tunables work here, and their values")
    sub.add_parser("list", parents=[common, as_json], help="the profiles (* = active)")
    apply = sub.add_parser("apply", parents=[common], help="apply or switch to a profile")
    apply.add_argument("profile")
    apply.add_argument("--dry-run", action="store_true", help="show the plan, write nothing")
    sub.add_parser("verify", parents=[common, as_json],
                   help="compare every knob with the active profile")
    model = sub.add_parser("model", help="model tools: `dsr1d model synth --preset tiny DIR`, "
                           "`dsr1d model convert SRC_DIR OUT.gguf --dtype int4`, "
                           "`dsr1d model check DIR` (llama.cpp against the torch reference)")
    model.add_argument("model_args", nargs=argparse.REMAINDER,
                       help="synth --preset tiny|1.5b|7b|draft [--seed N] [--dtype D] "
                            "[--gguf DTYPE] "
                            "[--force] DIR | convert SRC_DIR OUT.gguf [--dtype bf16|int8|int4] | "
                            "check DIR [--dtype fp32|bf16|int8|int4] [--tokens N] [--json]")
    simulate = sub.add_parser("simulate", help="the thermal plant simulator "
                              "(`dsr1d simulate --help`)")
    simulate.add_argument("sim_args", nargs=argparse.REMAINDER,
                          help="[--seconds N] [--mitigate|--no-mitigate] [--csv FILE] "
                               "[--fake-root DIR --realtime]")
    run = sub.add_parser("run", parents=[common], help="the daemon (systemd runs this)")
    run.add_argument("--bus-address", help="D-Bus address (default: the system bus, or "
                     "$DBUS_SYSTEM_BUS_ADDRESS)")
    run.add_argument("--verbose", action="store_true", help="debug logging")
    restore = sub.add_parser("restore", parents=[common], help="put back every changed knob")
    restore.add_argument("--discard", action="store_true",
                         help="move an unusable journal aside without restoring anything")
    return top


def core_paths(args: argparse.Namespace) -> tuple[str, str | None, str | None]:
    """Root, journal and profile directory, resolved as ``dsr1d run`` resolves them
    (`config.with_overrides`): the same flags reach the same journal, so ``dsr1d restore``
    after a crash — the unit's ExecStopPost — finds the one the daemon used."""
    path = Path(getattr(args, "config", DEFAULT_CONFIG))
    try:
        config = load_config(path)
    except ProfileError as exc:
        if hasattr(args, "config"):
            raise
        print(f"dsr1d: warning: ignoring the broken {path} ({exc}); using the default paths",
              file=sys.stderr)
        config = load_config(None)
    config = with_overrides(config, getattr(args, "root", None), getattr(args, "journal", None),
                            getattr(args, "profiles_dir", None))
    return config.root, config.journal, config.profiles_dir


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["simulate"]:  # its own options; argparse's REMAINDER drops leading ones
        from dsr1d.sim.sim import simulate_main

        return simulate_main(argv[1:])
    args = parser().parse_args(argv)
    if args.command == "model":
        tool = args.model_args[:1]
        if tool == ["synth"]:
            from dsr1d.engine.synth import synth_main

            return synth_main(args.model_args[1:])
        if tool == ["convert"]:
            from dsr1d.engine.gguf_convert import convert_main

            return convert_main(args.model_args[1:])
        if tool == ["check"]:
            from dsr1d.engine.check import check_main

            return check_main(args.model_args[1:])
        print("dsr1d: usage: dsr1d model synth --preset tiny|1.5b|7b|draft DIR | "
              "dsr1d model convert SRC_DIR OUT.gguf --dtype bf16|int8|int4 | "
              "dsr1d model check DIR [--dtype D]", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "run":
        from dsr1d.edges.service import main as run_daemon

        return run_daemon(getattr(args, "config", None), args.bus_address,
                          getattr(args, "root", None),
                          getattr(args, "journal", None), getattr(args, "profiles_dir", None),
                          args.verbose)
    try:
        core = build_core(*core_paths(args))
        return COMMANDS[args.command](core, args)
    except JournalBusy as exc:
        print(f"dsr1d: {exc}: it is the only writer of these knobs while it runs. Switch "
              f"profiles through it (`dsr1ctl profile NAME`, `dsr1ctl reload`), or stop it "
              f"first (`systemctl stop dsr1d`, which restores every knob).", file=sys.stderr)
        return EXIT_BUSY
    except (UnknownProfile, ProfileError, PluginError) as exc:
        print(f"dsr1d: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except JournalError as exc:
        print(f"dsr1d: {exc}", file=sys.stderr)
        return EXIT_JOURNAL
    except (ApplyFailed, TuningError, KnobError) as exc:
        print(f"dsr1d: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
