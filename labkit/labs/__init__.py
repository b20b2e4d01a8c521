"""The labs: ``python -m labkit lab NAME`` (or ``torchrun ... -m labkit.labs.NAME``).

What every lab shares: ``--help`` that shows defaults, one ``error:`` line for bad input,
and the rule that under torchrun only rank 0 prints.
"""
from __future__ import annotations

import argparse
import os
import sys

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
