"""``dsr1d run``: the asyncio daemon. Wires config, core, bus, udev, sd_notify and signals.

Start: read the config (broken: say why and exit 78 without touching a knob), own
``org.dsr1d`` (already owned: exit 1), restore a leftover journal, apply the default profile,
export the API, ``READY=1``. SIGTERM/SIGINT: ``STOPPING=1``, restore every knob, release the
name, exit 0. SIGHUP (or the ``Reload`` method): ``RELOADING=1``, reload config and profiles,
``READY=1``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable


from dsr1d import __version__
from dsr1d.constants import BUS_NAME, ENGINE_GB_PER_TOKEN, ENGINE_TOKENS_PER_S, PKG_POWER_W
from dsr1d.core.config import DEFAULT_PATH, Config, load_config, with_overrides
from dsr1d.core.context import build_core
from dsr1d.edges.dbus_api import (POLKIT_ACTIONS, Dispatcher, EngineService, ManagerService,
                                   connect, neighbours, take_name)
from dsr1d.core.manager import Manager
from dsr1d.core.mitigator import Mitigator
from dsr1d.core.plugin_manager import PluginError
from dsr1d.core.profiles import ProfileError, UnknownProfile
from dsr1d.core.sampler import Sampler, collect_sources
from dsr1d.core.state import JournalBusy, JournalError, OwnerLock
from dsr1d.core.tuning import ApplyFailed, TuningError
from dsr1d.edges.api import Api, ApiServer, read_keys
from dsr1d.edges.engine_host import EngineHost
from dsr1d.edges.metrics import Metrics
from dsr1d.edges.api_gate import Gate, Limits
from dsr1d.edges.notify import (notify, release_spares, reserve, setup_logging,
                                watchdog_interval_s)
from dsr1d.edges.ratelog import Tally

ENGINE_CONFIG = ("flash_attn", "kv_type", "speculative")   # dsr1d_engine_info's labels
ENGINE_HOLDER = "dsr1d-engine"  # owner of the engine's hold (not a bus name: never "leaves")
EXIT_CONFIG = 78  # EX_CONFIG: the unit does not restart on it (RestartPreventExitStatus)
log = logging.getLogger("dsr1d")


def _load(path: Path | None, overrides: dict[str, str | None]) -> Config:
    return with_overrides(load_config(path), **overrides)


class Daemon:
    """One run of the service."""

    def __init__(self, config_path: Path | None, bus_address: str | None,
                 overrides: dict[str, str | None]) -> None:
        self.config_path = config_path
        self.bus_address = bus_address
        self.overrides = overrides
        self.stop_event = asyncio.Event()
        self.sampler: Sampler | None = None
        self.mitigator: Mitigator | None = None
        self.latest: dict = {}
        self.energy_j = 0.0
        self._energy_at: float | None = None
        self.manager: Manager | None = None
        self.engine: EngineHost | None = None
        self._sync_threads: Callable[[], None] = lambda: None
        self._tokens_at: tuple[float, int] | None = None
        self.api: ApiServer | None = None
        self.metrics: Metrics | None = None

    async def run(self) -> int:
        reserve()
        _quiet_loop_errors(asyncio.get_running_loop())
        try:
            config = _load(self.config_path, self.overrides)
        except ProfileError as exc:
            return self._fail(f"configuration rejected: {exc}", EXIT_CONFIG)
        bus = await connect(self.bus_address)
        try:
            self.manager = manager = Manager(build_core(config.root, config.journal,
                                                        config.profiles_dir), config)
            self.sampler = Sampler(manager.core.root, collect_sources(manager.core.pm))
        except PluginError as exc:
            bus.disconnect()
            return self._fail(f"configuration rejected: {exc}", EXIT_CONFIG)
        # One writer: held until this process ends (the kernel drops it if the daemon dies).
        lock = OwnerLock(manager.core.journal.path)
        try:
            lock.acquire("the dsr1d daemon")
        except (JournalBusy, OSError) as exc:
            bus.disconnect()
            return self._fail(f"cannot start: {exc}", 1)
        # Exported before the name is taken, so no caller ever finds the name without objects;
        # start() below runs before the loop can dispatch any call.
        dispatcher = Dispatcher(bus)
        self.engine = self._make_engine(config, manager)
        manager_service = ManagerService(dispatcher, manager, self.reload, self.telemetry)
        await manager_service.export()
        EngineService(dispatcher, self.engine).export()
        if not await take_name(bus, BUS_NAME):
            bus.disconnect()
            return self._fail(f"{BUS_NAME} is already owned on this bus: is dsr1d running?", 1)
        try:
            manager.start()
        except (UnknownProfile, ProfileError) as exc:
            bus.disconnect()
            return self._fail(f"configuration rejected: default profile: {exc}", EXIT_CONFIG)
        except (ApplyFailed, TuningError, JournalError) as exc:
            bus.disconnect()
            return self._fail(f"cannot start: {exc}", 1)
        for name, meaning in (await neighbours(bus)).items():
            log.warning("%s on the bus: %s", name, meaning)
        self.mitigator = self._make_mitigator(manager)
        manager_service.attach_mitigator(self.mitigator)
        manager.change_listeners.append(lambda names: notify(STATUS=manager.status_line()))
        self.api = await self._start_api(config, manager, dispatcher)
        monitor = self._start_hotplug(manager)
        self._install_signals()
        notify(READY="1", STATUS=manager.status_line())
        log.info("ready: %s", manager.status_line(), extra={"PROFILE": manager.active})
        if self.engine is not None:
            self.engine.dtype = engine_setting(config, manager, "dtype")
            self.engine.backend = engine_setting(config, manager, "backend")
            await self.engine.start()
        watchdog = self._start_watchdog()
        sampling = asyncio.get_running_loop().create_task(self._sample_loop(config))
        lost = await self._until_stopped_or_lost(bus)
        sampling.cancel()
        self.sampler.stop()
        release_spares()          # whatever filled the descriptor table, the restore has room
        notify(STOPPING="1", STATUS="restoring every knob")
        if watchdog:
            watchdog.cancel()
        if monitor:
            monitor.stop()
        if self.api is not None:
            await self.api.stop()
        if self.engine is not None:
            await self.engine.stop()
        failed = manager.stop()
        lock.release()
        if lost:
            # Never run nameless: every knob is back, and a non-zero exit lets Restart= bring
            # the daemon back onto the bus.
            return self._fail(f"lost the bus connection ({lost}); knobs restored, exiting", 1)
        await bus.release_name(BUS_NAME)
        bus.disconnect()
        return 1 if failed else 0

    async def _until_stopped_or_lost(self, bus: Any) -> str | None:
        """Wait for a stop request (None) or the bus connection's loss (why)."""
        stop = asyncio.ensure_future(self.stop_event.wait())
        gone = asyncio.ensure_future(bus.wait_for_disconnect())
        done, _ = await asyncio.wait({stop, gone}, return_when=asyncio.FIRST_COMPLETED)
        if gone not in done:
            gone.cancel()
            return None
        stop.cancel()
        try:
            gone.result()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "disconnected"

    async def reload(self) -> list[ProfileError]:
        """Reload config and profiles; a broken config keeps the old one and says why."""
        assert self.manager is not None
        notify(RELOADING="1", MONOTONIC_USEC=str(time.monotonic_ns() // 1000))
        config: Config | None = None
        errors: list[ProfileError] = []
        # Files are read in a thread: the control plane keeps answering while they are.
        try:
            config = await asyncio.to_thread(_load, self.config_path, self.overrides)
        except ProfileError as exc:
            log.error("configuration rejected on reload, keeping the previous one: %s", exc)
            errors.append(exc)
        loaded = await asyncio.to_thread(self.manager.core.store.load_all)
        try:
            errors += self.manager.reload(config, loaded)
        except (ApplyFailed, TuningError) as exc:
            log.error("reload could not re-apply %s: %s", self.manager.active, exc)
        await self._reload_engine(self.manager.config)
        notify(READY="1", STATUS=self.manager.status_line())
        return errors

    async def _reload_engine(self, config: Config) -> None:
        """Engine settings that changed on reload restart the worker with them; adding or
        removing the model needs a restart of the daemon, and the log says so."""
        if self.engine is None:
            if config.model:
                log.warning("model= is now set: the engine starts at the next restart "
                            "(systemctl restart dsr1d)")
            return
        if not config.model:
            log.warning("model= was removed: the engine keeps serving until the next restart "
                        "(systemctl restart dsr1d)")
            return
        self._sync_threads()
        wanted = {"model": Path(config.model), "dtype": engine_setting(config, self.manager,
                                                                      "dtype"),
                  "backend": engine_setting(config, self.manager, "backend"),
                  "cache_dir": Path(config.engine_cache_dir), "context": config.engine_context,
                  "mmap": config.engine_mmap, "cpus": config.engine_cpus,
                  "parallel": config.engine_parallel,
                  "ping_timeout_s": config.engine_ping_timeout_s,
                  "server": config.engine_server, "aliases": tuple(config.aliases),
                  "embeddings": config.engine_embeddings, "draft": config.draft_model,
                  "flash_attn": config.engine_flash_attn, "kv_type": config.engine_kv_type,
                  "draft_max": draft_max(config, self.manager)}
        changed = [k for k, v in wanted.items() if getattr(self.engine, k) != v]
        for key in changed:
            log.info("engine %s %s -> %s: restarting the engine", key,
                     getattr(self.engine, key), wanted[key])
            setattr(self.engine, key, wanted[key])
        if changed:
            await self.engine.stop()
            await self.engine.start()
        else:
            self.engine.reload()      # a model waiting out its back-off is tried again now

    async def _start_api(self, config: Config, manager: Manager,
                         dispatcher: Dispatcher) -> ApiServer | None:
        """The OpenAI-compatible API on its unix socket (and TCP with keys, when configured)."""
        path = config.api_socket if config.api_socket is not None else \
            os.path.join(config.root, "run/dsr1d/api.sock")
        tcp = config.api_tcp
        keys: set[str] = set()
        if tcp:
            try:
                keys = read_keys(config.api_keys_file)
            except (OSError, ValueError) as exc:
                log.error("API over TCP stays off: %s", exc)
                tcp = ""
        if not path and not tcp:
            return None

        async def authorize(pid: int, uid: int) -> bool:
            return await dispatcher.auth.process_allowed(pid, uid, POLKIT_ACTIONS["Generate"])

        self.metrics = Metrics(status=lambda: self._status(manager))
        limits = Limits(config.api_connections, config.api_connections_per_client)
        server = ApiServer(Api(self.engine, authorize, self.metrics, keys, config.api_queue,
                               Gate(limits.within_descriptors())))
        where = await server.start(path, tcp)
        log.info("OpenAI-compatible API on %s", ", ".join(where) or "nothing (see above)")
        return server

    def _status(self, manager: Manager) -> dict[str, Any]:
        """What the metrics show of the daemon, read at scrape time."""
        engine, mitigator = self.engine, self.mitigator
        return {"profile": manager.active, "holds": list(manager.holds),
                "throttle_state": mitigator.state if mitigator else "none",
                "mitigations": mitigator.active if mitigator else [],
                "tokens_per_s": self.latest.get(ENGINE_TOKENS_PER_S, 0.0),
                "decoding": engine is not None and engine.state == "busy",
                "sample": self.latest, "version": __version__,
                "tokens_total": engine.tokens_seen if engine else 0,
                "prompt_tokens_total": engine.prompt_tokens_seen if engine else 0,
                "energy_joules_total": self.energy_j,
                "engine_restarts": engine.restarts if engine else 0,
                "engine_state": engine.state if engine else "unconfigured",
                "engine_build": engine.info.get("build", "") if engine else "",
                "engine_config": {k: str(engine.info.get(k, "")) for k in ENGINE_CONFIG}
                if engine and "kv_type" in engine.info else {}}

    def telemetry(self) -> dict:
        """GetTelemetry: the latest sample (taken now if the sampler has not run yet)."""
        return self.latest or self._take_sample()

    def _take_sample(self) -> dict:
        assert self.sampler is not None
        sample = self.sampler.sample()
        if self.engine is not None:
            sample[ENGINE_TOKENS_PER_S] = self._live_rate()
            sample["engine_state"] = self.engine.state
            figure = self.engine.bytes_per_token
            if figure is not None and self.engine.state == "busy":
                sample[ENGINE_GB_PER_TOKEN] = figure / 1e9
            self._add_energy(sample)
        self.latest = sample
        return sample

    def _add_energy(self, sample: dict) -> None:
        """Package energy while the engine decodes: power times the time since the last
        sample (nothing where the machine reports no power)."""
        now = time.monotonic()
        before, self._energy_at = self._energy_at, now
        watts = sample.get(PKG_POWER_W)
        if before is not None and watts is not None and self.engine is not None \
                and self.engine.state == "busy":
            self.energy_j += float(watts) * (now - before)

    def _live_rate(self) -> float:
        """Tokens per second since the last sample, while the engine decodes (0 when idle: the
        mitigation controller must not read the last job's rate as decode going on)."""
        assert self.engine is not None
        now, count = time.monotonic(), self.engine.tokens_seen
        before, self._tokens_at = self._tokens_at, (now, count)
        if before is None or self.engine.state != "busy" or now <= before[0]:
            return 0.0
        return (count - before[1]) / (now - before[0])

    async def _sample_loop(self, config: Config) -> None:
        """Sample every ``telemetry_interval_s`` and let the mitigator act on it."""
        while True:
            sample = self._take_sample()
            if self.mitigator is not None:
                try:
                    self.mitigator.on_sample(sample)
                except Exception:  # mitigation must never take the control plane down
                    log.exception("mitigation step failed")
            if config.api_textfile and self.metrics is not None:
                try:
                    await asyncio.to_thread(self.metrics.write_textfile, config.api_textfile)
                except OSError as exc:
                    log.error("metrics textfile %s: %s", config.api_textfile, exc)
            await asyncio.sleep(config.telemetry_interval_s)

    def _make_mitigator(self, manager: Manager) -> Mitigator:
        engine = self.engine
        mitigator = Mitigator(manager, threads=(lambda: engine.threads) if engine else None)

        def configure(old: str = "", new: str = "", reason: str = "") -> None:
            section = manager.profiles[manager.active].sections.get("mitigation", {})
            try:
                mitigator.configure(section)
            except ValueError as exc:
                log.error("[mitigation] of %s: %s", manager.active, exc)

        configure()
        manager.profile_listeners.append(configure)
        return mitigator

    def _make_engine(self, config: Config, manager: Manager) -> EngineHost | None:
        """The engine worker's host, holding ``engine_profile`` while it generates."""
        if not config.model:
            return None
        host = EngineHost(Path(config.model), config.engine_dtype, config.engine_threads,
                          config.engine_cpus, backend=config.engine_backend,
                          cache_dir=Path(config.engine_cache_dir), context=config.engine_context,
                          mmap=config.engine_mmap, root=config.root,
                          ping_timeout_s=config.engine_ping_timeout_s,
                          parallel=config.engine_parallel, server=config.engine_server,
                          aliases=tuple(config.aliases),
                          embeddings=config.engine_embeddings, draft=config.draft_model,
                          draft_max=draft_max(config, manager),
                          flash_attn=config.engine_flash_attn, kv_type=config.engine_kv_type)
        cookie: list[int] = []

        def busy(now_busy: bool) -> None:
            try:
                if now_busy and not cookie:
                    cookie.append(manager.hold(config.engine_profile, "the engine is generating",
                                               "dsr1d-engine", ENGINE_HOLDER))
                elif not now_busy and cookie:
                    manager.release(cookie.pop(), ENGINE_HOLDER)
            except Exception as exc:  # a failed hold must not stop generation
                log.warning("engine hold of %s: %s", config.engine_profile, exc)

        def profile_threads(old: str = "", new: str = "", reason: str = "") -> None:
            # A profile's [engine] threads wins while it is active; 0 or unset means the
            # config's engine_threads (0 there: one per physical core).
            if manager.active is None:
                return
            wanted = manager.profiles[manager.active].sections.get("engine", {}).get("threads") \
                or config.engine_threads
            asyncio.get_running_loop().create_task(host.set_profile_threads(wanted))

        self._sync_threads = profile_threads

        host.busy_listeners.append(busy)
        manager.profile_listeners.append(profile_threads)
        return host

    def _fail(self, message: str, code: int) -> int:
        log.error("%s", message)
        notify(STATUS=message, ERRNO="22" if code == EXIT_CONFIG else "1")
        return code

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_event.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(self.reload()))

    def _start_hotplug(self, manager: Manager):
        try:
            from dsr1d.edges.hotplug import CpuMonitor

            monitor = CpuMonitor(manager.reapply_cpus)
            monitor.start(asyncio.get_running_loop())
            return monitor
        except Exception as exc:  # no netlink (some containers): run without hotplug
            log.warning("CPU hotplug monitor unavailable: %s", exc)
            return None

    def _start_watchdog(self) -> asyncio.Task[None] | None:
        interval = watchdog_interval_s()
        if interval is None:
            return None

        async def ping() -> None:
            while True:
                notify(WATCHDOG="1")
                await asyncio.sleep(interval)

        return asyncio.get_running_loop().create_task(ping())


def engine_setting(config: Config, manager: Manager, key: str) -> str:
    """The engine's ``dtype`` or ``backend``: the config's ``engine_<key>`` unless it is ``auto``,
    else the default profile's ``[engine] <key>``, else ``auto``. Read at engine start and on
    reload (a change restarts the engine)."""
    value = getattr(config, f"engine_{key}")
    return value if value != "auto" else str(_profile_engine(config, manager, key, "auto"))


def _quiet_loop_errors(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio's own errors (an accept out of descriptors, retried each second) logged once
    per interval with a count, never a line each."""
    tally = Tally(log)

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        tally(context.get("message"), logging.ERROR, "%s%s", context.get("message"),
              f": {type(exc).__name__}: {exc}" if exc else "")

    loop.set_exception_handler(handle)


def draft_max(config: Config, manager: Manager) -> int:
    """Tokens drafted per step: the default profile's ``[engine] draft_max``, else the
    config's."""
    return int(_profile_engine(config, manager, "draft_max", config.draft_max))


def _profile_engine(config: Config, manager: Manager, key: str, default: Any) -> Any:
    """The default profile's ``[engine] key``, or ``default``."""
    profile = manager.profiles.get(config.default_profile)
    return profile.sections.get("engine", {}).get(key, default) if profile else default


def main(config: str | None, bus_address: str | None, root: str | None, journal: str | None,
         profiles_dir: str | None, verbose: bool = False) -> int:
    """Entry point of ``dsr1d run``."""
    setup_logging(verbose)
    path = Path(config) if config else DEFAULT_PATH
    overrides = {"root": root, "journal": journal, "profiles_dir": profiles_dir}
    return asyncio.run(Daemon(path, bus_address, overrides).run())
