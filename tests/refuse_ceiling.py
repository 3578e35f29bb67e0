"""A dsr1d plugin whose ``before_write`` hook refuses every write of a frequency ceiling
(``scaling_max_freq``) with EBUSY, as a cpufreq driver that holds its limits would."""

from __future__ import annotations

import errno

from dsr1d.contract.hookspecs import hookimpl


@hookimpl
def before_write(target: str, key: str, value: str) -> None:
    if target == "knob" and key.endswith("cpufreq/scaling_max_freq"):
        raise OSError(errno.EBUSY, "cpufreq holds its limits", key)
