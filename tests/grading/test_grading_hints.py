"""Hints lead, they do not answer: no hint of any exercise (the exercise's first and second hint,
every case's hint) contains the solution's code or formula, or says the solution in words.

The solution of exercise N.k is the region between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` of
the cell ``# Exercise N.k: ...`` in ``solutions/NN_*.ipynb``. Rules 1 and 2 read normalized text
(whitespace, ``*`` and backticks removed, so ``P / (t * p)`` and ``P/(t p)`` read the same):

1. no sub-expression of the solution (an operation, call, comparison, subscript... of at least
   ``MIN_EXPR`` characters) appears in a hint;
2. no hint writes an arithmetic expression with two or more operators between short symbols or
   numbers (``(K-1)/(M+K-1)``, ``T_F + T_I - T_W``, ``E/(k T)``): a hint names the concept, the
   section or the invariant, or asks a question; the formula is the learner's to find;
3. no hint writes code: a call with its arguments (``min(p, M)``, ``probs.topk(k)``), an
   assignment, ``//``, ``%`` or ``**``;
4. no hint is the solution in words: compared with the solution in tokens (the APIs it calls, its
   operators, constants, strings and the names it binds, each as written or in words: "k largest" is
   ``topk``), a hint names no API of the solution nor points at a library call in words ("torch has
   one call that ..."), and the hint with the second hint shown after it names at most
   ``MAX_TOKENS`` of its steps (see ``solution_tokens``). It covers every registered exercise, and
   it catches the 13 hints of issue 36 that were the answer in words (``OLD_ANSWER_HINTS``).

Every exercise module also records, per exercise, the verdict of a person-like review of its hints
against its solution (``Exercise.hint_review``), checked here to exist and to say "leads".
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
# the course's notebooks, named by the exercise modules the kit ships (nb01_pipeline_bubble.py ->
# 01_pipeline_bubble): other tests in the same worker register synthetic exercises (97_*, 98_*, 99_*, zz_*)
COURSE = {p.stem[2:] for p in (ROOT / "labkit" / "grading" / "exercises").glob("nb[0-9][0-9]_*.py")}
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
    ids = {ex.id for ex in all_exercises() if ex.notebook in COURSE}
    assert len(COURSE) >= 18 and len(ids) >= 60, (sorted(COURSE), len(ids))
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


# a hint that is an order ("Do not zero .grad inside the loop.") states the step to take; a hint asks about the
# invariant instead ("what does .grad hold after two backward calls?")
ORDER = re.compile(r"(?:^|[.?!:;]\s+)(?:do not|don't|never|always|you must|make sure)\b", re.I)


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda ex: ex.id)
def test_no_hint_is_an_order(ex):
    bad = {where: text for where, text in hints_of(ex) if ORDER.search(text)}
    assert not bad, f"exercise {ex.id}: hints that give an order, not a question: {bad}"


@pytest.mark.parametrize("hint, order", [
    ("... give the full batch's gradient? Do not zero .grad inside the loop.", True),  # 2.3's old hint
    ("Never call backward twice.", True),
    ("Which side of it is safe? Experts 7 and 15 must not be chosen.", False),
    ("what must the microbatch loop have left there when it ends?", False)])
def test_the_order_rule_can_fail(hint, order):
    assert bool(ORDER.search(hint)) is order


# ----------------------------------------------------------------------------- rule 4: tokens
# The rules above see code and formulas, not prose: "torch has one call that returns the k largest
# values ... apply it to the probabilities ... divide by the sum over the k" passes them and is the
# answer. Rule 4 compares each hint with its solution in tokens: the names the solution calls (its API),
# its operators and constants, and the names it introduces, each found in the hint either as written
# or in words (``WORDS``: "k largest" is topk, "round up" is ceil, "minus infinity" is -inf). What the
# learner already has is free: the names of the stub cell (parameters, given variables) and the
# exercise's title. A hint that names an API of the solution (``masked_fill``, ``torch.sign``,
# ``math``'s ``comb``) or points at a library call in words (``LIBRARY_CALL``) gives it away alone;
# otherwise it gives the answer when, together with the hint2 shown after it, it names
# ``MAX_TOKENS`` + 1 or more of the solution's steps.
MAX_TOKENS = 1

WORDS = {  # a solution's call/operator/constant -> how a hint says it in words (lower-cased text)
    "topk": r"\btop-?k\b|\b(?:k|two|2) (?:largest|best|highest|biggest)\b"
            r"|\b(?:largest|best|highest) (?:k|two)\b",
    "softmax": r"\bsoft-?max",
    "sum": r"\bsum(?:s|med|ming)?\b|\badd(?:s|ed|ing)?\b[^.;:?]{0,30}\bup\b",
    "mean": r"\bmean\b|\baverag",
    "max": r"\bmax(?:imum)?\b|\blargest\b|\bhighest\b|\bheaviest\b|\bbusiest\b",
    "min": r"\bmin(?:imum)?\b|\bsmallest\b|\bleast\b|\blowest\b|\bfewest\b|\bclamp",
    "chunk": r"\bchunks?\b|\bequal pieces\b|\bcut into\b",
    "stack": r"\bstack",
    "cat": r"\bconcatenat|\bend to end\b",
    "ceil": r"\bceil|\bround(?:s|ed|ing)? (?:it )?up\b",
    "FloorDiv": r"\bfloor\b|\binteger division\b|\bround(?:s|ed|ing)? (?:it )?down\b"
                r"|\bequal (?:stages|blocks|pieces|shares)\b",
    "Mod": r"\bmod(?:ulo)?\b|\bremainder\b",
    "NotEq": r"\bnot on\b|\bother than\b",
    "2": r"\btwo\b|\btwice\b|\bdouble|\bonce\b[^.;?]{0,40}\band once\b|\bforward and backward\b"
         r"|\bboth directions\b",
    "Mult": r"\btimes\b|\bmultipl(?:y|ies|ied|ying)\b|\bproduct of\b",
    "range": r"\bcounting (?:\w+ )?from\b|\bone at a time\b|\btoken by token\b",
    "masked_fill": r"\bmask",
    "-inf": r"\binf(?:inity)?\b",
    "isinf": r"\binf(?:inite|inity)?\b",
    "comb": r"\bbinomial\b|\bsubsets?\b|\bcombinations?\b|\bchoose\b",
    "bincount": r"\bcount(?:s|ed|ing)? (?:the )?(?:slots|tokens|choices)\b|\bhistogram",
    "sign": r"\bsign\b|\bdirection\b",
    "fork_rng": r"\bcontext manager\b|\bfork",
    "set_rng_state": r"\b(?:rng|random) state\b|\bset the saved state\b",
    "get_rng_state": r"\b(?:rng|random) state\b",
    "enable_grad": r"\bgradients? enabled\b|\benabl(?:e|ing) grad",
    "detach": r"\bdetach",
    "requires_grad_": r"\brequires? grad",
    "backward": r"\bbackpropagat",
    "all_reduce": r"\ball-?reduce",
    "reduce_from_tensor_model_parallel_region": r"\ball-?reduce|\bthe operator g\b|\bg sums\b",
    "logaddexp": r"\blog-?add-?exp",
    "exp": r"\bexponentiat",
    "view": r"\bview (?:the|it|them)\b|\breshape",
    "reshape": r"\bview (?:the|it|them)\b|\breshape|\bflatten",
    "scatter": r"\bscatter\b",
    "set": r"\bdistinct\b|\bunique\b",
    "sorted": r"\bsort|\bheaviest first\b|\bin order of\b",
    "retain_graph": r"\bretain|\bkeep the graph\b",
    "new_zeros": r"\bzeros? (?:at|after)\b",
}
# a library call pointed at in words ("torch has one call that ...", "Python's math module", "a context
# manager"): it gives an API away whatever the solution's names
LIBRARY_CALL = re.compile(r"\b(?:torch|pytorch|python|numpy|labkit)(?:'s)?(?:\.\w+)* (?:has|offers|provides|gives you) "
                          r"(?:one|a|an)\b|\bone (?:call|function|method) (?:of|in|from|that)\b|\bbuilt-?in (?:call|"
                          r"function)\b|\b(?:python|torch)'s \w+ module\b|\bcontext manager\b", re.I)
# called names that are plain words: named as written they count as one step, not as an API
PLAIN = {"sum", "max", "min", "mean", "sign", "view", "set", "list", "range", "len", "int", "float", "exp",
         "log", "chunk", "stack", "gather", "scatter", "where", "clone", "detach", "backward", "append",
         "pop", "sorted", "reshape", "zip", "run", "wait", "recv", "send", "isend", "values", "indices",
         "tolist", "to", "apply", "contiguous", "unsqueeze", "squeeze", "t", "cat", "grad", "ones",
         "zeros", "enumerate", "tuple", "dict", "abs", "round", "any", "all", "item", "expand", "sort",
         "Action", "shape"}
_FREE = {"torch", "F", "comm", "dist", "ctx", "self", "np", "nn", "True", "False", "None"}


def _literal(name: str) -> str:
    """A regex for ``name`` as written in prose: ``masked_fill``, ``masked fill``, ``masked-fill``, plurals."""
    parts = [re.escape(p) for p in name.lower().split("_") if p]
    return r"(?<!\w)" + r"[-_ ]?".join(parts) + r"(?:s|es|d|ed)?(?!\w)"


def stub_names() -> dict[str, set[str]]:
    """Exercise id -> the names its learner cell already holds (parameters, given variables, defs)."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            src = "".join(cell["source"])
            m = re.match(r"\s*#\s*Exercise\s+(\d+\.\d+)\s*:", src)
            if cell["cell_type"] != "code" or not m:
                continue
            names = out.setdefault(m.group(1), set())
            names |= set(re.findall(r"[\"'](\w[\w-]*)[\"']", src))  # strings it shows: "tp", "bf16"
            try:
                tree = ast.parse(src)
            except SyntaxError:
                continue
            names |= set(re.findall(r"`(\w+)`|\b([A-Za-z]\w*_\w+|[A-Z][a-z]+[A-Z]\w*)\b", src) and
                         [w for pair in re.findall(r"`(\w+)`|\b([A-Za-z]\w*_\w+|[A-Z][a-z]+[A-Z]\w*)\b", src)
                          for w in pair if w])
            for node in ast.walk(tree):
                if isinstance(node, ast.Name):
                    names.add(node.id)
                if isinstance(node, ast.arg):
                    names |= {node.arg, "@" + node.arg}  # "@": a parameter
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
                elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.alias):
                    names.add((node.asname or node.name).split(".")[0])
    return out


