# ruff: noqa: E501  (the corpus is code written as strings: a line of it is a line of a cell)
"""The honest corpus (issue 40): correct submissions written the way students write them.

Each notebook is a solved notebook (``solutions/``) with a few ordinary habits added, or with an
answer rewritten in another correct style; every one must score full marks. :func:`build` writes
them (``metadata.labkit.notebook`` set, and each habit with its cell in ``metadata.labkit.habits``,
"cell 9: import csv", so that a lost point names its habit). Habits are grouped three per notebook
on the solved 01, the cheapest notebook to grade (:func:`_plan` says how a failing habit is found
among them); the alternative answers, and the habits that belong to a notebook (0.2's ring with
``comm.send``/``comm.recv``, ``%timeit rank_coords(...)`` after 8.1), sit on theirs. Every
notebook holds at least one habit that main f822c52's static source policy refused.
"""
from __future__ import annotations

import random
from pathlib import Path

import nbformat

CHECKOUT = Path(__file__).resolve().parents[2]
BASES = {"01": "01_pipeline_bubble", "16": "16_context_parallel", "08": "08_3d_parallelism",
         "00": "00_distributed_primer"}
CALL = {"01": "bubble_fraction(4, 8)", "16": "causal_chunk_placement(4)", "08": "rank_coords(5, 2, 2, 4)",
        "00": "len(RANK_COLOURS)"}
ANSWER = {"01": "bubble_fraction", "16": "causal_chunk_placement", "08": "rank_coords", "00": "ring_all_reduce"}

# ---------------------------------------------------------------- habits: (label, cell source); {call} and
# {answer} stand for a call of the notebook's first answer and its name
CELLS = {
    "%matplotlib inline": "%matplotlib inline",
    "%timeit": "%timeit -n 3 -r 1 {call}",
    "%config": "%config InlineBackend.figure_format = 'retina'",
    "%env": "%env LABKIT_MY_SETTING=1",
    "%load_ext autoreload": "%load_ext autoreload\n%autoreload 2",
    "%%time": "%%time\nx_time = {call}",
    "%%capture": "%%capture captured\nprint({call})",
    "!pip list": "!pip list 2>/dev/null | head -3\n!echo done",
    "func?": "{answer}?",
    "help()": "help({answer})",
    "dir/vars": "print(len(dir()), len(vars()))\nprint([n for n in dir() if n.startswith('{answer}')])",
    "locals()": "print(sorted(k for k in locals() if not k.startswith('_'))[:5])",
    "getattr": "import math\nsqrt = getattr(math, 'sqrt')\nprint(sqrt(2.0), getattr({answer}, '__name__'))",
    "import csv": "import csv\nimport io\nbuf = io.StringIO()\ncsv.writer(buf).writerow(['K', 'value', {call}])\n"
                  "print(buf.getvalue().strip())",
    "import logging": "import logging\nlogging.basicConfig(level=logging.INFO)\nlog = logging.getLogger('mynb')\n"
                      "log.info('value %s', {call})",
    "import datetime": "import datetime\nprint(datetime.datetime.now().year > 2000)",
    "import pathlib": "import pathlib\nout = pathlib.Path('my_outputs')\nout.mkdir(exist_ok=True)\nprint(out.exists())",
    "import timeit": "import timeit\nprint(timeit.timeit(lambda: {call}, number=10) >= 0)",
    "import traceback": "import traceback\ntry:\n    {answer}(-1, -1) if '{answer}' != 'causal_chunk_placement' "
                        "else 1 / 0\nexcept Exception:\n    print(traceback.format_exc().splitlines()[-1])",
    "import pickle": "import pickle\nmine = {{'value': {call}}}\nwith open('mine.pkl', 'wb') as f:\n"
                     "    pickle.dump(mine, f)\nwith open('mine.pkl', 'rb') as f:\n    print(pickle.load(f) == mine)",
    "tqdm loop": "from tqdm.auto import tqdm\ntotal = 0\nfor i in tqdm(range(5)):\n    total += i\nprint(total)",
    "sympy": "import sympy as sp\nKs, Ms = sp.symbols('K M', positive=True)\nprint(sp.simplify((Ks - 1) / (Ms + Ks - 1)))",
    "from numpy.random import default_rng": "from numpy.random import default_rng\nrng_mine = default_rng(0)\n"
                                            "print(rng_mine.integers(0, 10, 3).shape)",
    "import matplotlib.cm as cm": "import matplotlib.cm as cm\nprint(cm.viridis(0.5)[:2])",
    "cudnn.deterministic seeding helper": "import random\nimport numpy as np\nimport torch\n\n"
                                          "def seed_everything(seed=0):\n    random.seed(seed)\n    np.random.seed(seed)\n"
                                          "    torch.manual_seed(seed)\n    torch.backends.cudnn.deterministic = True\n"
                                          "    torch.backends.cudnn.benchmark = False\n\nseed_everything(0)",
    "torch private attrs": "import torch\nx = torch.ones(3)\nx.add_(1)\nprint(x._version)\nv = x[1:]\n"
                           "print(v._base is x)\nlin = torch.nn.Linear(2, 2)\nprint(sorted(lin._parameters))",
    "own class private names": "class Stopwatch:\n    def __init__(self, key):\n        self._key = key\n"
                               "        self._laps = []\n    def _idle(self):\n        return not self._laps\n"
                               "    def __eq__(self, other):\n        return self._key == other._key\n\n"
                               "w = Stopwatch('a')\nprint(w._idle(), w == Stopwatch('a'), w._key)",
    "saving own figures and CSVs": "import csv\nimport matplotlib.pyplot as plt\nfig, ax = plt.subplots()\n"
                                   "ax.plot([1, 2, 3], [3, 1, 2])\nfig.savefig('my_figure.png')\nplt.close(fig)\n"
                                   "with open('my_table.csv', 'w', newline='') as f:\n"
                                   "    csv.writer(f).writerows([['a', 1], ['b', 2]])\nprint(open('my_table.csv').read()[:3])",
    "a cell that raises (a typo, fixed below)": "print(undefined_name_typo)",
}

