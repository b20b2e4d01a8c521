"""Process plumbing behind :func:`labkit.dist.launch`: forking ranks, torchrun, signals, the reaper.

A learner need not read this module: :mod:`labkit.dist` (``launch``, ``DistContext``) and
:mod:`labkit.grid` (``ProcessGrid``) are the API. What happens here:

* CPU (gloo): ranks are forked (~0.1 s per rank instead of ~10 s for ``spawn``, and a notebook
  can launch a function it defined in a cell); GPU (NCCL): one spawned process per CUDA device.
  They meet through a FileStore in a private folder ``labkit-store-*`` under the temporary
  directory, removed whatever ends the launch (below).
* Failure: the first rank to fail ends the launch with :class:`RankError`, naming the rank and
  carrying its traceback (or, for a worker killed by a signal or a native abort, its exit code or
  signal name and the last lines of its stderr); every other worker is terminated and joined.
* Faults of the parent: forked workers die with it whatever kills it (Linux ``PR_SET_PDEATHSIG``);
  SIGTERM / Ctrl-C stop every worker and remove the folder (SIGTERM raises :class:`Terminated`);
  a clean-up that takes longer than ``CLEANUP_DEADLINE`` seconds is cut short by a watchdog that
  SIGKILLs every worker; a SIGKILLed parent's folder is removed by a small reaper process in its
  own session (so that a ``killpg`` of the parent's group, as the grader's, does not take it too).
* Under ``torchrun`` this process is one rank (:func:`run_torchrun_rank`): it dies with its
  torchrun agent (a lost node takes its workers with it), stops within moments on SIGTERM even
  while blocked in C++ (one line, exit 143), and a rank whose work raised prints one line naming
  itself by global rank and node and, when a peer is gone, that peer by global rank and node
  (each rank's heartbeat in torchrun's store tells which), then exits 1.
"""
from __future__ import annotations

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

import torch
import torch.distributed as dist

__all__ = [
    "CLEANUP_DEADLINE",
    "RankError",
    "Terminated",
    "in_torchrun",
    "run_forked",
    "run_torchrun_rank",
    "stop_on_first_signal",
    "terminate_as_exception",
    "torchrun_env_problem",
    "torchrun_where",
]


# ----------------------------------------------------------------------------- signals

class Terminated(BaseException):
    """Raised in the parent by SIGTERM while :func:`launch` (or a labkit command) runs, so that
    ``finally`` blocks stop the workers and remove temporary files. ``signum``: the signal.
    A BaseException, like KeyboardInterrupt: ``except Exception`` does not swallow it."""

    def __init__(self, signum: int = signal.SIGTERM):
        self.signum = int(signum)
        super().__init__(f"terminated by {signal.Signals(self.signum).name}")


def _raise_terminated(signum, frame):
    raise Terminated(signum)


class terminate_as_exception:
    """Context manager: while inside, SIGTERM raises :class:`Terminated` (main thread only, and
    only where SIGTERM still has its default action; otherwise it does nothing)."""

    def __enter__(self):
        import threading
        self._old = None
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self._old = signal.signal(signal.SIGTERM, _raise_terminated)
        return self

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
        return False


class stop_on_first_signal:
    """Context manager (main thread only; elsewhere it does nothing): the FIRST SIGINT raises
    KeyboardInterrupt and the first SIGTERM raises :class:`Terminated`; every later one is only
    recorded (``got``), so a second Ctrl-C 0.05 s after the first can never cut the clean-up
    short, wherever it lands (even between the raise and the ``finally`` that stops the workers).
    Installed only over Python's own handlers (default_int_handler, SIG_DFL, or an outer
    instance, which then stays in charge). On leaving, the previous handlers are back, unless
    ``ignore_after`` and a signal came: then SIGINT and SIGTERM stay ignored (a command that is
    ending, :func:`labkit.labs.run_cli`)."""

    def __init__(self, ignore_after: bool = False):
        self.ignore_after, self.stopping, self.got, self._old = ignore_after, False, [], {}

    def _handler(self, signum, frame):
        if self.stopping:
            self.got.append(signum)
            return
        self.stopping = True
        self.got.append(signum)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signum)

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        ours = (signal.default_int_handler, signal.SIG_DFL, _raise_terminated)
        for sig in (signal.SIGINT, signal.SIGTERM):
            current = signal.getsignal(sig)
            if current in ours:
                self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, signal.SIG_IGN if self.ignore_after and self.got else old)
        return False