def solution_tokens(code: str, given: set[str] = frozenset()) -> dict[str, tuple[str, bool]]:
    """The steps of a solution: token -> (regex over a hint's lower-cased text, names an API).

    Tokens are the names the solution calls (as written, and in words from ``WORDS``; an API unless
    the name is a plain word of ``PLAIN``, which counts in words only), a module it calls into
    (``math``), the keywords it passes, its ``//``, ``%``, ``*`` and ``!=``, a comparison with a
    constant (``K == 1`` read as "K = 1"), its ``-inf``, its integer constants of 2 and more, its
    strings (a dict's keys), the names it binds (4 characters or more) and the parameters of several
    words it uses (``input_split_sizes``, also as "input split"). Left out: the other names and the
    strings of ``given`` (the learner's stub; "@name" marks a parameter) and exception classes (the
    docstring names them)."""
    tree = ast.parse(code)
    bound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    bound |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.Lambda) for a in n.args.args}
    tokens: dict[str, tuple[str, bool]] = {}

    def add(key: str, regex: str, api: bool = False) -> None:
        old = tokens.get(key)
        tokens[key] = (f"{old[0]}|{regex}" if old else regex, api or bool(old and old[1]))

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name and name not in _FREE and name not in given and not name.endswith("Error"):
                if name in WORDS:
                    add(name, WORDS[name])
                if name not in PLAIN:
                    add(name, _literal(name), api=True)
            while isinstance(f, ast.Attribute):
                f = f.value
            if isinstance(f, ast.Name) and f is not node.func and f.id not in _FREE | bound | set(given):
                add(f.id, _literal(f.id), api=True)  # the module: "math"
            for kw in node.keywords:
                if kw.arg and kw.arg in WORDS:
                    add(kw.arg, WORDS[kw.arg] + "|" + _literal(kw.arg), api=True)
            if name == "float" and node.args and isinstance(node.args[0], ast.Constant) \
                    and str(node.args[0].value).lstrip("-") == "inf":
                add("-inf", WORDS["-inf"])
        elif isinstance(node, ast.BinOp) and type(node.op).__name__ in WORDS:
            add(type(node.op).__name__, WORDS[type(node.op).__name__])
        elif isinstance(node, ast.Compare):
            if any(isinstance(o, ast.NotEq) for o in node.ops):
                add("NotEq", WORDS["NotEq"])
            if len(node.ops) == 1 and isinstance(node.left, ast.Name) \
                    and isinstance(node.comparators[0], ast.Constant) \
                    and isinstance(node.ops[0], (ast.Eq, ast.GtE, ast.Gt, ast.LtE, ast.Lt)):
                sym = {ast.Eq: "=", ast.GtE: ">=", ast.Gt: ">", ast.LtE: "<=", ast.Lt: "<"}[type(node.ops[0])]
                left, right = re.escape(node.left.id.lower()), re.escape(str(node.comparators[0].value).lower())
                add(ast.unparse(node), rf"(?<![\w.]){left} ?(?:{re.escape(sym)}|==|is) ?{right}(?![\w.])")
        elif isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 2:
            add(str(node.value), rf"(?<![\w.])(?<!section )(?<!sec\. )(?<!eq\. )(?<!notebook ){node.value}(?![\w.])")
            if str(node.value) in WORDS:
                add(str(node.value), WORDS[str(node.value)])
        elif isinstance(node, ast.Constant) and type(node.value) is str and 2 <= len(node.value) <= 12 \
                and re.fullmatch(r"[\w-]+", node.value) and node.value not in given:
            add(repr(node.value), _literal(node.value))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id not in given \
                and len(node.id) >= 4:
            add(node.id, _literal(node.id))
        elif isinstance(node, ast.Name) and "@" + node.id in given and "_" in node.id.strip("_"):
            parts = node.id.split("_")  # a parameter the solution uses: "input split" for input_split_sizes
            short = len(parts) >= 3 and parts[1] not in ("per", "of", "to", "after", "for")
            add(node.id, _literal(node.id) + ("|" + _literal("_".join(parts[:2])) if short else ""))
    return tokens


