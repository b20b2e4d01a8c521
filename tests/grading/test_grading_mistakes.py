"""Every named mistake of an exercise has a wrong answer in its tests (issue 36).

An exercise module names a learner's mistake in its failure lines: ``(value, "what this mistake did")``
pairs for :func:`labkit.grading.registry.expect_named`, ``(order, rule, "text")`` tables, and
``why = "..."`` branches. This test reads each ``labkit/grading/exercises/nbNN_*.py`` (no import, no
case run: it is static and takes well under a second) and asks that each such text is quoted by
``tests/exercises/test_exercises_nbNN.py``, i.e. that some test asserts the line a wrong answer gets
contains it (``assert_check_fails(..., contains=...)`` or ``assert_public_case_fails``). A new
mistake-named branch with no wrong answer that triggers it fails here, naming the file and line.

The match is on words: a text is covered when four of its consecutive words appear in a test, a
test's quoted fragment of at least 10 characters appears in it, or three of its consecutive words (14
characters or more) appear in one quote; an f-string is cut at its placeholders. The few that only a
person can match are listed in QUOTED_BY_HAND with the test that quotes them.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# (notebook, start of the text): covered by a test whose quote the word match cannot see
# (a fragment of punctuation and one-letter symbols); each checked by hand.
QUOTED_BY_HAND = {
    ("15", "each rank sends (d-1)/d"): "test_volume_mistakes_are_named quotes '(d-1)/d' (comm_volume_no_ring)",
    ("15", "that is stage"): "test_memory_mistakes_are_named quotes \"that is stage 2's memory\" (a placeholder "
                             "splits it)",
}


def _norm(text: str) -> str:
    return " ".join(re.sub(r"[^\w=+*/-]+", " ", text).split())


def _segments(node) -> list[str] | None:
    """The constant pieces of a str or f-string node (an f-string is cut at each placeholder)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant)]
    return None


def named_mistakes(module: Path) -> list[tuple[int, list[str]]]:
    """(line, constant pieces) of each mistake text in an exercise module."""
    found = []
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.List):
            for el in node.elts:
                if isinstance(el, ast.Tuple) and len(el.elts) in (2, 3):
                    seg = _segments(el.elts[-1])
                    if seg is not None:
                        found.append((el.lineno, seg))
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "why" for t in node.targets):
            seg = _segments(node.value)
            if seg:
                found.append((node.lineno, seg))
    return [(line, seg) for line, seg in found if len(_norm("".join(seg))) >= 12]


def quoted(test_file: Path) -> list[str]:
    """Every string (and f-string piece) in a test file, normalised; docstrings left out (a wrong answer's
    docstring that names its mistake asserts nothing)."""
    tree = ast.parse(test_file.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(n) is not None}
    out = []
    for node in ast.walk(tree):
        if id(node) in docstrings:
            continue
        for s in _segments(node) or []:
            if _norm(s):
                out.append(_norm(s))
    return out


def _covered(pieces: list[str], quotes: list[str]) -> bool:
    everything = "\n".join(quotes)
    for piece in map(_norm, pieces):
        words = piece.split(" ")
        for i in range(max(1, len(words) - 3)):
            window = " ".join(words[i:i + 4])
            if len(window) >= 16 and window in everything:
                return True
        if any(len(q) >= 10 and re.search("[a-z]{3}", q) and q in piece for q in quotes):
            return True
    # a quote with a value in it ("t*p=8 does not divide 12 GPUs"): three words of one piece in a quote
    for piece in map(_norm, pieces):
        words = piece.split(" ")
        for i in range(max(0, len(words) - 2)):
            window = " ".join(words[i:i + 3])
            if len(window) >= 14 and any(window in q for q in quotes):
                return True
    return False


def audit() -> list[str]:
    missing = []
    modules = sorted((ROOT / "labkit/grading/exercises").glob("nb[0-9][0-9]_*.py"))
    assert len(modules) >= 18, modules
    for module in modules:
        nn = module.name[2:4]
        quotes = quoted(ROOT / f"tests/exercises/test_exercises_nb{nn}.py")
        for line, pieces in named_mistakes(module):
            text = " ".join("".join(pieces).split()).lstrip(" (;:,")
            if _covered(pieces, quotes) or any(n == nn and text.startswith(s) for n, s in QUOTED_BY_HAND):
                continue
            missing.append(f"{module.name}:{line}: {text[:70]!r}")
    return missing


def test_every_named_mistake_has_a_wrong_answer_that_triggers_it():
    missing = audit()
    assert not missing, ("named mistakes that no test's wrong answer triggers (add one to "
                         "tests/exercises/test_exercises_nbNN.py asserting its line contains the text):\n  "
                         + "\n  ".join(missing))


def test_the_audit_sees_a_mistake_without_a_test(tmp_path):
    """The audit is not vacuous: it finds the mistake texts (over 90 of them), and a text no test quotes fails."""
    modules = sorted((ROOT / "labkit/grading/exercises").glob("nb[0-9][0-9]_*.py"))
    assert sum(len(named_mistakes(m)) for m in modules) > 90
    fake = tmp_path / "nb99_fake.py"
    fake.write_text('def case(x):\n    expect_named(x, 1, "x", [(2, "a brand new mistake nobody tests for yet")])\n')
    (line, pieces), = named_mistakes(fake)
    assert not _covered(pieces, ["a different line entirely about something else"])
    assert _covered(pieces, ["brand new mistake nobody tests"])
