"""The honest corpus (issue 40): 40 correct submissions written as students write them, every one
full marks, graded end to end (as root: a uid of its own per kernel, the jail) in one batch.

Built by :mod:`honest_corpus` from the solved notebooks: magics (``%matplotlib inline``,
``%timeit``, ``%config``, ``%env``, ``%load_ext autoreload``, ``%%time``, ``%%capture``),
``!pip list``, ``func?``, ``help()``, ``dir``/``vars``, ``locals()``, ``getattr``, imports of the
standard library and of installed packages (csv, logging, datetime, pathlib, timeit, traceback,
pickle, tqdm, sympy, ``from numpy.random import default_rng``, ``import matplotlib.cm as cm``), a
seeding helper with ``cudnn.deterministic``, torch's private attributes (``x._version``,
``t._base``, ``lin._parameters``), a class of the learner's own used through its private names,
saving one's own figures and CSVs, a cell that raises, a wrong attempt left above the right one,
cells run out of order, and alternative correct answers (numpy, loops, closed forms, bisection,
``divmod``, 0.2's ring with ``comm.send``/``comm.recv`` as the exercise text says). Three habits
per notebook, each habit in three notebooks (four with an alternative answer) and no two
notebooks sharing two habits: a lost point is reported with the cell of every habit of its
notebook, and with the habits all of whose notebooks lost points, most notebooks first (a habit
that costs points comes first there, alone or with the one alternative answer that carries it).

With the static source policy (main f822c52's policy.py, its grader's ``_policy_grades`` run on
these notebooks, measured) every one of the 40 loses points, 101 of 178 (three whole notebooks: those
with ``%matplotlib inline`` as the first cell); every point a policy refusal.
This test uses the grader's default options.
"""
from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest
from honest_corpus import build


@pytest.mark.skipif(os.geteuid() != 0, reason="graded as root, as autograder containers do (full isolation)")
def test_every_honest_submission_gets_full_marks(tmp_path):
    corpus = build(tmp_path / "corpus")
    assert len(corpus) >= 40
    habits = {p.name: h for p, _nb, h in corpus}
    book = tmp_path / "grades.csv"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # no --results-dir: the integrity report (tested on its own corpus) would add ~10 s of CPU here
    p = subprocess.run([sys.executable, "-m", "labkit", "grade", *(str(c[0]) for c in corpus), "--gradebook",
                        str(book), "-j", "2", "--cell-timeout", "120"],
                       capture_output=True, text=True, env=env, timeout=1800)
    rows = list(csv.DictReader(book.open()))
    assert len(rows) == len(corpus), p.stdout + p.stderr
    lost, failing = [], set()
    for row in rows:
        name = os.path.basename(row["submission"])
        if row["total"] != row["max"] or row["error"]:
            failing.add(name)
            scores = ", ".join(f"{k.removeprefix('exercise ')} {v}" for k, v in row.items() if k.startswith("exercise")
                               and v)
            lost.append(f"{row['submission']} ({'; '.join(habits[name])}): {row['total']}/{row['max']} ({scores}) "
                        f"{row['error']}")
    holding: dict[str, set] = {}  # habit -> the notebooks that hold it ("cell 5: %timeit" -> "%timeit")
    for n, hs in habits.items():
        for h in hs:
            holding.setdefault(h.partition(": ")[2], set()).add(n)
    suspects = sorted((h for h, ns in holding.items() if ns <= failing), key=lambda h: -len(holding[h]))
    assert not lost, ("honest submissions lost points (`python -m labkit grade FILE` shows one's cells and messages):\n"
                      + "\n".join(lost) + "\nhabits all of whose notebooks lost points, most notebooks first: "
                      + (", ".join(f"{h} ({len(holding[h])})" for h in suspects) or "none"))
    assert p.returncode == 0, p.stderr