def _stopping_handler_installed() -> bool:
    """True when SIGINT or SIGTERM is handled by a :class:`stop_on_first_signal` (main thread)."""
    return any(isinstance(getattr(signal.getsignal(s), "__self__", None), stop_on_first_signal)
               for s in (signal.SIGINT, signal.SIGTERM))


class RankError(RuntimeError):
    """A rank failed during :func:`launch`.

    Attributes: ``rank`` (int), ``exc_type`` (name of the original exception class),
    ``remote_traceback`` (the worker's formatted traceback, str).
    """

    def __init__(self, rank: int, exc_type: str, message: str, remote_traceback: str):
        self.rank = rank
        self.exc_type = exc_type
        self.original_message = message
        self.remote_traceback = remote_traceback
        what = "report" if exc_type == "ProcessDied" else "traceback"
        super().__init__(
            f"rank {rank} failed with {exc_type}: {message}\n"
            f"--- {what} from rank {rank} ---\n{remote_traceback}"
        )



# ----------------------------------------------------------------------------- torchrun variables


def in_torchrun() -> bool:
    """True when this process was started by ``torchrun`` (its env vars are set)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def torchrun_env_problem() -> str | None:
    """Why the torchrun variables in the environment cannot start a rank, as one message, or None
    (none set, or a consistent set). Checked before any rank starts, so that an exported ``RANK``
    without torchrun is a clear line, not torch's traceback, a wait for peers that never come, or
    (on a rank other than 0, which prints nothing) an exit without a word. The rules: RANK,
    WORLD_SIZE and LOCAL_RANK all set or none; integers with 0 <= RANK < WORLD_SIZE and LOCAL_RANK
    >= 0; MASTER_ADDR and MASTER_PORT set (torchrun sets all of them); rank 0 outside torchrun's
    agent store can bind MASTER_PORT (it serves the rendezvous there)."""
    env = os.environ
    given = [k for k in TORCHRUN_VARS if k in env]
    if not given:
        return None
    hint = "start with torchrun, or unset RANK WORLD_SIZE LOCAL_RANK to run on forked CPU ranks"
    if len(given) < len(TORCHRUN_VARS):
        missing = [k for k in TORCHRUN_VARS if k not in env]
        return f"{', '.join(f'{k}={env[k]}' for k in given)} set but {', '.join(missing)} not; {hint}"
    values = {}
    for k in TORCHRUN_VARS:
        try:
            values[k] = int(env[k])
        except ValueError:
            return f"{k}={env[k]!r} is not an integer; {hint}"
    if values["WORLD_SIZE"] < 1 or not 0 <= values["RANK"] < values["WORLD_SIZE"] or values["LOCAL_RANK"] < 0:
        return (f"RANK={values['RANK']}, WORLD_SIZE={values['WORLD_SIZE']}, LOCAL_RANK={values['LOCAL_RANK']}: "
                f"need 0 <= RANK < WORLD_SIZE and LOCAL_RANK >= 0; {hint}")
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if missing:
        return f"RANK, WORLD_SIZE and LOCAL_RANK are set but {' and '.join(missing)} not; {hint}"
    try:
        port = int(env["MASTER_PORT"])
        if not 0 < port < 65536:
            raise ValueError
    except ValueError:
        return f"MASTER_PORT={env['MASTER_PORT']!r} is not a port number (1..65535)"
    if values["RANK"] == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        import errno
        import socket
        with socket.socket() as sock:
            try:
                sock.bind((env["MASTER_ADDR"], port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return (f"MASTER_PORT={port} on MASTER_ADDR={env['MASTER_ADDR']} is taken by another process "
                            f"(rank 0 serves the rendezvous there); choose a free port")
    return None


# ----------------------------------------------------------------------------- forked workers


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
    process's group (the grader's time limit, a shell's job control) stops the launch but not it. The reaper blocks SIGUSR1, SIGINT and SIGTERM and waits: SIGUSR1
    (parent gone) removes the folder, retrying while the dying ranks still hold files in it;
    SIGINT / SIGTERM (a Ctrl-C or kill to the whole group) are ignored: the parent cleans up then
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
    sigs = {signal.SIGUSR1, signal.SIGTERM, signal.SIGINT}
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


_PRCTL = None


def _libc_prctl():
    """libc's ``prctl`` (Linux), looked up once."""
    global _PRCTL
    if _PRCTL is None:
        import ctypes
        _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
    return _PRCTL


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


