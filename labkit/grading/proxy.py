"""What a case receives as ``answer``: a proxy that sends calls to wherever the learner's code is.

``answer(*args)`` runs the learner's function on ``args`` and returns its result as data
(:mod:`labkit.grading.wire`); ``answer.run(fn, *args)`` runs the labkit function ``fn`` as
``fn(real_answer, *args)`` next to the learner's code and returns its result as data (for an
answer that is a class, an ``nn.Module`` factory, a function run on ranks, or a result that
needs autograd). An exception raised there comes back as an exception of the same name
(``ValueError`` stays a ``ValueError``; ``NotImplementedError`` still means "not attempted").

Two backends:

* :class:`LocalBackend` (``check`` in a notebook, pytest): the answer is in this process; the
  call still makes the data round trip, so a verdict is the same as under the grader.
* :class:`KernelBackend` (the grader): the answer lives in the learner's kernel; each call is a
  request to :func:`labkit.grading.kernel.serve`, with a deadline (the case's time left) and a
  size limit, and the reply is decoded without pickle.
"""
from __future__ import annotations

import base64
import builtins
import time
from typing import Any, Callable

from . import wire

__all__ = ["Answer", "LocalBackend", "KernelBackend", "CaseTimeout", "KernelFailure", "ReferenceImplementationUsed",
           "kernel_function_name", "set_deadline"]

_DEADLINE = [None]  # monotonic time the running case must end by (set by runner.run_case)


def set_deadline(t: float | None) -> None:
    _DEADLINE[0] = t


def _time_left(default: float = 10.0) -> float:
    d = _DEADLINE[0]
    return default if d is None else max(0.05, d - time.monotonic())


class CaseTimeout(Exception):
    """The learner's code did not return within the case's time limit."""


class KernelFailure(Exception):
    """The process running the learner's code died, exited, or answered nonsense."""


class ReferenceImplementationUsed(Exception):
    """The answer called (or is) one of labkit's reference implementations for the exercise."""

    def __init__(self, name: str):
        self.name = name
        super().__init__(name)


def kernel_function_name(fn: Callable) -> str:
    """``"module:qualname"`` of a top-level labkit function (what ``answer.run`` sends)."""
    mod, qual = getattr(fn, "__module__", ""), getattr(fn, "__qualname__", "")
    if not (mod.startswith("labkit.") and qual and "<" not in qual):
        raise ValueError(f"answer.run needs a top-level function of a labkit module (so the kernel can import "
                         f"it), got {fn!r}")
    return f"{mod}:{qual}"


class Answer:
    """The ``answer`` a case function receives (see the module docstring)."""

    def __init__(self, backend, exercise_id: str = "", references=()):
        self._backend = backend
        self._exercise = exercise_id
        self._references = tuple(references)

    def __call__(self, *args, **kwargs):
        return self._backend.call(self._request(None, args, kwargs))

    def run(self, fn: Callable, *args, **kwargs):
        """Run labkit's top-level ``fn(answer, *args, **kwargs)`` where the learner's code is."""
        return self._backend.call(self._request(kernel_function_name(fn), args, kwargs))

    def _request(self, fn, args, kwargs) -> dict:
        return {"op": "call", "exercise": self._exercise, "fn": fn, "args": list(args), "kwargs": dict(kwargs),
                "references": list(self._references), "timeout": _time_left()}

    @property
    def __name__(self):  # expect_raises names the call after the answer
        return "answer"

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"the learner's answer is not in the grader's process: call it (answer(...)) or give "
                             f"it to a labkit function that runs next to it (answer.run(fn, ...)); "
                             f"answer.{name} is not available")

    def __repr__(self) -> str:
        return f"<answer to exercise {self._exercise}>"


def _exception_from(d: dict) -> BaseException:
    """Rebuild an exception described by :func:`labkit.grading.kernel.describe_exception`."""
    from ..dist import RankError
    from .registry import CheckFailure

    if not isinstance(d, dict):
        return KernelFailure("a malformed error report came back")
    name = str(d.get("type", "Exception"))
    msg = str(d.get("message", ""))[:2000]
    if name == "ReferenceUsed":
        return ReferenceImplementationUsed(msg)
    if name == "CheckFailure":
        return CheckFailure(msg)
    if name == "RankError":
        exc_type = str(d.get("exc_type", "Exception"))
        original = str(d.get("original_message", ""))[:2000]
        if exc_type == "ReferenceUsed":
            return ReferenceImplementationUsed(original)
        rank = d.get("rank")
        return RankError(rank if type(rank) is int else -1, exc_type, original, "")
    base = Exception
    for b in d.get("bases", ()):
        cls = getattr(builtins, str(b), None)
        if isinstance(cls, type) and issubclass(cls, Exception):
            base = cls
            break
    if name == base.__name__:
        cls = base
    else:
        safe = name if name.isidentifier() and len(name) <= 80 else base.__name__
        cls = type(safe, (base,), {"__module__": "learner"})
    try:
        return cls(msg)
    except Exception:  # noqa: BLE001 - e.g. UnicodeDecodeError needs 5 arguments
        return type(name if name.isidentifier() else "Error", (Exception,), {})(msg)