def named_tokens(text: str, tokens: dict[str, tuple[str, bool]], title: str = "") -> tuple[set[str], set[str]]:
    """(steps, APIs) of ``tokens`` that ``text`` names; a token the title names too is free."""
    low, title = text.lower(), title.lower()
    steps, apis = set(), set()
    for key, (regex, api) in tokens.items():
        if re.search(regex, low) and not re.search(regex, title):
            steps.add(key)
            if api and re.search(_literal(key), low):
                apis.add(key)
    return steps, apis


def exposures(ex) -> list[tuple[str, str]]:
    """What a learner reads at once after repeated failures: the hint (or a failed case's own hint)
    followed by the second hint."""
    second = getattr(ex, "hint2", "")
    out = [("hint + hint2", f"{ex.hint} {second}")]
    out += [(f"case {c.name!r} + hint2", f"{c.hint} {second}") for c in ex.cases if c.hint]
    return out


def token_leaks(ex, code: str, given: set[str]) -> dict[str, str]:
    """Where the hints of ``ex`` name an API or more than ``MAX_TOKENS`` steps of the solution ``code``."""
    tokens = solution_tokens(code, given)
    bad = {}
    for where, text in exposures(ex):
        steps, apis = named_tokens(text, tokens, ex.title)
        apis |= {f"library call: {m.group(0)!r}" for m in LIBRARY_CALL.finditer(text)}
        if apis or len(steps) > MAX_TOKENS:
            bad[where] = f"names the solution's {'APIs ' + str(sorted(apis)) + ', ' if apis else ''}" \
                         f"steps {sorted(steps)}"
    return bad