def _worker(fn, args, rank, world_size, backend, store_path, timeout, conn, start_method, parent_pid, err_fd,
            make_context):
    status = "ok"
    try:
        _die_with_parent(parent_pid)
        # the parent handles Ctrl-C (it stops every worker); SIGTERM kills a worker at once
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
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
        payload = pickle.dumps(("ok", rank, result))
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


def _describe_exit(code) -> str:
    """'exit code 3', 'signal SIGABRT (a native abort)' ... for a multiprocessing exitcode."""
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        note = {"SIGABRT": " (a native abort)", "SIGSEGV": " (a native crash)",
                "SIGKILL": " (killed, e.g. out of memory)"}
        return f"signal {name}{note.get(name, '')}"
    return f"exit code {code}"


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


def run_forked(fn, world_size: int, args: tuple, backend: str, timeout: float, make_context) -> list:
    """Run ``fn(make_context(rank, world_size, local_rank, backend, device, group, timeout), *args)``
    on ``world_size`` new processes (forked for gloo, spawned for NCCL) and return their results in
    rank order; raise :class:`RankError` for the first rank that failed (see the module docstring).
    ``backend`` is already resolved ("gloo" or "nccl")."""
    start_method = "spawn" if backend == "nccl" else "fork"
    if start_method == "fork":
        # torch imports sympy lazily on the first ``tensor.backward(grad)`` (~0.3-0.6 s);
        # import it once here so forked ranks inherit it instead of each paying in turn.
        import torch.fx.experimental.symbolic_shapes  # noqa: F401
    mpctx = mp.get_context(start_method)
    with stop_on_first_signal():
        return _launch_workers(mpctx, fn, world_size, args, backend, timeout, start_method, make_context)


def _launch_workers(mpctx, fn, world_size, args, backend, timeout, start_method, make_context):
    procs, conns, err_fds = [], {}, {}
    tails = None
    reaper = None
    folder = None
    try:
        # the folder and its reaper come into being together, with SIGINT/SIGTERM held back: a
        # Ctrl-C between the two (or between mkdtemp and this try) would leave an empty folder
        with _signals_deferred():
            folder = _rendezvous_folder()
            # removes the folder should this process be SIGKILLed (its ranks die too: PDEATHSIG)
            reaper = _start_folder_reaper(folder)
        store = os.path.join(folder, "store")
        for rank in range(world_size):
            recv_end, send_end = mpctx.Pipe(duplex=False)
            err_r, err_w = os.pipe() if start_method == "fork" else (None, None)
            p = mpctx.Process(
                target=_worker,
                args=(fn, args, rank, world_size, backend, store, timeout, send_end, start_method,
                      os.getpid(), err_w, make_context),
                daemon=True,
            )
            try:
                p.start()
            finally:
                if err_w is not None:
                    os.close(err_w)
                    err_fds[err_r] = rank
            send_end.close()
            procs.append(p)
            conns[recv_end] = rank
        if err_fds:
            tails = _StderrTails(err_fds)
            tails.start()
            err_fds = {}

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
                        results[r] = value
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


