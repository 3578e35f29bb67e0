"""RAPL energy counters → watts (telemetry source ``rapl``).

``/sys/class/powercap/intel-rapl:N`` (a package, ``psys``) and ``intel-rapl:N:M`` (its
``core``, ``uncore``, ``dram`` subdomains; AMD exposes the same interface) each hold
``energy_uj``, a counter in µJ that wraps at ``max_energy_range_uj``. Power is the energy
delta over the time between two reads. Since CVE-2020-8694 (PLATYPUS) ``energy_uj`` is
readable by root only.

Keys: ``rapl_<domain>_w`` (``rapl_package_0_w``, ``rapl_package_0_dram_w``, ``rapl_psys_w``),
``pkg_power_w`` (the packages summed), ``ram_power_w`` (the ``dram`` domains summed, none when
one is unreadable) and ``pl1_w`` (package 0's ``constraint_0_power_limit_uw`` as the hardware
reads it back, where there is one); with two or more packages also ``pkg_power_packages_w`` and
``pl1_packages_w`` (lists, in zone order), for per-socket caps. The first read only primes the
counters; a counter that goes backwards (anything but a wrap) makes that domain unavailable for that
interval; a wrap is told from a reset by its size (a real wrap moves less than half the
range in one interval).
"""

from __future__ import annotations

import errno
import re
from dataclasses import dataclass
from typing import Any

from dsr1d.constants import PKG_POWER_PACKAGES_W, PKG_POWER_W, PL1_PACKAGES_W, PL1_W, RAM_POWER_W
from dsr1d.contract.hookspecs import hookimpl
from dsr1d.contract.sysroot import SysRoot
from dsr1d.contract.telemetry import UNAVAILABLE, Unavailable, describe_oserror, read_int, \
    sanitize
from dsr1d.contract.tunable import Support

POWERCAP = "sys/class/powercap"
CVE_NOTE = "root-only since CVE-2020-8694"
_ZONE = re.compile(r"intel-rapl:(\d+)(?::(\d+))?$")


@dataclass
class Domain:
    zone: str          # intel-rapl:0:1
    name: str          # dram
    key: str           # rapl_package_0_dram_w
    package: bool      # a top-level package-N domain (summed into pkg_power_w)
    max_range_uj: int
    energy: str        # the absolute path of its energy_uj
    pl1: str | None = None   # its constraint_0_power_limit_uw (packages with a limit)
    last_uj: int | None = None
    last_t: float | None = None


def _denied(exc: OSError) -> bool:
    return exc.errno in (errno.EACCES, errno.EPERM)