GIVEN = stub_names()


def test_every_registered_exercise_is_compared_in_tokens():
    """Rule 4 covers whatever is registered (exercises added later too): each one has a solution
    region whose tokens the test can read, and a learner cell that says what is given."""
    for ex in all_exercises():
        if ex.notebook not in COURSE:
            continue
        assert ex.id in REGIONS and ex.id in GIVEN, f"exercise {ex.id}: no solution region or learner cell"
        assert solution_tokens(REGIONS[ex.id], GIVEN[ex.id]), f"exercise {ex.id}: no token in its solution"


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda ex: ex.id)
def test_no_hint_is_the_solution_in_words(ex):
    bad = token_leaks(ex, REGIONS[ex.id], GIVEN.get(ex.id, set()))
    assert not bad, f"exercise {ex.id}: hints that are the answer in words: {bad}"


OLD_ANSWER_HINTS = {  # hint and hint2 of main f822c52 for the 13 exercises issue 36 names: the answer in words
    "0.1": ('Section 4 (Collectives): after a reduce-scatter each rank holds one piece of the result, not all'
            ' of it. Which piece does rank i hold, and over which ranks is it summed?',
            'Picture the N inputs added up into one tensor of the same size, then cut into N equal pieces in '
            'rank order: which piece ends on which rank?'),
    "4.1": ('Section 1 (the looped placement): the model is cut into K v equal stages of consecutive layers, '
            'and stage s goes to rank s mod K. Which stages does rank r get, and which layers does each of '
            'them hold?',
            "Rank r's stages are stage r, the stage one full round of K later, and so on, v of them; list the"
            ' layers of each in order, counting layers from 0.'),
    "4.3": ('Section 3: a microbatch crosses every boundary between two consecutive stages, once forward and '
            'once backward. How many boundaries do K v stages have, and does any of them lie inside one rank?',
            'With K = 1 every stage is on the same rank, so nothing leaves it. With K > 1 consecutive stages '
            'are always on different ranks (looped placement): count the crossings of all M microbatches.'),
    "5.3": ('Section 3 (the dropout pitfall): the recomputation in backward must draw the same dropout masks '
            'as the forward did. What must forward save besides x, and how can backward recompute with it '
            'without disturbing the random numbers the rest of training draws?',
            'torch.random has a context manager that restores the RNG state when it ends: inside it, set the '
            'saved state and recompute, with gradients enabled, from a detached copy of x that requires grad;'
            ' then backpropagate grad_y. backward returns one gradient per input of forward.'),
    "7.2": ('Section 2: this rank holds one block of V/t rows of the table, starting at vocab_start. An id '
            'inside the block is looked up at its row within the block; an id outside must give a zero row, '
            'with no value and no gradient. Which ids are outside, and how do you look them up without an '
            'index error?',
            "Look up with the outside ids replaced by any valid local row, then zero the result's rows for "
            'those ids with an operation that keeps the rest differentiable (masked_fill).'),
    "8.6": ('Section 2: per axis, count the collectives or sends one GPU takes part in per step and the '
            'payload of each; a ring all-reduce sends only a fraction of the payload from each GPU (notebook '
            '00, section 5). Which axis communicates per layer, which per microbatch, which once per step?',
            "TP: the f and g of attention and MLP, forward and backward, in each of this stage's layers, for "
            'each microbatch. PP: one activation forward and one gradient backward per microbatch (a middle '
            "stage). DP: one all-reduce of this GPU's gradients. Bytes are values times e."),
    "9.1": ('Section 2: GShard and Switch take the softmax over ALL experts, then keep the k largest '
            "probabilities; renormalising is an option, not the default. Are your weights the full softmax's "
            'probabilities, and do they keep their gradient?',
            'torch has one call that returns the k largest values and their indices along a dimension: apply '
            'it to the probabilities, not the logits, and divide by the sum over the k only when renormalize '
            'is true.'),
    "9.2": ('Section 3: capacity is counted in slots (a token routed to k experts fills k slots). How many '
            'slots would each expert get if the routing were perfectly even, and what does the capacity '
            'factor do to that? Then the slots are kept first come, first served.',
            'Slots come token by token, and within a token in the order of its k choices; count per expert '
            'and keep a slot while its expert is below capacity. C is an int: round up, never down.'),
    "10.1": ('Section 2 (Switch, eq. 4-6): per expert, the loss multiplies the fraction of slots routed to it '
            '(counted, no gradient) by its mean router probability (differentiable), sums over the experts '
            'and scales. Which of the two carries the gradient, and what scale makes a uniform routing give '
            'alpha?',
            'Count the slots per expert from indices, as a fraction of all slots; average the softmax of the '
            'logits over the tokens; the scale is alpha times the number of experts.'),
    "11.2": ('Section 3: three all-to-alls leave this rank in forward: the per-expert counts, the dispatched '
            'rows and the combined rows going back. How many values does each send, and how many bytes per '
            'value (the counts are int64)?',
            "The dispatch sends the rows given by this rank's input splits; the combine sends back the rows "
            'it received, given by its output splits; a row is hidden values. Rows a rank sends to itself '
            'count too.'),
    "12.1": ('Section 1: fine-grained segmentation cuts each expert into m smaller ones and activates m times '
            'as many, so the compute stays the same. How many experts are there then, how many are chosen, '
            'and how many different sets of that size exist?',
            "It is a count of subsets (order does not matter); Python's math module counts them exactly, as "
            'an int.'),
    "12.2": ("Section 3 (the DeepSeek-V3 gate): first score the groups (a group's score is the sum of its two "
            'best expert scores), keep the topk_groups best groups, then choose the k best experts among the '
            "kept groups only. How do you stop the other groups' experts from being chosen?",
            'View the scores as [T, groups, experts per group]; give the experts of the groups not kept a '
            'score that can never win (minus infinity), then choose k over all E.'),
    "14.3": ('Section 3: flat, every slot whose expert is on another node sends one row across; hierarchical, '
            'a token sends one row to each other node it needs, however many of its experts live there. Which'
            ' node holds expert e, and how many bytes is one row?',
            'Per token, turn its k experts into their nodes; the flat count takes every slot that is not on '
            'my node, the hierarchical count the distinct nodes other than mine.'),
}


