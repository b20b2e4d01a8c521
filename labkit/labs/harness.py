"""The one lab harness: what every lab does, written once.

A lab (``python -m labkit lab NAME``) supplies only its strategy, as a :class:`Lab`:

* ``parser()``: its options (``--help`` shows the defaults; bad values are one ``error:`` line),
  the ones every lab shares added by :func:`add_shared_options`;
* ``resolve(a, world)``: its sizes under torchrun (``world`` = WORLD_SIZE) or from the options;
* ``check(a)``: its layout rules and the memory refusal, as one message naming the values;
* ``runs(a, corpus)``: the parallel runs to start, each a :class:`Launch` (its per-rank build
  and step: a worker function that returns a dataclass holding the rank's verdict);
* ``reference(a, corpus)``: its single-device training, through :func:`train_reference`;
* ``report(a, outcome)``: its tables; returns the verdicts and any failed count;
* ``files(a, outcome, folder)``: its plots and CSV files in the run folder.

The harness owns the rest, the same for every lab: parsing, the one-line errors before any
rank starts, loading the corpus, launching the ranks (:func:`labkit.dist.launch`: forked CPU
processes, or one GPU per rank; under torchrun every process is one rank and only rank 0
prints), the single-device reference, the verdict (:class:`labkit.labs.verdict.Lockstep` on
the ranks, :func:`labkit.labs.verdict.verdict_exit` in the parent), the run folder (written
last, so a full disk cannot hide the table and the verdict), the exit code and the one line
that a failed rank or an unwritable file ends with. :func:`run` returns a :class:`LabRun`:
the exit code, the verdicts and the text the lab printed.
"""
from __future__ import annotations

import io
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from . import OutputError, error, is_main_rank, run_folder
from .verdict import Lockstep, LockstepResult, add_tolerance_option, verdict_exit


@dataclass
class Launch:
    """One parallel run of a lab: ``worker(ctx, *args)`` on ``world`` ranks.

    ``name`` labels the run in the report and the verdict (e.g. ``"1f1b"``, ``"TP=2"``);
    ``timeout``: seconds a rank waits for a peer before the run fails (:func:`labkit.dist.launch`)."""
    name: str
    world: int
    worker: Callable
    args: tuple = ()
    timeout: float = 120.0


@dataclass
class Reference:
    """The single-device training of a lab. ``losses``: the loss of every step (nats/token);
    ``seconds``: wall time of steps 1.. (step 0 is warm-up; NaN with one step); ``model``: the
    trained model (for a validation loss); ``extra``: what the lab's step returned besides the
    loss, one entry per step (None where it returned only the loss)."""
    losses: list[float]
    seconds: float
    model: torch.nn.Module
    extra: list = field(default_factory=list)

    def tokens_per_s(self, tokens_per_step: int) -> float:
        """Tokens per second over the timed steps (NaN when there is none)."""
        timed = len(self.losses) - 1
        return tokens_per_step * timed / self.seconds if timed > 0 and self.seconds > 0 else float("nan")


@dataclass
class Outcome:
    """What a lab's runs produced, for its report: ``results[run name]`` = the per-rank results
    (the workers' return values, in rank order); ``reference``: the single-device training;
    ``corpus``: the data; ``seconds``: wall time of the launches."""
    results: dict[str, list]
    reference: Reference | None
    corpus: Any
    seconds: float = 0.0


@dataclass
class Report:
    """What a lab's report concluded: ``verdicts[run name]`` (rank 0's
    :class:`~labkit.labs.verdict.LockstepResult`); ``failures``: one ``FAIL: ...`` line each for
    a check beside the verdict (e.g. counted collectives that differ from the formula)."""
    verdicts: dict[str, LockstepResult]
    failures: list[str] = field(default_factory=list)


@dataclass
class LabRun:
    """The result of :func:`run`: ``rc`` the exit code (0 OK, 1 a failed verdict, count, rank or
    file, 2 bad input); ``verdicts`` (empty when no run finished); ``text``: what the lab printed on
    stdout and stderr, in order; ``reference_losses``: the single-device losses, if it trained."""
    rc: int
    verdicts: dict[str, LockstepResult]
    text: str
    reference_losses: list[float] | None = None


