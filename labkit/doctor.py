"""``python -m labkit doctor [--run]``: does the kit work on this machine?

:func:`report` is the environment (torch, CUDA devices, NCCL/gloo, the backend ``auto`` picks per
world size): all that ``python -m labkit doctor`` prints. With ``--run``, started anywhere (a
laptop, one GPU, an 8-GPU node, under ``torchrun``), it prints that report and then runs every
lab briefly (a tiny model, 2-3 steps) with backend "auto", as a user would start it (through
:func:`labkit.labs.harness.run`, which returns the lab's verdicts), and prints for each::

    PASS  3d        gloo  8 ranks   largest difference from one device 1.9e-07   4.2 s

The 3D lab's run trains on padded documents (``--ignore-frac 0.25``: targets of -100 spread
unevenly over the DP ranks and microbatches), so its verdict also checks that the loss is the mean
over the step's valid targets, as on one device.
PASS when the lab exits with status 0 (its verdict: every step's loss and gradients equal the
single-device model's at the same parameters, :mod:`labkit.labs.verdict`), FAIL with the lab's
last error line otherwise. The largest difference is the largest |gradient - reference| (or
|loss - reference|) over the steps the verdict compared. The labs' own output is not shown
(``--verbose`` shows it). Under torchrun every rank runs the labs (they are collective) and rank 0
prints. Exit status: 0 if every lab passed, 1 otherwise.
"""
from __future__ import annotations

import contextlib
import io
import os
import tempfile
import time
from typing import Sequence


def report(world_sizes: Sequence[int] = (1, 2, 4, 8)) -> str:
    """Text report: torch version, CUDA devices, NCCL/gloo availability, the auto backend per
    world size in ``world_sizes``."""
    import torch
    import torch.distributed as dist

    from .dist import choose_backend, in_torchrun

    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    lines = [
        f"torch            {torch.__version__}",
        f"CUDA available   {torch.cuda.is_available()}",
        f"CUDA devices     {n_gpu}",
        f"NCCL available   {dist.is_nccl_available()}",
        f"gloo available   {dist.is_gloo_available()}",
        f"CPU cores        {os.cpu_count()}",
        f"under torchrun   {in_torchrun()}",
    ]
    for w in world_sizes:
        lines.append(f"auto backend for world size {w}: {choose_backend(w)}")
    return "\n".join(lines)


def _sizes(world: int) -> tuple[int, int, int]:
    """(t, p, d) for the 3D lab on ``world`` ranks: t = 2 and p = 2 where they divide, d the rest."""
    t = 2 if world % 2 == 0 else 1
    p = 2 if world % (2 * t) == 0 else 1
    return t, p, world // (t * p)


def _plans(world: int | None, out: str) -> list[tuple[str, int, list[str]]]:
    """(lab, ranks, argv) of each brief run; ``world``: WORLD_SIZE under torchrun, else None."""
    small = ["--steps", "2", "--seq", "16", "--batch", "8", "--embd", "16", "--heads", "2"]
    n = world or 2
    t, p, d = _sizes(world or 8)
    return [
        ("pipeline", n, ["--world-size", str(n), "--schedule", "1f1b", "--microbatches", "2", "--layers", str(2 * n),
                         "--out", out, *small]),
        ("tensor", n, ["--tp", str(n), "--layers", "1", "--out", out, *small, "--heads", str(n), "--embd", str(8 * n)]),
        ("moe", n, ["--ep", str(n), "--experts", str(2 * n), "--balance-steps", "2", "--layers", "2",
                    "--no-plots", "--out", os.path.join(out, "moe"), *small]),
        # padded documents: the shards hold different numbers of valid targets (labkit.parallel.loss)
        ("3d", t * p * d, ["--tp", str(t), "--pp", str(p), "--dp", str(d), "--microbatches", "2", "--layers", "2",
                           "--ignore-frac", "0.25", "--no-plots", "--out", out, *small]),
    ]


def run_all(verbose: bool = False) -> int:
    """Run every lab briefly here; print one PASS/FAIL line per lab; return 0 if all passed."""
    from .commands import lab
    from .dist import RankError, Terminated, choose_backend, in_torchrun
    from .labs import is_main_rank
    from .labs.harness import run

    world = int(os.environ["WORLD_SIZE"]) if in_torchrun() else None
    show = is_main_rank()
    if show:
        print(report([world] if world else [2, 8]))
        print()
    ok_all = True
    with tempfile.TemporaryDirectory(prefix="labkit-doctor-") as out:
        for name, ranks, argv in _plans(world, out):
            buf = io.StringIO()
            t0 = time.perf_counter()
            verdicts = {}
            try:
                with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                    res = run(lab(name, argv), argv)
                rc, verdicts = res.rc, res.verdicts
            except (KeyboardInterrupt, Terminated):
                raise                         # the command ends: labs.run_cli prints its one line
            except (Exception, SystemExit) as e:  # a lab that crashes is a FAIL line, not a traceback
                rc = 1
                why = "" if isinstance(e, RankError) else f"{type(e).__name__}: "
                buf.write(f"\n{why}{str(e).splitlines()[0] if str(e) else ''}")
            seconds = time.perf_counter() - t0
            diffs = [max(r.grad_diff, abs(r.loss - r.ref_loss) if r.loss is not None else 0.0)
                     for res in verdicts.values() if res is not None for r in res.records]
            largest = f"{max(diffs):.1e}" if diffs else "n/a"
            ok = rc == 0
            ok_all = ok_all and ok
            if verbose and show:
                print(buf.getvalue())
            if show:
                backend = choose_backend(ranks)
                line = (f"{'PASS' if ok else 'FAIL'}  {name:<9} {backend:<5} {ranks} ranks   "
                        f"largest difference from one device {largest:<8} {seconds:5.1f} s")
                if not ok:
                    last = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
                    line += f"\n      {last[-1] if last else f'exit status {rc}'}"
                print(line, flush=True)
    if show:
        print("\nall labs passed" if ok_all else "\nsome labs FAILED (run the lab itself to see its output)")
    return 0 if ok_all else 1