# alternative correct answers: (label, base, answer name, new cell source)
ALTERNATIVES = [
    ("1.1 with numpy", "01", "bubble_fraction",
     "import numpy as np\n\ndef bubble_fraction(K, M):\n    if min(K, M) < 1:\n"
     "        raise ValueError(f'K and M must be >= 1, got K={K}, M={M}')\n"
     "    return float(np.float64(K - 1) / np.float64(M + K - 1))"),
    ("1.1 by counting slots in a loop", "01", "bubble_fraction",
     "def bubble_fraction(K, M):\n    if K < 1 or M < 1:\n        raise ValueError(f'bad sizes K={K} M={M}')\n"
     "    idle = 0\n    for t in range(M + K - 1):\n        if not (0 <= t - (K - 1) < M):\n            idle += 1\n"
     "    return idle / (M + K - 1)"),
    ("1.2 closed form", "01", "smallest_microbatches",
     "import math\n\ndef smallest_microbatches(K, target):\n    if K == 1:\n        return 1\n"
     "    M = max(1, math.ceil((K - 1) * (1 - target) / target - 1e-9))\n"
     "    while M > 1 and bubble_fraction(K, M - 1) <= target:\n        M -= 1\n"
     "    while bubble_fraction(K, M) > target:\n        M += 1\n    return M"),
    ("1.2 bisection", "01", "smallest_microbatches",
     "def smallest_microbatches(K, target):\n    lo, hi = 1, 1\n    while bubble_fraction(K, hi) > target:\n"
     "        hi *= 2\n    while lo < hi:\n        mid = (lo + hi) // 2\n"
     "        if bubble_fraction(K, mid) <= target:\n            hi = mid\n        else:\n            lo = mid + 1\n"
     "    return lo"),
    ("16.2 with a loop over both ends", "16", "causal_chunk_placement",
     "def causal_chunk_placement(cp):\n    chunks = list(range(2 * cp))\n    pairs = []\n    while chunks:\n"
     "        pairs.append((chunks.pop(0), chunks.pop()))\n    return pairs"),
    ("16.2 zip of halves", "16", "causal_chunk_placement",
     "def causal_chunk_placement(cp):\n    return list(zip(range(cp), reversed(range(cp, 2 * cp))))"),
    ("16.1 by subtracting the max", "16", "merge_attention_partials",
     "def merge_attention_partials(out_a, lse_a, out_b, lse_b):\n    m = torch.maximum(lse_a, lse_b)\n"
     "    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)\n    ea, eb = torch.exp(lse_a - m), torch.exp(lse_b - m)\n"
     "    total = ea + eb\n    lse = m + torch.log(total)\n    safe = torch.where(total == 0, torch.ones_like(total), total)\n"
     "    out = (ea / safe)[..., None] * out_a + (eb / safe)[..., None] * out_b\n    return out, lse"),
    ("8.1 with divmod", "08", "rank_coords",
     "def rank_coords(rank, t, p, d):\n    if rank < 0 or rank >= t * p * d:\n"
     "        raise ValueError(f'rank {rank} is not in 0..{t * p * d - 1}')\n    rest, tp = divmod(rank, t)\n"
     "    pp, dp = divmod(rest, d)\n    return tp, pp, dp"),
    ("0.2 ring with comm.send/comm.recv", "00", "ring_all_reduce",
     "def ring_all_reduce(ctx, tensor):\n    n, r = ctx.world_size, ctx.rank\n    right, left = (r + 1) % n, (r - 1) % n\n"
     "    chunks = list(torch.tensor_split(tensor, n))\n\n    def exchange(out, into):\n"
     "        if r % 2 == 0:  # even ranks send first, odd ranks receive first: no deadlock with blocking calls\n"
     "            comm.send(out, right)\n            comm.recv(into, left)\n        else:\n"
     "            tmp = torch.empty_like(into)\n            comm.recv(tmp, left)\n            comm.send(out, right)\n"
     "            into.copy_(tmp)\n\n    for s in range(n - 1):\n        send_i, recv_i = (r - s) % n, (r - s - 1) % n\n"
     "        incoming = torch.empty_like(chunks[recv_i])\n        exchange(chunks[send_i].clone(), incoming)\n"
     "        chunks[recv_i] += incoming\n    for s in range(n - 1):\n        send_i, recv_i = (r + 1 - s) % n, (r - s) % n\n"
     "        incoming = torch.empty_like(chunks[recv_i])\n        exchange(chunks[send_i].clone(), incoming)\n"
     "        chunks[recv_i].copy_(incoming)\n    return tensor"),
]

