"""This process as one rank under ``torchrun``: the variables checked before any rank starts, dying
with the agent, SIGTERM within moments, heartbeats that name a lost peer, one line per failed rank
(:func:`run_torchrun_rank`; see :mod:`labkit.launch`)."""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta

from .errors import _error_priority
from .signals import _libc_prctl, _raise_terminated, _stopping_handler_installed


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


def torchrun_where(rank: int | None = None) -> str:
    """``'rank 2 (node 1, local rank 0)'`` for this process under torchrun (``rank`` None), from
    RANK, GROUP_RANK (the node's index) and LOCAL_RANK; ``'rank 2'`` for another rank."""
    if rank is not None and rank != int(os.environ.get("RANK", -1)):
        return f"rank {rank}"
    node = os.environ.get("GROUP_RANK")
    return (f"rank {os.environ['RANK']} ({f'node {node}, ' if node is not None else ''}"
            f"local rank {os.environ['LOCAL_RANK']})")


_TORCHRUN_GUARD = None
# temporary files being written now (labkit.labs.write_bytes_atomic): removed by the stop watcher before it ends
# the process, which runs no finally block
PENDING_FILES: set = set()
_STARTED = False   # this rank has begun to join its process group: a signal after it stops a rank at work
GUARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# the most seconds a rank whose lost peers were all stopped by a signal waits for its own signal (torchrun's agent
# sends it to its workers one by one) before it stops with the stop's line (:func:`_await_own_stop`); under the
# agent's 30 s grace before SIGKILL, and the bound when the signal never comes (the peer was on another node)
STOP_WAIT = 5.0
_ENDING = threading.Lock()   # held by whichever thread ends the process: one line, never two


def _store_prefix() -> str:
    """``labkit/<run id>/<restart>/``: this run's keys in torchrun's store (:class:`_Heartbeat`)."""
    env = os.environ
    return f"labkit/{env.get('TORCHELASTIC_RUN_ID', 'run')}/{env.get('TORCHELASTIC_RESTART_COUNT', 0)}/"


def _connect_store(timeout: float = 2.0):
    """A client of torchrun's store (MASTER_ADDR:MASTER_PORT); every call on it gives up after ``timeout`` s."""
    import torch.distributed as dist

    env = os.environ
    return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout), wait_for_workers=False)


def _end(text: str, code: int, locked: bool = False) -> None:
    """End this process: remove the temporary files being written, write ``text`` on stderr, ``os._exit(code)``.
    Whichever thread comes first (the stop watcher, or the main thread with an error) is the only one that
    writes: the other waits for ``_ENDING`` until the process is gone (``locked``: the caller holds it)."""
    if not locked:
        _ENDING.acquire()
    try:
        for path in list(PENDING_FILES):
            try:
                os.unlink(path)
            except OSError:
                pass
        if text:
            os.write(2, text.encode(errors="replace"))
    finally:
        os._exit(code)


def _what(signum: int) -> str:
    return ("interrupted (Ctrl-C, SIGINT)" if signum == signal.SIGINT
            else f"terminated ({signal.Signals(signum).name})")


def _record_stop(signum: int) -> None:
    """A rank at work that a signal stops: ``stopped/<rank>=<signal>`` in torchrun's store, before it exits,
    so that a peer that loses its connection to it knows that it was stopped, not that it died. Bounded: the
    heartbeat's spare client (or, before the heartbeat is up, a new one) gives up after 1-2 s."""
    if not _STARTED:
        return   # start-up: no peer is connected to this rank yet
    try:
        beat = _Heartbeat.INSTANCE
        store = beat.stop_store if beat is not None else None
        if store is None:
            store = _connect_store(1.0)
        store.set(_store_prefix() + f"stopped/{os.environ['RANK']}", str(int(signum)))
    except Exception:  # noqa: BLE001 - no store: a peer will then report this rank as lost
        pass


