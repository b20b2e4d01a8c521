"""Forked (gloo) or spawned (NCCL) ranks of one launch, the rendezvous folder and its reaper, and the
clean-up that leaves no process and no file (:func:`run_forked`; see :mod:`labkit.launch`)."""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait as mp_wait
from typing import Any

from .errors import RankError, _describe_exit, _error_priority
from .signals import STOP_SIGNALS, _libc_prctl, _signals_deferred, stop_on_first_signal


def _rendezvous_folder() -> str:
    """A fresh private folder ``labkit-store-*`` for the launch's FileStore (file ``store`` in it).

    Not a TCPStore held by the parent: its server thread may hold a lock (the allocator's)
    at the moment a worker is forked, and that worker then hangs in init_process_group
    (measured: ~20% of 5-rank launches failed on a loaded 2-core machine).
    """
    import tempfile

    # a private folder, removed whole after the launch (FileStore may leave helper files); its name
    # says whose it is, so that a later launch can remove it should both its owner and the reaper be
    # SIGKILLed at once (a kill of every process of a session or a uid)
    tmp = tempfile.gettempdir()
    _sweep_stale_folders(tmp)
    return tempfile.mkdtemp(prefix=f"{STORE_PREFIX}{_owner_tag(os.getpid())}.", dir=tmp)


STORE_PREFIX = "labkit-store-"


def _owner_tag(pid: int) -> str | None:
    """``"<pid>.<start time>.<host hash>"``: the process ``pid`` of this host, told apart from a later
    process with the same pid by its start time (clock ticks since boot, /proc/PID/stat field 22);
    None when /proc cannot tell (the process is gone, or no /proc)."""
    import zlib
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            start = f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None
    return f"{pid}.{start}.{zlib.crc32(socket.gethostname().encode()):08x}"


def _sweep_stale_folders(tmp: str) -> None:
    """Remove the rendezvous folders in ``tmp`` of launches on this host whose process is gone (its
    reaper was killed with it, e.g. by a SIGKILL of a whole session). A folder whose name does not
    name its owner, or names a live one or another host's, is left alone."""
    import shutil
    import zlib
    host = f"{zlib.crc32(socket.gethostname().encode()):08x}"
    try:
        names = os.listdir(tmp)
    except OSError:
        return
    for name in names:
        parts = name[len(STORE_PREFIX):].split(".") if name.startswith(STORE_PREFIX) else []
        if len(parts) != 4 or not parts[0].isdigit() or parts[2] != host:
            continue
        if _owner_tag(int(parts[0])) != ".".join(parts[:3]):
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)


def _start_folder_reaper(folder: str):
    """Fork a tiny process that removes ``folder`` if this process dies before it does,
    however it dies (SIGKILL included: no clean-up can run in a SIGKILLed process).

    Linux only (prctl PR_SET_PDEATHSIG delivers SIGUSR1 to the reaper when its parent dies);
    elsewhere returns None. The reaper runs in a session of its own, so that a ``killpg`` of this
    process's group (the grader's time limit, a shell's job control) stops the launch but not it.
    The reaper blocks SIGUSR1, SIGINT, SIGTERM and SIGHUP and waits: SIGUSR1
    (parent gone) removes the folder, retrying while the dying ranks still hold files in it;
    SIGINT / SIGTERM / SIGHUP (a Ctrl-C or kill to the whole group) are ignored: the parent cleans up then
    and :func:`_stop_folder_reaper` SIGKILLs the reaper (which cannot block that, so no wait hangs).
    Returns the reaper's pid, or None.
    """
    if not sys.platform.startswith("linux"):
        return None
    import shutil

    try:  # resolved here, not in the forked child (no dynamic loading after fork)
        prctl = _libc_prctl()
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    sigs = {signal.SIGUSR1, *STOP_SIGNALS}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)  # no signal is lost before sigwait
    try:
        pid = os.fork()
    except OSError:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        return None
    if pid:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        return pid
    try:  # the reaper: only plain system calls from here on, then os._exit
        prctl(1, int(signal.SIGUSR1), 0, 0, 0)  # PR_SET_PDEATHSIG
        try:
            os.setsid()
        except OSError:
            pass
        got = signal.SIGUSR1 if os.getppid() != parent else None
        while got != signal.SIGUSR1:  # Ctrl-C / SIGTERM to the whole group: the parent cleans up itself
            got = signal.sigwait(sigs)
        if got == signal.SIGUSR1:
            deadline = time.monotonic() + 10.0
            while os.path.exists(folder) and time.monotonic() < deadline:
                shutil.rmtree(folder, ignore_errors=True)
                if os.path.exists(folder):
                    time.sleep(0.05)
    finally:
        os._exit(0)


