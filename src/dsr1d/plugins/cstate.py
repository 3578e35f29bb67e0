"""CPU idle states (``[cstate]``).

Waking from a deep C-state costs tens to hundreds of microseconds, paid again and again as
decode threads sleep on each other between layers; deep package C-states also let the uncore
(and so memory bandwidth) clock down. A latency limit keeps cores in shallow states.

Knobs, from gentlest to bluntest:

- ``max_latency_us``: a PM QoS request held on ``/dev/cpu_dma_latency`` for as long as the
  process that applied it lives (the kernel drops it if we die: crash-safe by design);
- ``disable`` / ``disable_deeper_than_us``: ``cpuN/cpuidle/stateK/disable`` by state name or
  exit latency. The ``haltpoll`` governor ignores ``disable``; when it is active, the governor is
  switched to ``menu`` as part of the change (and restored with it);
- ``governor``: ``cpuidle/current_governor``;
- ``pkg_cstate_limit``: Intel MSR 0xE2 (MSR_PKG_CST_CONFIG_CONTROL) bits 3:0, a model-specific
  encoding (SDM vol. 4), written only when the register is not locked (bit 15).

Example::

    [cstate]
    max_latency_us = 0
    disable_deeper_than_us = 20
"""

from __future__ import annotations

from typing import Any

from dsr1d.contract.hookspecs import hookimpl
from dsr1d.contract.knobs import FileKnob, MsrKnob, PmQosKnob
from dsr1d.contract.schema import choice, integer, option, word_list
from dsr1d.contract.sysroot import CPU_DIR, SysRoot
from dsr1d.contract.tunable import Action, Setting, Skip, Support, summarize_per_cpu

CPUIDLE = f"{CPU_DIR}/cpuidle"
GOVERNOR = f"{CPUIDLE}/current_governor"
GOVERNORS = f"{CPUIDLE}/available_governors"
DRIVER = f"{CPUIDLE}/current_driver"
MSR_PKG_CST_CONFIG_CONTROL = 0xE2
PKG_CST_LOCK = 1 << 15
IGNORES_DISABLE = "haltpoll"


def _states(root: SysRoot, cpu: int) -> list[tuple[str, str, int]]:
    """(directory, name, exit latency µs) of each idle state of ``cpu``."""
    found = []
    for path in root.glob_fixed(f"{CPU_DIR}/cpu{cpu}/cpuidle/state*"):
        found.append((path, root.read_fixed(f"{path}/name"),
                      int(root.read_fixed(f"{path}/latency"))))
    return found


def _pkg_limit_detail(root: SysRoot) -> str | None:
    """Why MSR 0xE2 cannot be written, or None when it can."""
    if root.cpu_vendor() != "GenuineIntel":
        return "package C-state limit: Intel only (MSR 0xE2)"
    if not root.msr_available(0):
        return f"package C-state limit: no {root.display(root.msr_path(0))}"
    try:
        value = root.read_msr(0, MSR_PKG_CST_CONFIG_CONTROL)
    except OSError as exc:
        return f"package C-state limit: MSR 0xE2 unreadable ({exc.strerror})"
    if value & PKG_CST_LOCK:
        return "package C-state limit: MSR 0xE2 is locked by firmware (bit 15)"
    return None


