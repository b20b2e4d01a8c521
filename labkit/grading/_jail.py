"""Start a command as an unprivileged uid in private mount and IPC namespaces (root only; stdlib only).

Usage (as root, already inside ``unshare --mount --ipc --propagation private``)::

    python -S -I _jail.py UID GID [OPTION...] PATH... -- COMMAND...

Options, each one token ``--name=value``:

* ``--cgroup=DIR``: first of all, move this process into the cgroup v2 group DIR (so COMMAND
  and all it starts are in it).
* ``--copy=SRC:DST``: read SRC now (as root) and write it at DST (owned by UID, mode 0600)
  once the private folders are in place (the kernel's connection file).
* ``--tmp=BYTES``: give the namespace fresh tmpfs mounts of that size on /tmp, /var/tmp and
  /dev/shm (mode 1777); a PATH (or a ``--bind`` destination) under one of them is bound back
  into it, so a grader installed under /tmp, /var/tmp or /dev/shm still gives its kernel Python
  and the kit.
* ``--stage=DIR`` (required with ``--tmp``): a folder of the grader's (outside the new mounts; the grader
  removes it) where staging folders are made; nothing is ever made in the shared TMPDIR.
* ``--home=DIR``: make DIR (in the new /tmp) owned by UID, mode 0700, with ``ipython`` and
  ``mpl`` inside; COMMAND starts there (unless ``--workdir``).
* ``--workdir=DIR``: make DIR (in the new /tmp) owned by UID, mode 0700; COMMAND starts there (the
  kernel's working folder: the learner's own files, gone with the namespace).
* ``--root=DIR``: give COMMAND a file system of its own (an allow-list): a tmpfs mounted on DIR
  holds the system's folders (:data:`SYSTEM`: ``/usr``, ``/etc``, ``/dev``, ...) and each PATH
  bound at its own place, and nothing else; the process then ``chroot``s into it. So the kernel
  sees Python, the environment and the kit, but no other file of the checkout (its git
  history, the solutions), of the grader (hidden cases, results, submissions) or of any home.
* ``--loopback=1``: COMMAND runs in a network namespace of its own (``unshare --net``): bring
  its loopback up. Its 127.0.0.1 is its own: no other kernel's port (a torch store, a Jupyter
  channel) and none of the grader's can be reached.
* ``--bind=SRC:DST``: with ``--root``, bind SRC at DST in the new root after every PATH (the
  grader's copy of the kit, :mod:`labkit.grading.withhold`, over the kit's folder).
* ``--hide=PATH``: cover PATH with an empty read-only tmpfs (a folder) or /dev/null (a file),
  in this namespace only: the grader's exercise modules and reference list, hidden cases.
* ``--hidepid=1``: mount a procfs of the namespace's own on /proc with ``hidepid=2``: COMMAND's
  uid sees only its own processes (not the grader's command lines, which in a batch name the
  other submissions, nor another kernel's). Root only: a non-root grader's user namespace may
  not mount one.
* ``--rlimit=NAME:N``: ``resource.RLIMIT_NAME`` soft and hard limit N (NPROC, FSIZE, AS).
* ``--keep-user=1``: a non-root grader, inside ``unshare --user --map-root-user ...``: UID and GID
  stay what they are (its own, mapped to 0 here); instead every capability of the namespace
  is dropped (bounding set emptied, no new privileges), so COMMAND can neither undo the
  mounts above nor make new ones.

Some installs keep Python under a folder other users cannot enter (``/root/.pyenv``, mode
0700). For each such folder on the way to a PATH the kernel needs (Python's prefix, the
environment, the kit's source), this covers the folder with an empty tmpfs *in this namespace
only* and binds the needed PATHs back into it: the kernel user can then run Python, while the
rest of that folder (root's files, hidden cases kept there) stays invisible to it. Then it
drops to UID/GID with no supplementary groups, asks to be killed with its parent, and execs
COMMAND. Nothing outside the namespace changes, and the private folders vanish with the
namespace's last process.
"""
import ctypes
import os
import resource
import sys
import tempfile

