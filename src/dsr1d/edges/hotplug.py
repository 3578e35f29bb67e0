"""CPU hotplug: a pyudev kernel-event monitor that reports CPUs coming online.

Listens to the kernel source (no udevd needed) for the ``cpu`` subsystem; ``online``,
``add`` and ``change`` events of ``cpuN`` are reported, since the kernel may have reset the
CPU's settings while it was away.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Callable

import pyudev

log = logging.getLogger("dsr1d")
_CPU = re.compile(r"^cpu(\d+)$")
REAPPLY_ACTIONS = {"online", "add", "change"}


class CpuMonitor:
    """Calls ``on_online([cpu])`` from the event loop when a CPU comes (back) online."""

    def __init__(self, on_online: Callable[[list[int]], None]) -> None:
        self.on_online = on_online
        self.monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source="kernel")
        self.monitor.filter_by("cpu")
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.monitor.start()
        self._loop = loop
        loop.add_reader(self.monitor.fileno(), self._drain)

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.monitor.fileno())
            self._loop = None

    def _drain(self) -> None:
        while (device := self.monitor.poll(timeout=0)) is not None:
            match = _CPU.match(device.sys_name)
            if match and device.action in REAPPLY_ACTIONS:
                log.info("cpu%s: kernel event %s", match.group(1), device.action)
                try:
                    self.on_online([int(match.group(1))])
                except Exception as exc:  # a hotplug re-apply must never stop the daemon
                    log.error("re-apply on cpu%s failed: %s", match.group(1), exc)
