"""Command line: python -m labkit COMMAND [options]

Commands:
  doctor [--run]         torch/CUDA/NCCL/gloo report and the backend "auto" picks;
                         --run: every lab briefly here, one PASS/FAIL line each
  lab NAME [options]     train the GPT with one strategy (pipeline | tensor | moe | 3d)
  bench NAME [options]   side-by-side speed comparison (pipeline | tensor | moe | dp)
  build [--check]        write notebooks/ (learner versions) from solutions/
  grade PATH... [--results FILE]   run notebooks and grade their exercises
                         (--assignment NN_name; batch: --results-dir DIR --gradebook CSV -j N)
  autograder NN_name --out autograder.zip   a Gradescope autograder bundle for one notebook
  notebooks [DEST] [--solutions]   copy the learner notebooks (Colab, JupyterHub, a laptop)
  plan --model NAME --gpus N [options]   memory, communication and step time per GPU; best layouts

python -m labkit COMMAND --help (or lab NAME --help, bench NAME --help) lists its options.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from .cliparse import Parser
from .commands import BENCHES, LABS, run_module


def main(argv: list[str] | None = None) -> int:
    """The command line; Ctrl-C, SIGTERM and a failed rank end with one line (labs.run_cli)."""
    from .labs import run_cli
    args = sys.argv[1:] if argv is None else argv
    cmd = args[0] if args else None
    return run_cli(_main, args, check_env=cmd in ("lab", "bench", "doctor"),
                   stopped=STOPPED.get(cmd, "stopped"))


# what each command says it stopped when Ctrl-C, SIGTERM or SIGHUP ends it (labs.run_cli), in its own terms
STOPPED = {
    "lab": "stopped; no rank is left running",
    "bench": "stopped; no rank is left running",
    "doctor": "stopped; no rank is left running",
    "grade": "grading stopped; no kernel is left running and no results file is half-written",
    "autograder": "stopped; no half-written bundle is left",
    "build": "build stopped; each notebook is either written whole or untouched",
    "notebooks": "copy stopped; the notebooks copied so far are whole, the others not copied",
    "plan": "stopped (plan writes no file)",
}


def _doctor(rest: list[str]) -> int:
    p = Parser(prog="python -m labkit doctor", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world-size", type=int, nargs="*", default=[1, 2, 4, 8], help="world sizes to try")
    p.add_argument("--run", action="store_true",
                   help="also run every lab briefly on the backend auto picks: one PASS/FAIL line per lab")
    p.add_argument("--verbose", action="store_true", help="with --run: show the labs' own output")
    a = p.parse_args(rest)
    bad = [w for w in a.world_size if w < 1]
    if bad:
        print(f"error: --world-size must be >= 1, got {bad[0]}", file=sys.stderr)
        return 2
    from .doctor import report, run_all
    if not a.run:
        print(report(a.world_size))
        return 0
    return run_all(a.verbose)


def _named(cmd: str, names) -> "callable":
    def run(rest: list[str]) -> int:
        if rest and rest[0] in ("-h", "--help"):
            what = "train the GPT with one strategy" if cmd == "lab" else "a side-by-side speed comparison"
            print(f"usage: python -m labkit {cmd} NAME [options]: {what}; NAME is one of {', '.join(names)}\n"
                  f"python -m labkit {cmd} NAME --help lists the options of one")
            return 0
        if not rest:
            print(f"error: {cmd} needs a NAME, one of {', '.join(names)} "
                  f"(python -m labkit {cmd} NAME --help)", file=sys.stderr)
            return 2
        return run_module(cmd, rest[0], rest[1:])
    return run


# command -> a function of the remaining arguments, or "module:function" imported when it runs
COMMANDS = {
    "doctor": _doctor,
    "lab": _named("lab", LABS),
    "bench": _named("bench", BENCHES),
    "build": "labkit.grading.build:main",
    "grade": "labkit.grading.grader:main",
    "autograder": "labkit.grading.autograder:main",
    "notebooks": "labkit.grading.build:notebooks_main",
    "plan": "labkit.plan.cli:main",
}


def _main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    target = COMMANDS.get(cmd)
    if target is None:
        print(f"error: unknown command {cmd!r}; choose one of {', '.join(COMMANDS)} "
              f"(python -m labkit --help)", file=sys.stderr)
        return 2
    if isinstance(target, str):
        module, name = target.split(":")
        target = getattr(importlib.import_module(module), name)
    return target(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
