"""The learner's kernel as the grader sees it: started, fed cells, asked for data, killed.

The grader starts an IPython kernel itself (no nbclient) so it controls everything the
submission could abuse (the threats and the tests that show each: ``docs/grading.md``):

* **user**: as root, a uid of its own per kernel (:class:`~labkit.grading.contain.UidLease`),
  with :class:`~labkit.grading.contain.Limits`, started through :mod:`labkit.grading._jail` in
  private mount, IPC and network namespaces and a file system of its own (its HOME is
  :data:`PRIVATE_HOME` in a private /tmp; :func:`secret_paths` covered), in a cgroup of its own
  under cgroup v2. Root without CAP_SYS_ADMIN (Docker's default): no namespaces; where the
  installed kit is root-only, the kernel imports the grader's withheld copy
  (:attr:`KernelUser.kit_private`). :func:`isolation_problem` is the self-check at start; as any other user
  isolation is partial and :func:`isolation_note` says what is left open.
* **process tree**: a new session and a fresh ``LABKIT_KERNEL_MARK`` in its environment; at the
  end :meth:`KernelSession.kill` kills the group, the session, the marked processes and the
  orphans reparented to the grader (its subreaper), in any state, and reaps them; as root then
  every process and file of its uid (:mod:`labkit.grading.contain`).
* **output**: nobody subscribes to IOPub, so a flood is dropped by ZMQ; only execute replies
  come back, over a shell socket whose message size is capped.
* **time**: past a cell's limit the kernel gets SIGINT, then after :data:`INTERRUPT_GRACE`
  seconds it is killed (the grader replays the cells that ran in a fresh kernel).
* **environment**: an allow-list (:data:`KERNEL_ENV`); ``LABKIT_GRADING=1`` tells ``check`` to
  register answers. The kernel is not told where the results go.
"""
from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass

from .contain import Cgroup, Limits, UidLease, cgroup_v2_root, kill_uid, remove_files_of
from .kernel import GRADING_ENV
from .proxy import CaseTimeout, KernelFailure, request_kernel
from .registry import HIDDEN_ENV

__all__ = ["KernelUser", "kernel_user", "isolation_problem", "place_problem", "kit_folder",
           "KernelSession", "KernelStartTimeout", "KernelStartError", "isolation_note",
           "INTERRUPT_GRACE"]

INTERRUPT_GRACE = 2.0  # seconds a kernel gets to stop after SIGINT before it is killed
START_TIMEOUT = 60.0  # seconds a kernel may take to start

