"""Hints lead, they do not answer: no hint of any exercise (the exercise's first and second hint,
every case's hint) contains the solution's code or formula.

The solution of exercise N.k is the region between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` of
the cell ``# Exercise N.k: ...`` in ``solutions/NN_*.ipynb``. Two rules, both on normalized text
(whitespace, ``*`` and backticks removed, so ``P / (t * p)`` and ``P/(t p)`` read the same):

1. no sub-expression of the solution (an operation, call, comparison, subscript... of at least
   ``MIN_EXPR`` characters) appears in a hint;
2. no hint writes an arithmetic expression with two or more operators between short symbols or
   numbers (``(K-1)/(M+K-1)``, ``T_F + T_I - T_W``, ``E/(k T)``): a hint names the concept, the
   section or the invariant, or asks a question; the formula is the learner's to find;
3. no hint writes code: a call with its arguments (``min(p, M)``, ``probs.topk(k)``), an
   assignment, ``//``, ``%`` or ``**``. Naming a function (``torch.autograd.grad``) is fine.
"""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from labkit.grading.registry import all_exercises
from labkit.grading.runner import SECOND_HINT_AFTER, check

ROOT = Path(__file__).resolve().parents[2]
MIN_EXPR = 5  # characters of a normalized solution sub-expression that count as "its code"
_EXPR_NODES = (ast.BinOp, ast.BoolOp, ast.Compare, ast.Call, ast.Subscript, ast.IfExp, ast.ListComp,
               ast.GeneratorExp, ast.DictComp, ast.Lambda, ast.UnaryOp)
_SYM = r"(?:\d+(?:\.\d+)?|[A-Za-z][A-Za-z0-9]?(?:_[A-Za-z0-9]+)?|[A-Za-z]\w*\([^()]*\))"
_OPERAND = rf"(?:\(?\s*{_SYM}\s*\)?)"
_FORMULA = re.compile(rf"(?<![\w-]){_OPERAND}\s*[-+*/^]\s*{_OPERAND}\s*[-+*/^]\s*{_OPERAND}(?![\w-])")
_CODE = re.compile(r"[A-Za-z_][\w.]*\([^()]*[\w)]\)|\b\w+(?:\[[^\]]*\])?\s*(?:\+|-|\*)?=(?!=)\s*(?!\d+(?:\.\d+)?(?![\w.(]))\S|//|%|\*\*")  # noqa: E501


def _norm(text: str) -> str:
    return re.sub(r"[\s*`]", "", text)


def solution_regions() -> dict[str, str]:
    """Exercise id -> the code of its solution region(s), from every solution notebook."""
    out: dict[str, str] = {}
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            src = "".join(cell["source"])
            m = re.match(r"\s*#\s*Exercise\s+(\d+\.\d+)\s*:", src)
            if cell["cell_type"] != "code" or not m:
                continue
            parts = re.findall(r"### BEGIN SOLUTION\n(.*?)\n\s*### END SOLUTION", src, re.S)
            out[m.group(1)] = out.get(m.group(1), "") + "\n".join(_dedent(p) for p in parts)
    return out


def _dedent(code: str) -> str:
    lines = code.splitlines()
    pad = min((len(l) - len(l.lstrip()) for l in lines if l.strip()), default=0)
    return "\n".join(l[pad:] for l in lines)


def solution_expressions(code: str) -> set[str]:
    """The normalized text of every sub-expression of ``code`` that is more than a name or a number."""
    exprs = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, _EXPR_NODES):
            text = _norm(ast.unparse(node))
            if len(text) >= MIN_EXPR:
                exprs.add(text)
    return exprs


def hints_of(ex) -> list[tuple[str, str]]:
    """(where, text) of every hint of exercise ``ex``."""
    out = [("hint", ex.hint), ("hint2", getattr(ex, "hint2", ""))]
    out += [(f"case {c.name!r}", c.hint) for c in ex.cases if c.hint]
    return [(w, t) for w, t in out if t]


