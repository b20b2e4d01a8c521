"""A text cell no spreadsheet evaluates (the gradebook and the integrity report's CSV files)."""
from __future__ import annotations

__all__ = ["FORMULA_START", "inert"]

# a text cell a spreadsheet would read as a formula (OWASP, CSV injection): it starts with one of these
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def inert(text: str) -> str:
    """``text`` as a gradebook cell no spreadsheet evaluates: a leading ``=``, ``+``, ``-``, ``@``,
    tab or carriage return (OWASP's CSV-injection guidance) gets a ``'`` in front, which the
    spreadsheet shows as text; line breaks become spaces. Numbers are written by the gradebook
    itself and never pass through here."""
    text = str(text).replace("\r\n", " ").replace("\n", " ")
    return "'" + text if text.startswith(FORMULA_START) else text
