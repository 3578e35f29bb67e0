"""Apply, switch, verify and restore profiles (DESIGN.md, "State and rollback").

Rules kept here and nowhere else: the original of a knob is journaled before its first write;
writes that change nothing are skipped; a switch either fully happens or is fully undone; restore
goes in reverse order of first writes and removes the journal only when everything is back.

The tuner remembers the value it last wrote to (or read from) each knob it journaled, so a switch
between two profiles reads nothing it already knows: it is the one writer of those knobs. Anyone
else's write is drift, and re-applying the active profile (the repair) reads every knob again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

from dsr1d.contract.knobs import Knob, holds, knob_from_key
from dsr1d.contract.sysroot import KnobError, SysRoot
from dsr1d.contract.tunable import Setting, Skip, Support, Tunable, TunableInfo
from dsr1d.core.profiles import Profile
from dsr1d.core.state import Journal, JournalError, JournalState, Original

BeforeWrite = Callable[[str, str, str], None]


@dataclass(frozen=True)
class Change:
    """One knob: its key, its value now, and the value it should get."""

    tunable: str
    key: str
    current: str
    wanted: str
    knob: Knob = field(compare=False, repr=False)
    root: SysRoot = field(compare=False, repr=False)

    @property
    def where(self) -> str:
        """The path (and register) as shown to people; worked out only when shown."""
        return self.knob.where(self.root)


@dataclass
class Plan:
    """What applying a profile would do, from the state the machine is in now."""

    profile: str
    changes: list[Change] = field(default_factory=list)
    unchanged: list[Change] = field(default_factory=list)
    releases: list[Change] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)
    unsupported: dict[str, str] = field(default_factory=dict)
    wanted: dict[str, str] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)

    @property
    def writes(self) -> list[Change]:
        """Knobs left behind go back first, then the new profile's changes."""
        return self.releases + self.changes


@dataclass(frozen=True)
class Drift:
    """A knob that no longer holds what the active profile wants."""

    tunable: str
    key: str
    where: str
    wanted: str
    actual: str


@dataclass
class Verification:
    """The active profile, the knobs that drifted, and notes that are not drift."""

    profile: str | None
    drift: list[Drift] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class TuningError(Exception):
    """A profile could not be planned (a knob could not be read); nothing was written."""


UNDO_ADVICE = "run `dsr1d restore`"


class ApplyFailed(Exception):
    """A write (or a plugin's hook before one) failed; this switch's writes were undone (see
    ``undo_errors`` if not all, with ``advice`` on what to do then)."""

    def __init__(self, cause: Exception, previous: str | None, undo_errors: list[Exception],
                 advice: str = UNDO_ADVICE) -> None:
        self.cause = cause
        self.undo_errors = undo_errors
        if undo_errors:
            tail = ("; undoing also failed for " + "; ".join(str(e) for e in undo_errors)
                    + f" — {advice}")
        else:
            tail = f"; nothing changed, {previous or 'no profile'} still in force"
        super().__init__(f"{_describe(cause)}{tail}")


def _describe(exc: Exception) -> str:
    return str(exc) if isinstance(exc, KnobError) else f"{type(exc).__name__}: {exc}"


