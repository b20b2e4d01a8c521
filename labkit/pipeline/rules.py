"""The validity pass of a schedule, below both the validator and the simulator.

:func:`check_schedule` checks, in this order, and raises :class:`ScheduleError` naming
the rank, the action index and the rule for the FIRST problem it finds:

1. every action is well formed: a known kind, a stage that lives on this rank (stage ``s``
   on rank ``s % K``), a microbatch in ``0..M-1``, a send/receive that has a peer;
2. dependencies on each rank: F(s, m) after the input is received (or, when stage s-1 is on
   the same rank, after F(s-1, m)); B(s, m) and I(s, m) after F(s, m) and after the output
   gradient is received (or the B/I of (s+1, m) ran on this rank); W(s, m) after I(s, m)
   on the same rank; a SEND after the F/B/I whose result it sends (an input gradient is
   sent by SEND_B after the I or B that computes it);
3. every F of every (stage, microbatch) exactly once, and every parameter gradient exactly
   once: either one B, or one I and one W (never B and I/W both, never I without its W);
   every result that another rank needs is sent;
4. pairing: every send has its receive and vice versa, and between each pair of ranks the
   i-th send is the i-th receive (messages are matched in order: NCCL has no tags);
5. optionally, memory: no stage holds more than ``max_in_flight`` microbatches whose
   forward ran and whose backward has not (their activations are stashed); with a split
   backward a microbatch stays in flight until its W (W needs the stashed activations);
6. no deadlock, by running the schedule symbolically. ``sends="async"`` (default) is the
   runtime's semantics: a SEND never blocks, a rank blocks only before an F/B whose input
   has not been sent yet. ``sends="blocking"`` checks the stricter semantics of blocking
   (rendezvous) point-to-point calls, as with ``dist.send``/``dist.recv`` on NCCL: a SEND
   waits until the peer reaches the matching RECV and a RECV waits for the SEND. Two
   neighbours that both send first then deadlock, e.g. 1F1B with K=2, M=2 when rank 1 does
   ``SEND_B0@s1`` before ``RECV_F1@s1`` while rank 0 does ``SEND_F1@s0`` first.
"""
from __future__ import annotations

from .schedules import BACKWARD, COMM, KINDS, PLACEMENTS, Action, Schedule, ScheduleError
from .symbolic import advance_async, advance_blocking, stuck_actions

__all__ = ["check_schedule"]


def _at(r, i, a) -> str:
    return f"rank {r}, action {i} ({a!r})"


def _normalise(schedule) -> dict:
    if not isinstance(schedule, dict) or not schedule:
        raise ScheduleError(f"a schedule is a non-empty dict {{rank: [Action, ...]}}, got {type(schedule).__name__}")
    K = len(schedule)
    if sorted(schedule) != list(range(K)):
        raise ScheduleError(f"schedule ranks must be 0..{K - 1}, got {sorted(schedule)}")
    out = {}
    for r in range(K):
        acts = []
        for i, a in enumerate(schedule[r]):
            try:
                kind, stage, mb = a
            except (TypeError, ValueError):
                raise ScheduleError(f"rank {r}, action {i} ({a!r}): not an Action(kind, stage, microbatch)") from None
            if not isinstance(stage, int) or not isinstance(mb, int):
                raise ScheduleError(f"rank {r}, action {i} ({a!r}): stage and microbatch must be ints")
            acts.append(Action(kind, stage, mb))
        out[r] = acts
    return out


