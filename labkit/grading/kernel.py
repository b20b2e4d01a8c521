"""The learner's side of a graded check: runs the learner's answer, sends back only data.

Under ``python -m labkit grade``, ``check("N.k", answer)`` in the kernel only registers the
answer (:func:`register`); each call a case makes on its ``answer`` arrives through
:func:`serve` and runs in a forked *case server* (one per case, so state persists within a
case), which calls the learner's function, or a kernel-side function given it, and sends the
result back as :mod:`labkit.grading.wire` data. Expected values never come here, and all of this
can be replaced by code in the notebook: the grader judges the outputs itself.

In the interactive ``check`` only (feedback, never a grade), the request names what the graded
kernel will lack (:func:`labkit.grading.withhold.withheld_calls`); while the answer runs their
code objects are swapped for a tripwire, so a call by any route ends the case with "your answer
calls labkit's X, which is not available when the notebook is graded". The grader's requests name
none: there the functions are absent (:mod:`labkit.grading.withhold`).
"""
from __future__ import annotations

import base64
import importlib
import os
import select
import signal
import struct
import sys
import time
from typing import Any

from . import wire

__all__ = ["register", "serve", "invoke", "describe_exception", "ReferenceUsed", "GRADING_ENV"]

GRADING_ENV = "LABKIT_GRADING"  # "1" in a kernel started by the grader: check() only registers
REPLY_LIMIT = 32 * 2 ** 20  # bytes of one result

_ANSWERS: dict[str, tuple[int, Any]] = {}
_SERIAL = [0]
_TRIPPED: list[str] = []


class ReferenceUsed(BaseException):
    """Raised inside the learner's code when it calls a reference implementation.

    A BaseException, so ``except Exception`` in the learner's code does not hide it (and the
    call is recorded in any case)."""


# ----------------------------------------------------------------------------- registration


def register(exercise_id: str, answer: Any) -> int:
    """Remember ``answer`` for ``exercise_id`` (the last registration counts); return its serial."""
    _SERIAL[0] += 1
    _ANSWERS[str(exercise_id)] = (_SERIAL[0], answer)
    return _SERIAL[0]


# ----------------------------------------------------------------------------- the call itself


def _resolve(name: str):
    mod, _, qual = name.partition(":")
    if not mod.startswith("labkit.") or not qual or "<" in qual:
        raise ValueError(f"kernel-side function {name!r} is not a top-level labkit function")
    obj = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def _trip_code(template, qualname: str):
    return template.__code__.replace(co_name=qualname.rpartition(".")[2].rpartition(":")[2], co_qualname=qualname)


def _tripwire(*args, **kwargs):  # its code object replaces a reference function's while the answer runs
    # runs with the reference function's globals: reach everything through builtins
    name = __import__("sys")._getframe().f_code.co_qualname
    k = __import__("sys").modules["labkit.grading.kernel"]
    k._TRIPPED.append(name)
    raise k.ReferenceUsed(name)


def _trip_code_for(fn, label: str):
    """A tripwire code object that can replace ``fn.__code__`` (same free variables)."""
    fv = fn.__code__.co_freevars
    if not fv:
        return _trip_code(_tripwire, label)
    src = ("def _outer():\n    " + " = ".join(fv) + " = None\n"
           "    def _trip(*args, **kwargs):\n        (" + ", ".join(fv) + ",)\n"
           "        _s = __import__('sys')\n        _k = _s.modules['labkit.grading.kernel']\n"
           "        _n = _s._getframe().f_code.co_qualname\n        _k._TRIPPED.append(_n)\n"
           "        raise _k.ReferenceUsed(_n)\n    return _trip\n")
    ns: dict = {}
    exec(compile(src, "<labkit tripwire>", "exec"), ns)  # noqa: S102 - our own fixed template
    code = ns["_outer"]().__code__
    if code.co_freevars != fv:
        return None
    return _trip_code(type("T", (), {"__code__": code}), label)


def _functions_of(obj):
    """Plain Python functions that ``obj`` (a function, or a class and its methods) runs."""
    import types

    if isinstance(obj, types.FunctionType):
        return [obj]
    if isinstance(obj, type):
        out = []
        for v in vars(obj).values():
            v = getattr(v, "__func__", v)
            if isinstance(v, types.FunctionType):
                out.append(v)
        return out
    return []


class _Tripwires:
    """Swap the code of the named reference functions for :func:`_tripwire` (and back)."""

    def __init__(self, names):
        self.saved = []
        for name in names or ():
            try:
                obj = _resolve(name)
            except Exception:  # noqa: BLE001 - a name that moved must not break grading
                continue
            for fn in _functions_of(obj):
                trip = _trip_code_for(fn, f"{fn.__module__}:{fn.__qualname__}")
                if trip is not None:
                    self.saved.append((fn, fn.__code__, trip))

    def __enter__(self):
        for fn, _code, trip in self.saved:
            fn.__code__ = trip
        return self

    def __exit__(self, *exc):
        for fn, code, _trip in self.saved:
            fn.__code__ = code
        return False


def invoke(answer: Any, fn_name: str | None, args: tuple, kwargs: dict, references=()) -> Any:
    """Call ``answer(*args, **kwargs)``, or labkit's ``fn_name`` as ``fn(answer, *args, **kwargs)``,
    with the reference functions tripwired. Raises :class:`ReferenceUsed` when one was called
    (even if the learner's code caught the exception)."""
    fn = None if fn_name is None else _resolve(fn_name)
    del _TRIPPED[:]
    with _Tripwires(references):
        try:
            result = answer(*args, **kwargs) if fn is None else fn(answer, *args, **kwargs)
        finally:
            tripped = list(_TRIPPED)
    if tripped:
        raise ReferenceUsed(tripped[0])
    return result


