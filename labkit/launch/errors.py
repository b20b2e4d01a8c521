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


    def _render_traceback_(self) -> list[str]:
        """What IPython shows for this error (it calls ``_render_traceback_`` instead of formatting the
        traceback): the learner's own frames, from the notebook cell that launched the ranks and from the
        rank, and the rank's error; not the launcher's frames (issue 36: the stub's expected error in
        notebook 00 was 43 lines of launcher internals before the useful last line). The full rank
        traceback stays in ``remote_traceback``."""
        import traceback

        here = [f for f in traceback.extract_tb(self.__traceback__) if _is_learner_file(f.filename)]
        lines = [f"RankError: rank {self.rank} failed with {self.exc_type}"]
        if here:
            lines += [line.rstrip("\n") for line in traceback.format_list(here)]
        remote = _learner_frames(self.remote_traceback)
        if remote:
            lines.append(f"in rank {self.rank}:")
            lines += remote
        last = [line for line in str(self.remote_traceback).strip().splitlines() if line.strip()]
        what = "report" if self.exc_type == "ProcessDied" else "traceback"
        lines.append(last[-1] if last and self.exc_type != "ProcessDied" else
                     f"{self.exc_type}: {self.original_message}")
        lines.append(f"(rank {self.rank}'s whole {what}: the exception's remote_traceback)")
        return lines


def _is_learner_file(filename: str) -> bool:
    """A frame of the learner's code: not labkit's, torch's, the standard library's or an installed package's."""
    import os
    import sysconfig

    name = str(filename).replace("\\", "/")
    if name.startswith("<") and "ipython-input" not in name:
        return False
    skip = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))).replace("\\", "/") + "/",
            sysconfig.get_paths()["stdlib"].replace("\\", "/") + "/", "/site-packages/", "/dist-packages/"]
    return not any(s in name for s in skip)


def _learner_frames(remote_traceback: str) -> list[str]:
    """The ``File ...`` entries (with their source line) of a formatted traceback that are the learner's."""
    out, keep = [], False
    for line in str(remote_traceback).splitlines():
        if line.startswith('  File "'):
            keep = _is_learner_file(line.split('"')[1])
            if keep:
                out.append(line)
        elif keep and line.startswith("    "):
            out.append(line)
        else:
            keep = False
    return out


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