class _signals_deferred:
    """While inside (main thread only): SIGINT and SIGTERM are recorded, not acted on; on leaving,
    the previous handlers are back and the first recorded signal is raised (KeyboardInterrupt,
    or :class:`Terminated`), unless an exception is already on its way out."""

    def __enter__(self):
        self._old, self._got = {}, []
        if threading.current_thread() is threading.main_thread() and not _stopping_handler_installed():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, lambda signum, frame: self._got.append(signum))
        return self

    def __exit__(self, exc_type, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        if self._got and exc_type is None:
            old = self._old[self._got[0]]
            if callable(old):
                old(self._got[0], None)  # e.g. Python's default SIGINT handler: KeyboardInterrupt
            elif self._got[0] == signal.SIGINT:
                raise KeyboardInterrupt
            else:
                raise Terminated(self._got[0])
        return False


def _error_priority(err: tuple) -> int:
    """Which error explains a failed launch best (lower is better).

    0: a real exception (or a worker that died); 1: a timeout, the symptom of a wrong
    schedule or a missing peer; 2: a broken connection, which follows when another rank
    failed and exited first."""
    etype, msg, _ = err
    text = f"{etype} {msg}".lower()
    if any(s in text for s in ("connection closed", "connection reset", "broken pipe")):
        return 2
    if "timed out" in text or "timeout" in text:
        return 1
    return 0


def torchrun_where(rank: int | None = None) -> str:
    """``'rank 2 (node 1, local rank 0)'`` for this process under torchrun (``rank`` None), from
    RANK, GROUP_RANK (the node's index) and LOCAL_RANK; ``'rank 2'`` for another rank."""
    if rank is not None and rank != int(os.environ.get("RANK", -1)):
        return f"rank {rank}"
    node = os.environ.get("GROUP_RANK")
    return (f"rank {os.environ['RANK']} ({f'node {node}, ' if node is not None else ''}"
            f"local rank {os.environ['LOCAL_RANK']})")


_TORCHRUN_GUARD = None


def _guard_torchrun_rank() -> None:
    """Under torchrun, once per process: die with the agent (PR_SET_PDEATHSIG: a node whose torchrun
    is SIGKILLed takes its workers with it, instead of leaving them training), and stop within
    moments on SIGTERM wherever the main thread is blocked (a C++ wait in init_process_group or a
    gloo receive runs no Python signal handler). SIGTERM is blocked in every thread and taken by
    a watcher thread (``sigwait``), which prints one line that is true for this rank and ends the
    process with ``os._exit(143)``: no exit-time barrier waits for peers that are gone."""
    global _TORCHRUN_GUARD
    if _TORCHRUN_GUARD is not None or threading.current_thread() is not threading.main_thread():
        return
    agent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            _libc_prctl()(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        if os.getppid() != agent:  # the agent died before prctl
            os._exit(1)
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, _raise_terminated) \
            and not _stopping_handler_installed():
        _TORCHRUN_GUARD = False  # someone else handles SIGTERM
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads started later inherit it

    def watch():
        signal.sigwait({signal.SIGTERM})
        try:
            os.write(2, f"terminated (SIGTERM): {torchrun_where()} stopped\n".encode())
        finally:
            os._exit(128 + signal.SIGTERM)
    _TORCHRUN_GUARD = threading.Thread(target=watch, daemon=True, name="labkit-sigterm")
    _TORCHRUN_GUARD.start()


def run_torchrun_rank(fn, world_size: int, args: tuple, backend: str, timeout: float, make_context) -> list:
    """Under torchrun: this process is one rank. Initialise from the environment, run
    ``fn(make_context(...), *args)`` here and return every rank's result (``all_gather_object``).
    ``backend`` is already resolved. A failure ends this process with one line
    (:func:`_torchrun_rank_failed`), never a traceback. Raises ValueError when ``world_size``
    differs from WORLD_SIZE."""
    env_ws = int(os.environ["WORLD_SIZE"])
    if env_ws != world_size:
        raise ValueError(f"world_size={world_size} but torchrun started WORLD_SIZE={env_ws} ranks")
    _guard_torchrun_rank()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    try:
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
            import atexit

            atexit.register(_shutdown_torchrun)
        _Heartbeat.start_once()
        ctx = make_context(rank, world_size, local_rank, backend, device, dist.group.WORLD, timeout)
        result = fn(ctx, *args)
        gathered = [None] * world_size
        dist.all_gather_object(gathered, result)
        return gathered
    except Exception as e:  # noqa: BLE001 - one line per rank, then out: peers that are gone answer no barrier
        _torchrun_rank_failed(e)


class _Heartbeat(threading.Thread):
    """Under torchrun, once per process: who this rank is and that it is alive, in torchrun's own
    store (MASTER_ADDR:MASTER_PORT, served by node 0's agent, or by rank 0), so that a survivor can
    name the peer that is gone by global rank and node (gloo's error names neither).

    Keys (prefix ``labkit/<run id>/<restart>/``): ``who/<rank>`` = "node|local rank|host", set once;
    ``beat/<rank>``, a counter this thread adds 1 to every ``PERIOD`` s; ``done/<rank>``, set by a
    rank that ends on its own (an error line of its own, or a clean exit), which is therefore not
    "gone". The thread is a daemon and never blocks the rank: every store call has a short timeout,
    and a store that cannot be reached only means that no peer can be named."""

    PERIOD = 0.25
    INSTANCE = None

    def __init__(self):
        super().__init__(daemon=True, name="labkit-heartbeat")
        env = os.environ
        self.rank = int(env["RANK"])
        self.prefix = f"labkit/{env.get('TORCHELASTIC_RUN_ID', 'run')}/{env.get('TORCHELASTIC_RESTART_COUNT', 0)}/"
        self.store = None

    @classmethod
    def start_once(cls) -> None:
        if cls.INSTANCE is None:
            cls.INSTANCE = cls()
            cls.INSTANCE.start()

    def _connect(self):
        env = os.environ
        return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=2), wait_for_workers=False)

    def run(self) -> None:
        try:
            store = self._connect()
            env = os.environ
            store.set(self.prefix + f"who/{self.rank}",
                      f"{env.get('GROUP_RANK', '')}|{env.get('LOCAL_RANK', '')}|{socket.gethostname()}")
            self.store = store
            while True:
                store.add(self.prefix + f"beat/{self.rank}", 1)
                time.sleep(self.PERIOD)
        except Exception:  # noqa: BLE001 - the store is gone or unreachable: nothing to name then
            return

    def mark_done(self) -> None:
        """This rank ends on its own: it is not a lost peer."""
        try:
            store = self.store or self._connect()
            store.set(self.prefix + f"done/{self.rank}", "1")
        except Exception:  # noqa: BLE001
            pass

    def gone_peers(self, world_size: int, wait: float = 1.0) -> list[str] | None:
        """The peers whose heartbeat stopped within ``wait`` s and that did not end on their own, as
        "rank 2 (node 1, local rank 0, host h)"; None when the store cannot be reached (its host is
        gone: node 0's agent, or rank 0)."""
        try:
            store = self._connect()
            others = [r for r in range(world_size) if r != self.rank]

            def beats():
                return {r: store.add(self.prefix + f"beat/{r}", 0) for r in others}
            before = beats()
            time.sleep(max(wait, 3 * self.PERIOD))
            after = beats()
            gone = []
            for r in others:
                if after[r] != before[r] or store.check([self.prefix + f"done/{r}"]):
                    continue
                node, local, host = (store.get(self.prefix + f"who/{r}").decode().split("|")
                                     if store.check([self.prefix + f"who/{r}"]) else ("?", "?", "?"))
                gone.append(f"rank {r} (node {node}, local rank {local}, host {host})")
            return gone
        except Exception:  # noqa: BLE001
            return None