class Lab:
    """A lab's strategy; subclass it and give every method below (see the module docstring).
    ``name``: the command's name (``python -m labkit lab NAME``) and the run folder's prefix."""
    name = "lab"

    def parser(self):
        raise NotImplementedError

    def resolve(self, a, world: int | None) -> str | None:
        """Set the sizes the options leave open; ``world``: WORLD_SIZE under torchrun, else None.
        Returns an error message or None."""
        return None

    def check(self, a) -> str | None:
        """The first rule the options break (layout, sizes, memory), or None."""
        return None

    def load_corpus(self, a):
        """The corpus the runs train on (OSError/ValueError: one ``error:`` line)."""
        from ..data import Corpus
        return Corpus.load(a.data)

    def start(self, a, corpus) -> None:
        """Called in every process before any rank starts (a banner on the main rank, a clock);
        nothing by default."""

    def runs(self, a, corpus) -> list[Launch]:
        raise NotImplementedError

    def reference(self, a, corpus) -> Reference | None:
        raise NotImplementedError

    def report(self, a, outcome: Outcome) -> Report:
        raise NotImplementedError

    def conclude(self, verdicts: dict, reference_losses, failures: list[str]) -> int:
        """Print the verdict and the one-line conclusion (:func:`labkit.labs.verdict.verdict_exit`),
        then each of ``failures`` on stderr; returns the exit code (0 when all passed, else 1)."""
        rc = verdict_exit(verdicts, reference_losses=reference_losses)
        for line in failures:
            print(line, file=sys.stderr)
            rc = 1
        return rc

    def folder(self, a):
        """The run folder to create (after the verdict), or None for none: by default a fresh
        ``a.out/NAME-<time>`` (:func:`labkit.labs.run_folder`)."""
        return run_folder(a.out, self.name)

    def files(self, a, outcome: Outcome, folder) -> None:
        """Write the plots and CSV files into ``folder`` and print their paths."""


def add_shared_options(p, out: Sequence[str] = ("--out",), out_dest: str | None = None,
                       out_default: str | None = "runs", out_help: str = "folder for the run folder",
                       plots: bool = False) -> None:
    """Add the options every lab shares to its parser ``p``: ``--seed`` (weights and batches),
    ``--data`` (the corpus, :meth:`Lab.load_corpus`), ``--backend`` (auto | gloo | nccl),
    ``--tolerance`` (the verdict's rtol, :func:`~labkit.labs.verdict.add_tolerance_option`),
    the run folder option (spellings ``out``, stored as ``out_dest``, default ``out_default``,
    help ``out_help``: a lab keeps the spelling and default it always had) and, for a lab that
    draws, ``--no-plots`` (``plots=True``)."""
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    p.add_argument("--data", default=None, help="text file or folder (unset: the Python standard library)")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"), help="torch.distributed backend")
    add_tolerance_option(p)
    p.add_argument(*out, **({"dest": out_dest} if out_dest else {}), default=out_default, help=out_help)
    if plots:
        p.add_argument("--no-plots", action="store_true", help="skip the PNGs")


def lockstep(ctx, a, reference: Callable[[], torch.nn.Module], loss_fn) -> Lockstep:
    """Every rank's :class:`~labkit.labs.verdict.Lockstep` for a lab's run: rank 0 builds the
    single-device reference (``reference()``, moved to ``ctx.device``); the tolerance is the lab's
    ``--tolerance`` (rtol; atol = rtol / 10)."""
    ref = reference().to(ctx.device) if ctx.rank == 0 else None
    return Lockstep(ctx.group, ctx.rank, ref, loss_fn, rtol=a.tolerance, atol=a.tolerance / 10)


