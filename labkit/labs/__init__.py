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
from datetime import datetime
from pathlib import Path

from ..dist import in_torchrun


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
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
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
    """Why ``path`` cannot hold run folders (an existing non-folder, or under one), else None."""
    if path is None:
        return None
    p = Path(path)
    for q in (p, *p.parents):
        if q.exists():
            if not q.is_dir():
                return f"{flag} {path}: {q} exists and is not a folder"
            if not os.access(q, os.W_OK):
                return f"{flag} {path}: folder {q} is not writable"
            return None
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


def run_cli(main, *args, check_env: bool = True) -> int:
    """Run ``main(*args)`` the way a command line should end: its return code; Ctrl-C -> one line,
    exit 130; SIGTERM -> one line, exit 143 (128 + signal); a failed rank (RankError) -> one
    ``error:`` line naming the rank, exit 1. Workers are stopped and temporary files removed
    by :func:`labkit.dist.launch` before the line is printed. After an interrupt the command is
    ending: further SIGINT/SIGTERM are ignored from then on (an impatient second Ctrl-C would
    otherwise print a traceback from Python's exit handlers). ``check_env``: first refuse
    inconsistent torchrun variables (:func:`labkit.dist.torchrun_env_problem`) with one line, exit 2."""
    import signal

    from ..dist import RankError, Terminated, stop_on_first_signal, torchrun_env_problem
    problem = torchrun_env_problem() if check_env else None
    if problem:
        print(f"error: {problem}", file=sys.stderr)  # every process prints it: the variables are not to be trusted
        return 2
    with stop_on_first_signal(ignore_after=True):  # the one line is printed while later signals are ignored
        try:
            return main(*args) or 0
        except KeyboardInterrupt:
            _ignore_signals()
            print("interrupted (Ctrl-C): stopped; no rank is left running", file=sys.stderr)
            return 130
        except Terminated as e:
            _ignore_signals()
            print(f"terminated ({signal.Signals(e.signum).name}): stopped; no rank is left running", file=sys.stderr)
            return 128 + e.signum
        except RankError as e:
            if is_main_rank():
                print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
            return 1
        except OutputError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1


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


def activation_bytes(n_layer: int, batch: int, seq: int, hidden: int, heads: int, vocab: int,
                     extra_per_token: int = 0) -> int:
    """Bytes autograd keeps for one fp32 forward of the GPT over a ``batch x seq`` batch.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
    sec. 4.1 eq. 1: s*b*h*(34 + 5*a*s/h) bytes per layer with 16-bit activations; fp32 doubles
    it. Plus the logits, their softmax and gradient (3 * b*s*V * 4 bytes) and ``extra_per_token``
    bytes per token and layer (e.g. MoE expert inputs)."""
    per_layer = seq * batch * hidden * 34 + 5 * heads * seq * seq * batch
    return 2 * n_layer * per_layer + 12 * batch * seq * vocab + n_layer * batch * seq * extra_per_token


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


def bad_memory(params: int, model_bytes_per_param: float, act: int, act_copies: float, sizes: str,
               limit: int | None = None, ranks: int | None = None) -> str | None:
    """Refuse a run whose estimated memory exceeds what this machine has (all CPU ranks share it).

    ``params``: parameters of the model; ``model_bytes_per_param``: bytes per parameter over the
    whole run at its peak (every copy: each rank's fp32 weights, gradients and Adam's 2 moments
    = 16, the reference's weights and gradients = 8, ...); ``act``: :func:`activation_bytes` of
    the whole batch, held ``act_copies`` times at the peak. ``sizes``: the options, for the
    message. ``limit``: bytes available (None: :func:`available_memory`). ``ranks``: when given,
    ``model_bytes_per_param`` is ``4 * ranks + 48`` (every rank builds the full fp32 model, plus
    48 bytes/param for Adam, the reference and the verdict's copies) and the message says so,
    since that term grows with the world size. The estimate is
    rough (within a factor of ~2), so it refuses only what clearly cannot run."""
    limit = available_memory() if limit is None else limit
    if limit is None:
        return None
    need = params * model_bytes_per_param + act * act_copies
    if need <= limit:
        return None
    weights = _gib(params * model_bytes_per_param)
    if ranks is not None:
        how = f"4 bytes on each of the {ranks:,} ranks, which all build the full model, + 48"
    else:
        how = f"{model_bytes_per_param:g}"
    return (f"{sizes}: the run needs about {_gib(need)} of memory ({params:,} parameters "
            f"x ({how}) bytes = {weights}; "
            f"activations: {_gib(act * act_copies)}, Korthikanti et al. 2022 eq. 1), more than the {_gib(limit)} "
            f"available; use smaller sizes")


def _ignore_signals() -> None:
    import signal
    import threading
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