@pytest.mark.parametrize("ex_id", sorted(OLD_ANSWER_HINTS, key=lambda i: tuple(map(int, i.split(".")))))
def test_rule_4_catches_the_old_hints_that_were_the_answer_in_words(ex_id):
    """The check can fail: each of the 13 old hints that gave the answer in words is caught."""
    from types import SimpleNamespace

    hint, hint2 = OLD_ANSWER_HINTS[ex_id]
    ex = next(e for e in EXERCISES if e.id == ex_id)
    old = SimpleNamespace(id=ex.id, title=ex.title, hint=hint, hint2=hint2, cases=[])
    assert token_leaks(old, REGIONS[ex_id], GIVEN[ex_id]), f"the old hints of {ex_id} pass rule 4"


@pytest.mark.parametrize("code, hint, leaked", [
    ("weights, indices = logits.softmax(-1).topk(k)", "Use torch.topk on the probabilities.", "topk"),
    ("return math.comb(m * E, m * k)", "Python's math module counts subsets.", "math"),
    ("w = x.masked_fill(out, 0.0)", "Zero them with masked_fill.", "masked_fill"),
    ("n = len(xs)\ntotal = torch.stack(xs).sum(0)\nreturn list(total.chunk(n))",
     "The inputs added up, then cut into N equal pieces.", None),
    ("return 0 if K == 1 else 2 * M * (K * v - 1)", "With K = 1 nothing leaves; once forward and once back.", None),
    ("C = math.ceil(k * T / E * f)\nkeep = [t for t in range(T)]", "Go token by token; round up C.", None),
    ("weights, indices = logits.softmax(-1).topk(k)", "torch has one call that returns the k largest values.",
     None),
    ("with torch.random.fork_rng():\n    pass", "Recompute inside a context manager.", None),
])
def test_rule_4_catches_an_api_or_two_steps(code, hint, leaked):
    from types import SimpleNamespace

    ex = SimpleNamespace(id="x", title="", hint=hint, hint2="", cases=[])
    steps, apis = named_tokens(hint, solution_tokens(code))
    assert token_leaks(ex, code, set()), (steps, apis)
    assert leaked is None or leaked in apis, apis