def _stop_line(signum: int, sender: int, agent: int) -> str | None:
    """The one line a rank under torchrun prints when ``signum`` (from process ``sender``) stops it;
    None when another rank of this node prints it for all of them. At work (after start-up): a line
    true for this rank. During start-up, when torchrun's agent (``agent``) sent it, it sent it to
    every worker of this node at once: local rank 0 prints one line for the node and the others
    stay silent (a Ctrl-C while 8 ranks import torch is one line, not 8 tracebacks)."""
    what = _what(signum)
    if _STARTED:
        return f"{what}: {torchrun_where()} stopped"
    if sender == agent:
        if os.environ.get("LOCAL_RANK") != "0":
            return None
        node = os.environ.get("GROUP_RANK")
        n = os.environ.get("LOCAL_WORLD_SIZE")
        return (f"{what} during start-up: the {f'{n} ' if n else ''}ranks of "
                f"{f'node {node}' if node is not None else 'this node'} stopped before any work")
    return f"{what} during start-up: {torchrun_where()} stopped before any work"


def _guard_torchrun_rank() -> None:
    """Under torchrun, once per process (from ``import labkit`` on, so that start-up is covered too):
    die with the agent (PR_SET_PDEATHSIG: a node whose torchrun is SIGKILLed takes its workers with
    it, instead of leaving them training), and stop within moments on SIGTERM, SIGINT (torchrun
    passes a Ctrl-C on to its workers as SIGINT) or SIGHUP wherever the main thread is (a C++ wait
    in init_process_group or a gloo receive runs no Python signal handler; ``import torch`` would
    end in a KeyboardInterrupt traceback). The signals are blocked in every thread and taken by a
    watcher thread (``sigwaitinfo``), which prints one line (:func:`_stop_line`) and ends the
    process with ``os._exit(128 + signal)``: no exit-time barrier waits for peers that are gone. At work,
    it first records the stop in torchrun's store (:func:`_record_stop`), so that a peer that loses its
    connection before its own signal comes waits for it instead of reporting a failure."""
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
    signal.pthread_sigmask(signal.SIG_BLOCK, set(GUARDED))  # threads started later inherit it

    def watch():
        info = signal.sigwaitinfo(set(GUARDED))
        line = None
        try:
            _ENDING.acquire()   # the main thread, ending with an error line, does not write one too
            _record_stop(info.si_signo)
            line = _stop_line(info.si_signo, info.si_pid, agent)
        finally:
            _end(line + "\n" if line else "", 128 + info.si_signo, locked=True)
    _TORCHRUN_GUARD = threading.Thread(target=watch, daemon=True, name="labkit-stop")
    _TORCHRUN_GUARD.start()


def guard_at_import() -> None:
    """``import labkit`` under torchrun's agent (its variables, TORCHELASTIC_RUN_ID among them, are
    set): :func:`_guard_torchrun_rank` from the first moment, before torch is imported."""
    if in_torchrun() and "TORCHELASTIC_RUN_ID" in os.environ:
        _guard_torchrun_rank()