def check_schedule(schedule: dict, n_microbatches: int | None = None, n_stages: int | None = None,
                   sends: str = "async", max_in_flight=None, placement: str | None = None) -> Schedule:
    """The rules above, on ``schedule``: raise :class:`ScheduleError` for the first one it
    breaks, else return it as a :class:`~.schedules.Schedule`. Arguments as for
    :func:`labkit.pipeline.validate.validate_schedule` (the public entry point, which documents
    them); :func:`labkit.pipeline.simulate.simulate` runs it before timing."""
    if sends not in ("async", "blocking"):
        raise ValueError(f"sends must be 'async' or 'blocking', got {sends!r}")
    if placement is not None and placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS} or None, got {placement!r}")
    if isinstance(schedule, Schedule):  # its sizes, unless given
        n_microbatches = schedule.M if n_microbatches is None else n_microbatches
        n_stages = schedule.n_stages if n_stages is None else n_stages
        placement = placement or schedule.placement
    sched = Schedule.of(_normalise(schedule), n_microbatches, n_stages, placement)
    K, M, S, pl = sched.K, sched.M, sched.n_stages, sched.placement
    if pl == "v" and S != 2 * K:
        raise ScheduleError(f"V placement needs n_stages = 2K = {2 * K} (two stages per rank), got {S}")
    rk = sched.rank_of
    rule = "stage s is on rank s % K" if pl == "loop" else "V placement: rank r holds stages r and 2K-1-r"
    where_F, where_B, where_I, where_W = {}, {}, {}, {}  # (stage, mb) -> (rank, index)
    if max_in_flight is not None and not isinstance(max_in_flight, int):
        max_in_flight = list(max_in_flight)
        if len(max_in_flight) != S:
            raise ValueError(f"max_in_flight has {len(max_in_flight)} entries for {S} stages")
    live = [0] * S

    # 1-3: each rank on its own
    for r in range(K):
        seen: dict = {}
        for i, a in enumerate(sched[r]):
            here = _at(r, i, a)
            if a.kind not in KINDS:
                raise ScheduleError(f"{here}: unknown kind {a.kind!r}; kinds are {', '.join(KINDS)}")
            if not 0 <= a.stage < S:
                raise ScheduleError(f"{here}: stage {a.stage} outside 0..{S - 1}")
            if not 0 <= a.microbatch < M:
                raise ScheduleError(f"{here}: microbatch {a.microbatch} outside 0..{M - 1}")
            if rk(a.stage) != r:
                raise ScheduleError(f"{here}: stage {a.stage} lives on rank {rk(a.stage)} "
                                    f"({rule}, K={K}), not on rank {r}")
            s, m = a.stage, a.microbatch
            if a.kind in COMM:
                nb = s + 1 if a.kind in ("SEND_F", "RECV_B") else s - 1
                if not 0 <= nb < S:
                    raise ScheduleError(f"{here}: stage {s} has no stage {nb} to "
                                        f"{'send to' if a.kind.startswith('SEND') else 'receive from'}")
                if rk(nb) == r:
                    raise ScheduleError(f"{here}: stages {s} and {nb} are both on rank {r}; they pass tensors "
                                        f"locally, without a send/receive")
            if a in seen:
                raise ScheduleError(f"{here}: {a!r} appears twice (first at action {seen[a]}); every action "
                                    f"runs exactly once")
            if a.kind == "F":
                if s > 0:
                    if rk(s - 1) == r:
                        if Action("F", s - 1, m) not in seen:
                            raise ScheduleError(f"{here}: forward of stage {s} before the forward of stage "
                                                f"{s - 1} (microbatch {m}) that feeds it")
                    elif Action("RECV_F", s, m) not in seen:
                        raise ScheduleError(f"{here}: no RECV_F{m}@s{s} before it; its input comes from rank "
                                            f"{rk(s - 1)} (stage {s - 1})")
                where_F[(s, m)] = (r, i)
                live[s] += 1
                if max_in_flight is not None:
                    cap = max_in_flight if isinstance(max_in_flight, int) else max_in_flight[s]
                    if live[s] > cap:
                        raise ScheduleError(f"{here}: stage {s} would hold {live[s]} microbatches in flight "
                                            f"(forward done, backward not yet), more than max_in_flight={cap}")
            elif a.kind in BACKWARD:  # B (full) or I (input gradient only)
                what = "backward" if a.kind == "B" else "input gradient"
                if Action("F", s, m) not in seen:
                    raise ScheduleError(f"{here}: {what} before forward: F{m}@s{s} has not run on this rank")
                other = Action("I" if a.kind == "B" else "B", s, m)
                if other in seen:
                    raise ScheduleError(f"{here}: {other!r} already ran (action {seen[other]}); a microbatch runs "
                                        f"either B or I then W on a stage, never both (each parameter gradient "
                                        f"exactly once)")
                if s < S - 1:
                    if rk(s + 1) == r:
                        if Action("B", s + 1, m) not in seen and Action("I", s + 1, m) not in seen:
                            raise ScheduleError(f"{here}: {what} of stage {s} before the B or I of stage "
                                                f"{s + 1} (microbatch {m}) that gives its output gradient")
                    elif Action("RECV_B", s, m) not in seen:
                        raise ScheduleError(f"{here}: no RECV_B{m}@s{s} before it; its output gradient comes "
                                            f"from rank {rk(s + 1)} (stage {s + 1})")
                (where_B if a.kind == "B" else where_I)[(s, m)] = (r, i)
                if a.kind == "B":
                    live[s] -= 1
            elif a.kind == "W":
                if Action("B", s, m) in seen:
                    raise ScheduleError(f"{here}: B{m}@s{s} already computed the weight gradient (action "
                                        f"{seen[Action('B', s, m)]}); W after B counts it twice")
                if Action("I", s, m) not in seen:
                    raise ScheduleError(f"{here}: W before its I: I{m}@s{s} has not run on this rank (the weight "
                                        f"gradient needs the output gradient that I receives)")
                where_W[(s, m)] = (r, i)
                live[s] -= 1
            elif a.kind in ("SEND_F", "SEND_B"):
                srcs = [Action("F", s, m)] if a.kind == "SEND_F" else [Action("B", s, m), Action("I", s, m)]
                if not any(x in seen for x in srcs):
                    src = srcs[0] if a.kind == "SEND_F" else "B" + f"{m}@s{s} or I{m}@s{s}"
                    raise ScheduleError(f"{here}: sends the result of {src} before it is computed")
            seen[a] = i
        for a, i in seen.items():  # results other ranks need are sent
            snd = sched.produces(a)
            if snd is not None and snd not in seen:
                raise ScheduleError(f"{_at(r, i, a)}: its result is never sent ({snd!r} is missing); rank "
                                    f"{sched.message(snd).dst} needs it")
    for s in range(S):
        for m in range(M):
            r = rk(s)
            end = f"rank {r}, action {len(sched[r])} (end of list)"
            if (s, m) not in where_F:
                raise ScheduleError(f"{end}: F{m}@s{s} is missing; every stage runs F and B of every microbatch "
                                    f"(M={M}) exactly once")
            if (s, m) in where_I and (s, m) not in where_W:
                raise ScheduleError(f"{end}: W{m}@s{s} is missing after I{m}@s{s} (action {where_I[(s, m)][1]}); "
                                    f"without it the weight gradient of microbatch {m} is never computed")
            if (s, m) not in where_B and (s, m) not in where_I:
                raise ScheduleError(f"{end}: B{m}@s{s} is missing; every stage runs F and B of every microbatch "
                                    f"(M={M}) exactly once (or B split into I{m}@s{s} then W{m}@s{s})")

    # 4: pairing, in order, per channel (src, dst)
    sent, recvd = {}, {}
    for r in range(K):
        for i, a in enumerate(sched[r]):
            msg = sched.message(a)
            if msg is not None:
                src, dst, key = msg
                (sent if a.kind.startswith("SEND") else recvd).setdefault((src, dst), []).append((key, r, i, a))
    for ch in sorted(set(sent) | set(recvd)):
        snds, rcvs = sent.get(ch, []), recvd.get(ch, [])
        skeys, rkeys = {x[0] for x in snds}, {x[0] for x in rcvs}
        for key, rr, i, a in snds:
            if key not in rkeys:
                raise ScheduleError(f"{_at(rr, i, a)}: rank {ch[1]} never receives this message (missing receive)")
        for key, rr, i, a in rcvs:
            if key not in skeys:
                raise ScheduleError(f"{_at(rr, i, a)}: rank {ch[0]} never sends this message (missing send)")
        for j, (s_, r_) in enumerate(zip(snds, rcvs)):
            if s_[0] != r_[0]:
                _, rs, i_s, a_s = s_
                _, rr, i_r, a_r = r_
                raise ScheduleError(
                    f"{_at(rr, i_r, a_r)}: receive number {j} from rank {rs}, but rank {rs}'s send number {j} to "
                    f"rank {rr} is {a_s!r} (action {i_s}); sends and receives between two ranks must come in the "
                    f"same order (messages are matched in order)")

    # 6: deadlock
    idx = (advance_async if sends == "async" else advance_blocking)(sched)
    stuck = stuck_actions(sched, idx)
    if stuck:
        semantics = "async sends" if sends == "async" else "blocking (rendezvous) sends"
        raise ScheduleError(f"deadlock with {semantics}: " + "; ".join(stuck) + " - no rank can make progress")
    return sched
