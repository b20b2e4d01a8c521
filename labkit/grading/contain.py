"""Containment of one submission's processes by the operating system (root only).

The learner's kernel can fork, detach (``setsid``, double forks), clear its environment, leave
a thread-group leader in state Z while another thread runs, fill /tmp and /dev/shm, and hold
System V shared memory. Python-level bookkeeping cannot follow all of that, so the grader
relies on what the kernel (Linux) enforces:

* **a uid of its own** (:class:`UidLease`): each kernel runs under a fresh uid from
  :data:`UID_BASE` (no passwd entry is needed), locked with ``flock`` so that no other kernel
  of any grader on the machine gets it while it is in use. At the end every process of that
  uid is SIGKILLed, whatever its state (``/proc/PID/status`` ``Uid:`` line, so a state-Z
  leader whose threads still run is found and killed too), and the grader, the kernel's
  subreaper, reaps them (:func:`kill_uid`); then the files the uid owns in the shared
  world-writable folders are removed (:func:`remove_files_of`). One submission can never
  signal another's kernel: they never share a uid.
* **its own cgroup** when the machine has cgroup v2 (:func:`cgroup_v2_root`): memory, pids and
  CPU limits from :class:`Limits`; at the end ``cgroup.kill`` ends every process in it at once
  (:class:`Cgroup`). The uid is used as well, so the sweep above still runs.
* **private /tmp, /var/tmp and /dev/shm and IPC**: the kernel starts in its own mount and IPC
  namespaces (:mod:`labkit.grading._jail`), where these folders are fresh size-limited tmpfs
  mounts; they, and any System V segment, vanish with the kernel's last process.
* **rlimits** (:class:`Limits`): processes (``RLIMIT_NPROC``, counted per uid, so exactly the
  submission's), file size (``RLIMIT_FSIZE``) and address space per process (``RLIMIT_AS``).

Without root none of this is available: a non-root grader runs the kernel as its own user
(in user, mount and IPC namespaces of its own where ``unshare --user`` works: private
temporary folders, secrets covered, no capabilities; no uid, cgroup or process limit), and
:func:`labkit.grading.session.isolation_note` says what that leaves open.
"""
from __future__ import annotations

import errno
import fcntl
import os
import random
import shutil
import signal
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Limits", "UidLease", "Cgroup", "cgroup_v2_root", "uid_processes", "kill_uid", "kill_quietly", "reap",
           "remove_files_of", "UID_BASE", "UID_COUNT", "SHARED_TMP"]

UID_BASE = 1_900_000_000  # fresh uids come from [UID_BASE, UID_BASE + UID_COUNT)
UID_COUNT = 1_000_000
SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue")  # world-writable folders swept by uid
MiB = 2 ** 20


@dataclass(frozen=True)
class Limits:
    """Resource limits of one submission (``python -m labkit grade --max-...`` options).

    ``processes``: processes and threads of the submission's uid (``RLIMIT_NPROC``; cgroup v2
    ``pids.max``). ``file_size``: bytes of one file it writes (``RLIMIT_FSIZE``).
    ``address_space``: bytes of virtual memory of one process (``RLIMIT_AS``; torch alone maps
    about 0.7 GiB). ``memory``: bytes of memory of all its processes (cgroup v2 ``memory.max``
    only). ``cpus``: CPUs it may use (cgroup v2 ``cpu.max``; 0 = all). ``tmp_size``: bytes of
    each private tmpfs (/tmp, /var/tmp, /dev/shm)."""

    processes: int = 1024
    file_size: int = 256 * MiB
    address_space: int = 8 * 1024 * MiB
    memory: int = 8 * 1024 * MiB
    cpus: float = 0.0
    tmp_size: int = 512 * MiB

    def rlimits(self) -> dict[str, int]:
        """``resource.RLIMIT_*`` name -> value, for :mod:`labkit.grading._jail`."""
        return {"NPROC": self.processes, "FSIZE": self.file_size, "AS": self.address_space}


def _lock_dir() -> str:
    for d in ("/run/labkit-grader", os.path.join(tempfile.gettempdir(), "labkit-grader-uids")):
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
            st = os.lstat(d)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
                os.chmod(d, 0o700)
                return d
        except OSError:
            continue
    raise RuntimeError("no folder to keep the uid locks in (/run/labkit-grader)")