PRIVATE = ("/dev/shm", "/var/tmp", "/tmp")  # the one holding the staging folder is covered last
# what a new root (--root) holds of the system: programs, libraries, configuration, devices
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/dev", "/sys")


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


MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_MOVE, MS_REC = 1, 2, 4, 8, 4096, 8192, 16384
_LIBC = ctypes.CDLL("libc.so.6", use_errno=True)


def _mount(source, target: str, flags: int = 0, fstype: str | None = None, data: str | None = None) -> None:
    """mount(2) itself (``mount(8)`` fails after a move inside a user namespace of a non-root user)."""
    enc = (lambda x: None if x is None else os.fsencode(x))
    if _LIBC.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _tmpfs(target: str, data: str, flags: int = 0) -> None:
    _mount("tmpfs", target, flags, "tmpfs", data)


def _under(p: str, top: str) -> bool:
    return p == top or p.startswith(top.rstrip("/") + "/")


def _cover_blocked(needed) -> None:
    """Cover each folder others cannot enter with an empty tmpfs and bind the needed paths
    inside it back in place. Each needed path is held by an ``O_PATH`` descriptor while its
    folder is covered and bound from ``/proc/self/fd/N``: no staging folder, which could sit in
    the very folder being covered (a TMPDIR of mode 700)."""
    for top, paths in _tops(needed).items():
        held = [(os.open(p, os.O_PATH | os.O_DIRECTORY), p) for p in paths]
        try:
            _tmpfs(top, "mode=0755")
            for fd, p in held:
                os.makedirs(p, exist_ok=True)
                _mount(f"/proc/self/fd/{fd}", p, MS_BIND | MS_REC)
        finally:
            for fd, _ in held:
                os.close(fd)


def _private_tmp(size: int, stage_dir: str, needed) -> None:
    """Fresh tmpfs on each of :data:`PRIVATE`: mounted at a staging folder, the needed paths
    under it bound inside, then moved onto the folder it replaces."""
    real = os.path.realpath(stage_dir)
    # the folder that holds the staging folder goes last: once covered, the staging folder is out of reach
    for top in sorted(PRIVATE, key=lambda t: _under(real, os.path.realpath(t))):
        if not os.path.isdir(top) or os.path.islink(top):
            continue
        stage = tempfile.mkdtemp(prefix="tmp-", dir=stage_dir)
        _tmpfs(stage, f"size={size},mode=1777", MS_NOSUID | MS_NODEV)
        for p in sorted(needed, key=len):  # a folder before what is bound inside it (the kit over its folder)
            if _under(p, top) and p != top and os.path.exists(p):
                dst = os.path.join(stage, os.path.relpath(p, top))
                if os.path.isdir(p):
                    os.makedirs(dst, exist_ok=True)
                else:
                    os.makedirs(os.path.dirname(dst), exist_ok=True)
                    open(dst, "a").close()
                _mount(p, dst, MS_BIND | MS_REC)
        _mount(stage, top, MS_MOVE)
        try:
            os.rmdir(stage)  # the mount point left behind (the tmpfs now sits on ``top``)
        except OSError:
            pass  # the staging folder was in ``top`` itself: hidden now, and the grader removes it


def _new_root(root: str, needed, binds, proc: bool) -> None:
    """Build the new root on ``root`` (see ``--root``) and chroot into it. ``proc``: bind the
    system's /proc too (else the caller mounts a procfs of its own there)."""
    _tmpfs(root, "size=8m,mode=0755")

    def place(src: str, dst: str) -> None:
        inside = root + dst
        if os.path.isdir(src):
            os.makedirs(inside, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(inside), exist_ok=True)
            open(inside, "a").close()
        _mount(src, inside, MS_BIND | MS_REC)

    for top in SYSTEM + (("/proc",) if proc else ()):
        if os.path.islink(top):
            os.symlink(os.readlink(top), root + top)
        elif os.path.isdir(top):
            place(top, top)
    os.makedirs(root + "/proc", exist_ok=True)
    for top in PRIVATE:
        if not os.path.exists(root + top):  # /dev/shm came with /dev (--tmp covers each)
            os.makedirs(root + top)
            os.chmod(root + top, 0o1777)
    for p in needed:
        place(p, p)
    for src, dst in binds:
        place(src, dst)
    os.chroot(root)
    os.chdir("/")