MARK_ENV = "LABKIT_KERNEL_MARK"  # a fresh value per kernel, inherited by every process it starts
# the submissions and results of this grading (os.pathsep-separated): covered in the kernel's namespace,
# so one submission's code reads neither the others nor their results (set by the grader, never passed on)
PRIVATE_ENV = "LABKIT_PRIVATE_PATHS"
# the only variables of the grader's environment a kernel gets (plus LC_*): what Python, torch and the
# kit need to run; anything else (tokens, credentials, the grader's paths) stays with the grader
KERNEL_ENV = ("PATH", "LANG", "LANGUAGE", "TZ", "PYTHONPATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH",
              "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "LABKIT_TEST_MARK")


def kernel_environment() -> dict:
    """The kernel's environment: :data:`KERNEL_ENV` and ``LC_*`` of the grader's, nothing else."""
    return {k: v for k, v in os.environ.items() if k in KERNEL_ENV or k.startswith("LC_")}


def add_private_paths(paths) -> None:
    """Add ``paths`` (submissions, results) to what this grader's kernels must not read."""
    old = [p for p in os.environ.get(PRIVATE_ENV, "").split(os.pathsep) if p]
    new = [os.path.abspath(str(p)) for p in paths]
    os.environ[PRIVATE_ENV] = os.pathsep.join(dict.fromkeys(old + new))
MAX_MESSAGE = 64 * 2 ** 20  # bytes of one message from the kernel


# before the first cell: torch and the kit, so no cell's time limit pays for them. sys.path is IPython's, as
# in Jupyter: the working folder ('') after the standard library and before site-packages, so a module the
# notebook writes there (%%writefile helpers.py) imports. That folder is the kernel's own and empty at start:
# what a file written there later can shadow, it shadows for the notebook alone, whose results are judged in
# the grader on data like any other code it runs (docs/grading.md)
WARM_UP = "import torch, labkit.grading.kernel"
PRIVATE_HOME = "/tmp/labkit-home"  # the kernel's HOME, inside its private /tmp (jail mode)
PRIVATE_WORK = "/tmp/labkit-work"  # the kernel's working folder, inside its private /tmp (jail mode)


@dataclass
class KernelUser:
    name: str
    uid: int
    gid: int
    dedicated: bool  # only then may every process of this uid be killed at the end
    jail: bool = False  # run through _jail.py (private mount and IPC namespaces)
    limits: Limits = Limits()
    userns: bool = False  # a non-root grader: its own uid, in a user namespace of its own (no uid change)
    newroot: bool = False  # jail mode: a file system of its own (_jail.py --root): of the checkout, the kit alone
    # no jail (root without CAP_SYS_ADMIN): the installed kit is readable by root only, and the kernel imports the
    # grader's copy (labkit.grading.withhold) from PYTHONPATH, so the references stay withheld without namespaces
    kit_private: bool = False

    def command(self, cmd: list[str], cwd: str | None = None, options=(), kit: str | None = None,
                stage: str | None = None) -> tuple[list[str], dict]:
        """``cmd`` as this user: (argv, extra Popen keywords). ``options``: more
        :mod:`labkit.grading._jail` options (jail mode only). With :attr:`newroot`, ``stage``
        (a folder of the grader's, for the new root's mount point) gives ``cmd`` a file system
        of its own in which the kit's folder is ``kit`` (the grader's copy,
        :mod:`labkit.grading.withhold`; default the installed kit's folder) and nothing else of
        the folder that holds it."""
        if not self.jail:
            limits = self.limits

            def preexec():
                import resource

                for name, value in limits.rlimits().items():
                    resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (value, value))
                _pdeathsig()

            return cmd, dict(user=self.uid, group=self.gid, extra_groups=[], preexec_fn=preexec)
        import labkit

        kit_dir = os.path.dirname(os.path.abspath(labkit.__file__))
        needed = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                  os.path.dirname(os.path.realpath(sys.executable))}
        here = os.path.realpath(os.getcwd())  # `python -m` puts the grader's working folder on sys.path: the kernel
        needed |= {p for p in sys.path if p and os.path.isdir(p) and os.path.realpath(p) != here}  # needs none of it
        if cwd:
            needed.add(cwd)
        if self.newroot and stage:
            # a folder that holds the kit (the checkout, the grader's working folder on sys.path) is not
            # bound, unless it is Python's own (a kit installed in site-packages): the kit's folder alone is
            real_kit = os.path.realpath(kit_dir)
            own = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
            needed = {p for p in needed if not (real_kit.startswith(os.path.realpath(p).rstrip("/") + "/")
                                                and os.path.realpath(p) not in own
                                                and os.path.basename(p) not in ("site-packages", "dist-packages"))}
            root = os.path.join(stage, "root")
            os.makedirs(root, exist_ok=True)
            options = [f"--root={root}", f"--bind={kit or kit_dir}:{os.path.realpath(kit_dir)}", "--loopback=1",
                       *options]
        else:
            needed.add(os.path.dirname(kit_dir))
        jail = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_jail.py")
        rl = [f"--rlimit={k}:{v}" for k, v in self.limits.rlimits().items()
              if not (self.userns and k == "NPROC")]  # NPROC counts every process of the uid: the grader's too
        net = ["--net"] if self.newroot and stage else []  # a loopback of its own (the jail brings it up)
        if self.userns:
            return (["unshare", "--user", "--map-root-user", "--mount", "--ipc", *net, "--propagation", "private", "--",
                     sys.executable, "-S", "-I", jail, "0", "0", "--keep-user=1", *rl, *options, *sorted(needed), "--",
                     *cmd], {})
        return (["unshare", "--mount", "--ipc", *net, "--propagation", "private", "--", sys.executable, "-S", "-I",
                 jail, str(self.uid), str(self.gid), *rl, *options, *sorted(needed), "--", *cmd], {})


_USER_CACHE: list = []


def kernel_user(limits: Limits | None = None) -> KernelUser | None:
    """How kernels run when this process is root (else None), probed once: a template whose
    uid is replaced by a fresh one per kernel (:class:`~labkit.grading.contain.UidLease`),
    in private namespaces (``jail``) when ``unshare`` works."""
    if not _USER_CACHE:
        _USER_CACHE.append(_find_kernel_user())
    user = _USER_CACHE[0]
    if user is not None and limits is not None:
        user = KernelUser(user.name, user.uid, user.gid, user.dedicated, user.jail, limits, user.userns,
                          user.newroot, user.kit_private)
    return user


def _find_kernel_user() -> KernelUser | None:
    if os.geteuid() != 0:
        return _find_namespace_user()
    lease = UidLease()
    try:
        user = KernelUser("a uid of its own", lease.uid, lease.gid, True)
        why = "unshare or mount is missing"
        if shutil.which("unshare") and shutil.which("mount"):
            # private /tmp, /dev/shm and IPC, the grader's files hidden, and a file system of its own on the
            # grader's copy of the kit (so the installed kit may be root-only, as the Gradescope bundle makes it)
            user.jail = user.newroot = True
            ok, why = _probe(user)
            if ok:
                return user
            user.newroot = False
            ok, why_jail = _probe(user)
            if ok:
                _NO_NEW_ROOT[:] = [why]
                return user
            why = why_jail
        user.jail = False
        ok, why2 = _probe(user)
        if not ok:  # the installed kit root-only: the kernel on the grader's copy, whose references are withheld
            user.kit_private = True
            ok, why3 = _probe(user)
            why2 = why2 if ok or "readable" not in why3 else why3
            user.kit_private = ok
        if ok:
            _UNUSABLE[:] = [f"no private namespaces ({why})"]
            return user
        _UNUSABLE[:] = [f"a fresh uid cannot run {sys.executable} with labkit (in a jail: {why}; without: {why2})"]
        return None
    finally:
        kill_uid(lease.uid, 5)
        lease.release()


def _find_namespace_user() -> KernelUser | None:
    """A non-root grader: its own uid, in user, mount and IPC namespaces of the kernel's own
    (private /tmp, /var/tmp, /dev/shm and IPC; the grader's secret files covered; every
    capability dropped), when ``unshare --user`` works here; else None (no isolation)."""
    if not (shutil.which("unshare") and shutil.which("mount")):
        _UNUSABLE[:] = ["unshare or mount is missing"]
        return None
    user = KernelUser("this user, in namespaces of its own", os.getuid(), os.getgid(), False, True, Limits(), True)
    ok, why = _probe(user)
    if ok:
        _try_new_root(user)
        return user
    _UNUSABLE[:] = [f"no user namespace ({why})"]
    return None