def _stop_folder_reaper(pid) -> None:
    """Stop a reaper from :func:`_start_folder_reaper` (the folder is already removed)."""
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _die_with_parent(parent_pid: int) -> None:
    """In a worker: get SIGKILL when the parent dies, whatever kills it (Linux prctl
    PR_SET_PDEATHSIG), and exit now if the parent is already gone (it died before prctl)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            PR_SET_PDEATHSIG = 1
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:
        os._exit(1)


class _IsattyAs:
    """A stream that reports ``isatty()`` as given: a worker's stderr is a pipe to the parent,
    yet tqdm on rank 0 should still draw its bar when the parent's stderr is a terminal."""

    def __init__(self, stream, tty: bool):
        self._stream, self._tty = stream, tty

    def isatty(self) -> bool:
        return self._tty

    def __getattr__(self, name):
        return getattr(self._stream, name)


_STOP_SIGNALS = set(STOP_SIGNALS)


def _worker(fn, args, rank, world_size, backend, store_path, timeout, conn, start_method, parent_pid, err_fd,
            make_context):
    import torch
    import torch.distributed as dist

    status = "ok"
    try:
        _die_with_parent(parent_pid)
        # Ctrl-C and a closed terminal (SIGHUP) reach the whole process group: the parent acts on them (it
        # stops every worker and says why, or, started under nohup, ignores SIGHUP and the launch runs on), so
        # a rank never dies of them first, whichever process runs first (a rank killed by the group's SIGHUP
        # was reported as a failed rank, exit 1). SIGTERM kills a worker at once (the parent's _kill_all sends
        # it); a worker whose parent died dies with it (PDEATHSIG above)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # blocked by the parent across the fork
        if err_fd is not None:  # stderr goes through the parent, which keeps its last lines
            try:
                tty = sys.stderr is not None and bool(sys.stderr.isatty())
            except Exception:
                tty = False
            # (no flush of the inherited sys.stderr: its buffer is the parent's, already printed
            # or still to be printed by the parent; and a notebook's stream cannot flush here)
            os.dup2(err_fd, 2)
            os.close(err_fd)
            import io
            sys.stderr = _IsattyAs(io.TextIOWrapper(io.FileIO(2, "w", closefd=False), errors="backslashreplace",
                                                    line_buffering=True, write_through=True), tty)
        if start_method == "fork":
            # A forked child can hang in threaded kernels after the parent ran threaded
            # work; one thread per rank also keeps N ranks fair on a few cores.
            torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        store.set_timeout(timedelta(seconds=timeout))
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            device = torch.device("cpu")
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        ctx = make_context(rank, world_size, rank, backend, device, dist.group.WORLD, timeout)
        result = fn(ctx, *args)
        payload = pickle.dumps(("ok", rank, (result, [m for m in LAZY if m in sys.modules])))
        # No rank leaves before every rank is done: a rank that exits while a peer is still
        # connecting (or receiving) makes that peer fail with "connection closed by peer".
        dist.barrier(group=ctx.group)
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        status = "error"
        payload = pickle.dumps(("error", rank, (type(e).__name__, str(e), traceback.format_exc())))
    try:
        conn.send_bytes(payload)
    except Exception as e:  # result not picklable / pipe closed
        try:
            conn.send_bytes(pickle.dumps(("error", rank, (type(e).__name__, str(e), traceback.format_exc()))))
        except Exception:
            pass
    conn.close()
    if status == "ok":
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    try:
        sys.stderr.flush()
    except Exception:
        pass
    os._exit(0)