def train_reference(model: torch.nn.Module, steps: int, step_loss: Callable, lr: float, optimizer: str = "adam",
                    progress: str | None = None, after_backward: Callable | None = None) -> Reference:
    """Train ``model`` on one device for ``steps`` steps, on one CPU thread like each rank (so that
    tokens per second compare). ``step_loss(model, step)`` returns the loss of step ``step`` (a
    0-dim tensor) or ``(loss, extra)``; ``optimizer``: ``"adam"`` (torch.optim.Adam) or
    ``"adamw"`` (AdamW, no weight decay); ``after_backward(model, extra)`` runs between backward
    and the optimizer step (e.g. a bias update); ``progress``: a tqdm label (a bar only on a
    terminal). Step 0 is warm-up: :attr:`Reference.seconds` times steps 1.."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        params = list(model.parameters())
        opt = (torch.optim.Adam(params, lr=lr) if optimizer == "adam"
               else torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=True))
        bar = None
        if progress is not None:
            from tqdm import tqdm
            bar = tqdm(total=steps, desc=progress, unit="step", file=sys.stderr, leave=False, disable=None)
        losses, extras, seconds = [], [], 0.0
        for step in range(steps):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            out = step_loss(model, step)
            loss, extra = out if isinstance(out, tuple) else (out, None)
            loss.backward()
            if after_backward is not None:
                after_backward(model, extra)
            opt.step()
            if step >= 1:
                seconds += time.perf_counter() - t0
            losses.append(loss.item())
            extras.append(extra)
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return Reference(losses, seconds if steps > 1 else float("nan"), model, extras)
    finally:
        torch.set_num_threads(threads)


def execute(lab: Lab, a, corpus) -> Outcome | None:
    """Start ``lab``'s runs and its single-device reference (no printing beyond the lab's :meth:`Lab.start`).
    Returns the :class:`Outcome` on the printing rank, None on the other ranks under torchrun.
    Raises :class:`labkit.dist.RankError` when a rank fails."""
    # every lab's ranks step an optimizer, whose first call imports torch._dynamo (labkit.launch.forked.LAZY):
    # imported here, the forked ranks inherit it
    import torch._dynamo  # noqa: F401

    from ..dist import launch
    t0 = time.perf_counter()
    results = {}
    for r in lab.runs(a, corpus):
        results[r.name] = launch(r.worker, r.world, *r.args, backend=a.backend, timeout=r.timeout)
    seconds = time.perf_counter() - t0
    if not is_main_rank():
        return None
    return Outcome(results, lab.reference(a, corpus), corpus, seconds)


def prepare(lab: Lab, argv: Sequence[str]):
    """Parse ``argv`` and apply the lab's rules: ``(options, corpus, None)``, or ``(None, None,
    exit code)`` after one ``error:`` line. Nothing has started yet."""
    from ..dist import in_torchrun
    p = lab.parser()
    p.defer_needs = True    # the one rule for options without effect, once resolve has set the sizes left open
    a = p.parse_args(list(argv))
    world = int(os.environ["WORLD_SIZE"]) if in_torchrun() else None
    bad = lab.resolve(a, world) or p.unneeded(a) or lab.check(a)
    if bad:
        return None, None, error(bad)
    try:  # a bad --data path: a clear message before any process starts
        corpus = lab.load_corpus(a)
    except (OSError, ValueError) as e:
        return None, None, error(str(e))
    return a, corpus, None


def run(lab: Lab, argv: Sequence[str] | None = None) -> LabRun:
    """Run ``lab`` with the command-line arguments ``argv`` (default ``sys.argv[1:]``): check the
    options, launch the ranks, train the reference, print the lab's report and the verdict, write
    the run folder. Returns a :class:`LabRun` (exit code, verdicts, the printed text). A failed rank
    or an unwritable file is one ``error:`` line (exit 1); Ctrl-C and SIGTERM propagate to
    :func:`labkit.labs.run_cli`, which ends them with one line."""
    argv = sys.argv[1:] if argv is None else argv
    tee = _Tee()
    verdicts: dict = {}
    reference = None
    with tee:
        try:
            a, corpus, rc = prepare(lab, argv)
            if a is not None:
                lab.start(a, corpus)
                outcome = execute(lab, a, corpus)
                if outcome is None:          # torchrun, not rank 0: rank 0 reports
                    rc = 0
                else:
                    reference = outcome.reference
                    rep = lab.report(a, outcome)
                    verdicts = rep.verdicts
                    rc = lab.conclude(verdicts, reference.losses if reference else None, rep.failures)
                    folder = lab.folder(a)   # the files last (labs.OutputError: one line)
                    if folder is not None:
                        lab.files(a, outcome, folder)
        except OutputError as e:
            print(f"error: {e}", file=sys.stderr)
            rc = 1
        except Exception as e:
            from ..dist import RankError
            if not isinstance(e, RankError):
                raise
            if is_main_rank():
                print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
            rc = 1
    return LabRun(rc, verdicts, tee.text(), reference.losses if reference is not None else None)


class _Tee:
    """While active, everything written to sys.stdout and sys.stderr also lands in one buffer."""

    def __init__(self):
        self.buf = io.StringIO()

    def __enter__(self):
        self.saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _TeeStream(sys.stdout, self.buf), _TeeStream(sys.stderr, self.buf)
        return self

    def __exit__(self, *exc):
        sys.stdout, sys.stderr = self.saved
        return False

    def text(self) -> str:
        return self.buf.getvalue()


class _TeeStream:
    def __init__(self, stream, buf):
        self.stream, self.buf = stream, buf

    def write(self, s):
        self.buf.write(s)
        return self.stream.write(s)

    def flush(self):
        self.stream.flush()

    def __getattr__(self, name):  # isatty, fileno, encoding, ...: the real stream's
        return getattr(self.stream, name)