class UidLease:
    """A uid that no other live kernel uses, held (``flock``) until :meth:`release`.

    A uid is taken only when its lock is free and no process of that uid is alive (a grader
    that died without cleaning up leaves its uid's processes; that uid is skipped)."""

    def __init__(self, base: int = UID_BASE, count: int = UID_COUNT):
        folder = _lock_dir()
        for _ in range(200):
            uid = base + random.randrange(count)
            fd = os.open(os.path.join(folder, f"{uid}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            if uid_processes(uid):
                os.close(fd)
                continue
            self.uid = self.gid = uid
            self._fd = fd
            self._path = os.path.join(folder, f"{uid}.lock")
            return
        raise RuntimeError("could not find a free uid for the kernel")

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.unlink(self._path)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = None


def uid_processes(uid: int) -> list[tuple[int, str, int]]:
    """(pid, state, ppid) of every process any of whose uids (real, effective, saved, fs) is
    ``uid``, zombies included (read from ``/proc/PID/status``)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", "rb") as f:
                text = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = {}
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key in ("State", "PPid", "Uid"):
                fields[key] = value.split()
        try:
            if uid in map(int, fields["Uid"]):
                out.append((int(entry), fields["State"][0], int(fields["PPid"][0])))
        except (KeyError, ValueError, IndexError):
            continue
    return out


def kill_quietly(pid: int, sig: int = signal.SIGKILL, send=os.kill) -> None:
    """``send(pid, sig)`` (:func:`os.kill` or :func:`os.killpg`); nothing where it is gone or not ours."""
    try:
        send(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def reap(pid: int) -> None:
    """Reap ``pid`` if it is a dead child of this process (nothing otherwise)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def kill_uid(uid: int, timeout: float = 10.0) -> list[int]:
    """SIGKILL every process of ``uid`` and reap those that are this process's children, until
    none is left (or ``timeout`` s passed); returns the pids still there (empty on success).

    A zombie leader with live threads is signalled like any process (the signal goes to its
    whole thread group); a zombie whose parent is another process of ``uid`` is reparented to
    this process (a subreaper) when that parent dies, and reaped on a later sweep."""
    me = os.getpid()
    deadline = time.monotonic() + timeout
    while True:
        procs = uid_processes(uid)
        for pid, _state, _ppid in procs:
            if pid == me:
                continue
            kill_quietly(pid)
        for pid, _state, ppid in uid_processes(uid):
            if ppid == me:
                reap(pid)
        left = [p for p, _, _ in uid_processes(uid) if p != me]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


def remove_files_of(uid: int, roots=SHARED_TMP) -> list[str]:
    """Remove every file, folder and link that ``uid`` owns under ``roots`` (never following a
    link; a folder it owns goes with all it holds); returns what could not be removed."""
    left = []

    def walk(folder: str) -> None:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            return
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            try:
                if st.st_uid == uid:
                    if stat.S_ISDIR(st.st_mode):
                        shutil.rmtree(e.path)
                    else:
                        os.unlink(e.path)
                elif stat.S_ISDIR(st.st_mode):
                    walk(e.path)
            except OSError:
                left.append(e.path)

    for root in roots:
        if os.path.isdir(root):
            walk(root)
    return left


def cgroup_v2_root() -> Path | None:
    """The cgroup v2 mount (``/sys/fs/cgroup`` holding ``cgroup.controllers``), else None."""
    root = Path("/sys/fs/cgroup")
    return root if (root / "cgroup.controllers").is_file() else None


class Cgroup:
    """A cgroup v2 group ``labkit/NAME`` under ``root`` with the memory, pids and CPU limits of
    ``limits``. :meth:`kill` ends every process in it (``cgroup.kill``, else SIGKILL to each
    pid in ``cgroup.procs``) and removes it. Raises OSError when the group cannot be made
    (no delegation, controllers busy): the caller then relies on the uid alone."""

    def __init__(self, root: Path, name: str, limits: Limits):
        parent = Path(root) / "labkit"
        parent.mkdir(exist_ok=True)
        wanted = [c for c in ("memory", "pids", "cpu")
                  if c in (Path(root) / "cgroup.controllers").read_text().split()]
        for folder in (Path(root), parent):
            have = (folder / "cgroup.subtree_control").read_text().split()
            missing = [c for c in wanted if c not in have]
            if missing:
                (folder / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in missing))
        self.path = parent / name
        self.path.mkdir()
        if "memory" in wanted:
            (self.path / "memory.max").write_text(str(limits.memory))
            if (self.path / "memory.swap.max").exists():
                (self.path / "memory.swap.max").write_text("0")
        if "pids" in wanted:
            (self.path / "pids.max").write_text(str(limits.processes))
        if "cpu" in wanted and limits.cpus:
            period = 100_000
            (self.path / "cpu.max").write_text(f"{int(limits.cpus * period)} {period}")

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def kill(self, timeout: float = 10.0) -> list[int]:
        """Kill everything in the group, reap this process's children among them, remove the
        group; returns the pids still in it (empty on success)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                (self.path / "cgroup.kill").write_text("1")
            except OSError:
                for pid in self.pids():
                    kill_quietly(pid)
            for pid in self.pids():  # this process's children among them: reaped
                reap(pid)
            try:
                populated = "populated 1" in (self.path / "cgroup.events").read_text()
            except OSError:
                populated = bool(self.pids())
            if not populated or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        try:
            self.path.rmdir()
        except OSError as e:
            if e.errno != errno.ENOENT:
                return self.pids() or [-1]
        return []