def _plain(v):
    """``v`` with every :class:`~labkit.grading.wire.LearnerText` back to a plain str (an error
    report: the learner's exception is shown as it raised it)."""
    if isinstance(v, str):
        return str.__str__(v)
    if isinstance(v, dict):
        return {_plain(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_plain(x) for x in v)
    return v


def _result(data: bytes):
    try:
        reply = wire.loads(data, text_class=wire.LearnerText)   # the learner's strings: shown by length only
    except wire.WireError as e:
        raise KernelFailure(f"the kernel's reply is not valid data ({e})") from None
    if not isinstance(reply, dict):
        raise KernelFailure("the kernel's reply is not valid data")
    if "ok" in reply:
        return reply["ok"]
    if "exc" in reply:   # the learner's own exception: its name and message as it raised them
        raise _exception_from(_plain(reply["exc"]))
    if "reference" in reply:
        raise ReferenceImplementationUsed(str(_plain(reply["reference"])))
    if reply.get("timeout"):
        raise CaseTimeout()
    if reply.get("died"):
        raise KernelFailure("the process running the learner's code died (it was killed, exited or crashed)")
    raise KernelFailure(f"the kernel could not run the call: {str(reply.get('error', 'no reply'))[:300]}")


class LocalBackend:
    """The answer is an object in this process (``check`` in a notebook; pytest)."""

    def __init__(self, answer: Any):
        self.answer = answer

    def call(self, req: dict):
        from .kernel import reply_for

        req = wire.loads(wire.dumps(req))  # the learner's code gets fresh copies, as in a kernel
        return _result(reply_for(self.answer, req))


class KernelBackend:
    """The answer lives in a Jupyter kernel started by the grader (connection ``info``, process ``pid``).

    Made in the process that runs the case (a fork of the grader): it opens its own ZMQ
    context and shell connection. Each call waits at most the case's time left plus a margin;
    a reply larger than ``limit`` bytes is refused by ZMQ itself."""

    MARGIN = 3.0  # seconds to wait beyond the kernel-side deadline before declaring the kernel stuck

    def __init__(self, info: dict, pid: int | None, case_token: str, limit: int = 64 * 2 ** 20):
        self.info, self.pid, self.token, self.limit = info, pid, case_token, limit
        self.kc = None

    def _client(self):
        if self.kc is None:
            import zmq
            from jupyter_client.blocking import BlockingKernelClient

            ctx = zmq.Context()  # never the parent's (this process is a fork)
            ctx.setsockopt(zmq.MAXMSGSIZE, self.limit)
            kc = BlockingKernelClient(context=ctx)
            kc.load_connection_info(self.info)
            kc.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
            self.kc = kc
        return self.kc

    def _alive(self) -> bool:
        if not self.pid:
            return True
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
            return state not in (b"Z", b"X")
        except (OSError, IndexError):
            return False

    def call(self, req: dict):
        # no reference list: a tripwire in the kernel would be the learner's to disable; under the
        # grader the references are absent from the kernel's kit instead (labkit.grading.withhold)
        req = dict(req, case=self.token, references=[])
        timeout = float(req["timeout"])
        data = request_kernel(self._client(), req, timeout + self.MARGIN, self._alive)
        return _result(data)


def request_kernel(kc, req: dict, wait: float, alive=lambda: True) -> bytes:
    """Send one :func:`labkit.grading.kernel.serve` request on client ``kc``; the reply's bytes.

    Raises :class:`CaseTimeout` after ``wait`` seconds and :class:`KernelFailure` when the
    kernel dies or replies with something that is not a base64 string."""
    import queue

    b64 = base64.b64encode(wire.dumps(req)).decode("ascii")
    expr = f"__import__('labkit.grading.kernel', fromlist=['serve']).serve({b64!r})"
    msg_id = kc.execute("", silent=True, store_history=False, user_expressions={"r": expr}, allow_stdin=False)
    deadline = time.monotonic() + wait
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CaseTimeout()
        try:
            msg = kc.get_shell_msg(timeout=min(0.5, left))
        except queue.Empty:
            if not alive():
                raise KernelFailure("the kernel died (the learner's code killed it, or it exited)") from None
            continue
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        expr_reply = msg.get("content", {}).get("user_expressions", {}).get("r", {})
        if expr_reply.get("status") != "ok":
            raise KernelFailure(f"the kernel could not run the grader's call: {expr_reply.get('ename', '')} "
                                f"{str(expr_reply.get('evalue', ''))[:200]}".rstrip())
        text = expr_reply.get("data", {}).get("text/plain", "")
        # the repr of a base64 str: parsed by hand (never eval'd)
        text = text.strip() if isinstance(text, str) else ""
        if len(text) < 2 or text[0] not in "'\"" or text[-1] != text[0]:
            raise KernelFailure("the kernel's reply is not a labkit reply")
        try:
            return base64.b64decode(text[1:-1], validate=True)
        except Exception:  # noqa: BLE001
            raise KernelFailure("the kernel's reply is not a labkit reply") from None
