"""How much memory the engine may use: what the machine has free, within the cgroup's limit
(``memory.max`` of the unit's cgroup, e.g. ``MemoryMax=`` in systemd), whichever is less."""

from __future__ import annotations

from pathlib import Path

import psutil

CGROUP_FS = Path("/sys/fs/cgroup")


def cgroup_room(proc_cgroup: Path = Path("/proc/self/cgroup"), fs: Path = CGROUP_FS) -> int | None:
    """Bytes left under the cgroup v2 ``memory.max`` of this process and its ancestors (the
    tightest), or None when no limit is set or cgroups cannot be read."""
    try:
        line = next(ln for ln in proc_cgroup.read_text().splitlines() if ln.startswith("0::"))
    except (OSError, StopIteration):
        return None
    group = fs / line[3:].strip().lstrip("/")
    rooms = []
    while True:
        try:
            limit = (group / "memory.max").read_text().strip()
            if limit != "max":
                rooms.append(int(limit) - int((group / "memory.current").read_text()))
        except (OSError, ValueError):
            pass
        if group == fs or fs not in group.parents:
            break
        group = group.parent
    return max(min(rooms), 0) if rooms else None


def available() -> tuple[int, str]:
    """Bytes the engine can allocate, and where the figure comes from (for error messages)."""
    free = psutil.virtual_memory().available
    room = cgroup_room()
    if room is not None and room < free:
        return room, "left under the service's cgroup limit (memory.max)"
    return free, "available"