def _loopback_up() -> None:
    """``ip link set lo up`` with two ioctls (SIOCGIFFLAGS, SIOCSIFFLAGS; IFF_UP = 1)."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, 0x8913, struct.pack("16sH14s", b"lo", 0, b"")))[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", flags | 1, b""))


def _hide(path: str) -> None:
    if os.path.isdir(path):
        _tmpfs(path, "size=4k,mode=0555", MS_RDONLY)
    elif os.path.exists(path):
        _mount("/dev/null", path, MS_BIND)


def main(argv):
    sep = argv.index("--")
    uid, gid = int(argv[1]), int(argv[2])
    opts, paths = {}, []
    for a in argv[3:sep]:
        if a.startswith("--") and "=" in a:
            k, v = a[2:].split("=", 1)
            opts.setdefault(k, []).append(v)
        else:
            paths.append(a)
    cmd = argv[sep + 1:]
    for cg in opts.get("cgroup", []):
        with open(os.path.join(cg, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    copies = []
    for spec in opts.get("copy", []):
        src, dst = spec.split(":", 1)
        with open(src, "rb") as f:
            copies.append((dst, f.read()))
    needed = sorted({os.path.realpath(p) for p in paths if os.path.isdir(p)})
    needed = [p for p in needed if not any(p != q and p.startswith(q + "/") for q in needed)]
    # staging folders go in the grader's own folder for this kernel (``--stage``, which it removes), never in
    # the shared TMPDIR, which the kernel's uid may be unable to enter and where nothing may be left behind
    stage = opts.get("stage", [None])[0]
    if stage is None and opts.get("tmp") and not opts.get("root"):
        raise SystemExit("labkit jail: --tmp needs --stage=DIR (a folder of the grader's, removed by it)")
    kept = list(needed)  # what the private temporary folders must show again: the PATHs and the binds
    if opts.get("loopback"):
        _loopback_up()
    if opts.get("root"):
        binds = [tuple(b.split(":", 1)) for b in opts.get("bind", [])]
        _new_root(opts["root"][0], needed, binds, proc=not opts.get("hidepid"))
        stage = tempfile.mkdtemp(prefix="stage-", dir="/")  # on the new root's own tmpfs
        kept += [dst for _src, dst in binds]  # the grader's copy of the kit, over a folder that may be in /tmp
    for size in opts.get("tmp", []):
        _private_tmp(int(size), stage, kept)
    if not opts.get("root"):
        # after the private temporary folders: a folder of mode 700 in /tmp (the grader's TMPDIR) is then
        # already replaced by an open one in the new tmpfs, and the staging folder was still reachable
        _cover_blocked(needed)
    for path in opts.get("hide", []):
        _hide(os.path.realpath(path))
    if opts.get("hidepid"):
        _mount("proc", "/proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "proc", "hidepid=2")
    home = opts.get("home", [None])[0]
    if home:
        for d in (home, os.path.join(home, "ipython"), os.path.join(home, "mpl")):
            os.makedirs(d, mode=0o700, exist_ok=True)
            os.chown(d, uid, gid)
    workdir = opts.get("workdir", [None])[0]
    if workdir:
        os.makedirs(workdir, mode=0o700, exist_ok=True)
        os.chown(workdir, uid, gid)
    for dst, data in copies:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, data)
        os.fchown(fd, uid, gid)
        os.close(fd)
    for spec in opts.get("rlimit", []):
        name, value = spec.split(":", 1)
        resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (int(value), int(value)))
    libc = _LIBC
    if "keep-user" in opts:
        cap = 0
        while libc.prctl(24, cap, 0, 0, 0) == 0:  # PR_CAPBSET_DROP, until EINVAL past the last capability
            cap += 1
        if cap == 0 or libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
            raise SystemExit("labkit jail: could not drop the namespace's capabilities")
    else:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL: die with the grader
    if workdir or home:
        os.chdir(workdir or home)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv)
