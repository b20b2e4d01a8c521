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
    the rule (argparse's own message), then exit code 2; ``--help`` is unchanged.

    It also holds the kit's one rule for options that do nothing in the layout given: an option
    declared with :meth:`needs` and written on the command line (whatever its value, the default
    included) while its condition is false is refused, naming the option it needs
    (``--cp-attention ulysses has no effect without --cp > 1 (got --cp 1): set --cp, or leave
    --cp-attention out``). The rule is checked at the end of parsing, or, with ``defer_needs``,
    when the caller calls :meth:`unneeded` after setting the sizes the options leave open (the
    labs' harness, after ``resolve``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._needs: list[tuple[str, object, str, str]] = []
        self.given: set[str] = set()
        self.defer_needs = False

    def needs(self, option: str, when, what: str, needed: str) -> None:
        """Declare that ``option`` has an effect only when ``when(namespace)`` is true; ``what`` says
        the condition for the message, formatted with the namespace (``"--cp > 1 (got --cp {cp})"``);
        ``needed``: the option to set (``"--cp"``), or ``"no --opt"`` when it is ``--opt`` that must go."""
        self._needs.append((option, when, what, needed))

    def _get_values(self, action, arg_strings):  # argparse calls it for each option written, only
        if action.option_strings:
            self.given.add(action.dest)
        return super()._get_values(action, arg_strings)

    def unneeded(self, a) -> str | None:
        """The message for the first option written that has no effect with the values of ``a``
        (see :meth:`needs`), or None."""
        for option, when, what, needed in self._needs:
            action = next(x for x in self._actions if option in x.option_strings)
            if action.dest in self.given and not when(a):
                def text(value):
                    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else value
                value = getattr(a, action.dest)
                shown = option if isinstance(value, bool) or value is None else f"{option} {text(value)}"
                values = {k: text(v) for k, v in vars(a).items()}
                fix = f"leave {needed[3:]} out" if needed.startswith("no ") else f"set {needed}"
                return f"{shown} has no effect without {what.format(**values)}: {fix}, or leave {option} out"
        return None

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
        self.given = set()
        a, extras = super().parse_known_args(out, namespace)
        if not self.defer_needs:
            bad = self.unneeded(a)
            if bad:
                self.error(bad)
        return a, extras

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