def _torchrun_rank_failed(e: BaseException) -> None:
    """Under torchrun, a rank whose work raised: ONE line on its stderr naming it by global rank and
    node (torchrun prints no RankError header, and a lost peer makes every survivor raise) and, when
    it lost a peer, which peers are gone (their heartbeat stopped: :class:`_Heartbeat`), then
    ``os._exit(1)``: the exit-time barrier would wait for ranks that are gone. The full traceback
    is printed only with LABKIT_TRACEBACK=1."""
    first = (str(e).strip().splitlines() or [""])[0]
    kind = _error_priority((type(e).__name__, str(e), ""))
    why = {2: "lost its connection to a peer that stopped or died", 1: "timed out waiting for a peer"}.get(kind, "failed")
    beat = _Heartbeat.INSTANCE
    if beat is not None:
        beat.mark_done()
        if kind in (1, 2):
            gone = beat.gone_peers(int(os.environ["WORLD_SIZE"]))
            if gone is None:
                why += (f" (gone: the rendezvous store at {os.environ.get('MASTER_ADDR')}:"
                        f"{os.environ.get('MASTER_PORT')}, i.e. node 0's agent or rank 0)")
            elif gone:
                why += f" (gone: {', '.join(gone)})"
    text = f"error: {torchrun_where()} {why}: {type(e).__name__}: {first[:300]}\n"
    if os.environ.get("LABKIT_TRACEBACK") == "1":
        text = traceback.format_exc() + text
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001
        pass
    os.write(2, text.encode(errors="replace"))
    os._exit(1)


def _shutdown_torchrun() -> None:
    """At exit under torchrun: wait for every rank, then tear the group down, so that no rank
    closes its connections while a peer still uses them (gloo aborts the peer then)."""
    if _Heartbeat.INSTANCE is not None:
        _Heartbeat.INSTANCE.mark_done()
    try:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except Exception:
        pass
