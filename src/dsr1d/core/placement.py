"""Where the engine's decode threads run: one CPU per physical core, on one NUMA node.

Decode is memory-bandwidth bound. A hyperthread adds no bandwidth, and two decode threads on SMT
siblings of one core fight over its load ports, so the engine gets one CPU per physical core (the
lowest-numbered usable sibling). Threads spread over two NUMA nodes read half the weights across
the socket interconnect, so the engine stays on one node and its memory is placed on that node;
a second engine would take the next node (one engine per socket).

Everything here is pure except `read_topology` (which reads through a `SysRoot`, and never raises
on a sparse or unreadable tree) and `bind_memory` (the one call into the real kernel).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable

from dsr1d.contract.sysroot import CPU_DIR, SysRoot, parse_cpu_list


NODE_DIR = "sys/devices/system/node"



@dataclass(frozen=True)
class Cpu:
    """One logical CPU: its socket, its physical core and its NUMA node.

    ``core`` is a key shared by all SMT siblings of one physical core: the lowest CPU number
    among them (CPU numbers are unique machine-wide, so no package is needed to qualify it).
    """

    package: int
    core: int
    node: int


@dataclass
class Topology:
    """The online CPUs of a machine, and how they group into cores and nodes."""

    cpus: dict[int, Cpu]
    notes: list[str] = field(default_factory=list)  # how the tree was incomplete, for the log

    @property
    def nodes(self) -> list[int]:
        """NUMA nodes that hold at least one online CPU."""
        return sorted({c.node for c in self.cpus.values()})

    @property
    def packages(self) -> list[int]:
        return sorted({c.package for c in self.cpus.values()})

    def siblings(self, cpu: int) -> list[int]:
        """Every online CPU on the same physical core as ``cpu`` (itself included)."""
        core = self.cpus[cpu].core
        return sorted(n for n, c in self.cpus.items() if c.core == core)


@dataclass
class Placement:
    """Where the engine worker runs.

    ``cpus``: the CPUs to pin the worker to (one per physical core used); ``threads``: the decode
    thread count (``len(cpus)``); ``node``: the NUMA node it runs on, None on a one-node machine;
    ``mem_bind_nodes``: nodes to place its memory on (empty on a one-node machine);
    ``reasons``: sentences for the log explaining each choice.
    """

    cpus: list[int]
    threads: int
    node: int | None
    mem_bind_nodes: list[int]
    reasons: list[str]


# -- reading the topology -----------------------------------------------------------------------


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The kernel's compact form of a CPU list: ``[0, 1, 2, 3, 8]`` → ``0-3,8``."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def _read_text(root: SysRoot, rel: str) -> str | None:
    try:
        return root.read(rel)
    except (OSError, UnicodeDecodeError):
        return None


def _read_int(root: SysRoot, rel: str) -> int | None:
    text = _read_text(root, rel)
    try:
        return int(text) if text else None
    except ValueError:
        return None


def _read_cpu_list(root: SysRoot, rel: str) -> list[int] | None:
    text = _read_text(root, rel)
    if not text:
        return None
    try:
        return parse_cpu_list(text)
    except ValueError:
        return None


def _online_cpus(root: SysRoot, notes: list[str]) -> list[int]:
    online = _read_cpu_list(root, f"{CPU_DIR}/online")
    if online:
        return online
    # No online list: every cpuN directory counts, unless its own online file says 0.
    found: list[int] = []
    for rel in root.glob(f"{CPU_DIR}/cpu[0-9]*"):
        name = rel.rsplit("/", 1)[-1][3:]
        if name.isdigit() and _read_text(root, f"{rel}/online") != "0":
            found.append(int(name))
    if found:
        notes.append(f"no readable {CPU_DIR}/online: assumed CPUs {format_cpu_list(found)} "
                     "are online")
    return sorted(found)


def _node_of_cpus(root: SysRoot) -> dict[int, int]:
    nodes: dict[int, int] = {}
    for rel in root.glob(f"{NODE_DIR}/node[0-9]*"):
        name = rel.rsplit("/", 1)[-1][4:]
        if not name.isdigit():
            continue
        for cpu in _read_cpu_list(root, f"{rel}/cpulist") or []:
            nodes.setdefault(cpu, int(name))
    return nodes


def _core_keys(root: SysRoot, online: list[int], notes: list[str]) -> dict[int, int]:
    """Each CPU's core key: the lowest CPU of its sibling group.

    Sibling lists are merged (union-find) so a CPU whose own files are missing still joins the
    core that a sibling's list puts it in.
    """
    parent = {cpu: cpu for cpu in online}

    def find(cpu: int) -> int:
        while parent[cpu] != cpu:
            parent[cpu] = parent[parent[cpu]]
            cpu = parent[cpu]
        return cpu

    missing: list[int] = []
    for cpu in online:
        base = f"{CPU_DIR}/cpu{cpu}/topology"
        siblings = (_read_cpu_list(root, f"{base}/core_cpus_list")
                    or _read_cpu_list(root, f"{base}/thread_siblings_list"))
        if siblings is None:
            missing.append(cpu)
            continue
        for other in siblings:
            if other in parent:  # offline siblings play no part
                a, b = find(cpu), find(other)
                parent[max(a, b)] = min(a, b)
    if missing:
        notes.append(f"no SMT sibling list for CPUs {format_cpu_list(missing)}: "
                     "each treated as its own physical core")
    return {cpu: find(cpu) for cpu in online}


def read_topology(root: SysRoot) -> Topology:
    """The online CPUs with their package, core and node, read from sysfs below ``root``.

    Missing or unreadable files degrade: no sibling list makes a CPU its own core, no package id
    means package 0, no node directories mean one node (0) holding every CPU.
    """
    notes: list[str] = []
    online = _online_cpus(root, notes)
    cores = _core_keys(root, online, notes)
    node_of = _node_of_cpus(root)
    default_node = min(node_of.values(), default=0)
    unplaced = [cpu for cpu in online if cpu not in node_of]
    if node_of and unplaced:
        notes.append(f"CPUs {format_cpu_list(unplaced)} are in no node's cpulist: "
                     f"counted on node {default_node}")
    cpus: dict[int, Cpu] = {}
    for cpu in online:
        package = _read_int(root, f"{CPU_DIR}/cpu{cpu}/topology/physical_package_id")
        cpus[cpu] = Cpu(package=package if package is not None else 0, core=cores[cpu],
                        node=node_of.get(cpu, default_node))
    return Topology(cpus=cpus, notes=notes)


# -- planning -----------------------------------------------------------------------------------


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _usable_cpus(topology: Topology, allowed: list[int] | None, affinity: set[int],
                 reasons: list[str]) -> set[int]:
    """Online CPUs in the daemon's affinity, narrowed to the operator's list when one is given."""
    base = set(topology.cpus) & affinity
    if not allowed:  # an unset engine_cpus may arrive as an empty list
        return base
    wanted = set(allowed)
    usable = wanted & base
    dropped = wanted - usable
    if not usable:
        # Refusing to run would take the engine down over a stale CPU list; running unpinned
        # within the daemon's own CPUs keeps it up and the log says why.
        reasons.append(f"none of engine_cpus {format_cpu_list(wanted)} is online and in the "
                       f"daemon's CPU affinity: using CPUs {format_cpu_list(base)} instead")
        return base
    if dropped:
        reasons.append(f"engine_cpus {format_cpu_list(dropped)} ignored: offline or outside "
                       "the daemon's CPU affinity")
    return usable


def _choose_node(topology: Topology, cores: dict[int, list[int]],
                 reasons: list[str]) -> int:
    """The node with the most usable physical cores (ties: the lowest node id)."""
    per_node: dict[int, int] = {}
    for cpus in cores.values():
        node = topology.cpus[cpus[0]].node
        per_node[node] = per_node.get(node, 0) + 1
    node = max(per_node, key=lambda n: (per_node[n], -n))
    count = len(topology.nodes)
    unit = "socket" if count == len(topology.packages) else "NUMA node"
    other = "the other" if count == 2 else "the others"
    reasons.append(f"{count} NUMA nodes: engine bound to node {node}; a second engine per node "
                   f"would use {other} (one engine per {unit})")
    if len(per_node) > 1:
        left = ", ".join(f"{_plural(per_node[n], 'core')} on node {n}"
                         for n in sorted(per_node) if n != node)
        reasons.append(f"usable CPUs span nodes {format_cpu_list(per_node)}: kept to node {node} "
                       f"({_plural(per_node[node], 'core')}), leaving out {left}; threads on "
                       "two nodes would read weights across the socket interconnect")
    return node


def plan(topology: Topology, allowed: list[int] | None, threads: int,
         affinity: Iterable[int] | None = None) -> Placement:
    """Decide the engine worker's CPUs, thread count and memory node.

    ``allowed`` is the operator's ``engine_cpus`` (None or empty: every online CPU);
    ``affinity`` is the daemon's own CPU affinity (None: read it with
    ``os.sched_getaffinity(0)``, the one impure step, which tests replace); ``threads`` is the
    requested decode thread count (0: one per chosen physical core).
    """
    if threads < 0:
        raise ValueError(f"threads must be 0 (automatic) or more, got {threads}")
    reasons = list(topology.notes)
    own = set(os.sched_getaffinity(0) if affinity is None else affinity)
    if not topology.cpus:
        topology = Topology({cpu: Cpu(0, cpu, 0) for cpu in own})
        reasons.append("no CPU topology readable: each CPU of the daemon's affinity treated "
                       "as its own physical core")
    usable = _usable_cpus(topology, allowed, own, reasons)
    if not usable:
        reasons.append("no usable CPU: the engine is not pinned")
        return Placement(cpus=[], threads=threads or 1, node=None, mem_bind_nodes=[],
                         reasons=reasons)

    cores: dict[int, list[int]] = {}
    for cpu in sorted(usable):
        cores.setdefault(topology.cpus[cpu].core, []).append(cpu)
    node: int | None = None
    if len(topology.nodes) > 1:
        node = _choose_node(topology, cores, reasons)
        cores = {k: v for k, v in cores.items() if topology.cpus[v[0]].node == node}

    # Lowest first, so the engine sits on a contiguous block and leaves the rest together.
    ordered = sorted(cores.values(), key=lambda cpus: cpus[0])
    available = len(ordered)
    count = threads or available
    if count > available:
        reasons.append(f"{_plural(threads, 'thread')} requested but only "
                       f"{_plural(available, 'physical core')} usable: capped to {available} "
                       "(a second thread on a core's SMT sibling slows decode)")
        count = available
    chosen = [cpus[0] for cpus in ordered[:count]]

    siblings = sorted({s for cpu in chosen for s in topology.siblings(cpu)} - set(chosen))
    where = f" on node {node}" if node is not None else ""
    idle = (f"SMT sibling{'s' if len(siblings) > 1 else ''} {format_cpu_list(siblings)} "
            "left idle" if siblings else "no SMT siblings")
    reasons.insert(0, f"{_plural(count, 'physical core')}{where} ({idle})")
    if 0 < threads < available:
        rest = [cpus[0] for cpus in ordered[count:]]
        reasons.append(f"{_plural(threads, 'thread')} requested: using the lowest {count} of "
                       f"{available} physical cores (cores of CPUs {format_cpu_list(rest)} "
                       "left free)")
    return Placement(cpus=chosen, threads=count, node=node,
                     mem_bind_nodes=[node] if node is not None else [], reasons=reasons)


def describe(placement: Placement) -> str:
    """One line for the engine log and ``dsr1d probe``."""
    if placement.cpus:
        head = (f"{_plural(placement.threads, 'decode thread')} on CPUs "
                f"{format_cpu_list(placement.cpus)}")
    else:
        head = f"{_plural(placement.threads, 'decode thread')}, not pinned"
    if placement.mem_bind_nodes:
        head += f", memory on node {format_cpu_list(placement.mem_bind_nodes)}"
    return head + (": " + "; ".join(placement.reasons) if placement.reasons else "")