class Tuner:
    """The tuning core, bound to one hardware root, its tunables and its journal."""

    def __init__(self, root: SysRoot, tunables: dict[str, Tunable], journal: Journal,
                 before_write: BeforeWrite | None = None) -> None:
        self.root = root
        self.tunables = tunables
        self.journal = journal
        self._before_write = before_write or (lambda target, key, value: None)
        self.undo_advice = UNDO_ADVICE       # the daemon says what to do while it runs
        self.vanished: list[str] = []        # knobs the last restore found gone
        self._values: dict[str, str] = {}    # key -> value last written or read, journaled keys
        self._support: dict[str, Support] = {}  # probes, until the CPUs or the root change

    # -- reading -----------------------------------------------------------------------------

    def probe(self) -> list[TunableInfo]:
        """Every tunable: supported here or not, why, and its current values."""
        infos = []
        self.root.forget_fixed()
        for name, tunable in self.tunables.items():
            try:
                support = self._support[name] = tunable.probe(self.root)
                current = tunable.read(self.root) if support.supported else {}
            except OSError as exc:  # a knob that cannot even be read: say so, never crash
                where = f" {exc.filename}" if exc.filename else ""
                support = Support(False, f"unreadable{where}: {exc.strerror}")
                current = {}
            infos.append(TunableInfo(name, tunable.summary, support, current))
        return infos

    def active(self) -> str | None:
        """The profile the journal says is applied, if any."""
        state = self.journal.load()
        return state.profile if state else None

    def plan(self, profile: Profile, cpus: list[int] | None = None) -> Plan:
        """What applying ``profile`` would change; writes nothing (the dry run)."""
        return self._plan(profile, self.journal.load() or self.journal.new(), cpus)

    def verify(self) -> Verification:
        """Compare every knob the active profile set with what it wants."""
        state = self.journal.load()
        result = Verification(state.profile if state else None)
        if state is None:
            return result
        holder_alive = _alive(state.pid)
        for key, wanted in state.wanted.items():
            original = state.original(key)
            tunable = original.tunable if original else "?"
            knob = knob_from_key(key)
            try:
                if holds(knob, self.root, wanted):
                    continue
                actual = self._values[key] = knob.read(self.root)
            except OSError as exc:
                self._values.pop(key, None)
                actual = f"unreadable ({exc.strerror})"
            if getattr(knob, "lives_with_process", False) and not holder_alive:
                result.notes.append(f"{tunable}: {knob.where(self.root)} {wanted}: the request "
                                    f"ended with process {state.pid}, which applied it")
                continue
            result.drift.append(Drift(tunable, key, knob.where(self.root), wanted, actual))
        return result

    # -- writing -----------------------------------------------------------------------------

    def switch(self, profile: Profile, cpus: list[int] | None = None) -> Plan:
        """Apply ``profile`` (from nothing or from the active one), all or nothing.

        With ``cpus``, only the per-CPU knobs of those CPUs (for CPUs that came online).
        """
        state = self.journal.load() or self.journal.new()
        if cpus is not None:  # CPUs came or went: what is supported may have changed
            self._support.clear()
            self.root.forget_fixed()
        # Re-applying the active profile is the repair after drift: it reads every knob.
        trusted = self._trusted(state) if cpus is None and profile.name != state.profile else {}
        plan = self._plan(profile, state, cpus, trusted)
        pending = state.copy()
        known = {o.key for o in pending.originals}
        for change in plan.changes:
            if change.key not in known:  # journaled once, before its first write
                known.add(change.key)
                pending.originals.append(Original(change.key, change.tunable, change.current))
        # Journaled before the first knob write: the originals of the knobs about to change,
        # and the profile it is going to (a switch that fails writes the old state back). The
        # originals of knobs going back stay until they are back: a second write, only then.
        pending.profile = profile.name
        pending.wanted = plan.wanted
        done: list[Change] = []
        try:  # every hook and every write inside: whatever fails, this switch is undone
            if (pending.profile, pending.wanted, len(pending.originals)) != \
                    (state.profile, state.wanted, len(state.originals)):
                self.journal.save(pending)
            for change in plan.writes:
                self._write(change.tunable, change.knob, change.wanted)
                done.append(change)
        except Exception as exc:
            undo_errors = self._undo(done)
            if not undo_errors:
                self._save_or_remove(state)
            if isinstance(exc, JournalError):
                raise
            raise ApplyFailed(exc, state.profile, undo_errors, self.undo_advice) from None
        if plan.dropped:
            dropped = set(plan.dropped)
            pending.originals = [o for o in pending.originals if o.key not in dropped]
            self.journal.save(pending)
        return plan

    def restore(self) -> tuple[list[Change], list[KnobError]]:
        """Put every journaled knob back, newest first; keep the journal for what failed.

        Returns the knobs that were written back and the errors of those that could not be.
        """
        state = self.journal.load()
        self.root.pm_qos_release()
        self.vanished = []
        self._values.clear()
        self._support.clear()
        self.root.forget_fixed()
        if state is None:
            return [], []
        restored: list[Change] = []
        errors: list[KnobError] = []
        kept: list[Original] = []
        for original in reversed(state.originals):
            try:
                knob = knob_from_key(original.key)
                if not knob.exists(self.root):
                    self.vanished.append(f"{knob.where(self.root)} ({original.tunable})")
                    continue  # a CPU unplugged while we were down: nothing left to restore
                current = knob.read(self.root)
                if current != original.value:
                    self._write(original.tunable, knob, original.value)
                    restored.append(Change(original.tunable, original.key, current,
                                           original.value, knob, self.root))
            except KnobError as exc:
                errors.append(exc)
                kept.append(original)
            except (OSError, ValueError) as exc:
                errors.append(KnobError(original.tunable, original.key, _as_oserror(exc), "read"))
                kept.append(original)
        if errors:
            self.journal.save(JournalState(state.root, list(reversed(kept)), pid=state.pid))
        else:
            self.journal.remove()
        return restored, errors

    # -- internals ---------------------------------------------------------------------------

    def _settings(self, profile: Profile, plan: Plan, cpus: list[int] | None) -> list[Setting]:
        settings: dict[str, Setting] = {}
        for name, tunable in self.tunables.items():
            options = profile.sections.get(name)
            if not options:
                continue
            support = self._support.get(name)
            if support is None:
                support = self._support[name] = tunable.probe(self.root)
            if not support.supported:
                plan.unsupported[name] = support.detail
                continue
            try:
                actions = tunable.apply(self.root, options, cpus)
            except OSError as exc:
                raise TuningError(f"{name}: cannot plan: {exc}") from None
            for action in actions:
                if isinstance(action, Skip):
                    plan.skips.append(action)
                else:
                    settings[action.knob.key] = action
        return list(settings.values())

    def _trusted(self, state: JournalState) -> dict[str, str]:
        """What this tuner knows of the knobs the journal lists as its own."""
        values = self._values
        return {o.key: values[o.key] for o in state.originals if o.key in values}

    def _plan(self, profile: Profile, state: JournalState, cpus: list[int] | None = None,
              trusted: dict[str, str] | None = None) -> Plan:
        with self.root.steady():
            return self._plan_steady(profile, state, cpus, trusted or {})

    def _plan_steady(self, profile: Profile, state: JournalState, cpus: list[int] | None,
                     trusted: dict[str, str]) -> Plan:
        plan = Plan(profile.name)
        settings = self._settings(profile, plan, cpus)
        for setting in settings:
            knob = setting.knob
            current = trusted.get(knob.key)
            if current is None:
                current = self._values[knob.key] = self._read(setting.tunable, knob)
            change = Change(setting.tunable, knob.key, current, setting.value, knob, self.root)
            (plan.changes if current != setting.value else plan.unchanged).append(change)
            plan.wanted[setting.knob.key] = setting.value
        if cpus is not None:
            # A partial (per-CPU) apply keeps everything else the profile set.
            plan.wanted = {**state.wanted, **plan.wanted}
            return plan
        for original in state.originals:
            if original.key in plan.wanted:
                continue
            knob = knob_from_key(original.key)
            try:
                current = trusted.get(original.key)
                if current is None or not knob.exists(self.root):  # its CPU went offline?
                    current = knob.read(self.root)
            except OSError as exc:
                plan.skips.append(Skip(original.tunable, original.key,
                                       f"cannot read to restore: {exc.strerror}; kept in journal"))
                continue
            plan.dropped.append(original.key)
            if current != original.value:
                plan.releases.append(Change(original.tunable, original.key, current,
                                            original.value, knob, self.root))
        return plan

    def _read(self, tunable: str, knob: Knob) -> str:
        try:
            return knob.read(self.root)
        except OSError as exc:
            raise TuningError(str(KnobError(tunable, knob.where(self.root), exc, "read"))) from None

    def _write(self, tunable: str, knob: Knob, value: str) -> None:
        self._before_write("knob", knob.key, value)
        self._values.pop(knob.key, None)  # unknown until the write is known to have happened
        try:
            knob.write(self.root, value)
            self._values[knob.key] = value
        except OSError as exc:
            raise KnobError(tunable, knob.where(self.root), exc, f"write {value!r} to") from None

    def _undo(self, done: list[Change]) -> list[Exception]:
        errors: list[Exception] = []
        for change in reversed(done):
            try:
                self._write(change.tunable, change.knob, change.current)
            except Exception as exc:  # a knob refusing, or a plugin's hook raising
                errors.append(exc)
        return errors

    def _save_or_remove(self, state: JournalState) -> None:
        if state.originals or state.profile:
            self.journal.save(state)
        else:
            self.journal.remove()


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _as_oserror(exc: Exception) -> OSError:
    return exc if isinstance(exc, OSError) else OSError(0, str(exc))
