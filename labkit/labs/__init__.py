"""The labs: ``python -m labkit lab NAME`` (or ``torchrun ... -m labkit.labs.NAME``).

Each lab module (``pipeline``, ``tensor``, ``moe``, ``moe_eplb``, ``threed``) supplies only its
strategy, as a :class:`labkit.labs.harness.Lab`; :mod:`labkit.labs.harness` runs every lab the
same way. What every lab shares, here: ``--help`` that shows defaults, one ``error:`` line for
bad input, the rule that under torchrun only rank 0 prints, one line (no traceback) when the run
is interrupted or a rank fails (:func:`run_cli`), a fresh run folder per run (:func:`run_folder`)
and the verdict (:mod:`labkit.labs.verdict`).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

from ..launch.torchrun import in_torchrun


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every option's default, except None (the help text says what unset means)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def is_main_rank() -> bool:
    """True outside torchrun, and on global rank 0 under it (the rank that prints and saves)."""
    return not in_torchrun() or int(os.environ["RANK"]) == 0


def error(message: str) -> int:
    """Print ``error: message`` on stderr (once: rank 0 only under torchrun); returns exit code 2."""
    if is_main_rank():
        print(f"error: {message}", file=sys.stderr)
    return 2


class OutputError(Exception):
    """A lab's output file (a plot, a CSV, a trace, its run folder) could not be written; the
    message names the file and the errno. :func:`run_cli` prints it as one ``error:`` line (exit 1)."""


def _output_error(path, e: OSError) -> OutputError:
    import errno
    name = errno.errorcode.get(e.errno, str(e.errno)) if e.errno else type(e).__name__
    return OutputError(f"cannot write {path}: {e.strerror or e} ({name}); the table and the verdict above are complete")


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` all or nothing: into a hidden temporary file in the same folder,
    then renamed over ``path`` (``os.replace`` is atomic). A failed write (a full disk: ENOSPC)
    removes the temporary file and raises :class:`OutputError` naming ``path`` and the errno, so
    no truncated file is left."""
    from ..launch.torchrun import PENDING_FILES  # a rank stopped by a signal under torchrun removes it
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    PENDING_FILES.add(str(tmp))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise _output_error(path, e) from None
    except BaseException:   # Ctrl-C, SIGTERM: no temporary file is left either
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    finally:
        PENDING_FILES.discard(str(tmp))


def save_figure(fig, path: str | os.PathLike, dpi: int = 100) -> None:
    """Render the matplotlib ``fig`` as PNG in memory, then :func:`write_bytes_atomic` it to
    ``path`` (a full disk is one :class:`OutputError`, not matplotlib's and PIL's tracebacks)."""
    import io
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    write_bytes_atomic(path, buf.getvalue())


def out_folder(out: str | None, prefix: str) -> str:
    """``out`` (``--out``; created if needed) or, when None, a fresh :func:`run_folder` under
    ``runs/``; :class:`OutputError` when it cannot be made (a full disk)."""
    if not out:
        return str(run_folder("runs", prefix))
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise _output_error(out, e) from None
    return out


def run_folder(parent: str | os.PathLike, prefix: str) -> Path:
    """Create and return a NEW folder ``parent/prefix-YYYYmmdd-HHMMSS`` (``-2``, ``-3``, ... when
    a run that finished in the same second took the name): two runs never share a folder."""
    parent = Path(parent)
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _output_error(parent, e) from None
    stem = f"{prefix}-{datetime.now():%Y%m%d-%H%M%S}"
    for i in range(1, 10_000):
        folder = parent / (stem if i == 1 else f"{stem}-{i}")
        try:
            folder.mkdir()  # atomic: exactly one run gets each name
            return folder
        except FileExistsError:
            continue
        except OSError as e:
            raise _output_error(folder, e) from None
    raise FileExistsError(f"{parent}: no free run folder name {stem}-N")


def bad_out(path: str | os.PathLike | None, flag: str = "--out") -> str | None:
    """Why ``path`` cannot hold run folders (an existing non-folder, or under one; a place where no
    folder or file can be made), else None. Checked before any rank starts: a run that trains and
    then cannot write its files wastes the run. It tries: the folders it makes to find out are
    removed again (root may write where the permission bits say no, and /proc refuses root)."""
    if path is None:
        return None
    p = Path(path).absolute()
    made = []
    for q in (p, *p.parents):
        if q.exists():
            if not q.is_dir():
                return f"{flag} {path}: {q} exists and is not a folder"
            if not os.access(q, os.W_OK):
                return f"{flag} {path}: folder {q} is not writable"
            break
        made.append(q)
    import tempfile
    try:
        for q in reversed(made):
            q.mkdir()
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        return f"{flag} {path}: cannot write there ({e.strerror or e})"
    finally:
        for q in made:
            try:
                q.rmdir()
            except OSError:
                pass
    return None