@pytest.mark.parametrize("code, hint", [
    ("weights, indices = logits.softmax(-1).topk(k)", "Section 2: which probabilities does the gate mix by?"),
    ("return math.comb(m * E, m * k)", "How many experts are there after the cut, and does order matter?"),
    ("n = len(xs)\ntotal = torch.stack(xs).sum(0)\nreturn list(total.chunk(n))",
     "Which rank holds which part of the result, and over which ranks is it reduced?"),
])
def test_rule_4_lets_a_leading_hint_through(code, hint):
    from types import SimpleNamespace

    ex = SimpleNamespace(id="x", title="", hint=hint, hint2="", cases=[])
    assert token_leaks(ex, code, set()) == {}


REVIEW = re.compile(r"leads: \S.{10,}; reviewed \d{4}-\d{2}-\d{2}$")


@pytest.mark.parametrize("ex", [e for e in all_exercises() if e.notebook in COURSE],
                         ids=lambda ex: ex.id)
def test_every_exercise_records_the_review_of_its_hints(ex):
    """Every registered exercise (those added later too) carries the verdict of a person-like reading
    of its hints against its solution, in its module: ``exNN.hint_review = "leads: ...; reviewed
    YYYY-MM-DD"``. A hint judged to give the answer is rewritten, not recorded as such."""
    assert REVIEW.match(ex.hint_review or ""), (
        f"exercise {ex.id}: hint_review must read 'leads: <what the hints ask or name>; reviewed <date>', "
        f"got {ex.hint_review!r}")


def test_no_stored_notebook_output_shows_a_hint():
    """nbval compares stored outputs as text: a hint printed by a failing check in a stored output would
    tie the notebooks to the hint's wording (and show it before the exercise is tried). The solution and
    learner notebooks store only passing checks, so rewording a hint never changes an output."""
    texts = [t for ex in all_exercises() for _, t in hints_of(ex)]
    for path in sorted((ROOT / "solutions").glob("*.ipynb")) + sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            out = json.dumps(cell.get("outputs", []))
            assert "Hint:" not in out and "Second hint:" not in out, f"{path.name} cell {cell.get('id')}"
            assert not any(json.dumps(t)[1:60] in out for t in texts), f"{path.name} cell {cell.get('id')}"


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
