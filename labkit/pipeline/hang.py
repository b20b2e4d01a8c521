"""Explain a pipeline step that hung: the first line of the error a failed wait raises.

The runtime (:mod:`.runtime`) calls :func:`explain_hang` when a receive times out or fails.
The cause is found without any process, by running the schedule on paper
(:func:`.symbolic.diagnose_hang`, the same answer on every rank), and the schedule is checked
again by :func:`.validate.validate_schedule` (a run with ``validate=False`` skipped it).
"""
from __future__ import annotations

from .schedules import Action, Schedule, ScheduleError
from .symbolic import diagnose_hang
from .validate import validate_schedule

__all__ = ["explain_hang"]


def explain_hang(actions: Schedule, rank: int, a: Action, comm_action: Action, error: BaseException,
                 global_ranks: list[int] | None = None) -> str:
    """The message of a failed wait on pipeline rank ``rank`` (at action ``a``, waiting for
    ``comm_action``). First line: the first action that cannot complete (:func:`diagnose_hang`)
    and which rank this report is from, by its global rank too when the pipeline group's ranks
    ``global_ranks`` are not 0..K-1 (a pipeline inside a larger grid: the rank a launch or
    torchrun names)."""
    g = list(global_ranks) if global_ranks is not None else list(range(len(actions.actions)))
    same = g == list(range(len(g)))

    def who(r):
        return f"rank {r}" if same else f"pipeline rank {r} (global rank {g[r]})"
    peer = actions.peer(comm_action)
    here = (f"this error is from {who(rank)}, which was at {a!r} waiting for "
            f"{comm_action!r} ({'from' if comm_action.kind.startswith('RECV') else 'to'} {who(peer)})")
    found = diagnose_hang(actions)
    if found is not None:
        r, i, b, reason = found
        where = "" if same else f" (ranks in this sentence are the pipeline group's: global ranks {g})"
        first = (f"pipeline schedule hung: the first action that cannot complete is {b!r} on {who(r)} (its action "
                 f"{i}): {reason}{where}; {here}")
    else:
        first = (f"{'pipeline ' if same else ''}{who(rank)}: a wait failed although the schedule can finish when "
                 f"run symbolically (so another rank probably failed first: see its error, or the messages between "
                 f"two ranks come in different orders); {here}")
    cause = str(error).strip().splitlines()[0] if str(error).strip() else ""
    lines = [first, f"cause: {type(error).__name__}: {cause}"]
    try:
        validate_schedule(actions.actions, n_stages=actions.n_stages)
    except ScheduleError as e:
        lines.append(f"validate_schedule (skipped with validate=False) reports: {e}")
    return "\n".join(lines)
