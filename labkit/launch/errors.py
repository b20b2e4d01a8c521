"""What a failed launch reports: :class:`RankError`, which of several ranks' errors explains the
failure best, and how a worker's exit is described."""
from __future__ import annotations

import signal


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