_NO_NEW_ROOT: list[str] = []  # why kernels do not get a file system of their own


def _try_new_root(user: KernelUser) -> None:
    """Give ``user`` a file system of its own (:attr:`KernelUser.newroot`) if a probe runs there."""
    user.newroot = True
    ok, why = _probe(user)
    if not ok:
        user.newroot = False
        _NO_NEW_ROOT[:] = [why]


PROBE = ("import os, sys, ipykernel, labkit.grading.kernel\n"
         "print('labkit-probe', os.getuid(), os.geteuid(), os.path.dirname(labkit.__file__))\n"
         "for f in sys.argv[1:]:\n"
         "    try:\n"
         "        open(f).close()\n"
         "        print('labkit-probe-readable', f)\n"
         "    except OSError:\n"
         "        pass")


def _probe(user: KernelUser) -> tuple[bool, str]:
    """The self-check: can ``user`` start this environment's Python and import ipykernel and the
    kit, in the jail a kernel gets (the same :mod:`labkit.grading._jail` options: private
    temporary folders, home, hidden secrets, its own /proc and root, there on the grader's copy
    of the kit, as a kernel gets it), and does it run as a uid other than root when the grader
    is root? (ok, why not). Leaves nothing behind: its staging folder is removed."""
    stage = tempfile.mkdtemp(prefix="labkit-probe-", dir=_open_tmp() if user.kit_private else None)
    os.chmod(stage, 0o755)
    try:
        options, extra, env_kit, copy = [], [], {}, None
        if user.kit_private or user.newroot:  # the grader's copy of the kit, as a kernel gets it
            from .withhold import build_kit

            copy = build_kit([], os.path.join(stage, "kit")).path
        if user.kit_private:  # the copy on PYTHONPATH; the installed kit must stay unreadable
            import labkit

            env_kit = {"PYTHONPATH": os.path.dirname(copy)}
            extra = [os.path.join(os.path.dirname(os.path.abspath(labkit.__file__)), "__init__.py")]
        if user.jail:
            options = [f"--tmp={2 ** 20}", f"--stage={stage}", f"--home={PRIVATE_HOME}", f"--workdir={PRIVATE_WORK}",
                       *(f"--hide={p}" for p in secret_paths())]
            if not user.userns:
                options.append("--hidepid=1")
        argv, kw = user.command([sys.executable, *_no_user_site(), "-c", PROBE, *extra], options=options,
                                kit=copy, stage=stage if user.newroot else None)
        env = {**kernel_environment(), "HOME": PRIVATE_HOME if user.jail else stage, "TMPDIR": "/tmp", **env_kit}
        probe = subprocess.run(argv, cwd="/", stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               timeout=120, env=env, **kw)
        if probe.returncode != 0:
            return False, _first_line(probe.stderr)
        line = next((l.split() for l in probe.stdout.splitlines() if l.startswith("labkit-probe ")), None)
        if line is None or len(line) < 3:
            return False, "the probe printed nothing"
        if os.geteuid() == 0 and "0" in line[1:3]:
            return False, "the probe ran as root"
        readable = [l.split(None, 1)[1] for l in probe.stdout.splitlines() if l.startswith("labkit-probe-readable ")]
        if readable:
            return False, f"the kernel's uid can read the installed kit ({readable[0]})"
        return True, ""
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"{type(e).__name__}: {e}"
    finally:
        shutil.rmtree(stage, ignore_errors=True)


_UNUSABLE: list[str] = []  # why running as root did not give an unprivileged kernel


def _first_line(text: str) -> str:
    lines = [l.strip() for l in str(text).strip().splitlines() if l.strip()]
    return lines[-1][:200] if lines else "no output"


def secret_paths() -> list[str]:
    """What the kernel must not read: the grader's exercise modules (cases, expected-value
    code), its reference list, the hidden cases shipped in ``labkit/grading/hidden`` and the
    instructor's hidden-case folders (those that exist). In jail mode each is
    covered by an empty mount in the kernel's namespace (:mod:`labkit.grading._jail`)."""
    here = os.path.dirname(os.path.abspath(__file__))
    out = [os.path.join(here, "exercises"), os.path.join(here, "references.py"), os.path.join(here, "hidden")]
    out += [p for p in os.environ.get(HIDDEN_ENV, "").split(os.pathsep) if p and os.path.isdir(p)]
    # the solved notebooks shipped with the kit (labkit/_solutions, a link to solutions/ in a checkout)
    kit = os.path.dirname(here)
    solutions = os.path.join(kit, "_solutions")
    if os.path.isdir(solutions):
        out += [solutions, os.path.realpath(solutions)]
    # this grading's submissions and results, unless a folder among them holds what the kernel runs
    needed = [os.path.realpath(q) for q in (kit, sys.prefix, sys.base_prefix, os.path.dirname(sys.executable))]
    for p in os.environ.get(PRIVATE_ENV, "").split(os.pathsep):
        real = os.path.realpath(p) if p else ""
        if real and os.path.exists(real) and not any(n == real or n.startswith(real.rstrip("/") + "/")
                                                     for n in needed):
            out.append(real)
    return list(dict.fromkeys(out))


