"""Real systemd as PID 1: a cached Debian tree booted with systemd-nspawn (TESTING-RECIPES.md).

The tree (debootstrap minbase + systemd, dbus, polkitd, python3, venv support) is built once per machine
under ``/var/cache/dsr1d-test/bookworm/tree-<key>``; ``key`` changes with ``TREE_VERSION`` or the
package list, so bumping either rebuilds.  Each boot runs on an overlayfs whose upper layer is a
throw-away directory, so a test can write anywhere in the container (``/etc/systemd/system``,
``/opt/dsr1d/venv``) without touching the cache, and several containers can run at once.

Usable without pytest::

    python3 tests/harness/container.py build              # build the cached tree if needed
    python3 tests/harness/container.py prune              # remove trees of older keys
    python3 tests/harness/container.py shell [PROJECT]    # boot, print the nsenter line, wait
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

SUITE = "bookworm"
TREE_VERSION = "1"
PACKAGES = (
    "systemd", "systemd-sysv", "libpam-systemd", "dbus",
    "python3", "python3-venv",  # python3-venv brings ensurepip: `python3 -m venv` has pip
    "ca-certificates",          # pip inside reaches PyPI over HTTPS through the host's network
    "make",                     # `make install` runs inside the container
    # What tools/apt-deps.sh wants for building the project's venv (systemd-python is an sdist).
    "python3-dev", "gcc", "pkg-config", "libsystemd-dev",
    "procps",                   # ps/pgrep/kill for tests and for debugging a stuck boot
    "polkitd",                  # the real polkit daemon, for the rules-file test
)
CACHE = Path(os.environ.get("DSR1D_TEST_CACHE", "/var/cache/dsr1d-test")) / SUITE
HOST_TOOLS = {"debootstrap": "debootstrap", "systemd-nspawn": "systemd-container"}
# The hardware knobs the daemon tunes; inside, /sys is read-only unless bound.
KNOB_BINDS = ("/sys/kernel/mm/transparent_hugepage", "/dev/cpu_dma_latency",
              "/sys/devices/system/cpu")
# Where the host's pip finds wheels without the network (its pip.conf names them).
PIP_DIRS = ("/opt/wheels", "/opt/pypi", "/opt/pypi-more")
PIP_CONFIGS = ("/etc/pip.conf", "/etc/xdg/pip", "/root/.config/pip")
# HTTPS from this machine passes a proxy whose CA only the host's bundle has.
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
CLEAN_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
             "HOME": "/root", "LANG": "C.UTF-8", "TERM": "dumb"}
_COMPLETE = ".dsr1d-tree-complete"
_names = itertools.count()


class ContainerError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------- the tree

def tree_key() -> str:
    digest = hashlib.sha256(" ".join(sorted(PACKAGES)).encode()).hexdigest()[:8]
    return f"v{TREE_VERSION}-{digest}"


def tree_path() -> Path:
    return CACHE / f"tree-{tree_key()}"


def ensure_tree(log=sys.stderr) -> Path:
    """Return the cached tree, building it first if needed (safe under concurrent runs)."""
    tree = tree_path()
    if (tree / _COMPLETE).exists():
        return tree
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second run waits here, then finds the tree
        if not (tree / _COMPLETE).exists():
            ensure_host_tools(log)
            _build(tree, log)
    return tree


def ensure_host_tools(log=sys.stderr) -> None:
    missing = sorted({pkg for tool, pkg in HOST_TOOLS.items() if not shutil.which(tool)})
    if not missing:
        return
    print(f"container: apt-get install {' '.join(missing)}", file=log, flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    _run(["apt-get", "update", "-q"], env=env, timeout=600)
    _run(["apt-get", "install", "-y", "-q", *missing], env=env, timeout=900)


def debian_mirror() -> str:
    """The mirror the host's apt uses (deb822 first, then the one-line format)."""
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    if sources.exists():
        for line in sources.read_text().splitlines():
            if line.startswith("URIs:") and "security" not in line:
                return line.split()[1]
    legacy = Path("/etc/apt/sources.list")
    if legacy.exists():
        for line in legacy.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and "security" not in parts[1]:
                return parts[1] if not parts[1].startswith("[") else parts[2]
    return "http://deb.debian.org/debian"


def _build(tree: Path, log) -> None:
    for stale in CACHE.glob(".build-*"):  # left by a run that was killed mid-build
        _rmtree(stale)
    build = Path(tempfile.mkdtemp(prefix=f".build-{tree_key()}-", dir=CACHE))
    build.chmod(0o755)  # it becomes the container's "/"; mkdtemp made it 0700
    started = time.monotonic()
    print(f"container: debootstrap {SUITE} into {build} (about a minute)", file=log, flush=True)
    _run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE,
          str(build), debian_mirror()], timeout=1800)
    _configure(build)
    (build / _COMPLETE).write_text(f"{tree_key()} {' '.join(PACKAGES)}\n")
    if tree.exists():  # an incomplete tree from an older layout of this code
        _rmtree(tree)
    os.rename(build, tree)
    print(f"container: tree ready in {time.monotonic() - started:.0f} s: {tree}",
          file=log, flush=True)