def run_torchrun_rank(fn, world_size: int, args: tuple, backend: str, timeout: float, make_context) -> list:
    """Under torchrun: this process is one rank. Initialise from the environment, run
    ``fn(make_context(...), *args)`` here and return every rank's result (``all_gather_object``).
    ``backend`` is already resolved. A failure ends this process with one line
    (:func:`_torchrun_rank_failed`), never a traceback. Raises ValueError when ``world_size``
    differs from WORLD_SIZE."""
    env_ws = int(os.environ["WORLD_SIZE"])
    if env_ws != world_size:
        raise ValueError(f"world_size={world_size} but torchrun started WORLD_SIZE={env_ws} ranks")
    import torch
    import torch.distributed as dist

    _guard_torchrun_rank()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    global _STARTED
    _STARTED = True
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
    "gone"; ``stopped/<rank>`` = the signal's number, set by a rank that a signal stops (its stop
    watcher, before it exits: :func:`_record_stop`) or that ends with such a stop
    (:func:`_await_own_stop`). The thread is a daemon and never blocks the rank: every store call
    has a short timeout, and a store that cannot be reached only means that no peer can be named."""

    PERIOD = 0.25
    INSTANCE = None

    def __init__(self):
        super().__init__(daemon=True, name="labkit-heartbeat")
        self.rank = int(os.environ["RANK"])
        self.prefix = _store_prefix()
        self.store = None
        self.stop_store = None   # a client of the stop watcher's own, connected before any signal comes

    @classmethod
    def start_once(cls) -> None:
        if cls.INSTANCE is None:
            cls.INSTANCE = cls()
            cls.INSTANCE.start()

    def run(self) -> None:
        try:
            store = _connect_store()
            env = os.environ
            store.set(self.prefix + f"who/{self.rank}",
                      f"{env.get('GROUP_RANK', '')}|{env.get('LOCAL_RANK', '')}|{socket.gethostname()}")
            self.store = store
            self.stop_store = _connect_store()
            while True:
                store.add(self.prefix + f"beat/{self.rank}", 1)
                time.sleep(self.PERIOD)
        except Exception:  # noqa: BLE001 - the store is gone or unreachable: nothing to name then
            return

    def mark_done(self) -> None:
        """This rank ends on its own: it is not a lost peer."""
        try:
            store = self.store or _connect_store()
            store.set(self.prefix + f"done/{self.rank}", "1")
        except Exception:  # noqa: BLE001
            pass

    def gone_peers(self, world_size: int, wait: float = 1.0, store=None) -> list[tuple[int, str]] | None:
        """The peers whose heartbeat stopped within ``wait`` s and that did not end on their own (a
        peer stopped by a signal is gone, whether or not it ended on its own), as (global rank,
        "rank 2 (node 1, local rank 0, host h)"); None when the store cannot be reached (its host is
        gone: node 0's agent, or rank 0). ``store``: a client to use (else a new one)."""
        try:
            store = store or _connect_store()
            others = [r for r in range(world_size) if r != self.rank]

            def beats():
                return {r: store.add(self.prefix + f"beat/{r}", 0) for r in others}
            before = beats()
            time.sleep(max(wait, 3 * self.PERIOD))
            after = beats()
            gone = []
            for r in others:
                if after[r] != before[r] or (store.check([self.prefix + f"done/{r}"])
                                             and not store.check([self.prefix + f"stopped/{r}"])):
                    continue
                node, local, host = (store.get(self.prefix + f"who/{r}").decode().split("|")
                                     if store.check([self.prefix + f"who/{r}"]) else ("?", "?", "?"))
                gone.append((r, f"rank {r} (node {node}, local rank {local}, host {host})"))
            return gone
        except Exception:  # noqa: BLE001
            return None


def _stopped_peers(store, world_size: int) -> dict[int, int]:
    """{global rank: signal} of the peers recorded in ``store`` as stopped by a signal (``stopped/<rank>``)."""
    me, prefix, out = int(os.environ["RANK"]), _store_prefix(), {}
    for r in range(world_size):
        if r != me and store.check([prefix + f"stopped/{r}"]):
            out[r] = int(store.get(prefix + f"stopped/{r}").decode())
    return out


def _stop_to_await(store, world_size: int, stopped: dict, gone) -> tuple[int, list[str]] | None:
    """(signal, the stopped peers named) when this rank lost its connection because peers were stopped by
    a signal, not because one died: every gone peer (``gone``, from :meth:`_Heartbeat.gone_peers`) is
    recorded as stopped; or, where who is gone cannot be told (``gone`` None: no heartbeat yet, or the
    store's host has gone since), a stop was recorded when the connection was lost (``stopped``). None
    otherwise, or when no stop watcher takes this rank's own signal."""
    if not isinstance(_TORCHRUN_GUARD, threading.Thread):
        return None
    if gone:
        try:
            stopped = {**stopped, **_stopped_peers(store, world_size)}   # a peer may have recorded it since
        except Exception:  # noqa: BLE001
            pass
        if all(r in stopped for r, _ in gone):
            return stopped[gone[0][0]], [text for _, text in gone]
        return None
    if gone is None and stopped:
        return stopped[min(stopped)], [torchrun_where(r) for r in sorted(stopped)]
    return None


def _await_own_stop(store, signum: int, peers: list[str]) -> None:
    """This rank lost its connection to peers that a signal stopped (torchrun's agent passes a Ctrl-C or
    SIGTERM on to its workers one by one): it is no failure, and this rank's own signal is on its way.
    Record that this rank ends with the stop (``stopped/<rank>``: a peer that loses it in turn knows), then
    wait for the signal, which the stop watcher takes (one line, exit 128 + signal). The bound is the
    program's: after ``STOP_WAIT`` s without it (the signal stopped another node's ranks only, or the agent
    is slow), end with the stop's line naming the peers it reached, exit 128 + ``signum``; the agent's
    SIGKILL after its grace and its death (PR_SET_PDEATHSIG) end the wait too. Never returns."""
    try:
        store.set(_store_prefix() + f"stopped/{os.environ['RANK']}", str(int(signum)))
    except Exception:  # noqa: BLE001 - a peer that loses this rank will then report it as lost
        pass
    time.sleep(STOP_WAIT)   # signals are blocked in this thread: the watcher ends the process when its own comes
    _end(f"{_what(signum)}: {torchrun_where()} stopped (the signal stopped its peer{'s' if len(peers) > 1 else ''} "
         f"{', '.join(peers)}; none reached this rank within {STOP_WAIT:g} s)\n", 128 + int(signum))


def _torchrun_rank_failed(e: BaseException) -> None:
    """Under torchrun, a rank whose work raised: ONE line on its stderr naming it by global rank and
    node (torchrun prints no RankError header, and a lost peer makes every survivor raise) and, when
    it lost a peer, which peers are gone (their heartbeat stopped: :class:`_Heartbeat`), then
    ``os._exit(1)``: the exit-time barrier would wait for ranks that are gone. A rank that lost its
    connection only to peers that a signal stopped (each recorded ``stopped/<rank>`` before it exited)
    reports no failure: it waits, bounded, for its own signal (:func:`_await_own_stop`). The full
    traceback is printed only with LABKIT_TRACEBACK=1."""
    first = (str(e).strip().splitlines() or [""])[0]
    kind = _error_priority((type(e).__name__, str(e), ""))
    why = {2: "lost its connection to a peer that stopped or died",
           1: "timed out waiting for a peer"}.get(kind, "failed")
    beat = _Heartbeat.INSTANCE
    if beat is not None:
        beat.mark_done()
    if kind in (1, 2):
        world_size = int(os.environ["WORLD_SIZE"])
        try:
            store = _connect_store()
            stopped = _stopped_peers(store, world_size)   # a stopped peer recorded it before it exited
        except Exception:  # noqa: BLE001
            store, stopped = None, {}
        gone = beat.gone_peers(world_size, store=store) if beat is not None and store is not None else None
        stop = _stop_to_await(store, world_size, stopped, gone)
        if stop is not None:
            try:
                sys.stdout.flush()
            except Exception:  # noqa: BLE001
                pass
            _await_own_stop(store, *stop)
        if beat is not None and gone is None:
            why += (f" (gone: the rendezvous store at {os.environ.get('MASTER_ADDR')}:"
                    f"{os.environ.get('MASTER_PORT')}, i.e. node 0's agent or rank 0)")
        elif gone:
            why += f" (gone: {', '.join(text for _, text in gone)})"
    text = f"error: {torchrun_where()} {why}: {type(e).__name__}: {first[:300]}\n"
    if os.environ.get("LABKIT_TRACEBACK") == "1":
        text = traceback.format_exc() + text
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001
        pass
    _end(text, 1)


def _shutdown_torchrun() -> None:
    """At exit under torchrun: wait for every rank, then tear the group down, so that no rank
    closes its connections while a peer still uses them (gloo aborts the peer then)."""
    if _Heartbeat.INSTANCE is not None:
        _Heartbeat.INSTANCE.mark_done()
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except Exception:
        pass
