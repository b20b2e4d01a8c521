"""Check a schedule before anything runs, and say what is wrong in words.

:func:`validate_schedule` raises :class:`ScheduleError` naming the rank, the action index and
the rule for the FIRST problem it finds; the rules, in the order they are checked (well-formed
actions, dependencies on each rank, every F and every parameter gradient exactly once, send and
receive pairing in order, optionally activations in flight, no deadlock), are listed in
:mod:`.rules`, the pass the simulator runs too. ``sends="async"`` (default) is the runtime's
semantics: a SEND never blocks, a rank blocks only before an F/B whose input has not been sent
yet. ``sends="blocking"`` checks the stricter semantics of blocking (rendezvous)
point-to-point calls, as with ``dist.send``/``dist.recv`` on NCCL: a SEND waits until the peer
reaches the matching RECV and a RECV waits for the SEND.
"""
from __future__ import annotations

from .rules import check_schedule
from .schedules import Schedule, ScheduleError

__all__ = ["validate_schedule", "ScheduleError"]


def validate_schedule(schedule: dict, n_microbatches: int | None = None, n_stages: int | None = None,
                      sends: str = "async", max_in_flight=None, placement: str | None = None) -> Schedule:
    """Raise :class:`ScheduleError` for the first problem of ``schedule``; return it as a
    :class:`~.schedules.Schedule` (actions per rank, K, M, n_stages, placement) when it is valid.

    ``schedule``: ``{rank: [Action(kind, stage, microbatch), ...]}`` for ranks 0..K-1 (plain
    tuples are accepted). ``n_microbatches`` (M) and ``n_stages`` default to one more than
    the largest index used. ``sends``: "async" (the runtime's semantics) or "blocking"
    (rendezvous sends); see the module docstring and :mod:`.rules`. ``max_in_flight``: None, an int for every
    stage, or a sequence indexed by stage (e.g. ``[min(M, K - s) for s in range(K)]`` for
    1F1B). ``placement``: "loop" (stage s on rank s % K) or "v" (rank r holds stages r and
    2K-1-r); None infers it (:func:`~.schedules.infer_placement`). A :class:`~.schedules.Schedule`
    brings its own M, n_stages and placement (used where these are None). Starts no process.
    """
    return check_schedule(schedule, n_microbatches, n_stages, sends, max_in_flight, placement)