def _configure(root: Path) -> None:
    # Empty machine-id: systemd makes a fresh one at each boot (the tree is shared).
    (root / "etc/machine-id").write_text("")
    # Nothing reads the console here; a getty would only respawn against it.
    _mask(root, "console-getty.service", "getty@.service")
    (root / "etc/apt/apt.conf.d/99dsr1d-test").write_text(
        'APT::Install-Recommends "false";\n')


def _mask(root: Path, *units: str) -> None:
    for unit in units:
        link = root / "etc/systemd/system" / unit
        link.unlink(missing_ok=True)
        link.symlink_to("/dev/null")


def _rmtree(path: Path) -> None:
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False)


# ----------------------------------------------------------------------------- the container

class Container:
    """A booted container: ``exec(*cmd)`` runs inside via nsenter; ``close()`` powers it off.

    ``project``: a host directory bound read-only at ``/src`` or, with ``project_writable``,
    mounted there as an overlay whose writes are thrown away at close (so ``pip install /src``
    and ``make install`` can write their build files).  The host's CA bundle is copied
    in, so HTTPS (pip to PyPI, through the host's network) works as on the host.  ``pip_dirs``:
    also bind the host's local wheel directories read-only and copy its pip configuration, so
    pip inside resolves packages exactly as the host's pip does.
    ``binds`` / ``binds_ro``: extra ``{host: container}`` bind mounts.
    """

    def __init__(self, project: str | os.PathLike[str] | None = None, *,
                 project_writable: bool = False, pip_dirs: bool = True,
                 binds: Mapping[str, str] | None = None,
                 binds_ro: Mapping[str, str] | None = None, boot_timeout: float = 120) -> None:
        self.project = Path(project) if project else None
        self.project_writable = project_writable
        self.pip_dirs = pip_dirs
        self.binds = dict(binds or {})
        self.binds_ro = dict(binds_ro or {})
        self.boot_timeout = boot_timeout
        self.name = f"dsr1dtest{os.getpid()}n{next(_names)}"
        self.run_dir: Path | None = None
        self.root: Path | None = None
        self.nspawn: subprocess.Popen | None = None
        self.leader: int | None = None
        self.state: str | None = None  # "running" or "degraded" once booted
        self.boot_seconds: float | None = None

    # ----- life cycle

    def __enter__(self) -> "Container":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> "Container":
        tree = ensure_tree()
        started = time.monotonic()
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"{self.name}-", dir="/var/tmp"))
        self.root = self._mount_overlay(tree)
        self._seed_host_config()
        console = open(self.run_dir / "console.log", "wb")
        with console:
            self.nspawn = subprocess.Popen(
                self._nspawn_argv(), stdin=subprocess.DEVNULL, stdout=console,
                stderr=subprocess.STDOUT, start_new_session=True)
        self.leader = self._find_leader()
        self.state = self._wait_running()
        self.boot_seconds = time.monotonic() - started
        return self

    def close(self, timeout: float = 60) -> None:
        """Power off and wait for nspawn; kill it if it hangs; drop the overlay."""
        try:
            if self.nspawn is not None:
                self._power_off(timeout)
        finally:
            self.nspawn = self.leader = None
            if self.root is not None:
                subprocess.run(["umount", "-l", str(self.root)], check=False,
                               stderr=subprocess.DEVNULL)
                self.root = None
            if self.run_dir is not None:
                _rmtree(self.run_dir)
                self.run_dir = None

    def _power_off(self, timeout: float) -> None:
        try:
            if self.nspawn.poll() is None and self.leader is None:
                raise subprocess.TimeoutExpired("systemd-nspawn", 0)  # no PID 1 to ask
            if self.nspawn.poll() is None:
                self.exec("systemctl", "--no-block", "poweroff", check=False, timeout=10)
            self.nspawn.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill()
        except BaseException:  # Ctrl-C mid-shutdown: nspawn is in its own session, end it
            self._kill()
            raise

    def _kill(self) -> None:
        # nspawn turns SIGTERM into a poweroff request; SIGKILL to its group ends it for good.
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.nspawn.pid, sig)
            except ProcessLookupError:
                pass
            if self.leader is not None and sig == signal.SIGKILL:
                _signal(self.leader, sig)
            try:
                self.nspawn.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    # ----- inside

    def exec(self, *cmd: str, check: bool = True, input: str | None = None,
             env: Mapping[str, str] | None = None, timeout: float = 120,
             ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` in all of the container's namespaces, with a clean environment."""
        if self.leader is None:
            raise ContainerError("the container is not running")
        argv = ["nsenter", "-t", str(self.leader), "-a", "--", *cmd]
        proc = subprocess.run(argv, input=input, capture_output=True, text=True,
                              env={**CLEAN_ENV, **(env or {})}, timeout=timeout)
        if check and proc.returncode != 0:
            raise ContainerError(f"{' '.join(cmd)} -> {proc.returncode}\n"
                                 f"stdout: {proc.stdout}\nstderr: {proc.stderr}")
        return proc

    def write_file(self, path: str, text: str, mode: int = 0o644) -> None:
        """Write a file inside the container (through the overlay, before or after boot)."""
        target = self.root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        target.chmod(mode)

    def bus_address(self) -> str:
        """The container's system bus, reachable from the host."""
        return f"unix:path=/proc/{self.leader}/root/run/dbus/system_bus_socket"

    def console_log(self) -> str:
        try:
            return (self.run_dir / "console.log").read_text(errors="replace")
        except (OSError, TypeError):
            return ""

    def failed_units(self) -> str:
        return self.exec("systemctl", "--failed", "--no-legend", "--plain",
                         check=False).stdout.strip()

    # ----- boot details

    def _mount_overlay(self, tree: Path) -> Path:
        for sub in ("upper", "work", "root"):
            (self.run_dir / sub).mkdir()
        root = self.run_dir / "root"
        _run(["mount", "-t", "overlay", "overlay", "-o",
              f"lowerdir={tree},upperdir={self.run_dir / 'upper'},workdir={self.run_dir / 'work'}",
              str(root)])
        return root

    def _seed_host_config(self) -> None:
        copies = [CA_BUNDLE] + (list(PIP_CONFIGS) if self.pip_dirs else [])
        for path in filter(os.path.exists, copies):
            target = self.root / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            if os.path.isdir(path):
                shutil.copytree(path, target, dirs_exist_ok=True)
            else:
                target.unlink(missing_ok=True)  # never write through a symlink
                shutil.copyfile(path, target)

    def _nspawn_argv(self) -> list[str]:
        argv = ["systemd-nspawn", "-D", str(self.root), "--boot", "--register=no",
                "--keep-unit", "--console=read-only", "-M", self.name]
        argv += [f"--bind={path}" for path in KNOB_BINDS if os.path.exists(path)]
        ro = dict(self.binds_ro)
        if self.project is not None and self.project_writable:
            # Copy-on-write: builds inside (setuptools writes egg-info, build/) land in run_dir.
            upper = self.run_dir / "src-upper"
            upper.mkdir(exist_ok=True)
            argv.append(f"--overlay={self.project.resolve()}:{upper}:/src")
        elif self.project is not None:
            ro[str(self.project.resolve())] = "/src"
        if self.pip_dirs:
            ro.update({d: d for d in PIP_DIRS if os.path.isdir(d)})
        argv += [f"--bind-ro={host}:{inside}" for host, inside in ro.items()]
        argv += [f"--bind={host}:{inside}" for host, inside in self.binds.items()]
        return argv

    def _find_leader(self, timeout: float = 30) -> int:
        """The container's PID 1 as the host sees it: a descendant of nspawn with NSpid ... 1."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.nspawn.poll() is not None:
                raise ContainerError(f"systemd-nspawn exited {self.nspawn.returncode}\n"
                                     f"{self.console_log()}")
            for pid in _descendants(self.nspawn.pid):
                if _nspid(pid)[-1:] == ["1"] and len(_nspid(pid)) > 1:
                    return pid
            time.sleep(0.05)
        raise ContainerError(f"no container PID 1 under nspawn\n{self.console_log()}")

    def _wait_running(self) -> str:
        """Wait for ``is-system-running``; "running" or "degraded" is booted."""
        deadline = time.monotonic() + self.boot_timeout
        while time.monotonic() < deadline:
            if self.nspawn.poll() is not None:
                raise ContainerError(f"container exited during boot\n{self.console_log()}")
            left = max(1.0, deadline - time.monotonic())
            try:
                proc = self.exec("systemctl", "is-system-running", "--wait", check=False,
                                 timeout=left)
            except subprocess.TimeoutExpired:
                break
            state = proc.stdout.strip()
            if state == "running":
                return state
            if state == "degraded":
                print(f"container {self.name}: degraded, failed units:\n{self.failed_units()}",
                      file=sys.stderr, flush=True)
                return state
            time.sleep(0.1)  # systemd's private socket is not there yet
        raise ContainerError(f"container did not finish booting in {self.boot_timeout} s\n"
                             f"{self.console_log()}")


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rpartition(")")[2].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _nspid(pid: int) -> list[str]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return line.split()[1:]
    except OSError:
        pass
    return []


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _run(argv: Sequence[str], **kwargs) -> None:
    proc = subprocess.run(list(argv), capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        raise ContainerError(f"{' '.join(argv)} -> {proc.returncode}\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["build"]:
        print(ensure_tree())
        return 0
    if args[:1] == ["prune"]:  # old trees are never removed automatically: one may be in use
        for old in CACHE.glob("tree-*"):
            if old != tree_path():
                print(f"removing {old}")
                _rmtree(old)
        return 0
    if args[:1] == ["shell"]:
        with Container(args[1] if len(args) > 1 else None) as box:
            print(f"booted ({box.state}) in {box.boot_seconds:.1f} s; enter with:\n"
                  f"  nsenter -t {box.leader} -a -- bash\nCtrl-C powers it off", flush=True)
            try:
                signal.pause()
            except KeyboardInterrupt:
                pass
        return 0
    print(f"usage: {Path(sys.argv[0]).name} build | prune | shell [PROJECT_DIR]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