class _StderrTails(threading.Thread):
    """Parent side: forwards every worker's stderr (one pipe per rank) to this process's fd 2
    as it comes, and keeps the last bytes of each, for the report of a worker that died."""

    KEEP = 8192

    def __init__(self, fds: dict):
        super().__init__(daemon=True, name="labkit-stderr")
        self.fds = dict(fds)                                # fd -> rank
        self.tails = {r: b"" for r in self.fds.values()}
        self.closed = {r: threading.Event() for r in self.fds.values()}

    def run(self) -> None:
        import selectors
        sel = selectors.DefaultSelector()
        for fd in self.fds:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            for key, _ in sel.select(timeout=0.5):
                fd, rank = key.fd, self.fds[key.fd]
                try:
                    data = os.read(fd, 65536)
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(fd)
                    os.close(fd)
                    self.closed[rank].set()
                    continue
                self.tails[rank] = (self.tails[rank] + data)[-self.KEEP:]
                try:
                    while data:
                        data = data[os.write(2, data):]
                except OSError:
                    pass

    def tail(self, rank: int, lines: int = 15, wait: float = 1.0) -> str:
        """The last ``lines`` lines rank ``rank`` wrote to stderr (waits up to ``wait`` s for its end)."""
        if rank not in self.closed:
            return ""
        self.closed[rank].wait(wait)
        text = self.tails[rank].decode(errors="replace").replace("\r", "\n")
        return "\n".join([l for l in text.splitlines() if l.strip()][-lines:])