def secret_files() -> list[str]:
    """One file per :func:`secret_paths` entry, for the readability probe."""
    out = []
    for p in secret_paths():
        if os.path.isdir(p):
            out += sorted(os.path.join(p, n) for n in os.listdir(p) if n.endswith(".py"))[:1]
        elif os.path.isfile(p):
            out.append(p)
    return out


def place_problem() -> str:
    """What this machine lacks for the grader to run and clean up at all ("" when nothing): a
    mounted /proc (every process a submission starts is found, killed and reaped through it),
    /dev/null and a temporary folder. One line with the cause and the fix; checked before the
    isolation self-check and not waived by ``--allow-partial-isolation`` (without /proc nothing
    the kernel starts could be found again)."""
    if not os.path.isdir("/proc/self/fd"):
        return ("/proc is not mounted here (a chroot or container without it?): the grader finds, kills and reaps "
                "every process a submission starts through /proc. Fix: mount it before grading "
                "(mount -t proc proc /proc, or from outside a chroot: mount -t proc proc DIR/proc)")
    if not os.path.exists("/dev/null"):
        return ("/dev/null is missing here (a chroot without /dev?). Fix: mount /dev before grading "
                "(from outside a chroot: mount --rbind /dev DIR/dev)")
    try:
        tempfile.gettempdir()
    except (OSError, FileNotFoundError) as e:
        return (f"no usable temporary folder ({e}). Fix: create /tmp (mode 1777) or set TMPDIR to a folder "
                f"root may write")
    return ""


_CAP_SYS_ADMIN = 21


def _capable(cap: int) -> bool:
    """Whether this process's effective capabilities hold ``cap`` (``/proc/self/status``)."""
    try:
        with open("/proc/self/status") as f:
            eff = next(int(l.split()[1], 16) for l in f if l.startswith("CapEff:"))
        return bool(eff >> cap & 1)
    except (OSError, StopIteration, ValueError, IndexError):
        return True


def _root_is_a_mount_point() -> bool:
    """Whether ``/`` is a mount point (not so in a chroot made in a plain folder): only then can a
    new mount namespace make its mounts private (``unshare --propagation private``)."""
    try:
        with open("/proc/self/mountinfo") as f:
            return any(l.split()[4] == "/" for l in f if len(l.split()) > 4)
    except OSError:
        return True


def isolation_problem(limits: Limits | None = None, allow_partial: bool = False) -> str:
    """The self-check a grader runs before grading ("" when it passed): as root, a kernel must run
    as a uid of its own in a jail with a file system of its own (:func:`kernel_user` proved,
    with a probe in exactly that jail, that this uid starts Python and imports the kit), else
    this returns one line naming the cause and the fix, and the grader stops (exit 2) rather
    than run a submission as root or claim isolation it lacks. ``allow_partial``
    (``--allow-partial-isolation``) waives every cause but one: a kernel that would run as root.
    A non-root grader is never refused: :func:`isolation_note` says what its partial isolation
    leaves open. Causes named: no CAP_SYS_ADMIN (a Docker container's default set, e.g. Gradescope's), a chroot whose
    folder is not a mount point, Python or its packages unreadable by other uids."""
    if os.geteuid() != 0:
        return ""
    user = kernel_user(limits)
    if user is not None and user.jail and user.newroot and not user.userns:
        return ""
    if user is None:  # never waived: a kernel as root could rewrite the grader and its results
        return ("cannot isolate the submissions' kernels: they would run as root ("
                + ("; ".join(_UNUSABLE) or "no unprivileged uid could run the kernel")
                + "). Fix: make Python and its packages readable by other users (chmod o+rX on them and their "
                  "folders, or install them outside /root; the kit may stay root-only)")
    if allow_partial:
        return ""
    import labkit

    kit = os.path.dirname(os.path.abspath(labkit.__file__))
    partial = ("or pass --allow-partial-isolation to grade with the weaker isolation the output then describes "
               "(a uid of its own per kernel, no file system of its own; labkit's references are withheld only "
               f"where the installed kit's folder is readable by root only: chmod 700 {kit})")
    if not _capable(_CAP_SYS_ADMIN):
        return ("cannot isolate the submissions' kernels: the grader runs as root without CAP_SYS_ADMIN (the default "
                "of a Docker container), so it can make no private mount namespace for them. Fix: run the container "
                "with --cap-add SYS_ADMIN and a seccomp profile that allows unshare and mount (e.g. --security-opt "
                f"seccomp=unconfined); {partial}")
    if not _root_is_a_mount_point():
        return ("cannot isolate the submissions' kernels: / is not a mount point (a chroot made in a plain folder), "
                "so the kernels' mounts could not be kept private to them. Fix: make the chroot's folder a mount "
                f"point before entering it (mount --bind DIR DIR); {partial}")
    if user is None:
        cause = "; ".join(_UNUSABLE) or "no unprivileged uid could run the kernel"
    elif not user.jail:
        cause = "; ".join(_UNUSABLE) or "no private namespaces"
    else:
        cause = f"no file system of its own for the kernel ({'; '.join(_NO_NEW_ROOT) or 'the probe failed'})"
    return (f"cannot isolate the submissions' kernels: {cause}. Fix: run the grader as root where "
            f"`unshare --mount --ipc --net` works (a container needs CAP_SYS_ADMIN) and make Python and its "
            f"packages ({sys.prefix}) readable by other users (chmod o+rX on them and their folders; the kit may stay "
            f"root-only: a kernel imports the grader's copy); {partial}")