def describe_exception(e: BaseException) -> dict:
    """An exception as data: its type name, builtin base names, message (and a rank's details)."""
    d = {"type": type(e).__name__, "bases": [c.__name__ for c in type(e).__mro__ if c.__module__ == "builtins"],
         "message": _text(e)}
    if isinstance(e, ReferenceUsed):
        d["type"] = "ReferenceUsed"
    for attr in ("rank", "exc_type", "original_message"):
        if hasattr(e, attr) and type(e).__name__ == "RankError":
            d[attr] = getattr(e, attr)
    return d


def _text(e: BaseException, limit: int = 2000) -> str:
    try:
        s = str(e)
    except Exception:  # noqa: BLE001
        s = ""
    return s[:limit]


def reply_for(answer: Any, req: dict) -> bytes:
    """Run one call request and encode the reply (``ok`` / ``exc`` / ``reference``)."""
    try:
        value = invoke(answer, req.get("fn"), tuple(req.get("args", ())), dict(req.get("kwargs", {})),
                       req.get("references", ()))
        reply = {"ok": value}
    except ReferenceUsed as e:
        reply = {"reference": _text(e)}
    except BaseException as e:  # noqa: BLE001 - every exception is a verdict
        reply = {"exc": describe_exception(e)}
    try:
        return wire.dumps(reply, REPLY_LIMIT)
    except wire.WireError as e:
        return wire.dumps({"exc": {"type": "WireError", "bases": ["ValueError", "Exception", "BaseException"],
                                   "message": f"the answer's result cannot be sent back as data: {e}"}})
    except Exception as e:  # noqa: BLE001 - e.g. a tensor subclass whose methods raise
        return wire.dumps({"exc": {"type": "WireError", "bases": ["ValueError", "Exception", "BaseException"],
                                   "message": f"the answer's result cannot be sent back as data: "
                                              f"{type(e).__name__}: {_text(e, 200)}"}})


# ----------------------------------------------------------------------------- the case server


class _Server:
    def __init__(self, token: str):
        self.token = token
        req_r, self.req_w = os.pipe()
        self.rep_r, rep_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(self.req_w)
            os.close(self.rep_r)
            _server_main(req_r, rep_w)  # never returns
        os.close(req_r)
        os.close(rep_w)
        self.pid = pid
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass

    def stop(self):
        for fd in (self.req_w, self.rep_r):
            try:
                os.close(fd)
            except OSError:
                pass
        kill_and_reap(self.pid)


def kill_and_reap(pid: int) -> None:
    """SIGKILL the process group ``pid`` (a case server or case process and every rank it forked)
    and the process itself, then reap it; a process already gone is no error."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _server_main(req_r: int, rep_w: int) -> None:
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        sys.stdout = open(os.devnull, "w")
        sys.stderr = open(os.devnull, "w")
        try:
            import torch

            torch.set_num_threads(1)  # a forked child can hang in threaded kernels otherwise
        except Exception:  # noqa: BLE001
            pass
        while True:
            data = _read_frame(req_r, None)
            if data is None:
                break
            req = wire.loads(data)
            entry = _ANSWERS.get(str(req.get("exercise")))
            if entry is None:
                out = wire.dumps({"error": f"no answer was registered for exercise {req.get('exercise')!r}"})
            else:
                out = reply_for(entry[1], req)
            _write_frame(rep_w, out)
    finally:
        os._exit(0)


def _write_frame(fd: int, data: bytes) -> None:
    view = memoryview(struct.pack("<Q", len(data)) + data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _read_exact(fd: int, n: int, deadline) -> bytes | None:
    chunks, got = [], 0
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if not poller.poll(max(1, int(left * 1000))):
                continue
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int, deadline, limit: int = 2 * REPLY_LIMIT) -> bytes | None:
    head = _read_exact(fd, 8, deadline)
    if head is None:
        return None
    (n,) = struct.unpack("<Q", head)
    if n > limit:
        raise ValueError("reply too large")
    return _read_exact(fd, n, deadline)


_CURRENT: list[_Server] = []


def _stop_server() -> None:
    while _CURRENT:
        _CURRENT.pop().stop()


def _call(req: dict, raw: bytes) -> bytes:
    token = str(req.get("case"))
    if not _CURRENT or _CURRENT[0].token != token:
        _stop_server()
        _CURRENT.append(_Server(token))
    srv = _CURRENT[0]
    timeout = float(req.get("timeout", 10.0))
    deadline = time.monotonic() + max(0.05, timeout)
    try:
        _write_frame(srv.req_w, raw)
        out = _read_frame(srv.rep_r, deadline)
    except TimeoutError:
        _stop_server()
        return wire.dumps({"timeout": True})
    except OSError:
        out = None
    if out is None:
        _stop_server()
        return wire.dumps({"died": True})
    return out


def serve(request: str) -> str:
    """Entry point for the grader (evaluated as a kernel user expression): one base64 request
    in, one base64 reply out. Requests: ``ping``, ``answers`` (exercise id -> serial of every
    registered answer), ``call`` (run one call in this case's server), ``end`` (stop it)."""
    try:
        raw = base64.b64decode(request)
        req = wire.loads(raw)
        op = req.get("op")
        if op == "call":
            out = _call(req, raw)
        elif op == "answers":
            out = wire.dumps({"ok": {k: s for k, (s, _) in _ANSWERS.items()}})
        elif op == "end":
            _stop_server()
            out = wire.dumps({"ok": True})
        else:
            out = wire.dumps({"ok": "pong"})
    except BaseException as e:  # noqa: BLE001
        out = wire.dumps({"error": f"{type(e).__name__}: {_text(e, 300)}"})
    return base64.b64encode(out).decode("ascii")