def _kill_all(procs, grace: float = 1.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join()


# torch imports sympy lazily on the first ``tensor.backward(grad)`` (~0.3-0.6 s) and torch._dynamo on the first
# call of an optimizer's method or of torch.utils.checkpoint (about 2 s of CPU: 16 s for 8 ranks). run_forked imports
# PRE_IMPORTS before it forks, and each module of LAZY that the ranks of one launch imported before every later
# launch of this process (a test process's or a notebook's next launches inherit it; a process whose ranks never
# build an optimizer never pays for it).
PRE_IMPORTS: tuple[str, ...] = ("torch.fx.experimental.symbolic_shapes",)
LAZY: tuple[str, ...] = ("torch._dynamo",)
_learned: set[str] = set()


def run_forked(fn, world_size: int, args: tuple, backend: str, timeout: float, make_context) -> list:
    """Run ``fn(make_context(rank, world_size, local_rank, backend, device, group, timeout), *args)``
    on ``world_size`` new processes (forked for gloo, spawned for NCCL) and return their results in
    rank order; raise :class:`RankError` for the first rank that failed (see the module docstring).
    ``backend`` is already resolved ("gloo" or "nccl")."""
    start_method = "spawn" if backend == "nccl" else "fork"
    if start_method == "fork":
        for name in (*PRE_IMPORTS, *sorted(_learned)):  # once here: forked ranks inherit them instead of each paying
            importlib.import_module(name)
    mpctx = mp.get_context(start_method)
    with stop_on_first_signal():
        return _launch_workers(mpctx, fn, world_size, args, backend, timeout, start_method, make_context)


def _launch_workers(mpctx, fn, world_size, args, backend, timeout, start_method, make_context):
    procs, conns, err_fds = [], {}, {}
    tails = None
    reaper = None
    folder = None
    try:
        # the folder and its reaper come into being together, SIGINT/SIGTERM held back until both
        # are known: a Ctrl-C landing after mkdtemp returned but before ``folder`` is set (or after
        # the reaper's fork but before its pid is kept) would leave a folder, or a reaper, behind
        with _signals_deferred():
            folder = _rendezvous_folder()
            # removes the folder should this process be SIGKILLed (its ranks die too: PDEATHSIG)
            reaper = _start_folder_reaper(folder)
        store = os.path.join(folder, "store")
        for rank in range(world_size):
            # a rank started is a rank known to the clean-up below: a stop landing between the fork and
            # ``procs.append`` would leave that rank running (in a notebook, until its timeout)
            with _signals_deferred():
                recv_end, send_end = mpctx.Pipe(duplex=False)
                err_r, err_w = os.pipe() if start_method == "fork" else (None, None)
                p = mpctx.Process(
                    target=_worker,
                    args=(fn, args, rank, world_size, backend, store, timeout, send_end, start_method,
                          os.getpid(), err_w, make_context),
                    daemon=True,
                )
                # the stop signals blocked across the fork: the child inherits the mask, so a signal that lands
                # before it set its own handlers waits in the kernel instead of running this process's
                # handler in the child (or being dropped by Python's after-fork code); _worker unblocks
                old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
                try:
                    p.start()
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
                    if err_w is not None:
                        os.close(err_w)
                        err_fds[err_r] = rank
                send_end.close()
                procs.append(p)
                conns[recv_end] = rank
        if err_fds:
            with _signals_deferred():  # the forwarder started and known together (the clean-up joins it)
                forwarder = _StderrTails(err_fds)
                forwarder.start()
                tails, err_fds = forwarder, {}

        def died(rank, proc):
            proc.join(0.5)
            tail = tails.tail(rank) if tails is not None else ""
            return ("ProcessDied", f"worker died with {_describe_exit(proc.exitcode)} before returning a result",
                    f"last lines of rank {rank}'s stderr:\n{tail}" if tail else "(no stderr output)")

        results: dict[int, Any] = {}
        errors: list[tuple[float, int, tuple]] = []
        sentinels = {p.sentinel: r for r, p in enumerate(procs)}
        pending = dict(conns)
        first_error_at = None
        while pending:
            wait_for = 0.2 if first_error_at is None else max(0.0, first_error_at + 1.0 - time.monotonic())
            ready = mp_wait(list(pending) + list(sentinels), timeout=wait_for)
            for obj in ready:
                if obj in pending:
                    rank = pending.pop(obj)
                    try:
                        kind, r, value = pickle.loads(obj.recv_bytes())
                    except EOFError:
                        kind, r, value = ("error", rank, died(rank, procs[rank]))
                    obj.close()
                    if kind == "ok":
                        results[r], imported = value
                        _learned.update(imported)
                    else:
                        errors.append((time.monotonic(), r, value))
                        first_error_at = first_error_at or time.monotonic()
                elif obj in sentinels:
                    rank = sentinels.pop(obj)
                    proc = procs[rank]
                    proc.join(0.5)
                    conn = next((c for c, r in pending.items() if r == rank), None)
                    if conn is not None and not conn.poll(0):
                        pending.pop(conn)
                        errors.append((time.monotonic(), rank, died(rank, proc)))
                        first_error_at = first_error_at or time.monotonic()
            if first_error_at is not None and time.monotonic() >= first_error_at + 1.0:
                break  # give the other ranks a moment to report, then stop everything
        if errors:
            errors.sort(key=lambda e: (_error_priority(e[2]), e[0]))
            _, rank, (etype, msg, tb) = errors[0]
            raise RankError(rank, etype, msg, tb)
        return [results[r] for r in range(world_size)]
    finally:
        # the clean-up's own bound: after CLEANUP_DEADLINE s, whatever the load, a watchdog thread
        # SIGKILLs every worker and removes the folder (the joins below then return at once)
        deadline = threading.Timer(CLEANUP_DEADLINE, _hard_stop, (procs, folder, reaper))
        deadline.daemon = True
        deadline.start()
        with _signals_deferred():  # a second Ctrl-C must not cut the clean-up short
            _kill_all(procs)
            for c in conns:
                c.close()
            for fd in err_fds:  # not handed to the forwarder (a start failed)
                os.close(fd)
            if tails is not None:
                tails.join(2.0)
            if folder is not None:
                import shutil

                shutil.rmtree(folder, ignore_errors=True)
            _stop_folder_reaper(reaper)
            deadline.cancel()


CLEANUP_DEADLINE = 5.0  # seconds the clean-up of a launch may take before every worker is SIGKILLed


def _hard_stop(procs, folder: str, reaper) -> None:
    """The clean-up deadline passed: SIGKILL every worker (it cannot block that), remove the
    rendezvous folder, then SIGKILL the folder's reaper, from the watchdog thread (the main
    thread may be slowed or stuck; it reaps them when it gets there)."""
    import shutil
    for p in procs:
        try:
            if p.pid is not None:
                os.kill(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
    if reaper is not None:
        try:
            os.kill(reaper, signal.SIGKILL)
        except ProcessLookupError:
            pass