def isolation_note(user: KernelUser | None) -> str:
    """One line for the grader's output about how the kernel is isolated."""
    if user is None and os.geteuid() == 0:
        return ("isolation is partial: the grader runs as root, but " + "; ".join(_UNUSABLE or ["no unprivileged user"])
                + ", so the submission's kernel runs as root; make Python and labkit readable by other users "
                  "(e.g. chmod o+rx on their folders) for full isolation.")
    if user is not None and user.userns:
        return ("isolation is partial: the grader is not root, so each kernel runs as this same user, but in user, "
                "mount and IPC namespaces of its own with no capabilities: private /tmp, /var/tmp and /dev/shm "
                "(its files there vanish with it), the grader's exercise code, reference list and hidden cases "
                "covered, limits on file size and memory; it can still signal the grader and its other processes, "
                "read their environment and files through /proc, and write wherever this user may outside those "
                "folders. Run the grader as root (as autograder containers do) for full isolation.")
    if user is not None and user.jail and user.newroot:
        return ("isolation: each kernel runs as a uid of its own in its own session, mount and IPC namespaces, "
                "in a file system of its own (Python and the kit; no other file of the checkout, no solution, "
                "hidden case or file of the grader's; private /tmp and /dev/shm; no other uid's process in its "
                "/proc), with the assignment's labkit references withheld until their exercises are graded, and "
                "limits on processes, file size and memory; it cannot signal the grader or another submission, "
                "read the grader's cases or write the results")
    if user is not None and user.jail:
        return ("isolation: each kernel runs as a uid of its own in its own session, mount and IPC namespaces "
                "(private /tmp and /dev/shm; the grader's exercise code, reference list and hidden cases hidden; "
                "no other uid's process in its /proc), "
                "with limits on processes, file size and memory; it cannot signal the grader or another "
                "submission, read the grader's cases or write the results"
                + (f"; no file system of its own ({_NO_NEW_ROOT[0]}): the rest of the checkout is readable"
                   if _NO_NEW_ROOT else ""))
    if user is not None and user.kit_private:
        return ("isolation is partial: each kernel runs as a uid of its own in its own session, with limits (it "
                "cannot signal the grader or write the results), but " + "; ".join(_UNUSABLE) + ": no file system "
                "of its own. The installed kit is readable by root only and the kernel imports the grader's copy, "
                "with the assignment's labkit references withheld until their exercises are graded and no exercise "
                "code, reference list or hidden case; it shares /tmp, the network and the view of /proc with the "
                "grader, and reads whatever other users may read (a warning names each of the grader's files it "
                "can read)")
    if user is not None:
        return ("isolation is partial: each kernel runs as a uid of its own in its own session, with limits (it "
                "cannot signal the grader or write the results), but " + "; ".join(_UNUSABLE) + ": no file system "
                "of its own, so the assignment's labkit references are NOT withheld (an answer that calls one earns "
                "its points); it shares /tmp, the network and the view of /proc with the grader, and reads whatever "
                "other users may read (a warning names each of the grader's files it can read)")
    why = f" ({'; '.join(_UNUSABLE)})" if _UNUSABLE else ""
    return (f"isolation is partial: the grader is not root{why}, so the submission's kernel runs as the same user; "
            "code in it could signal the grader, read files this user can read (hidden cases, the grader's "
            "exercise code and expected values) and write where this user can; no process or file limits. "
            "Run the grader as root (as autograder containers do) for full isolation.")


def _no_user_site() -> list[str]:
    """``["-s"]`` (no user site-packages: a ``.pth`` file there would run code in every later kernel
    of this user), unless the kit, torch or ipykernel are installed there."""
    import importlib.util
    import site

    user_site = os.path.realpath(site.getusersitepackages())
    for name in ("labkit", "torch", "ipykernel"):
        spec = importlib.util.find_spec(name)
        if spec and spec.origin and os.path.realpath(spec.origin).startswith(user_site + os.sep):
            return []
    return ["-s"]


def _pdeathsig():
    """In the kernel (after it changed user): die with the grader."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001
        pass


_KEEP: set[int] = set()  # kernels of this grader that are alive (a spare must survive another's kill)


def _processes(zombies: list | None = None) -> dict[int, tuple[int, int, int, int]]:
    """pid -> (ppid, session id, uid, start time) of every live process in /proc. A leader in
    state Z whose other threads still run is live; a dead zombie (only waiting for its parent)
    is left out, and appended to ``zombies`` as (pid, ppid) when a list is given."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # state ppid pgrp session ... threads . start
            if fields[0] in (b"Z", b"X") and int(fields[17]) <= 1:
                if zombies is not None:
                    zombies.append((int(entry), int(fields[1])))
                continue
            out[int(entry)] = (int(fields[1]), int(fields[3]), os.stat(f"/proc/{entry}").st_uid, int(fields[19]))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _marked(mark: str, procs) -> list[int]:
    """Those of ``procs`` whose environment holds ``MARK_ENV=mark`` (that this user may read: all, as root)."""
    needle = f"{MARK_ENV}={mark}".encode()
    out = []
    for entry in procs:
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            out.append(int(entry))
    return out


