"""The argument parser every ``python -m labkit ...`` command uses.

``argparse`` prints the whole usage block before an error; a labkit command prints one line,
``error: MESSAGE (see PROG --help)``, on stderr (rank 0 only under torchrun) and exits with 2,
like every other bad-input error of the kit. No heavy import here: ``plan`` stays fast.
"""
from __future__ import annotations

import argparse
import os
import sys


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one ``error:`` line naming the option and
    the rule (argparse's own message), then exit code 2; ``--help`` is unchanged."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        under_torchrun = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        if not under_torchrun or os.environ.get("RANK") == "0":
            print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        self.exit(2)
