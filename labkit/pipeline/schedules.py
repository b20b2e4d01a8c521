"""Pipeline schedules as data: for each rank, an ordered list of :class:`Action`.

A model is cut into ``n_stages`` consecutive stages. With ``K`` ranks and ``v`` chunks per
rank there are ``n_stages = K * v`` stages and stage ``s`` lives on rank ``s % K`` ("looped"
placement, Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", sec. 2.2; the same rule as ``torch.distributed.pipelining``).
With 16 layers on K=4 ranks and v=2, rank 0 holds stage 0 (layers 0-1) and stage 4
(layers 8-9).

An action is ``Action(kind, stage, microbatch)``; ``stage`` is always a stage that lives on
the rank that runs the action:

=========  ==============================================================================
kind       meaning (stage s, microbatch m)
=========  ==============================================================================
``F``      forward of stage s on microbatch m
``B``      full backward of stage s on microbatch m (input gradient and weight gradients)
``I``      input-gradient part of the backward (what stage s-1 waits for); torch's
           ``BACKWARD_INPUT``, the zero-bubble paper's "B" (Qi et al. 2024, sec. 2)
``W``      weight-gradient part of the backward, any time after the matching ``I`` on the
           same rank (nobody waits for it); torch's ``BACKWARD_WEIGHT``
``SEND_F`` send the output of F(s, m) to the rank of stage s+1
``RECV_F`` receive the input of F(s, m) from the rank of stage s-1
``SEND_B`` send the input gradient of B(s, m) (or I(s, m)) to the rank of stage s-1
``RECV_B`` receive the output gradient of B(s, m) (or I(s, m)) from the rank of stage s+1
=========  ==============================================================================

A (stage, microbatch) runs either ``B`` or the pair ``I`` then ``W``, never both.

So ``SEND_F m@s`` on one rank pairs with ``RECV_F m@s+1`` on the next, and ``SEND_B m@s``
pairs with ``RECV_B m@s-1``. Neighbouring stages on the same rank (K = 1) pass tensors
locally and need no send/receive. ``repr(Action("F", 1, 0))`` is ``F0@s1`` ("forward of
microbatch 0 on stage 1"); :func:`parse_actions` reads that notation back.

Communication semantics (what the runtime does and what :func:`~labkit.pipeline.validate.
validate_schedule` simulates): a SEND never blocks (an ``isend``; completed at the end of
the step); a RECV posts a receive at its place in the list and the rank blocks on it just
before the first F/B that needs the tensor. Between one pair of ranks messages are matched
in order (NCCL ignores tags), so the i-th send from rank a to rank b must be the i-th
receive on b from a.

Placement: "loop" (the default above) or "v" (zero-bubble V schedules, Qi et al. 2024,
sec. 6, and DualPipeV): with ``n_stages = 2K`` rank r holds stages r and 2K-1-r, so stage
K-1 and stage K are both on rank K-1 and the microbatch turns back there ("V" shape).
:func:`stage_rank` takes the placement; :meth:`Schedule.of` infers it once from the
schedule (:func:`infer_placement`), and the validator, simulator and runtime read it there.

A schedule is a ``dict[int, list[Action]]`` (rank -> actions). A learner can write the
compute order only (F and B actions) and let :func:`add_communication` insert the sends and
receives. :class:`Schedule` is that dict with its sizes (K, M, n_stages, placement) and the
answers to "which message does this action send, or wait for" (:meth:`Schedule.message`,
:meth:`Schedule.needs`, :meth:`Schedule.produces`); the validator returns one. Which named
schedules exist, and how each is built and run, is :mod:`.registry`.
"""
from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "Action", "ScheduleError", "COMPUTE", "COMM", "KINDS",
    "stage_rank", "parse_actions", "format_schedule", "add_communication",
    "gpipe_schedule", "one_f_one_b_schedule", "interleaved_schedule",
    "check_pipeline_sizes", "PLACEMENTS", "infer_placement", "infer_sizes", "interleaved_group",
    "interleaved_warmup", "Schedule", "Message",
]

COMPUTE = ("F", "B", "I", "W")
BACKWARD = ("B", "I")  # the kinds that produce the input gradient (consume the output gradient)
PLACEMENTS = ("loop", "v")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
KINDS = COMPUTE + COMM


class ScheduleError(ValueError):
    """A schedule (or the sizes it is built from) is invalid; the message names the rank,
    the action index and the rule that is broken."""


class Action(NamedTuple):
    """One step of one rank: ``kind`` (one of :data:`KINDS`), ``stage`` (index of the stage
    on this rank that the action belongs to), ``microbatch`` (0-based). Printed as
    ``F0@s1`` = kind, microbatch, ``@s``, stage."""

    kind: str
    stage: int
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}@s{self.stage}"

    __str__ = __repr__