def _descendants(pid: int, procs) -> list[int]:
    children: dict[int, list[int]] = {}
    for p, (ppid, *_) in procs.items():
        children.setdefault(ppid, []).append(p)
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _become_subreaper() -> None:
    """Orphans of the kernel's processes (double forks, setsid) become this process's children,
    so :meth:`KernelSession.kill` still finds them (Linux PR_SET_CHILD_SUBREAPER)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(36, 1)
    except Exception:  # noqa: BLE001
        pass


class KernelStartTimeout(RuntimeError):
    """The kernel was not ready in time: ``budget`` True when the grader's time budget ran out
    first, False when :data:`START_TIMEOUT` did."""

    def __init__(self, budget: bool):
        self.budget = budget
        super().__init__("the time budget ran out while the kernel started" if budget else
                         f"the kernel did not start within {START_TIMEOUT:g} s")


class KernelStartError(RuntimeError):
    """The kernel process exited before it answered: no code of the submission had run in it."""


def kit_folder(user: KernelUser | None) -> str | None:
    """Where the grader makes the kernel's copy of the kit (:mod:`labkit.grading.withhold`): a folder every uid
    can pass through where the kernel imports it from PYTHONPATH (:attr:`KernelUser.kit_private`), else the
    default temporary folder (the jail binds it)."""
    return _open_tmp() if user is not None and user.kit_private else None


def _open_tmp() -> str | None:
    """A temporary folder every uid can pass through (each folder on its path ``o+x``), for a kernel's
    own folder (its sockets): TMPDIR when it is one, else the first of /tmp, /var/tmp, /dev/shm
    that is. A TMPDIR of mode 700 (or inside such a folder) would keep the kernel's uid from its
    own sockets. None: the default temporary folder."""
    def open_path(p: str) -> bool:
        p = os.path.realpath(p)
        while True:
            try:
                if not os.stat(p).st_mode & 0o001:
                    return False
            except OSError:
                return False
            if p == "/":
                return True
            p = os.path.dirname(p)

    for p in (tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(p) and open_path(p):
            return p
    return None


class KernelSession:
    """One learner kernel (see the module docstring). Its working folder, on its ``sys.path`` as in
    Jupyter, is a fresh folder of its own that only its uid may write and that is gone after
    grading: :data:`PRIVATE_WORK` in its private /tmp (jail mode), else :attr:`work` (a subfolder
    of the grader's folder for this kernel, removed by :meth:`kill`). So a learner's own module
    (``%%writefile helpers.py``, ``import helpers``), CSV or figure by a relative path works as in
    their Jupyter, and nothing is written beside the submission."""

    def __init__(self, user: KernelUser | None = None, kit: str | None = None):
        self.lease = self.cgroup = None
        if user is not None and not user.userns:  # a uid of its own: no other kernel, of any grader, has it
            self.lease = UidLease()
            user = KernelUser(f"uid {self.lease.uid}", self.lease.uid, self.lease.gid, True, user.jail, user.limits,
                              newroot=user.newroot, kit_private=user.kit_private)
        self.user = user
        self.dir = tempfile.mkdtemp(prefix="labkit-kernel-", dir=_open_tmp() if user is not None else None)
        self.work = os.path.join(self.dir, "work")  # the working folder without a jail (the jail's: PRIVATE_WORK)
        self.cwd = self.work
        self.proc = self.stderr = None
        self.kc = None
        self.info = None
        self.mark = uuid.uuid4().hex  # MARK_ENV in the kernel's environment: found again at kill()
        self.kit = kit  # the kit's folder the kernel imports (the grader's copy; jail mode with newroot only)
        self.sockets = None  # jail mode: the folder of the kernel's Unix sockets (its channels, the relay's)
        self.sockets_mounted = False  # as root that folder is a tmpfs of 1 MiB and 64 files (its uid may write it)

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        """Launch the kernel and wait until it answers (see :meth:`launch`, :meth:`wait_ready`)."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the kernel process and connect; returns at once (a spare warms up meanwhile)."""
        import zmq
        from jupyter_client.blocking import BlockingKernelClient
        from jupyter_client.connect import write_connection_file

        conn = os.path.join(self.dir, "kernel.json")
        private = self.user is not None and self.user.jail
        sockets = os.path.join(self.dir, "zmq")
        key = uuid.uuid4().hex.encode()  # every message signed: without a key anyone who reaches a socket runs code
        if private:
            # Unix sockets in a folder of this kernel's uid, in no other kernel's file system: on TCP any
            # process of the machine could subscribe to its IOPub channel (which needs no key) and read
            # the code and outputs of another submission graded beside it
            os.makedirs(sockets, mode=0o700)
            os.chown(sockets, self.user.uid, self.user.gid)
            self.sockets = sockets
            if not self.user.userns:  # else on the machine's disk, which the kernel could fill
                subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=1m,nr_inodes=64,mode=0700,uid={self.user.uid},"
                                f"gid={self.user.gid}", "labkit-sockets", sockets], check=True,
                               stdin=subprocess.DEVNULL, capture_output=True)
                self.sockets_mounted = True
            _, self.info = write_connection_file(conn, ip=os.path.join(sockets, "k"), transport="ipc", key=key)
        else:
            _, self.info = write_connection_file(conn, ip="127.0.0.1", key=key)
        env = kernel_environment()
        env[GRADING_ENV] = "1"
        env[MARK_ENV] = self.mark
        env["MPLBACKEND"] = "Agg"
        # the exercises' models are tiny: one intra-op thread is faster than two fighting over the cores
        # (8x on a loaded 2-core machine), and a batch grades several kernels at once
        env.setdefault("OMP_NUM_THREADS", "1")
        kw = {}
        conn_inside = os.path.join(PRIVATE_HOME, "kernel.json")
        argv = [sys.executable, *_no_user_site(), "-m", "ipykernel_launcher", "-f", conn_inside if private else conn,
                "--HistoryManager.enabled=False"]
        if private:
            env.update(HOME=PRIVATE_HOME, TMPDIR="/tmp", USER=self.user.name.replace(" ", "-"),
                       LOGNAME=self.user.name.replace(" ", "-"), IPYTHONDIR=os.path.join(PRIVATE_HOME, "ipython"),
                       MPLCONFIGDIR=os.path.join(PRIVATE_HOME, "mpl"))
            options = [f"--copy={conn}:{conn_inside}", f"--tmp={self.user.limits.tmp_size}", f"--stage={self.dir}",
                       f"--home={PRIVATE_HOME}", f"--workdir={PRIVATE_WORK}", *(f"--hide={p}" for p in secret_paths())]
            if not self.user.userns:  # as root: other uids' processes (the grader's command line) out of sight
                options.append("--hidepid=1")
            root = cgroup_v2_root() if not self.user.userns else None
            if root is not None:
                try:
                    self.cgroup = Cgroup(root, f"kernel-{self.user.uid}", self.user.limits)
                    options.insert(0, f"--cgroup={self.cgroup.path}")
                except OSError:
                    self.cgroup = None  # no delegation here: the uid alone contains the kernel
            argv, kw = self.user.command(argv, sockets, options, kit=self.kit, stage=self.dir)
            self.cwd = "/"
        else:  # IPython's startup files, matplotlib's rc, HOME and TMPDIR of this kernel alone (removed by kill):
            # what the notebook writes there is gone after grading, and a uid with no home still starts a kernel
            for sub in ("tmp", "ipython", "mpl", "work"):
                os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
            env.update(IPYTHONDIR=os.path.join(self.dir, "ipython"), MPLCONFIGDIR=os.path.join(self.dir, "mpl"),
                       HOME=self.dir, TMPDIR=os.path.join(self.dir, "tmp"))
            if self.user is not None:  # a uid of its own without namespaces
                for root, dirs, files in os.walk(self.dir):
                    for name in [root] + [os.path.join(root, n) for n in dirs + files]:
                        os.chown(name, self.user.uid, self.user.gid)
                env.update(USER=self.user.name, LOGNAME=self.user.name)
                if self.kit and self.user.kit_private:  # the grader's copy before the (root-only) kit
                    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(self.kit)]
                                                        + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
                argv, kw = self.user.command(argv, self.cwd)
        _become_subreaper()  # orphans of the kernel's processes come here, whoever runs the grader
        kw.setdefault("preexec_fn", _pdeathsig)
        # the kernel's stderr: an unlinked file of the grader's (bounded by the kernel's RLIMIT_FSIZE), read only
        # to say why a kernel exited while starting (before any cell ran)
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.stderr, cwd=self.cwd, env=env,
            start_new_session=True, close_fds=True, **kw)
        _KEEP.add(self.proc.pid)
        self._started = _processes().get(self.proc.pid, (0, 0, 0, 2 ** 62))[3]  # clock ticks since boot
        ctx = zmq.Context()
        ctx.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
        self.kc = BlockingKernelClient(context=ctx)
        self.kc.load_connection_info(self.info)
        self.kc.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)

    def wait_ready(self, deadline: float | None = None) -> None:
        """Wait until the kernel answers and has imported torch and the kit: at most
        :data:`START_TIMEOUT` seconds, and never past ``deadline`` (a ``time.monotonic()`` value,
        the grader's time budget). Raises :class:`KernelStartTimeout` when either runs out first,
        :class:`KernelStartError` when the kernel exits while starting."""
        limit = time.monotonic() + START_TIMEOUT
        budget = deadline is not None and deadline < limit
        deadline = min(limit, deadline) if deadline is not None else limit
        while True:
            msg_id = self.kc.kernel_info()
            try:
                while True:
                    msg = self.kc.get_shell_msg(timeout=0.5)
                    if msg.get("parent_header", {}).get("msg_id") == msg_id:
                        self._warm_up(deadline, budget)
                        return
            except queue.Empty:
                pass
            if not self.alive():
                raise KernelStartError(f"the kernel exited while starting (exit code {self.proc.poll()})"
                                       + self._start_error())
            if time.monotonic() > deadline:
                raise KernelStartTimeout(budget)

    def _warm_up(self, deadline: float, budget: bool) -> None:
        """Import torch and the kit before the first cell, so no cell's time limit pays for it."""
        mid = self.kc.execute(WARM_UP, silent=True, store_history=False, allow_stdin=False)
        while self.alive():
            left = deadline - time.monotonic()
            if left <= 0:
                if budget:
                    raise KernelStartTimeout(budget)
                return  # slow, not stuck: the first cell's own limit applies
            try:
                msg = self.kc.get_shell_msg(timeout=min(0.5, left))
            except queue.Empty:
                continue
            if msg.get("parent_header", {}).get("msg_id") == mid:
                return

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # ------------------------------------------------------------------ run
    def execute(self, code: str, timeout: float) -> tuple[str, str, str]:
        """Run one cell: ("ok" | "error" | "timeout" | "dead", error name, error value)."""
        if not self.alive():
            return "dead", "", ""
        msg_id = self.kc.execute(code, silent=False, store_history=True, allow_stdin=False, stop_on_error=False)
        deadline = time.monotonic() + timeout
        interrupted = False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                if interrupted:
                    return "timeout", "", ""
                self.interrupt()
                interrupted = True
                deadline = time.monotonic() + INTERRUPT_GRACE
                continue
            try:
                msg = self.kc.get_shell_msg(timeout=min(0.5, left))
            except queue.Empty:
                if not self.alive():
                    return "dead", "", ""
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if interrupted:
                return "timeout", "", ""
            c = msg.get("content", {})
            if c.get("status") == "ok":
                return "ok", "", ""
            return "error", str(c.get("ename", "Error"))[:200], str(c.get("evalue", ""))[:2000]

    def request(self, req: dict, wait: float = 10.0):
        """One :func:`labkit.grading.kernel.serve` request; its decoded reply dict (or None)."""
        from . import wire

        try:
            data = request_kernel(self.kc, req, wait, self.alive)
            reply = wire.loads(data)
        except (CaseTimeout, KernelFailure, wire.WireError):
            return None
        return reply if isinstance(reply, dict) else None

    def interrupt(self) -> None:
        try:
            os.kill(self.proc.pid, signal.SIGINT)
        except (ProcessLookupError, PermissionError):
            pass

    # ------------------------------------------------------------------ end
    def _start_error(self) -> str:
        """': LAST LINE' of what the kernel wrote to stderr before it exited while starting ('' if nothing)."""
        try:
            self.stderr.seek(max(0, os.fstat(self.stderr.fileno()).st_size - 4096))
            last = _first_line(self.stderr.read().decode("utf-8", "replace"))
        except (OSError, ValueError, AttributeError):
            return ""
        return "" if last == "no output" else f": {last}"

    def kill(self) -> None:
        """Kill the kernel and everything it started: its process group, its session, its
        descendants, every process whose environment carries this kernel's :data:`MARK_ENV`
        (a daemon that left the session and was orphaned to init), every process orphaned to
        this process (a subreaper) since the kernel started, in any state (a leader in state Z
        whose threads run), reaping the dead ones; as root then every process of the kernel's
        own uid (:mod:`labkit.grading.contain`). Returns once none of them is left (sweeps until
        a sweep finds nothing, at most 10 s)."""
        if self.proc is not None:
            pid = self.proc.pid
            me = os.getpid()
            deadline = time.monotonic() + 10
            started = self._started
            while True:  # a fork bomb may need more than one sweep
                zombies: list = []
                procs = _processes(zombies)
                victims = set(_descendants(pid, procs)) | set(_marked(self.mark, procs))
                if self.proc.poll() is None:
                    victims.add(pid)
                for p, (ppid, sid, _uid, start) in procs.items():
                    if p == me:
                        continue
                    if sid == pid or (ppid == me and start >= started and p != pid and p not in _KEEP):
                        victims.add(p)
                for z, ppid in zombies:  # dead children of ours (orphans reparented here): reaped
                    if ppid == me and z != pid and z not in _KEEP:
                        try:
                            os.waitpid(z, os.WNOHANG)
                        except ChildProcessError:
                            pass
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                for p in victims:
                    try:
                        os.kill(p, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                victims.discard(os.getpid())
                if not victims or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            _KEEP.discard(pid)
        self._end_containment()
        if self.kc is not None:
            try:
                self.kc.stop_channels()
                self.kc.context.destroy(linger=0)
            except Exception:  # noqa: BLE001
                pass
            self.kc = None
        if self.sockets_mounted:
            subprocess.run(["umount", "--lazy", self.sockets], stdin=subprocess.DEVNULL, capture_output=True)
            self.sockets_mounted = False
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.stderr is not None:
            self.stderr.close()

    def _end_containment(self) -> None:
        """Every process of the kernel's uid (and cgroup) killed and reaped, zombies included;
        the files it owns in the shared temporary folders removed; the uid given back. Raises
        RuntimeError when a process of the uid survives (the uid then stays locked)."""
        if self.user is None or self.lease is None:
            return
        left = self.cgroup.kill() if self.cgroup is not None else []
        left = kill_uid(self.user.uid) or left
        remove_files_of(self.user.uid)
        if left:
            raise RuntimeError(f"processes {left} of the kernel's uid {self.user.uid} could not be killed")
        self.lease.release()
        self.lease = None

    def hidden_files_readable(self, paths) -> list[str]:
        """Which of ``paths`` the kernel user could open (root mode only), probed with this
        kernel's uid in the same namespaces as the kernel."""
        if self.user is None or not paths:
            return []
        code = ("import sys\nfor p in sys.argv[1:]:\n    try:\n        open(p, 'rb').read(1) and print(p)\n"
                "    except OSError:\n        pass\n")
        options = [f"--tmp={2 ** 20}", f"--stage={self.dir}", *(f"--hide={p}" for p in secret_paths())]
        argv, kw = self.user.command([sys.executable, "-S", "-c", code, *map(str, paths)], None,
                                     options if self.user.jail else (), kit=self.kit, stage=self.dir)
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd="/", **kw)
        except Exception:  # noqa: BLE001
            return []
        return [l for l in out.stdout.splitlines() if l]
