"""The daemon's control logic: which profile is active, holds, reload, stop. No D-Bus here.

Holds work like power-profiles-daemon's: while any hold lasts, the most recent hold's profile
is active (holds stack; releasing the newest falls back to the one before it, and the last one
back to the profile chosen by hand or by the configuration). A manual switch cancels every hold.
A hold belongs to the bus connection that made it and ends when that connection leaves the bus.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable

from dsr1d.contract.tunable import TunableInfo
from dsr1d.core.config import Config
from dsr1d.core.context import Core
from dsr1d.core.profiles import Profile, ProfileError, UnknownProfile
from dsr1d.core.tuning import ApplyFailed, Plan, TuningError, Verification

log = logging.getLogger("dsr1d")


class HoldError(Exception):
    """A release that names no hold, or a hold that belongs to someone else."""

    def __init__(self, name: str, message: str) -> None:
        self.name = name
        super().__init__(message)


MAX_HOLDS_PER_CLIENT = 16
MAX_HOLDS = 256
MAX_HOLD_TEXT = 256  # characters of a reason or application id


def _check_hold_text(reason: str, application_id: str) -> None:
    for what, text in (("reason", reason), ("application_id", application_id)):
        if len(text) > MAX_HOLD_TEXT:
            raise HoldError("InvalidArgument", f"the hold's {what} is {len(text)} characters; "
                            f"at most {MAX_HOLD_TEXT}")


@dataclass(frozen=True)
class Hold:
    """A profile held on behalf of a bus client."""

    cookie: int
    profile: str
    reason: str
    application_id: str
    owner: str


ProfileListener = Callable[[str, str, str], None]
ChangeListener = Callable[[list[str]], None]


class Manager:
    """Owns the active profile and the holds; every change goes through the tuning core."""

    def __init__(self, core: Core, config: Config) -> None:
        self.core = core
        self.config = config
        core.tuner.undo_advice = ("switch again to retry (`dsr1ctl profile NAME`), or restart "
                                  "the daemon (`systemctl restart dsr1d`), which restores every "
                                  "knob")
        self.profiles: dict[str, Profile] = {}
        self.selected = config.default_profile
        self.selected_by_hand = False
        self.active: str | None = None
        self.unsettled = False  # a failed switch could not undo all of its writes
        self.holds: list[Hold] = []
        self.tunables: list[TunableInfo] = []
        self.overlays: dict[str, dict[str, dict[str, Any]]] = {}
        self._next_cookie = 1
        self.profile_listeners: list[ProfileListener] = []
        self.change_listeners: list[ChangeListener] = []

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Recover a leftover journal, load profiles, apply the default profile."""
        self.recover()
        self.profiles = self._load_profiles(previous={})
        self.tunables = self.core.tuner.probe()
        for info in self.tunables:
            if not info.support.supported:
                log.info("tunable %s unsupported here: %s", info.name, info.support.detail,
                         extra={"TUNABLE": info.name})
        self._apply(self._profile(self.selected), "start")

    def recover(self) -> None:
        """Restore what a previous run left in the journal (it died without restoring)."""
        state = self.core.journal.load()
        if state is None:
            return
        log.warning("journal of a previous run (pid %d, profile %s) found: it died without "
                    "restoring; restoring %d knob(s) now", state.pid, state.profile,
                    len(state.originals))
        restored, errors = self.core.tuner.restore()
        for change in restored:
            log.info("recovered %s: %s -> %s", change.where, change.current, change.wanted,
                     extra={"TUNABLE": change.tunable})
        self._log_vanished()
        if errors:
            # A list[Exception] copy: ApplyFailed takes a list, which is invariant.
            raise ApplyFailed(errors[0], None, list(errors[1:]))

    def stop(self) -> int:
        """Restore every knob; returns how many could not be restored."""
        restored, errors = self.core.tuner.restore()
        log.info("stopped: restored %d knob(s)", len(restored))
        self._log_vanished()
        for error in errors:
            log.error("not restored: %s", error)
        return len(errors)

    def reload(self, config: Config | None = None,
               loaded: tuple[dict[str, Profile], list[ProfileError]] | None = None
               ) -> list[ProfileError]:
        """Reload profiles (and a new config); broken profiles keep their previous version.
        ``loaded`` is ``core.store.load_all()`` done beforehand (off the event loop)."""
        errors: list[ProfileError] = []
        if config is not None:
            if (config.root, config.journal, config.profiles_dir) != (
                    self.config.root, self.config.journal, self.config.profiles_dir):
                log.warning("root, journal and profiles_dir changes take effect at restart")
            self.config = config
            if not self.selected_by_hand:
                self.selected = config.default_profile
        previous = self.profiles
        self.profiles = self._load_profiles(previous=previous, errors=errors, loaded=loaded)
        in_use = {name for name in (self.wanted(), self.active) if name is not None}
        for name in in_use - set(self.profiles):
            log.error("profile %s no longer exists; keeping the loaded version while it is "
                      "in use", name)
            self.profiles[name] = previous[name]
        self._changed(["Profiles"])
        self._apply(self.profiles[self.wanted()], "reload", force=True)
        return errors

    # -- what clients ask for ----------------------------------------------------------------

    def wanted(self) -> str:
        """The profile that should be active: the newest hold's, else the selected one."""
        return self.holds[-1].profile if self.holds else self.selected

    def switch(self, name: str) -> None:
        """Switch by hand: cancels every hold. All or nothing."""
        profile = self._profile(name)
        # Always re-applied, also when already active: that is how drift or a half-undone
        # switch is repaired (`dsr1ctl profile NAME`).
        self._apply(profile, "manual", force=True)
        self.selected, self.selected_by_hand = name, True
        if self.holds:
            log.info("manual switch to %s cancels %d hold(s)", name, len(self.holds))
            self.holds.clear()
            self._changed(["Holds"])

    def hold(self, name: str, reason: str, application_id: str, owner: str) -> int:
        """Hold ``name`` for ``owner``; returns the cookie that releases it. HoldError
        ``TooManyHolds`` past the limits per client and in total, ``InvalidArgument`` for an
        over-long reason or application id (every hold is re-sent in the ``Holds`` property)."""
        _check_hold_text(reason, application_id)
        if sum(h.owner == owner for h in self.holds) >= MAX_HOLDS_PER_CLIENT:
            raise HoldError("TooManyHolds", f"{owner} already holds {MAX_HOLDS_PER_CLIENT} "
                            f"profiles; release one first")
        if len(self.holds) >= MAX_HOLDS:
            raise HoldError("TooManyHolds", f"{MAX_HOLDS} holds are active; no more are taken")
        profile = self._profile(name)
        self._apply(profile, f"hold by {application_id or owner}: {reason}")
        cookie = self._next_cookie
        self._next_cookie += 1
        self.holds.append(Hold(cookie, name, reason, application_id, owner))
        log.info("hold %d: %s for %s (%s)", cookie, name, application_id or owner, reason,
                 extra={"PROFILE": name})
        self._changed(["Holds"])
        return cookie

    def release(self, cookie: int, owner: str) -> None:
        """Release a hold made by ``owner``. If switching back fails, the hold stays (its
        profile is still what is applied) and ApplyFailed says why."""
        hold = next((h for h in self.holds if h.cookie == cookie), None)
        if hold is None:
            raise HoldError("NoSuchHold", f"no hold with cookie {cookie}")
        if hold.owner != owner:
            raise HoldError("NotHolder", f"hold {cookie} belongs to another client")
        rest = [h for h in self.holds if h is not hold]
        wanted = rest[-1].profile if rest else self.selected
        self._apply(self._profile(wanted), f"hold {cookie} released")
        self.holds = rest
        self._changed(["Holds"])

    def release_owner(self, owner: str) -> None:
        """Release every hold of a client that left the bus."""
        gone = [h for h in self.holds if h.owner == owner]
        if gone:
            self._drop(gone, f"holder {owner} left the bus")

    def verify(self) -> Verification:
        return self.core.tuner.verify()

    def reapply_cpus(self, cpus: list[int]) -> Plan | None:
        """Apply the active profile's per-CPU knobs to CPUs that came online."""
        if self.active is None:
            return None
        plan = self.core.tuner.switch(self._effective(self.profiles[self.active]), cpus=cpus)
        log.info("cpu %s online: re-applied %s (%d write(s))", ",".join(map(str, cpus)),
                 self.active, len(plan.writes), extra={"PROFILE": self.active})
        return plan

    def status_line(self) -> str:
        """The one line shown in ``systemctl status`` (sd_notify STATUS=)."""
        holds = f", {len(self.holds)} hold(s): {self.holds[-1].profile}" if self.holds else ""
        return f"profile {self.active or 'none'}{holds}"

    # -- internals ---------------------------------------------------------------------------

    def _profile(self, name: str) -> Profile:
        if name not in self.profiles:
            raise UnknownProfile(name, sorted(self.profiles))
        return self.profiles[name]

    def _load_profiles(self, previous: dict[str, Profile],
                       errors: list[ProfileError] | None = None,
                       loaded: tuple[dict[str, Profile], list[ProfileError]] | None = None
                       ) -> dict[str, Profile]:
        profiles, broken = loaded or self.core.store.load_all()
        for error in broken:
            name = error.profile
            kept = " (keeping the previous version)" if name in previous else ""
            log.error("profile %s rejected: %s%s", name, error, kept)
            if name in previous:
                profiles[name] = previous[name]
        if errors is not None:
            errors.extend(broken)
        return dict(sorted(profiles.items()))

    def set_overlay(self, name: str, sections: dict[str, dict[str, Any]] | None,
                    reason: str) -> None:
        """Lay ``sections`` over whatever profile is active (or lift overlay ``name``).

        Overlays are how throttle mitigation acts: journaled and restored like any profile
        write, kept across profile switches until lifted. ApplyFailed leaves them as before.
        """
        previous = dict(self.overlays)
        if sections is None:
            self.overlays.pop(name, None)
        else:
            self.overlays[name] = sections
        if self.active is None:
            return
        try:
            self._apply(self.profiles[self.active], reason, force=True)
        except (ApplyFailed, TuningError):
            self.overlays = previous
            raise

    def _effective(self, profile: Profile) -> Profile:
        if not self.overlays:
            return profile
        sections = {name: dict(values) for name, values in profile.sections.items()}
        for overlay in self.overlays.values():
            for section, values in overlay.items():
                sections.setdefault(section, {}).update(values)
        return replace(profile, sections=sections)

    def _apply(self, profile: Profile, reason: str, force: bool = False) -> None:
        if profile.name == self.active and not force and not self.unsettled:
            return
        try:
            plan = self.core.tuner.switch(self._effective(profile))
        except ApplyFailed as exc:
            # Undo failed too: the knobs are neither the old profile nor the new one, so the
            # next switch re-applies even the profile that looks active.
            self.unsettled = self.unsettled or bool(exc.undo_errors)
            raise
        self.unsettled = False
        old, self.active = self.active, profile.name
        log.info("profile %s applied (%s): %d write(s), %d unsupported, %d skipped", profile.name,
                 reason, len(plan.writes), len(plan.unsupported), len(plan.skips),
                 extra={"PROFILE": profile.name})
        for skip in plan.skips:
            log.info("%s: skipped %s: %s", skip.tunable, skip.option, skip.reason,
                     extra={"TUNABLE": skip.tunable})
        if old != profile.name:
            for listener in self.profile_listeners:
                listener(old or "", profile.name, reason)
            self._changed(["ActiveProfile"])

    def _drop(self, holds: list[Hold], reason: str) -> None:
        self.holds = [h for h in self.holds if h not in holds]
        self._changed(["Holds"])
        try:
            self._apply(self._profile(self.wanted()), reason)
        except (ApplyFailed, UnknownProfile) as exc:
            log.error("could not switch back after %s: %s", reason, exc)

    def _log_vanished(self) -> None:
        for knob in self.core.tuner.vanished:
            log.warning("journaled knob %s no longer exists (a CPU unplugged, a driver "
                        "unloaded?): nothing to restore there, skipped", knob)

    def _changed(self, names: list[str]) -> None:
        for listener in self.change_listeners:
            listener(names)
