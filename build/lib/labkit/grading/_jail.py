"""Run a command as an unprivileged user in a private mount namespace (root only; stdlib only).

Usage (as root, already inside ``unshare --mount --propagation private``)::

    python -S -I _jail.py UID GID PATH... -- COMMAND...

Some installs keep Python under a folder other users cannot enter (``/root/.pyenv``, mode
0700). For each such folder on the way to a PATH the kernel needs (Python's prefix, the
environment, the kit's source), this covers the folder with an empty tmpfs *in this namespace
only* and binds the needed PATHs back into it: the kernel user can then run Python, while the
rest of that folder (root's files, hidden cases kept there) stays invisible to it. Then it
drops to UID/GID with no supplementary groups, asks to be killed with its parent, and execs
COMMAND. Nothing outside the namespace changes.
"""
import os
import subprocess
import sys
import tempfile


def _blocked(path: str) -> bool:
    try:
        return not os.stat(path).st_mode & 0o001  # others cannot enter it
    except OSError:
        return False


def _tops(needed):
    tops = {}
    for p in needed:
        cur = "/"
        for part in p.strip("/").split("/")[:-1]:
            cur = os.path.join(cur, part)
            if _blocked(cur):
                tops.setdefault(cur, []).append(p)
                break
    # a folder already covered by a higher one is rebuilt inside it
    return {t: ps for t, ps in tops.items() if not any(t != u and t.startswith(u + "/") for u in tops)}


def _mount(*args):
    subprocess.run(["mount", *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def main(argv):
    sep = argv.index("--")
    uid, gid = int(argv[1]), int(argv[2])
    needed = sorted({os.path.realpath(p) for p in argv[3:sep] if os.path.isdir(p)})
    needed = [p for p in needed if not any(p != q and p.startswith(q + "/") for q in needed)]
    cmd = argv[sep + 1:]
    for top, paths in _tops(needed).items():
        stage = tempfile.mkdtemp(prefix="labkit-jail-")
        held = []
        for i, p in enumerate(paths):
            dst = os.path.join(stage, str(i))
            os.makedirs(dst)
            _mount("--rbind", p, dst)
            held.append((dst, p))
        _mount("-t", "tmpfs", "-o", "mode=0755", "tmpfs", top)
        for dst, p in held:
            os.makedirs(p, exist_ok=True)
            _mount("--move", dst, p)
        for dst, _ in held:
            os.rmdir(dst)
        os.rmdir(stage)
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: die with the grader
    except Exception:  # noqa: BLE001
        pass
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv)