def leaks(hint: str, exprs: set[str]) -> list[str]:
    """What in ``hint`` is the solution's code (rule 1) or a formula (rule 2)."""
    h = _norm(hint)
    found = sorted(e for e in exprs if e in h)
    found += [m.group(0).strip() for m in _FORMULA.finditer(hint)]
    found += [m.group(0).strip() for m in _CODE.finditer(hint)]
    return found


REGIONS = solution_regions()
EXERCISES = [ex for ex in all_exercises() if ex.id in REGIONS]


def test_every_notebook_exercise_has_a_solution_region_and_hints():
    ids = {ex.id for ex in all_exercises() if not ex.notebook.startswith(("zz_", "99_"))}
    assert ids - set(REGIONS) == set(), "exercises without a solution region"
    for ex in EXERCISES:
        assert ex.hint and getattr(ex, "hint2", ""), f"exercise {ex.id} lacks a first or a second hint"


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda ex: ex.id)
def test_no_hint_contains_the_solutions_code_or_a_formula(ex):
    exprs = solution_expressions(REGIONS[ex.id])
    bad = {where: leaks(text, exprs) for where, text in hints_of(ex)}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"exercise {ex.id}: hints that give the answer: {bad}"


@pytest.mark.parametrize("hint, leak", [
    ("Count time slots: each stage idles K-1 of the M+K-1 slots.", "M+K-1"),
    ("Solve (K-1)/(M+K-1) <= target for M.", "(K-1)/(M+K-1)"),
    ("Use math.comb(m*E, m*k).", "math.comb(mE,mk)"),
    ("Per rank: ZB-H1 (K-1)(T_F + T_I - T_W).", "T_F + T_I - T_W"),
    ("f_j = E/(k T) * count_j", "E/(k T)"),
    ("return (grad, None)", "(grad,None)"),
    ("probs = logits.softmax(-1); take probs.topk(k)", "probs.topk(k)"),
    ("Node of a slot = expert // experts_per_node.", "//"),
    ("Under 1F1B the first stage holds min(p, M) microbatches.", "min(p, M)"),
    ("C = math.ceil(capacity)", "C = m"),
])
def test_the_rules_catch_a_hint_that_gives_the_answer(hint, leak):
    """The check can fail: hints written as the old ones were are caught."""
    exprs = set().union(*(solution_expressions(code) for code in REGIONS.values())) | {"(grad,None)"}
    assert any(leak == x or _norm(leak) == _norm(x) for x in leaks(hint, exprs)), leaks(hint, exprs)


@pytest.mark.parametrize("hint", [
    "Which of a stage's time slots does it spend waiting, and how many slots are there in all?",
    "Think of the n_gpus / (t p) model copies and of the K-1 slots",  # one operator between symbols: allowed
    "Look at the top-k gate of section 2 and the all-reduce in one-forward-one-backward.",
    "How many bytes does the ring send per GPU, as a fraction of the payload?",
])
def test_the_rules_let_a_leading_hint_through(hint):
    exprs = set().union(*(solution_expressions(code) for code in REGIONS.values()))
    assert leaks(hint, exprs) == [], leaks(hint, exprs)


def test_the_second_hint_follows_a_repeated_failure(capsys):
    from labkit.grading import runner

    ex = next(e for e in EXERCISES if e.id == "1.1")
    runner._FAILED_CHECKS.pop("1.1", None)
    wrong = lambda K, M: 0.5  # noqa: E731
    lines = [check("1.1", wrong).message for _ in range(SECOND_HINT_AFTER)]
    capsys.readouterr()
    assert "Second hint" not in lines[0] and f"Hint: {ex.hint}" in lines[0]
    assert lines[-1].endswith(f"Hint: {ex.hint}\n  Second hint: {ex.hint2}"), lines[-1]
    runner._FAILED_CHECKS.pop("1.1", None)
