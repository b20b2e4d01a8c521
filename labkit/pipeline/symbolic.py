"""Run a schedule on paper: the one symbolic executor behind the validator's deadlock check,
the runtime's hang diagnosis and the simulator's clock.

:func:`execute` walks every rank's action list round-robin; a ``step`` callback says whether
a rank's next action can complete now (and does its bookkeeping: a message sent, a clock
advanced). It stops when no rank can move, so what is left is stuck. Two step rules come
with it (the communication semantics of :mod:`.schedules`):

* :func:`advance_async`: the runtime's. A SEND never blocks (``isend``); a RECV is only
  posted; an F/B/I blocks until the message it needs was sent.
* :func:`advance_blocking`: rendezvous sends (``dist.send``/``dist.recv`` on NCCL): a SEND
  and its RECV complete together, each waits for the other side; compute never waits.

:func:`stuck_actions` describes, per stuck rank, what it waits for; :func:`diagnose_hang`
finds the first action that cannot complete (a message never sent, or a wait cycle).
"""
from __future__ import annotations

from typing import Callable

from .schedules import COMM, COMPUTE, Action, Schedule

__all__ = ["execute", "advance_async", "advance_blocking", "stuck_actions", "diagnose_hang"]


def execute(schedule: Schedule, step: Callable[[int, int, Action, list], bool]) -> list[int]:
    """Run ``schedule`` symbolically: per rank, ``step(rank, index, action, idx)`` is asked
    whether the rank's next action completes now (True: the rank moves on; False: it is blocked
    there). ``idx`` (per rank, the index of its next action) may be advanced by ``step`` for
    another rank (a rendezvous completes both sides). Ranks are visited 0..K-1 in turn until
    none moves. Returns ``idx``: ``len(schedule[r])`` for a rank that finished, else the
    index of the action it is stuck on."""
    idx = [0] * schedule.K
    progress = True
    while progress:
        progress = False
        for r in range(schedule.K):
            acts = schedule[r]
            while idx[r] < len(acts):
                if not step(r, idx[r], acts[idx[r]], idx):
                    break
                idx[r] += 1
                progress = True
    return idx


def advance_async(schedule: Schedule) -> list[int]:
    """:func:`execute` with the runtime's semantics (SEND/RECV never block; F/B/I wait until
    their input message was sent)."""
    sent: set = set()

    def step(r, i, a, idx):
        need = schedule.needs(a) if a.kind in COMPUTE else None
        if need is not None and schedule.message(need).key not in sent:
            return False
        if a.kind.startswith("SEND"):
            sent.add(schedule.message(a).key)
        return True
    return execute(schedule, step)


def advance_blocking(schedule: Schedule) -> list[int]:
    """:func:`execute` with rendezvous semantics: a SEND and its RECV complete together when
    both ranks have reached them; F/B/I never wait (their inputs were received before)."""
    def step(r, i, a, idx):
        if a.kind in COMPUTE:
            return True
        key, peer = schedule.message(a).key, schedule.peer(a)
        if idx[peer] < len(schedule[peer]):
            b = schedule[peer][idx[peer]]
            if b.kind in COMM and b.kind[:4] != a.kind[:4] and schedule.message(b).key == key:
                idx[peer] += 1
                return True
        return False
    return execute(schedule, step)


def stuck_actions(schedule: Schedule, idx: list[int]) -> list[str]:
    """One phrase per rank that did not finish (``idx`` from :func:`execute`): its action and
    the rank it waits for."""
    parts = []
    for r in range(schedule.K):
        if idx[r] >= len(schedule[r]):
            continue
        a = schedule[r][idx[r]]
        if a.kind in COMPUTE:
            src = schedule.message(schedule.needs(a)).src
            parts.append(f"rank {r}, action {idx[r]} ({a!r}) waits for the input from rank {src}")
        else:
            parts.append(f"rank {r}, action {idx[r]} ({a!r}) waits for rank {schedule.peer(a)}")
    return parts


def diagnose_hang(schedule: Schedule):
    """Why a schedule cannot finish, found without any process: ``(rank, index, action,
    reason)`` of the first action that cannot complete, or None when it can finish.

    Runs the schedule with the runtime's semantics (:func:`advance_async`). Among the stuck
    ranks, an action whose message is never sent at all is the cause (the lowest such rank);
    otherwise the stuck ranks wait for each other in a cycle, described from the lowest rank.
    When nothing is stuck, a SEND whose receive no rank posts is reported. Every rank
    computes the same answer."""
    K = schedule.K
    idx = advance_async(schedule)
    stuck = [r for r in range(K) if idx[r] < len(schedule[r])]

    def waits_for(r):
        """(peer, the SEND it waits for, that SEND's index on the peer or None)."""
        src, _, (direction, stage, mb) = schedule.message(schedule.needs(schedule[r][idx[r]]))
        send = Action("SEND_" + direction, stage, mb)
        where = next((j for j, b in enumerate(schedule[src]) if b == send), None)
        return src, send, where

    for r in stuck:
        src, send, where = waits_for(r)
        if where is None:
            a = schedule[r][idx[r]]
            return r, idx[r], a, (f"it needs the {'input' if a.kind == 'F' else 'output gradient'} that rank {src} "
                                  f"never sends ({send!r} is not in rank {src}'s list)")
    if stuck:
        chain, r = [], stuck[0]
        seen = set()
        while r not in seen:
            seen.add(r)
            src, send, where = waits_for(r)
            chain.append(f"rank {r}'s {schedule[r][idx[r]]!r} waits for {send!r}, which rank {src} reaches only "
                         f"after its own {schedule[src][idx[src]]!r}")
            r = src
        first = stuck[0]
        return first, idx[first], schedule[first][idx[first]], "deadlock: " + "; ".join(chain)
    posted = {(r, schedule.message(a).key) for r in range(K) for a in schedule[r] if a.kind.startswith("RECV")}
    for r in range(K):
        for i, a in enumerate(schedule[r]):
            if a.kind.startswith("SEND"):
                _, dst, key = schedule.message(a)
                if (dst, key) not in posted:
                    return r, i, a, f"rank {dst} never posts the matching receive"
    return None
