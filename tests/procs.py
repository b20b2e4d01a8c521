"""Helpers shared by the fault tests: which processes are still alive (read from /proc), and the
clean-up that kills what a test started."""
import os
import signal


def live_processes(*, ppid: int | None = None, pgid: int | None = None) -> list[int]:
    """PIDs of live (non-zombie) processes whose parent is ``ppid`` or whose process group is
    ``pgid`` (fields 4 and 5 of /proc/PID/stat)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, parent, group = f.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if state != "Z" and ((ppid is not None and int(parent) == ppid) or (pgid is not None and int(group) == pgid)):
            out.append(int(pid))
    return out


def kill_groups(procs) -> None:
    """SIGKILL each ``subprocess.Popen`` in ``procs`` with its process group, and reap it (a test's clean-up)."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(10)