GENERIC = list(CELLS)
HABITS = GENERIC + ["a wrong attempt left above the right one", "cells run out of order"]
# notebooks: (base, [habit labels], [alternative labels])
PLAN: list[tuple[str, list[str], list[str]]] = []
# the one habit (an old-policy refusal, issue 40) each alternative answer carries along
WITH_ALTERNATIVE = ["import csv", "%config", "import logging", "%%capture", "import pathlib", "import datetime",
                    "own class private names", "%timeit", ""]


def _plan() -> list[tuple[str, list[str], list[str]]]:
    """31 notebooks of three habits on the solved 01 (its grading is the cheapest), habit i with
    i + 1 and i + 3 (mod 31): each habit is in three notebooks and no two notebooks share more than
    one habit, so the habit whose notebooks all lose points is the one that costs them; then each
    alternative answer on its own notebook, with one habit (0.2's ring alone; 8.1 with divmod and
    ``%timeit rank_coords(5, 2, 2, 4)`` after 8.1, the issue's example)."""
    if not PLAN:
        n = len(HABITS)
        PLAN.extend(("01", [HABITS[i], HABITS[(i + 1) % n], HABITS[(i + 3) % n]], []) for i in range(n))
        PLAN.extend((base, [h] if h else [], [label]) for (label, base, _, _), h in zip(ALTERNATIVES, WITH_ALTERNATIVE))
    return PLAN


def _code(nb):
    return [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]


def _after_first_check(nb) -> int:
    return next(i for i in _code(nb) if "check(" in nb.cells[i].source) + 1


def _defining(nb, name: str) -> int:
    return next(i for i in _code(nb) if f"def {name}(" in nb.cells[i].source)


def _apply(nb, base: str, habit: str, rng: random.Random):
    """Add ``habit`` to the notebook ``nb``; returns the cell that holds it."""
    answer, call = ANSWER[base], CALL[base]
    new = nbformat.v4.new_code_cell
    if habit == "%matplotlib inline":
        where, cell = 0, new("%matplotlib inline")
    elif habit == "a wrong attempt left above the right one":
        body = f"def {answer}(*args, **kwargs):\n    # first try, wrong: kept for my notes\n    return None"
        where, cell = _defining(nb, answer), new(body)
    elif habit == "cells run out of order":
        counts = list(range(1, len(_code(nb)) + 1))
        rng.shuffle(counts)
        for i, n in zip(_code(nb), counts):
            nb.cells[i].execution_count = n
        nb.cells.insert(1, new("value_defined_later = 1"))
        where, cell = 1, new("print(value_defined_later)  # ran after the cell below in my session\n")
    else:
        where, cell = _after_first_check(nb), new(CELLS[habit].format(call=call, answer=answer))
    nb.cells.insert(where, cell)
    return cell


def build(folder: Path) -> list[tuple[Path, str, list[str]]]:
    """Write the corpus into ``folder``; [(path, notebook, each habit and alternative with its cell:
    "cell 5: %timeit", numbered as the grader numbers cells)]."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for n, (base, habits, alts) in enumerate(_plan()):
        nb = nbformat.read(str(CHECKOUT / "solutions" / f"{BASES[base]}.ipynb"), as_version=4)
        rng = random.Random(n)
        labelled = []
        for label in alts:
            _, _, name, src = next(a for a in ALTERNATIVES if a[0] == label)
            nb.cells[_defining(nb, name)].source = src
            labelled.append((nb.cells[_defining(nb, name)], label))
        labelled += [(_apply(nb, base, h, rng), h) for h in habits]
        for c in nb.cells:  # the ids of inserted cells: unique, as Jupyter writes them
            c.setdefault("id", f"c{rng.getrandbits(32):08x}")
        where = {c.id: i + 1 for i, c in enumerate(nb.cells)}
        named = [f"cell {where[c.id]}: {label}" for c, label in labelled]
        nb.metadata.setdefault("labkit", {})
        nb.metadata["labkit"].update(notebook=BASES[base], habits=named)
        path = folder / f"h{n:02d}_{BASES[base]}.ipynb"
        nbformat.validator.normalize(nb)
        nbformat.write(nb, str(path))
        out.append((path, BASES[base], named))
    return out
