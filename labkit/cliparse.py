"""The argument parser every ``python -m labkit ...`` command uses.

``argparse`` prints the whole usage block before an error; a labkit command prints one line,
``error: MESSAGE (see PROG --help)``, on stderr (rank 0 only under torchrun) and exits with 2,
like every other bad-input error of the kit. No heavy import here: ``plan`` stays fast.
"""
from __future__ import annotations

import argparse
import os
import re
import sys


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one ``error:`` line naming the option and
    the rule (argparse's own message), then exit code 2; ``--help`` is unchanged."""

    def parse_known_args(self, args=None, namespace=None):
        """argparse's, except that a value starting with a minus and a digit (``--cost-model -1,0,0``,
        ``--warmup -1``) is the option's value, not taken for an unknown option: the rule it breaks
        is then named by the command's own check."""
        args = list(sys.argv[1:] if args is None else args)
        one = {s for a in self._actions if a.option_strings and a.nargs is None for s in a.option_strings}
        out, i = [], 0
        while i < len(args):
            if args[i] in one and i + 1 < len(args) and re.match(r"-\.?\d", args[i + 1]):
                out.append(f"{args[i]}={args[i + 1]}")
                i += 2
            else:
                out.append(args[i])
                i += 1
        return super().parse_known_args(out, namespace)

    def error(self, message: str):  # noqa: D401 - argparse's hook
        under_torchrun = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        if not under_torchrun or os.environ.get("RANK") == "0":
            print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        self.exit(2)


def too_small(*checks: tuple[str, int, int]) -> str | None:
    """The first ``(flag, value, low)`` with ``value < low``, as ``'FLAG must be >= LOW, got VALUE'``
    (a message for :func:`labkit.labs.error`); None when every value is large enough."""
    for flag, value, low in checks:
        if value < low:
            return f"{flag} must be >= {low}, got {value}"
    return None
