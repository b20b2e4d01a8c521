"""The corpus the integrity report is measured on (issue 40, item 3).

``copies()``: the kit's reference source for an exercise turned into the learner's answer the way a
learner hiding a paste would: renamed (every local name and argument), reformatted (``ast.unparse``:
comments and docstrings gone, layout and quotes normalised), split into helpers, helpers reordered,
and the kit's solved notebook's answer renamed. Each must be flagged.

``HONEST``: correct answers written independently: the solution in other styles, numpy for
torch/Fraction, loops for comprehensions, a different decomposition. None may be flagged.

Each entry: (notebook, exercise, label, code defining the exercise's answer name).
"""
from __future__ import annotations

import ast
import inspect
import textwrap


class _Rename(ast.NodeTransformer):
    """Every argument and local name -> a fresh one (function names kept where ``keep``)."""

    def __init__(self, keep: set[str]):
        self.keep, self.map = keep, {}

    def _new(self, name: str) -> str:
        if name in self.keep:
            return name
        return self.map.setdefault(name, f"v{len(self.map)}_{name[::-1].lower()}x")

    def visit_arg(self, node):
        node.arg = self._new(node.arg)
        return node

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Store) or node.id in self.map:
            node.id = self._new(node.id)
        return node


def _strip_docstrings(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.body and isinstance(node.body[0], ast.Expr) \
                and isinstance(getattr(node.body[0], "value", None), ast.Constant) \
                and isinstance(node.body[0].value.value, str):
            node.body = node.body[1:] or [ast.Pass()]
    return tree


def renamed(src: str, name: str, new_name: str, keep=()) -> str:
    tree = ast.parse(textwrap.dedent(src))
    tree.body[0].name = new_name
    tree = _Rename(set(keep) | {new_name}).visit(tree)
    return ast.unparse(_strip_docstrings(tree))


def copies() -> list[tuple[str, str, str, str]]:
    from labkit.context_parallel.sharding import check_sequence_split, chunk_placement
    from labkit.pipeline.schedules import add_communication, gpipe_schedule
    from labkit.pipeline.simulate import bubble_formula

    bf = inspect.getsource(bubble_formula)
    ac = inspect.getsource(add_communication)
    gs = inspect.getsource(gpipe_schedule)
    cp = inspect.getsource(chunk_placement)
    cs = inspect.getsource(check_sequence_split)
    keep = {"Fraction", "Action", "range", "len", "max", "sorted", "set", "isinstance", "ValueError",
            "ScheduleError", "COMPUTE", "Schedule", "infer_placement", "numbers", "bool"}
    out = []
    # 1.1: bubble_formula pasted (9 lines, the example), then disguised
    out.append(("01_pipeline_bubble", "1.1", "pasted as is",
                "from fractions import Fraction\n" + bf.replace("def bubble_formula", "def bubble_fraction")))
    out.append(("01_pipeline_bubble", "1.1", "renamed and reformatted",
                "from fractions import Fraction\n" + renamed(bf, "bubble_formula", "bubble_fraction", keep)))
    out.append(("01_pipeline_bubble", "1.1", "split into helpers",
                "from fractions import Fraction\n\n"
                "def _few(K, M, v):\n    return Fraction(v * (K - M) + M - 1, v * K + M - 1)\n\n"
                "def _many(K, M, v):\n    return Fraction(K - 1, v * M + K - 1)\n\n"
                "def bubble_fraction(K, M, v=1):\n    if M < K:\n        return _few(K, M, v)\n"
                "    return _many(K, M, v)\n"))
    # 2.1: gpipe_schedule and its helper add_communication pasted, renamed, reordered
    comm = renamed(ac, "add_communication", "insert_p2p", keep)
    out.append(("02_gpipe", "2.1", "renamed, helper first",
                "from labkit.pipeline.schedules import Action, Schedule, ScheduleError, COMPUTE, infer_placement\n\n"
                + comm + "\n\n" + renamed(gs.replace("    check_pipeline_sizes(K, M)\n", "").replace(
                    "add_communication", "insert_p2p"), "gpipe_schedule", "gpipe_actions", keep | {"insert_p2p"})))
    out.append(("02_gpipe", "2.1", "renamed, helper after, answer first",
                "from labkit.pipeline.schedules import Action, Schedule, ScheduleError, COMPUTE, infer_placement\n\n"
                + renamed(gs.replace("    check_pipeline_sizes(K, M)\n", "").replace("add_communication", "with_sends"),
                          "gpipe_schedule", "gpipe_actions", keep | {"with_sends"})
                + "\n\n" + renamed(ac, "add_communication", "with_sends", keep)))
    # 16.2: chunk_placement with its check pasted, renamed
    out.append(("16_context_parallel", "16.2", "renamed with its check",
                "import numbers\n\n" + renamed(cs, "check_sequence_split", "_validate", keep) + "\n\n"
                + renamed(cp.replace("check_sequence_split", "_validate"), "chunk_placement", "causal_chunk_placement",
                          keep | {"_validate"})))
    # the solved notebook's answer, renamed: the kit ships it (labkit/_solutions)
    from labkit.grading.integrity import _solved_answer

    for nb, ex, _name in (("01_pipeline_bubble", "1.2", "smallest_microbatches"),
                         ("02_gpipe", "2.2", "count_in_flight"), ("06_megatron_ffn", "6.1", "mlp_partials")):
        solved = _solved_answer(nb, ex)
        tree = ast.parse(solved)
        parts = []
        for node in tree.body:
            seg = ast.get_source_segment(solved, node)
            parts.append(renamed(seg, node.name, node.name, keep | {n.name for n in tree.body} | {"np", "gelu"}))
        out.append((nb, ex, "solved notebook's answer renamed", "\n\n".join(parts[::-1])))
    return out


HONEST = [
    ("01_pipeline_bubble", "1.1", "numpy, guard clause",
     "import numpy as np\n\ndef bubble_fraction(K, M):\n    if min(K, M) < 1:\n"
     "        raise ValueError(f'K and M must be >= 1 (K={K}, M={M})')\n"
     "    idle = np.float64(K - 1)\n    total = np.float64(M + K - 1)\n    return float(idle / total)\n"),
    ("01_pipeline_bubble", "1.1", "timeline count",
     "def bubble_fraction(K, M):\n    if K < 1 or M < 1:\n        raise ValueError('need positive K and M, got '"
     " + str((K, M)))\n    steps = M + K - 1  # forward slots of one device\n    busy = M\n"
     "    return 1 - busy / steps\n"),
    ("01_pipeline_bubble", "1.1", "simulated with loops",
     "def bubble_fraction(K, M):\n    if K <= 0 or M <= 0:\n        raise ValueError(f'bad sizes K={K} M={M}')\n"
     "    clock = 0\n    idle = 0\n    for t in range(M + K - 1):\n        working = 0 <= t - (K - 1) < M\n"
     "        idle += 0 if working else 1\n        clock += 1\n    return idle / clock\n"),
    ("02_gpipe", "2.1", "list building with helpers",
     "from labkit.pipeline.schedules import Action\n\ndef fwd_part(r, K, M):\n    out = []\n    for mb in range(M):\n"
     "        if r:\n            out.append(Action('RECV_F', r, mb))\n        out.append(Action('F', r, mb))\n"
     "        if r != K - 1:\n            out.append(Action('SEND_F', r, mb))\n    return out\n\n"
     "def bwd_part(r, K, M):\n    out = []\n    for mb in range(M):\n        if r != K - 1:\n"
     "            out.append(Action('RECV_B', r, mb))\n        out.append(Action('B', r, mb))\n        if r:\n"
     "            out.append(Action('SEND_B', r, mb))\n    return out\n\n"
     "def gpipe_actions(K, M):\n    return {r: fwd_part(r, K, M) + bwd_part(r, K, M) for r in range(K)}\n"),
    ("02_gpipe", "2.1", "comprehensions and a table",
     "from labkit.pipeline.schedules import Action\n\ndef gpipe_actions(K, M):\n    sched = {}\n"
     "    for rank in range(K):\n        first, last = rank == 0, rank == K - 1\n"
     "        f = [a for m in range(M) for a in ([] if first else [Action('RECV_F', rank, m)]) + "
     "[Action('F', rank, m)] + ([] if last else [Action('SEND_F', rank, m)])]\n"
     "        b = [a for m in range(M) for a in ([] if last else [Action('RECV_B', rank, m)]) + "
     "[Action('B', rank, m)] + ([] if first else [Action('SEND_B', rank, m)])]\n"
     "        sched[rank] = f + b\n    return sched\n"),
    ("16_context_parallel", "16.2", "a loop pairing ends",
     "def causal_chunk_placement(cp):\n    chunks = list(range(2 * cp))\n    pairs = []\n"
     "    while chunks:\n        lo = chunks.pop(0)\n        hi = chunks.pop()\n        pairs.append((lo, hi))\n"
     "    return pairs\n"),
    ("16_context_parallel", "16.2", "zip of halves",
     "def causal_chunk_placement(cp):\n    front = list(range(cp))\n    back = list(reversed(range(cp, 2 * cp)))\n"
     "    return list(zip(front, back))\n"),
    ("01_pipeline_bubble", "1.2", "closed form",
     "import math\n\ndef smallest_microbatches(K, target):\n    if K == 1:\n        return 1\n"
     "    need = (K - 1) * (1 - target) / target\n    return max(1, math.ceil(need - 1e-12))\n"),
    ("01_pipeline_bubble", "1.2", "search with numpy",
     "import numpy as np\n\ndef smallest_microbatches(K, target):\n    Ms = np.arange(1, 100000)\n"
     "    ok = (K - 1) / (Ms + K - 1) <= target\n    return int(Ms[np.argmax(ok)])\n"),
    ("06_megatron_ffn", "6.1", "loop over shards",
     "def mlp_partials(X, A, B, t):\n    F = A.shape[1]\n    if F % t != 0:\n"
     "        raise ValueError('t must divide F: ' + str((t, F)))\n    size = F // t\n    outs = []\n"
     "    for rank in range(t):\n        cols = slice(rank * size, (rank + 1) * size)\n        h = X @ A[:, cols]\n"
     "        outs.append(gelu(h) @ B[cols])\n    return outs\n"),
    ("06_megatron_ffn", "6.1", "np.split",
     "import numpy as np\n\ndef mlp_partials(X, A, B, t):\n    if A.shape[1] % t:\n"
     "        raise ValueError(f'{t} does not divide {A.shape[1]}')\n"
     "    return [gelu(X.dot(a)).dot(b) for a, b in zip(np.split(A, t, axis=1), np.split(B, t, axis=0))]\n"),
    ("02_gpipe", "2.2", "event sweep",
     "def count_in_flight(actions):\n    peak = {}\n    for rank, acts in actions.items():\n        live = best = 0\n"
     "        for a in acts:\n            if a.kind == 'F':\n                live += 1\n"
     "            elif a.kind == 'B':\n                live -= 1\n            best = max(best, live)\n"
     "        peak[rank] = best\n    return peak\n"),
]


# answers that hand the exercise to the kit by name (issue 40 item 3: shown, never scored); each must be flagged
# ("names reference"), and no HONEST answer may be (several import the kit's Action, which is no reference)
CALLS = [
    ("01_pipeline_bubble", "1.1", "from-import of the reference in the answer",
     "def bubble_fraction(K, M):\n    from labkit.pipeline.simulate import bubble_formula\n"
     "    return float(bubble_formula(K, M))\n"),
    ("01_pipeline_bubble", "1.1", "module alias, attribute",
     "import labkit.pipeline.simulate as sim\n\ndef bubble_fraction(K, M):\n"
     "    return float(sim.bubble_formula(K, M))\n"),
    ("01_pipeline_bubble", "1.1", "top-level alias of a re-export",
     "from labkit import pipeline\nf = pipeline.bubble_fraction\n\ndef bubble_fraction(K, M):\n"
     "    return f(K, M)\n"),
    ("01_pipeline_bubble", "1.1", "a kit function that runs the reference",
     "from labkit.pipeline.plot import bubble_fraction as bf\n\ndef bubble_fraction(K, M):\n"
     "    return bf(K, M)\n"),
    ("02_gpipe", "2.1", "the reference under another name",
     "from labkit.pipeline.schedules import gpipe_schedule as g\n\ndef gpipe_actions(K, M):\n"
     "    return g(K, M).actions\n"),
    ("16_context_parallel", "16.2", "the reference by attribute",
     "import labkit\n\ndef causal_chunk_placement(cp):\n"
     "    return labkit.context_parallel.sharding.chunk_placement(cp)\n"),
]

# honest answers that share a name with a kit reference the notebook imported: not a use of the kit
HONEST_NAMESAKES = [
    ("01_pipeline_bubble", "1.1", "an argument named like the kit's simulate",
     "from labkit.pipeline import simulate\n\ndef bubble_fraction(K, M, simulate=None):\n"
     "    if K < 1 or M < 1:\n        raise ValueError(f'K={K}, M={M}')\n"
     "    simulate = [t < K - 1 for t in range(M + K - 1)]\n    return sum(simulate) / len(simulate)\n"),
    ("01_pipeline_bubble", "1.1", "an own function named like the kit's bubble_formula",
     "from labkit.pipeline.simulate import bubble_formula\n\ndef bubble_formula(K, M):\n"
     "    return (K - 1) / (M + K - 1)\n\ndef bubble_fraction(K, M):\n    if K < 1 or M < 1:\n"
     "        raise ValueError(f'K={K}, M={M}')\n    return bubble_formula(K, M)\n"),
]