def bad_number(flag: str, value: float, low: float = 0.0, strict: bool = True) -> str | None:
    """``flag`` must be finite and > low (``strict``) or >= low; returns the message or None."""
    if not math.isfinite(value) or (value <= low if strict else value < low):
        return f"{flag} must be a finite number {'>' if strict else '>='} {low:g}, got {value}"
    return None


LR_MAX = 10.0  # Adam moves each weight by about lr per step: far beyond 10 it can only diverge


def bad_lr(lr: float, flag: str = "--lr") -> str | None:
    """``lr`` must be finite, > 0 and <= :data:`LR_MAX` (an Adam/AdamW step moves each weight by
    about ``lr``, Kingma & Ba 2015 sec. 2.1); returns the message or None."""
    if not (math.isfinite(lr) and 0 < lr <= LR_MAX):
        return (f"{flag} must be a finite number in (0, {LR_MAX:g}] (an Adam step moves each weight by about "
                f"lr), got {lr}")
    return None


def bad_seed(seed: int) -> str | None:
    """Seeds feed ``torch.Generator.manual_seed`` after ``seed * 1_000_003 + 2 * step``: keep them
    in [0, 2**40) so that stays a valid 64-bit seed."""
    if not 0 <= seed < 2**40:
        return f"--seed must be in [0, 2**40), got {seed}"
    return None


def run_cli(main, *args, check_env: bool = True, stopped: str = "stopped; no rank is left running") -> int:
    """Run ``main(*args)`` the way a command line should end: its return code; Ctrl-C -> one line,
    exit 130; SIGTERM or SIGHUP (a closed terminal) -> one line, exit 128 + signal (143, 129); a failed
    rank (RankError) -> one
    ``error:`` line naming the rank, exit 1. Workers are stopped and temporary files removed
    by :func:`labkit.dist.launch` before the line is printed. After an interrupt the command is
    ending: further SIGINT/SIGTERM are ignored from then on (an impatient second Ctrl-C would
    otherwise print a traceback from Python's exit handlers). ``check_env``: first refuse
    inconsistent torchrun variables (:func:`labkit.dist.torchrun_env_problem`) with one line, exit 2.
    ``stopped``: what the interrupted command stopped, in its own words (a lab's ranks; the grader's
    kernels, ...), after "interrupted (Ctrl-C): " or "terminated (SIGTERM): ". When the reader of
    stdout or stderr goes away (``| head``), further output is dropped, the command finishes its work
    and files, and ends silently with 141 (128 + SIGPIPE, as a tool ended by SIGPIPE) instead of 0."""
    import signal

    from ..launch import RankError, Terminated, stop_on_first_signal, torchrun_env_problem
    problem = torchrun_env_problem() if check_env else None
    if problem:
        print(f"error: {problem}", file=sys.stderr)  # every process prints it: the variables are not to be trusted
        return 2
    with stop_on_first_signal(ignore_after=True), _reader_may_leave() as gone:  # later signals ignored
        try:
            code = main(*args) or 0
            return 128 + signal.SIGPIPE if code == 0 and gone() else code
        except KeyboardInterrupt:
            _ignore_signals()
            _keyboard_interrupt_handled()
            print(f"interrupted (Ctrl-C): {stopped}", file=sys.stderr)
            return 130
        except Terminated as e:
            _ignore_signals()
            print(f"terminated ({signal.Signals(e.signum).name}): {stopped}", file=sys.stderr)
            return 128 + e.signum
        except RankError as e:
            if is_main_rank():
                print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
            return 1
        except OutputError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1


class _DropWhenReaderGone:
    """``sys.stdout``/``sys.stderr`` while a command runs: writes go to the real stream until its reader goes
    away (``| head`` that has read its lines: EPIPE, BrokenPipeError); from then on they are dropped and the
    command goes on to finish its work and write its files. The stream's file descriptor is pointed at
    /dev/null at once (the standard library's advice on SIGPIPE, "Note on SIGPIPE" in the ``signal`` docs),
    so the data still buffered and the flush at exit raise nothing either."""

    def __init__(self, stream):
        self.stream, self.gone = stream, False

    def _closed(self) -> None:
        self.gone = True
        try:
            fd = self.stream.fileno()
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)
        except (OSError, ValueError, AttributeError):
            pass

    def write(self, s):
        if not self.gone:
            try:
                return self.stream.write(s)
            except BrokenPipeError:
                self._closed()
        return len(s)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        if not self.gone:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._closed()

    def __getattr__(self, name):  # isatty, fileno, encoding, buffer, ...: the real stream's
        return getattr(self.stream, name)


@contextmanager
def _reader_may_leave():
    """Run the command with :class:`_DropWhenReaderGone` as ``sys.stdout`` and ``sys.stderr`` (for every
    command: ``python -m labkit ... | head`` never shows a traceback and loses no file); yields a function
    telling whether a reader went away. Forked ranks inherit the wrappers and drop their output the same way."""
    saved = sys.stdout, sys.stderr
    out, err = (_DropWhenReaderGone(s) if s is not None else None for s in saved)
    sys.stdout, sys.stderr = out, err
    try:
        yield lambda: bool((out and out.gone) or (err and err.gone))
    finally:
        for w in (out, err):
            if w is not None:
                w.flush()
        sys.stdout, sys.stderr = saved