class Rapl:
    name = "rapl"
    summary = "package / core / dram power from RAPL energy counters (powercap sysfs)"
    priority = 20

    def __init__(self) -> None:
        self.domains: list[Domain] = []

    # -- discovery ---------------------------------------------------------------------------

    def _zones(self, root: SysRoot) -> list[str]:
        return [p for p in root.glob(f"{POWERCAP}/intel-rapl:*")
                if _ZONE.search(p.rsplit("/", 1)[-1])]

    def discover(self, root: SysRoot) -> list[Domain]:
        zones = self._zones(root)
        names: dict[str, str] = {}
        for path in zones:
            zone = path.rsplit("/", 1)[-1]
            try:
                names[zone] = root.read(f"{path}/name")
            except OSError:
                names[zone] = zone.replace(":", "_")
        domains = []
        for path in zones:
            zone = path.rsplit("/", 1)[-1]
            m = _ZONE.search(zone)
            assert m
            name = names[zone]
            if m.group(2) is None:
                key = f"rapl_{sanitize(name)}_w"
                package = name.startswith("package")
            else:
                parent = names.get(f"intel-rapl:{m.group(1)}", f"intel-rapl:{m.group(1)}")
                key = f"rapl_{sanitize(parent)}_{sanitize(name)}_w"
                package = False
            try:
                max_range = int(root.read(f"{path}/max_energy_range_uj"))
            except (OSError, ValueError):
                max_range = 0  # unknown: a decrease is then never taken for a wrap
            limit = f"{path}/constraint_0_power_limit_uw"
            domains.append(Domain(zone, name, key, package, max_range,
                                  root.display(f"{path}/energy_uj"),
                                  root.display(limit) if package and root.exists(limit) else None))
        return domains

    # -- the contract ------------------------------------------------------------------------

    def probe(self, root: SysRoot) -> Support:
        zones = self._zones(root)
        if not zones:
            return Support(False, f"no RAPL domains in {root.display(POWERCAP)} "
                                  "(no intel_rapl_msr / intel_rapl_common driver)")
        first = f"{zones[0]}/energy_uj"
        try:
            root.read(first)
        except OSError as exc:
            if _denied(exc):
                return Support(False, f"{root.display(first)}: permission denied ({CVE_NOTE})")
            return Support(False, describe_oserror(exc, root.display(first)))
        return Support(True, f"{len(zones)} domains in {root.display(POWERCAP)}")

    def start(self, root: SysRoot) -> None:
        self.domains = self.discover(root)

    def stop(self) -> None:
        self.domains = []

    def read(self, root: SysRoot, now: float) -> dict[str, Any]:
        if not self.domains:
            self.domains = self.discover(root)
            if not self.domains:
                raise Unavailable(f"no RAPL domains in {root.display(POWERCAP)}")
        out: dict[str, Any] = {}
        missing: dict[str, str] = {}
        vanished = False
        package_w: list[float] = []
        package_missing = False
        for d in self.domains:
            path = d.energy
            try:
                uj = read_int(path)
            except OSError as exc:
                if _denied(exc):
                    missing[d.name] = f"{path}: permission denied ({CVE_NOTE})"
                else:
                    missing[d.name] = f"vanished: {describe_oserror(exc, path)}"
                    vanished = True
                d.last_uj = d.last_t = None
                package_missing |= d.package
                continue
            except ValueError:
                missing[d.name] = f"{path}: not a number"
                d.last_uj = d.last_t = None
                package_missing |= d.package
                continue
            watts, why = self._power(d, uj, now)
            d.last_uj, d.last_t = uj, now
            if watts is None:
                if why:
                    missing[d.name] = why
                package_missing |= d.package
                continue
            out[d.key] = watts
            if d.package:
                package_w.append(watts)
        if package_w and not package_missing:
            out[PKG_POWER_W] = round(sum(package_w), 3)
        if package_w and not package_missing and len(package_w) > 1:
            out[PKG_POWER_PACKAGES_W] = package_w          # per socket, in zone order
        dram = [d.key for d in self.domains if d.name == "dram"]
        if dram and all(k in out for k in dram):
            out[RAM_POWER_W] = round(sum(out[k] for k in dram), 3)
        limits = []
        for d in self.domains:
            if d.pl1 is None:
                continue
            try:
                limits.append(read_int(d.pl1) / 1e6)
            except (OSError, ValueError):
                limits = []  # the limit is evidence for one decision only; power still counts
                break
        if limits:
            out[PL1_W] = limits[0]
            if len(limits) > 1:
                out[PL1_PACKAGES_W] = limits
        if vanished:  # hotplug: find the domains again for the next read
            self.domains = self.discover(root)
        if missing:
            out[UNAVAILABLE] = missing
        return out

    @staticmethod
    def _power(d: Domain, uj: int, now: float) -> tuple[float | None, str]:
        """Watts since the last read, or None and why (empty: just primed)."""
        if d.last_uj is None or d.last_t is None:
            return None, ""
        dt = now - d.last_t
        if dt <= 0:
            return None, f"{d.zone} read twice at the same time"
        delta = uj - d.last_uj
        if delta < 0:
            wrapped = d.max_range_uj - d.last_uj + uj
            if d.max_range_uj <= 0 or not 0 <= wrapped < d.max_range_uj // 2:
                return None, (f"{d.zone} energy_uj went backwards ({d.last_uj} -> {uj}, "
                              f"max_energy_range_uj {d.max_range_uj}): no value this interval")
            delta = wrapped
        return round(delta / dt / 1e6, 3), ""


@hookimpl
def register_telemetry_sources(register: Any) -> None:
    register(Rapl())