class Cstate:
    name = "cstate"
    summary = "idle states: PM QoS latency limit, per-state disable, governor, package limit"
    per_cpu = True
    options = {
        "max_latency_us": option(
            integer(0, 2_000_000_000),
            "PM QoS CPU latency limit in µs, held while dsr1d runs (0 = stay in the shallowest state)",
            "µs",
        ),
        "disable": option(word_list, "idle states to disable, by name (e.g. C6 C10)", "names"),
        "disable_deeper_than_us": option(
            integer(0, 1_000_000), "disable every idle state whose exit latency exceeds this", "µs"
        ),
        "governor": option(
            choice("menu", "teo", "ladder", "haltpoll"), "cpuidle governor", "menu|teo|ladder|haltpoll"
        ),
        "pkg_cstate_limit": option(
            integer(0, 15),
            "deepest package C-state (MSR 0xE2 bits 3:0, model-specific encoding); Intel only",
            "0..15",
        ),
    }

    def probe(self, root: SysRoot) -> Support:
        parts = []
        if root.pm_qos_available():
            parts.append("PM QoS via /dev/cpu_dma_latency")
        states = _states(root, 0)
        if states:
            gov = root.read(GOVERNOR) if root.exists(GOVERNOR) else "unknown"
            parts.append(f"{len(states)} idle states ({', '.join(s[1] for s in states)}), governor {gov}")
            if gov == IGNORES_DISABLE:
                parts.append("haltpoll ignores per-state disable: switched to menu when disabling")
        else:
            driver = root.read(DRIVER) if root.exists(DRIVER) else "absent"
            parts.append(f"no cpuidle states (driver: {driver})")
        why_not_pkg = _pkg_limit_detail(root)
        parts.append(why_not_pkg or "package C-state limit via MSR 0xE2")
        supported = root.pm_qos_available() or bool(states) or why_not_pkg is None
        return Support(supported, "; ".join(parts))

    def read(self, root: SysRoot) -> dict[str, str]:
        current: dict[str, str] = {}
        if root.pm_qos_available():
            current["latency_limit_us"] = str(root.pm_qos_effective())
        if root.exists(GOVERNOR):
            current["governor"] = root.read(GOVERNOR)
        disabled = {}
        for cpu in root.online_cpus():
            names = [name for path, name, _ in _states(root, cpu) if root.read(f"{path}/disable") == "1"]
            disabled[cpu] = ",".join(names) or "none"
        if any(_states(root, 0)):
            current["disabled"] = summarize_per_cpu(disabled)
        if _pkg_limit_detail(root) is None:
            current["pkg_cstate_limit"] = MsrKnob(0, MSR_PKG_CST_CONFIG_CONTROL, 0xF).read(root)
        return current

    def apply(
        self, root: SysRoot, options: dict[str, Any], cpus: list[int] | None = None
    ) -> list[Action]:
        targets = root.online_cpus() if cpus is None else cpus
        actions: list[Action] = []
        if "max_latency_us" in options and cpus is None:
            actions.append(self._pm_qos(root, options["max_latency_us"]))
        disables = self._disables(root, options, targets)
        governor = self._governor(
            root, options, wants_disable=any(isinstance(a, Setting) for a in disables)
        )
        if any(isinstance(a, Skip) and a.option == "disable" for a in governor):
            disables = [a for a in disables if isinstance(a, Skip)]  # would be ignored anyway
        actions += governor + disables
        if "pkg_cstate_limit" in options:
            actions += self._pkg_limit(root, options["pkg_cstate_limit"], targets)
        return actions

    def _pm_qos(self, root: SysRoot, latency: int) -> Action:
        if not root.pm_qos_available():
            return Skip(self.name, "max_latency_us", f"no {root.display('dev/cpu_dma_latency')}")
        return Setting(self.name, PmQosKnob(), str(latency))

    def _disables(self, root: SysRoot, options: dict[str, Any], cpus: list[int]) -> list[Action]:
        names = set(options.get("disable", []))
        deeper = options.get("disable_deeper_than_us")
        if not names and deeper is None:
            return []
        actions: list[Action] = []
        seen: set[str] = set()
        for cpu in cpus:
            for path, name, latency in _states(root, cpu):
                seen.add(name)
                if name in names or (deeper is not None and latency > deeper):
                    actions.append(Setting(self.name, FileKnob(f"{path}/disable"), "1"))
        if not seen:
            actions.append(Skip(self.name, "disable", "no cpuidle states on this machine"))
        elif names - seen:
            actions.append(Skip(self.name, "disable", f"no idle state named {sorted(names - seen)} "
                                f"(states here: {sorted(seen)})"))
        return actions

    def _governor(self, root: SysRoot, options: dict[str, Any], wants_disable: bool) -> list[Action]:
        wanted = options.get("governor")
        if wanted is None and not wants_disable:
            return []
        if not root.exists(GOVERNOR):
            return [Skip(self.name, "governor", f"no writable {root.display(GOVERNOR)}")]
        available = root.read(GOVERNORS).split() if root.exists(GOVERNORS) else []
        effective = wanted or root.read(GOVERNOR)
        if wants_disable and effective == IGNORES_DISABLE:
            if "menu" not in available:
                return [Skip(self.name, "disable", "the haltpoll governor ignores per-state disable "
                             "and no other governor is available")]
            wanted = "menu"
        if wanted is None:
            return []
        if wanted not in available:
            return [Skip(self.name, "governor", f"{wanted!r} is not available (have: {available})")]
        return [Setting(self.name, FileKnob(GOVERNOR), wanted)]

    def _pkg_limit(self, root: SysRoot, limit: int, cpus: list[int]) -> list[Action]:
        why_not = _pkg_limit_detail(root)
        if why_not is not None:
            return [Skip(self.name, "pkg_cstate_limit", why_not)]
        return [Setting(self.name, MsrKnob(cpu, MSR_PKG_CST_CONFIG_CONTROL, 0xF), str(limit))
                for cpu in cpus if root.msr_available(cpu)]


@hookimpl
def register_tunables(register: Any) -> None:
    register(Cstate())