def schedule_name(text: str) -> str:
    """A ``--schedule`` value's canonical name (:func:`labkit.pipeline.registry.canonical`):
    ``zb-h1``, ``zbv``, ``dualpipev``, ...; other spellings (``zbh1``, ``ZB-H1``, ``zb-v``) are
    aliases. Use as argparse's ``type=`` with the canonical names as ``choices``."""
    from ..pipeline.registry import canonical
    return canonical(text)


def count_parameters_meta(build) -> int:
    """Parameters of the model ``build()`` returns, built on the meta device (no memory used)."""
    import torch
    with torch.device("meta"):
        return sum(p.numel() for p in build().parameters())


def available_memory() -> int | None:
    """Bytes of host memory available now (Linux ``MemAvailable``), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def loss_change(first: float, last: float) -> str:
    """``'5.562 -> 2.104 (62% lower)'``; ``'5.562 -> nan (diverged: NaN/inf)'`` when a loss is not finite."""
    if not (math.isfinite(first) and math.isfinite(last)):
        return f"{first:.3f} -> {last:.3f} (diverged: NaN/inf)"
    drop = 1 - last / first if first else float("nan")
    return f"{first:.3f} -> {last:.3f} ({drop:.0%} lower)"


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB" if n < 2**40 else f"{n / 2**40:.3g} TiB"


def bad_memory(spec, lay, sizes: str, limit: int | None = None) -> str | None:
    """Refuse a run whose memory, as the planner counts it, exceeds what this machine has (all
    CPU ranks share it). None when it fits (or when the planner cannot express the layout: the
    lab's own layout rules, checked first, name real problems).

    ``spec``, ``lay``: the run as a :class:`labkit.plan.spec.ModelSpec` and an fp32
    :class:`labkit.plan.spec.Layout` (a schedule that holds at least as many activations as the
    lab's, e.g. GPipe). Counted: the planner's bytes of every one of the t p d ranks
    (:func:`labkit.plan.memory.memory_per_rank` with the CPU's saved-tensor sizes: parameters,
    gradients, Adam state, activations); the whole fp32 model each rank builds before it keeps
    its part (4 bytes per parameter each); the single-device reference (the planner's
    t = p = d = 1 layout over the whole batch) and the verdict's gathered parameters and
    gradients (8 bytes per parameter). ``sizes``: the options, for the message. ``limit``:
    bytes available (None: :func:`available_memory`)."""
    from dataclasses import replace

    from ..plan.memory import memory_per_rank
    limit = available_memory() if limit is None else limit
    if limit is None:
        return None
    try:
        ranks = memory_per_rank(spec, lay, device="cpu")
        one = replace(lay, t=1, p=1, d=1, v=1, ep=1, b=spec.global_batch, M=1, zero=0, sequence_parallel=False,
                      placement="loop", schedule="1f1b")
        reference = memory_per_rank(spec, one, device="cpu")[0].total
    except ValueError:
        return None
    n, params = lay.n_gpus, spec.total_params()
    run = lay.t * lay.d * sum(r.total for r in ranks)
    build = 4 * params * n
    checks = reference + 8 * params
    need = run + build + checks
    if need <= limit:
        return None
    return (f"{sizes}: the run needs about {_gib(need)} of memory, more than the {_gib(limit)} available "
            f"(the planner's count for {params:,} parameters: the {n:,} ranks' parameters, gradients, Adam state "
            f"and activations {_gib(run)}; the full fp32 model each rank builds before keeping its part "
            f"{_gib(build)}; the single-device reference and the verdict's copies {_gib(checks)}); "
            f"use smaller sizes")


def _keyboard_interrupt_handled() -> None:
    """Tell CPython that the KeyboardInterrupt was handled. It remembers one that left code it ran through its
    ``PyRun_*`` calls (torch runs some of its start-up so, through pybind11) even when a caller caught it, and
    then ends ``python -m labkit`` by SIGINT instead of with the status returned: exit -2, not 130, after a
    Ctrl-C about 3 s into ``lab 3d`` (torch registering its operators). A ``PyRun_*`` call that ends without
    an error forgets it; elsewhere than CPython this does nothing."""
    try:
        import ctypes
        run = ctypes.pythonapi.PyRun_String
    except (ImportError, AttributeError):
        return
    run.restype, run.argtypes = ctypes.py_object, [ctypes.c_char_p, ctypes.c_int, ctypes.py_object, ctypes.py_object]
    try:
        run(b"None", 258, {}, {})  # 258: Py_eval_input
    except Exception:  # noqa: BLE001 - only a wish to exit with the status returned
        pass


def _ignore_signals() -> None:
    import signal
    import threading
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
