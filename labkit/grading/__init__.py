"""Course machinery: exercise checks, the notebook builder and the autograder.

Learners use one function::

    from labkit.grading import check
    check("1.1", bubble_fraction)     # prints one line: passed / failed (why, hint) / not attempted

``check`` returns a :class:`~labkit.grading.runner.CheckResult` (status, passed, total, message)
that displays nothing in a notebook, so the printed line is the cell's only output.

Instructor workflow::

    python -m labkit build                       # notebooks/ (learner versions) from solutions/
    python -m labkit build --check               # CI: exit 1 naming each stale notebook
    LABKIT_HIDDEN_CASES=/secret/cases \
        python -m labkit grade submission.ipynb --results results.json   # Gradescope format

Author workflow: write ``solutions/NN_topic.ipynb`` (exercise regions between
``### BEGIN SOLUTION`` / ``### END SOLUTION``) and ``labkit/grading/exercises/nbNN_topic.py``,
then ``python -m labkit build --execute NN`` and commit both folders.

The grader's contract
---------------------
The grade is earned by what the learner's functions return on the grader's inputs, and by nothing
else: how the code is written (magics, shell lines, imports, reflection) costs nothing. The table
of threat -> mechanism -> test, and what is not covered, is ``docs/grading.md``.

* **Verdicts come from the grader's process, which never executes learner code.** Learner code
  runs in the notebook kernel (and the processes it starts). ``check`` there only registers the
  answer. Each case runs in (a fork of) the grader and has three parts: inputs chosen by the
  case, a call made in the kernel (``answer(...)``, or ``answer.run(fn, ...)`` for a kernel-side
  helper that runs the learner's code there, e.g. on ranks), and a judgement made in the
  grader on the DATA that comes back (:mod:`labkit.grading.wire`: JSON plus raw tensor bytes,
  size-limited and counted before anything is built, never pickle). Expected values, the code
  computing them, and hidden cases (loaded only by the grader; their inputs are sent only when
  used) never enter the kernel; what runs next to the learner's code lives in
  :mod:`labkit.grading.kernelside`, is the learner's to replace, carries data only and reaches
  no reference. **No measurement made in the kernel decides a verdict**: where the point is how
  data moves (0.2's ring from send/recv, 7.3's all-reduces) the ranks get no process group and
  every send, receive and all-reduce is a message to a relay in the case's (the grader's)
  process (:mod:`labkit.grading.relay`), which delivers it, computes the reductions and logs it;
  the case judges the log against what the algorithm must send. 13.1 is judged on the returned
  gradients and on what ``.grad`` holds after the call, with ``.grad`` preset.
* **The reference is not in the kernel** (:mod:`labkit.grading.withhold`; as root): the kernel
  imports the grader's copy of the kit, where each reference of the assignment's exercises,
  and every kit function or class from which one can be reached (a call graph of the kit's
  source, :mod:`labkit.grading.reach`, built with the copy), is a stub that raises "withheld"
  until the grader has graded its exercises, however it is reached; its code waits in a file
  only the grader may read (0600), made readable once the grading point has passed and
  unreadable again for the secret pass. No shipped cell needs one before its exercise
  (``python -m labkit build --check`` fails otherwise), so nothing is kept.
* **The results file is written only by the grader**, atomically (new file, rename) after the
  kernel and everything it started are dead; the kernel is not told where it is.
* **The assignment is pinned by the grader** (``--assignment NN_name``;
  :mod:`labkit.grading.assignments`): only that notebook's exercises count, each graded once
  from the name the notebook defines for it, at its grading point (after its last ``check``
  cell, or after the cell defining it when the check was deleted), whatever the submission's
  metadata, file name or ``check`` calls say.
* **Fresh inputs** (:mod:`labkit.grading.fresh`): hidden cases also draw inputs seeded from
  ``os.urandom`` in the grader's case process each run; expected values are computed there.
  Every exercise that takes inputs has such a case (those without inputs are listed in
  ``fresh.EXEMPT`` with the reason; tests/grading/test_grading_fresh.py checks both).
  An instructor's hidden cases (``LABKIT_HIDDEN_CASES``) run after every visible result is
  fixed, in a fresh kernel that replays the cells that ran; visible messages show a
  learner-returned value that is not a number by its type and size only.
* **Points are all-or-nothing per exercise**: an exercise earns its points only when every one
  of its cases (public and hidden) passes, so a wrong answer cannot collect points from the
  cases that cannot show its bug. In the results each exercise has one test carrying its points
  ("Exercise 2.3 (title)", score all or 0), followed by one test per case worth 0 points
  (passed/failed with its message; hidden cases ``after_published``, without details).
* **A file system of its own** (``_jail.py --root``): the kernel sees ``/usr``, ``/etc``,
  ``/dev``, ``/sys``, Python, its environment and the kit's folder (the grader's copy, without
  the exercise code, reference list, hidden cases and solutions), nothing else of the checkout
  (git history, solutions), of the grader or of any home folder. It also runs in a network
  namespace of its own (its loopback only): its Jupyter channels are Unix sockets in a folder of
  its uid, signed with a key, and the relay of 0.2 and 7.3 is a Unix socket there too, so no
  other process of the machine (another kernel of a batch) can reach its channels or its ranks'
  stores, nor can it reach anything listening on the machine.
* **Isolation and containment** (:mod:`labkit.grading.contain`, :mod:`labkit.grading._jail`):
  as root, each kernel runs under a uid of its own (locked, so no other kernel of any grader
  has it), in its own session and in private mount and IPC namespaces: fresh size-limited
  tmpfs on /tmp, /var/tmp and /dev/shm, and empty mounts over ``labkit/grading/exercises``,
  ``references.py``, the hidden-case folders, the kit's solved notebooks and the grading's
  (or batch's) submissions and results (file-system level: the kernel imports labkit, but
  cannot open the grader's cases, expected-value code, reference list, the solutions or
  another submission; the grader probes this as that uid and warns otherwise); an
  environment from an allow-list (no variable of the grader's but PATH, locale, Python and
  thread settings). rlimits: processes per uid, file size,
  address space; under cgroup v2 also its own cgroup (memory, pids, CPU; ``cgroup.kill``). At
  the end every process of the uid is SIGKILLed in any state (a zombie leader whose threads
  run) and reaped, its files in the shared temporary folders removed, the uid released. So
  it can neither signal the grader nor another submission, write the results, read the
  grader's secrets, nor leave a process or file. Without ``unshare``: uid, limits and sweeps,
  but a shared /tmp, and the grader's files hidden only by their own permissions.
* **As any other user** the output says that isolation is partial. What holds (tested with
  the hostile suite graded as a fresh unprivileged uid): every process of the submission is
  killed in any state and reaped (the grader is their subreaper; group, session,
  descendants, environment mark), the next submission is unharmed, the grader's memory and
  time are bounded, verdicts are judged on data in the grader. With unprivileged user
  namespaces (``unshare --user``) each kernel also runs in user, mount and IPC namespaces of
  its own with no capabilities: private /tmp, /var/tmp, /dev/shm and IPC (its files there
  vanish with it), the grader's exercise code, reference list and hidden cases covered,
  file-size and memory rlimits. NOT covered: the kernel is the grader's user, so it can
  signal the grader and every process of that user, read their environment and, through
  ``/proc/PID/root`` or ``/proc/PID/mem`` (where the system lets a user debug its own
  processes), the grader's files (hidden cases) and memory; it can write wherever that user
  may outside the private folders (its home, the results folder, the kit itself if writable:
  then the grader's code is the kernel's to change); nothing is withheld (the reference is
  readable by that user); no process limit, no cgroup; without user namespaces its /tmp files stay and the grader's
  files are readable. Verdicts judged in the grader hold only as far as that user's
  processes cannot reach into the grader's; as root, under a uid of its own, the kernel
  cannot. The relay (a Unix socket in the jailed kernel's own folder; else TCP on
  127.0.0.1) admits only ranks that hold the case's random
  token, sent to the kernel alone.
* **Robustness and bounds**: a cell that raises costs only the exercises that depend on it; a
  cell that kills or exits the kernel, or runs past ``--cell-timeout`` (SIGINT, then SIGKILL),
  is skipped: a fresh kernel replays the cells that ran and grading goes on. Output is never
  collected (a flood is dropped), and each case has a time limit covering its kernel calls.
  ``--time-budget`` bounds the whole submission (default from the cell limit, the number of
  cells and every case's limit); each cell up to the last grading point runs once, in order
  (later cells cannot change a grade and do not run), and its own ``check`` calls (read from
  its source) are graded once after it, whatever serials the kernel reports.
* **What cannot be made absent** (the learner's own copy of the kit's source, shared code) is
  for the instructor's integrity report, never the score.

Interactive ``check`` in a notebook is feedback, not a grade: it runs the same cases in the
notebook's own process (each call still makes the data round trip, so verdicts match), judges
only the function it is given, and says when the answer calls something the graded kernel will
not have (:func:`labkit.grading.withhold.withheld_calls`: "your answer calls labkit's
bubble_formula, which is not available when the notebook is graded ...: write it yourself").

Instructors and authors: :mod:`labkit.grading.registry` (declaring exercises and cases, hidden
case files), :mod:`labkit.grading.build` (``python -m labkit build``),
:mod:`labkit.grading.grader` (``python -m labkit grade``), :mod:`labkit.grading.testing`
(one-line wrong-answer tests), :mod:`labkit.grading.session` (the kernel the grader runs),
:mod:`labkit.grading.kernel` and :mod:`labkit.grading.proxy` (the two ends of a call),
:mod:`labkit.grading.contain` (uids, cgroups, limits, sweeps). Names are imported lazily, so
``python -m labkit build`` does not import torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "check": "runner", "evaluate": "runner", "CheckResult": "runner", "CheckNotPassed": "runner",
    "CheckFailure": "registry", "exercise": "registry", "expect_close": "registry",
    "expect_equal": "registry",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