def stage_rank(stage: int, K: int, placement: str = "loop") -> int:
    """Rank that holds ``stage`` with K ranks: ``stage % K`` for looped placement ("loop"),
    ``stage`` for stage < K and ``2K - 1 - stage`` above for V placement ("v", 2K stages)."""
    if placement == "v":
        return stage if stage < K else 2 * K - 1 - stage
    if placement != "loop":
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    return stage % K


def infer_placement(schedule: dict, n_stages: int | None = None) -> str:
    """"v" when the schedule has 2K stages (K = number of ranks >= 2) and every action's
    stage sits on its rank by V placement but not all do by looped placement; else "loop".

    So a looped schedule (and any schedule with a stage on the wrong rank) is judged by the
    looped rule, and the validator names that rule in its message."""
    K = len(schedule)
    acts = [(r, a[1]) for r in schedule for a in schedule[r]]
    S = n_stages if n_stages is not None else 1 + max((st for _, st in acts), default=0)
    if K < 2 or S != 2 * K or not all(isinstance(st, int) and 0 <= st < S for _, st in acts):
        return "loop"
    if all(stage_rank(st, K, "loop") == r for r, st in acts):
        return "loop"
    return "v" if all(stage_rank(st, K, "v") == r for r, st in acts) else "loop"


def infer_sizes(schedule: dict, n_microbatches: int | None = None, n_stages: int | None = None):
    """(K, M, n_stages) of a schedule (used by the validator and the simulator alike): K = number
    of ranks; M and n_stages default to one more than the largest microbatch and stage index used."""
    acts = [a for r in schedule for a in schedule[r]]
    M = n_microbatches if n_microbatches is not None else 1 + max((a[2] for a in acts), default=0)
    S = n_stages if n_stages is not None else 1 + max((a[1] for a in acts), default=0)
    return len(schedule), M, S


def parse_actions(text: str) -> list[Action]:
    """``"F0@s0 SEND_F0@s0 RECV_B0@s0 B0@s0"`` -> list of :class:`Action` (inverse of repr).

    Separators: spaces, commas or newlines. Raises ScheduleError on a malformed token."""
    out = []
    for tok in text.replace(",", " ").split():
        head, sep, st = tok.partition("@s")
        kind = head.rstrip("0123456789")
        mb = head[len(kind):]
        if not sep or kind not in KINDS or not mb or not st.isdigit():
            raise ScheduleError(f"cannot parse action {tok!r}: expected KIND<microbatch>@s<stage>, e.g. F0@s1, "
                                f"with KIND one of {', '.join(KINDS)}")
        out.append(Action(kind, int(st), int(mb)))
    return out


def format_schedule(schedule: dict, compute_only: bool = False) -> str:
    """One line per rank: ``rank 0: F0@s0 F1@s0 ...`` (only F/B when ``compute_only``)."""
    lines = []
    for r in sorted(schedule):
        acts = [a for a in schedule[r] if not compute_only or a.kind in COMPUTE]
        lines.append(f"rank {r}: " + " ".join(map(repr, acts)))
    return "\n".join(lines)


def interleaved_group(K: int, M: int) -> int:
    """Microbatches per round of interleaved 1F1B: ``M / max(1, M // K)``.

    torch.distributed.pipelining's ``ScheduleInterleaved1F1B`` runs ``rounds = max(1, M // K)``
    rounds of ``M / rounds`` microbatches; each round goes through chunk 0, then chunk 1, ...
    (Megatron-LM: groups of K, i.e. M a multiple of K). So K = 4, M = 6 runs one round of 6,
    K = 3, M = 8 two rounds of 4. Raises ScheduleError when ``rounds`` does not divide M (e.g.
    K = 2, M = 5: 2 rounds of 2.5)."""
    rounds = max(1, M // K)
    if M % rounds:
        raise ScheduleError(
            f"interleaved 1F1B with K={K} ranks needs M split into equal rounds (torch's "
            f"ScheduleInterleaved1F1B rule: rounds = max(1, M // K) = {rounds} must divide M); got M={M}: "
            f"choose M < 2K or a multiple of max(1, M // K), e.g. M={rounds * K} or M={(rounds + 1) * K}")
    return M // rounds


def check_pipeline_sizes(K: int, M: int, v: int = 1) -> None:
    """Raise ScheduleError unless K >= 1, M >= 1, v >= 1 and, for v >= 2, ``max(1, M // K)``
    divides M (:func:`interleaved_group`).

    The last rule is torch.distributed.pipelining's for ``ScheduleInterleaved1F1B``: the
    microbatches go through the chunks in equal rounds. Megatron-LM (Narayanan et al. 2021,
    sec. 2.2) asked for M a multiple of K, a special case (rounds of K); torch also runs
    M < K (one round of M) and e.g. K = 4, M = 6 (one round of 6)."""
    for name, val in (("K (pipeline ranks)", K), ("M (microbatches)", M), ("v (chunks per rank)", v)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ScheduleError(f"{name} must be an integer >= 1, got {val!r}")
    if v > 1:
        interleaved_group(K, M)


# ----------------------------------------------------------------------------- the Schedule object


class Message(NamedTuple):
    """A tensor that crosses a rank boundary: ``src`` and ``dst`` ranks and ``key`` =
    ``(direction, stage_from, microbatch)``, which names the tensor independent of the side
    (``("F", s, m)``: the output of F(s, m); ``("B", s, m)``: the input gradient of B/I(s, m))."""

    src: int
    dst: int
    key: tuple


class Schedule(dict):
    """A pipeline schedule with its shape: the dict ``{rank: [Action, ...]}`` itself, plus ``K``
    ranks, ``M`` microbatches, ``n_stages`` stages and the ``placement`` ("loop" or "v").

    It is a dict, so code that takes ``{rank: [Action]}`` takes a Schedule too (and a learner's
    dict stays what it was). :func:`~.validate.validate_schedule` returns one; :meth:`of`
    builds one from a dict without checking it. The messages between ranks are answered here,
    once: :meth:`message`, :meth:`needs`, :meth:`produces` (the semantics of the module
    docstring; torch.distributed.pipelining's action IR has the same F/B/I/W and send/receive
    kinds). The sizes are fixed when it is built: after editing the lists, build it again."""

    def __init__(self, actions: dict, K: int, M: int, n_stages: int, placement: str = "loop"):
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        super().__init__({r: list(actions[r]) for r in actions})
        self.K, self.M, self.n_stages, self.placement = K, M, n_stages, placement
        # rank_of as a table: the validator and the simulator ask it millions of times on a grid
        self._ranks = tuple(stage_rank(s, K, placement) for s in range(n_stages))

    @classmethod
    def of(cls, schedule, n_microbatches: int | None = None, n_stages: int | None = None,
           placement: str | None = None) -> "Schedule":
        """``schedule`` (a Schedule, returned as is when nothing is overridden, or a dict
        ``{rank: [Action or (kind, stage, microbatch)]}``) as a Schedule; M, n_stages and the
        placement default to what the actions use (:func:`infer_sizes`, :func:`infer_placement`).
        Checks nothing: validate with :func:`~.validate.validate_schedule`."""
        if isinstance(schedule, Schedule) and n_microbatches in (None, schedule.M) \
                and n_stages in (None, schedule.n_stages) and placement in (None, schedule.placement):
            return schedule
        acts = {r: [a if type(a) is Action else Action(*a) for a in schedule[r]] for r in schedule}
        K, M, S = infer_sizes(acts, n_microbatches, n_stages)
        return cls(acts, K, M, S, placement or infer_placement(acts, S))

    @property
    def actions(self) -> dict:
        """The plain dict ``{rank: [Action]}`` (a copy of the mapping; the lists are shared)."""
        return dict(self)

    @property
    def v(self) -> int:
        """Stages per rank (``n_stages // K``)."""
        return self.n_stages // self.K

    def rank_of(self, stage: int) -> int:
        """The rank that holds ``stage`` (:func:`stage_rank` with this placement)."""
        if 0 <= stage < self.n_stages:
            return self._ranks[stage]
        return stage_rank(stage, self.K, self.placement)

    def message(self, a: Action) -> Message | None:
        """The :class:`Message` a SEND/RECV action moves, or None for the compute kinds."""
        rk = self.rank_of
        if a.kind == "SEND_F":
            return Message(rk(a.stage), rk(a.stage + 1), ("F", a.stage, a.microbatch))
        if a.kind == "RECV_F":
            return Message(rk(a.stage - 1), rk(a.stage), ("F", a.stage - 1, a.microbatch))
        if a.kind == "SEND_B":
            return Message(rk(a.stage), rk(a.stage - 1), ("B", a.stage, a.microbatch))
        if a.kind == "RECV_B":
            return Message(rk(a.stage + 1), rk(a.stage), ("B", a.stage + 1, a.microbatch))
        return None

    def peer(self, a: Action) -> int:
        """The other rank of a SEND/RECV action."""
        msg = self.message(a)
        return msg.dst if a.kind.startswith("SEND") else msg.src

    def needs(self, a: Action) -> Action | None:
        """The RECV action that brings the remote input of an F/B/I action, or None (its input
        is local, or it is W, which needs only its own I)."""
        rk = self.rank_of
        if a.kind == "F" and a.stage > 0 and rk(a.stage - 1) != rk(a.stage):
            return Action("RECV_F", a.stage, a.microbatch)
        if a.kind in BACKWARD and a.stage < self.n_stages - 1 and rk(a.stage + 1) != rk(a.stage):
            return Action("RECV_B", a.stage, a.microbatch)
        return None

    def produces(self, a: Action) -> Action | None:
        """The SEND action that ships the result of an F/B/I action to another rank, or None."""
        rk = self.rank_of
        if a.kind == "F" and a.stage < self.n_stages - 1 and rk(a.stage + 1) != rk(a.stage):
            return Action("SEND_F", a.stage, a.microbatch)
        if a.kind in BACKWARD and a.stage > 0 and rk(a.stage - 1) != rk(a.stage):
            return Action("SEND_B", a.stage, a.microbatch)
        return None


# ----------------------------------------------------------------------------- communication


def add_communication(compute: dict, n_stages: int | None = None, lookahead: int = 1,
                      placement: str | None = None) -> dict:
    """Insert SEND/RECV actions into a compute-only schedule (F, B, I, W per rank).

    Each SEND goes right after the F/B that produces the tensor. Receives are posted
    early, ``lookahead`` compute actions before the one that needs the tensor (0: right
    before it), and in the order in which the peer sends, so that messages between a pair
    of ranks match in order. Posting early lets the transfer overlap compute; the rank
    still blocks only before the consuming F/B (see the module docstring).

    Args: ``compute``: ``{rank: [Action("F"|"B"|"I"|"W", stage, microbatch), ...]}`` for
    ranks 0..K-1; ``n_stages`` defaults to 1 + the largest stage index; ``placement``
    "loop" or "v" (None: :func:`infer_placement`). Returns a new dict. Raises ScheduleError
    if an action is not a compute kind.
    """
    K = len(compute)
    acts = [a for r in compute for a in compute[r]]
    for r in compute:
        for i, a in enumerate(compute[r]):
            if a.kind not in COMPUTE:
                raise ScheduleError(f"rank {r}, action {i} ({a!r}): add_communication takes compute actions "
                                    f"({', '.join(COMPUTE)}) only")
    if n_stages is None:
        n_stages = 1 + max((a.stage for a in acts), default=0)
    top = Schedule(compute, K, 1, n_stages, placement or infer_placement(compute, n_stages))
    # the order in which each sender emits messages on each channel (src, dst)
    sent_order: dict = {}
    for r in sorted(compute):
        for a in compute[r]:
            snd = top.produces(a)
            if snd is not None:
                src, dst, key = top.message(snd)
                sent_order.setdefault((src, dst), []).append(key)
    out = {}
    for r in sorted(compute):
        ops = compute[r]
        cursor = {}  # src -> how many of that channel's messages are posted
        posted = set()
        seq: list[Action] = []

        def post_up_to(recv: Action):
            src, dst, key = top.message(recv)
            order = sent_order.get((src, dst), [])
            if key in posted:
                return
            if key not in order:  # nobody sends it: post it anyway, the validator will say so
                posted.add(key)
                seq.append(recv)
                return
            i = cursor.get(src, 0)
            while i < len(order):
                k = order[i]
                kind = "RECV_F" if k[0] == "F" else "RECV_B"
                stage = k[1] + 1 if k[0] == "F" else k[1] - 1
                seq.append(Action(kind, stage, k[2]))
                posted.add(k)
                i += 1
                if k == key:
                    break
            cursor[src] = i

        for j, a in enumerate(ops):
            for ahead in ops[j:j + lookahead + 1]:
                need = top.needs(ahead)
                if need is not None:
                    post_up_to(need)
            seq.append(a)
            snd = top.produces(a)
            if snd is not None:
                seq.append(snd)
        out[r] = seq
    return out


# ----------------------------------------------------------------------------- builders


def interleaved_warmup(K: int, M: int, v: int, r: int) -> int:
    """Warm-up forwards of rank r before its first backward (interleaved 1F1B, v >= 1).

    v = 1: ``min(K - r - 1, M)`` (PipeDream-Flush, Narayanan et al. 2021 sec. 2.2.1).
    v >= 2: ``min((v - 1) g + 2 (K - r - 1), v M)`` with g microbatches per round
    (:func:`interleaved_group`; g = K when K divides M): today's rule in Megatron-Core
    (``forward_backward_pipelining_with_interleaving``: ``(num_model_chunks - 1) *
    microbatch_group_size_per_vp_stage + 2 (pp_size - rank - 1)``) and torch's
    ``ScheduleInterleaved1F1B`` (``get_rank_warmup_ops``). Megatron-LM v2 (2021) ran every
    forward first when M = K (``all_warmup_microbatches``), so its last rank held 2K chunks
    at v = 2; with today's rule it holds K + 1."""
    if v == 1:
        return min(K - r - 1, M)
    return min((v - 1) * interleaved_group(K, M) + 2 * (K - r - 1), v * M)


def _interleaved_order(K: int, M: int, v: int, r: int) -> list[Action]:
    """F/B order of rank r in interleaved 1F1B (v = 1: plain 1F1B).

    With g microbatches per round (:func:`interleaved_group`), the k-th forward of a rank runs
    model chunk ``(k // g) % v`` on microbatch ``(k // (g v)) g + k % g``: each round of g
    microbatches goes through chunk 0, then chunk 1, ... Backward visits the chunks in reverse
    (the j-th backward: chunk ``v - 1 - (j // g) % v``). Warm-up: :func:`interleaved_warmup`
    forwards; then one forward, one backward in turn; finally the remaining backwards.
    """
    total = v * M
    g = interleaved_group(K, M) if v > 1 else K

    def chunk_mb(k):
        rnd, j = divmod(k, g * v)
        return j // g, rnd * g + j % g

    def fwd(k):
        c, m = chunk_mb(k)
        return Action("F", c * K + r, m)

    def bwd(k):
        c, m = chunk_mb(k)
        return Action("B", (v - 1 - c) * K + r, m)

    warmup = interleaved_warmup(K, M, v, r)
    order = [fwd(k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [fwd(warmup + i), bwd(i)]
    order += [bwd(i) for i in range(total - warmup, total)]
    return order


def gpipe_schedule(K: int, M: int) -> dict:
    """GPipe (Huang et al. 2019, sec. 2.2): every rank runs the forwards of all M
    microbatches, then their backwards (in the same order, as torch's ScheduleGPipe).

    K ranks, one stage each (stage r on rank r). Returns ``{rank: [Action, ...]}`` with
    sends/receives. Bubble with uniform stage costs: (K-1)/(M+K-1) of the step; every stage
    holds all M microbatches' activations at its peak. Raises ScheduleError for K < 1 or
    M < 1."""
    check_pipeline_sizes(K, M)
    compute = {r: [Action("F", r, m) for m in range(M)] + [Action("B", r, m) for m in range(M)]
               for r in range(K)}
    return add_communication(compute, K)


def one_f_one_b_schedule(K: int, M: int) -> dict:
    """1F1B / PipeDream-Flush (Narayanan et al. 2021, sec. 2.2.1; Harlap et al. 2018):
    rank r runs ``min(K - r - 1, M)`` warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards. Same bubble as GPipe, (K-1)/(M+K-1), but
    stage s holds at most ``min(M, K - s)`` microbatches in flight. M < K is allowed (the
    warm-up is capped at M). Raises ScheduleError for K < 1 or M < 1."""
    check_pipeline_sizes(K, M)
    return add_communication({r: _interleaved_order(K, M, 1, r) for r in range(K)}, K)


def interleaved_schedule(K: int, M: int, v: int) -> dict:
    """Interleaved 1F1B (Narayanan et al. 2021, sec. 2.2.2): each rank holds v model chunks
    (stages r, r+K, ..., r+(v-1)K), so a microbatch visits every rank v times. Bubble with
    uniform costs (backward = forward per chunk): (K-1)/(vM+K-1), v times smaller than
    1F1B's in bubble time.

    Follows torch's ``ScheduleInterleaved1F1B`` and today's Megatron-Core: microbatches go
    through the chunks in rounds of ``g = M / max(1, M // K)`` (:func:`interleaved_group`;
    g = K when K divides M, as Megatron-LM required), and rank r runs
    ``(v-1) g + 2 (K-r-1)`` warm-up forwards (:func:`interleaved_warmup`), also at M = K
    (Megatron-LM v2 then ran all forwards first). Peak in flight on rank r: that warm-up plus
    one chunk-microbatch, at most v M. v = 1 is plain 1F1B. Raises ScheduleError on K, M,
    v < 1 or rounds that do not divide M (e.g. K = 2, M = 5)."""
    check_pipeline_sizes(K, M, v)
    return add_communication({r: _interleaved_order(K, M, v, r) for r in range(K)}, K * v)
