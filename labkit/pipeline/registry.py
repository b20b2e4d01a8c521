"""The one table of pipeline schedules: name -> builder, placement, stages per rank, runtime
class, bubble formula, label and the spellings users type.

Everything that offers a choice of schedule reads it: the labs' ``--schedule`` options,
:mod:`labkit.parallel`, the planner (:mod:`labkit.plan`), the explorer and the benchmarks.
Like torch.distributed.pipelining's one name map (``get_schedule_class``), a name is
looked up without regard to case, and the other spellings in use (``zbh1``, ``ZB-V``,
``Interleaved 1F1B``) lead to the same entry (:func:`lookup`, :func:`canonical`).

``dualpipe`` (DeepSeek-V3's full DualPipe: two copies of the parameters, microbatches fed
from both ends) is known to the planner only; nothing here builds or runs it.

This module imports no torch (the planner reads it); the runtime classes, in
:mod:`.schedule_classes`, are imported when :attr:`ScheduleInfo.runtime_class` is asked for.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable

from .schedules import ScheduleError, gpipe_schedule, interleaved_schedule, one_f_one_b_schedule
from .simulate import bubble_formula
from .zero_bubble import bubble_time_formula, dualpipev_overlapped, dualpipev_schedule, zb_h1_schedule, zbv_schedule

__all__ = ["ScheduleInfo", "REGISTRY", "lookup", "canonical", "names"]


@dataclass(frozen=True)
class ScheduleInfo:
    """One schedule. ``name``: the canonical spelling (``"zb-h1"``); ``label``: how plots and
    the explorer write it (``"ZB-H1"``); ``aliases``: other accepted spellings (lower case);
    ``build(K, M, v)`` -> ``{rank: [Action]}`` (None: planner only); ``placement``: "loop"
    (stage s on rank s % K) or "v" (rank r holds stages r and 2K-1-r); ``chunks``: stages per
    rank v (None: any v >= 1, chosen by the user); ``runtime``: the class name in
    :mod:`.schedule_classes` (torch's where torch has it); ``torch_name``: torch.distributed.pipelining's
    nearest class; ``zero_bubble``: backward split into I and W; ``min_microbatches(K)``:
    the least M it runs with; ``formula``: its bubble as text; ``planned``: the planner
    (:mod:`labkit.plan`) has its memory and time formulas."""

    name: str
    label: str
    aliases: tuple = ()
    build: Callable | None = None
    placement: str = "loop"
    chunks: int | None = 1
    runtime: str | None = None
    torch_name: str | None = None
    zero_bubble: bool = False
    formula: str = ""
    planned: bool = False
    min_microbatches: Callable[[int], int] = field(default=lambda K: 1)

    @property
    def runtime_class(self):
        """The :class:`~.runtime.PipelineSchedule` subclass that runs this schedule."""
        if self.runtime is None:
            raise ValueError(f"schedule {self.name!r} is known to the planner only; it has no runtime")
        from . import schedule_classes
        return getattr(schedule_classes, self.runtime)

    @property
    def v_shaped(self) -> bool:
        """Two stages per rank in V placement (ZB-V, DualPipeV)."""
        return self.placement == "v"

    def v(self, chunks: int | None = None) -> int:
        """Stages per rank: the schedule's own (1 or 2), or ``chunks`` (default 2) when it
        takes any v (interleaved 1F1B)."""
        if self.chunks is not None:
            return self.chunks
        return 2 if chunks is None else chunks

    def n_stages(self, K: int, chunks: int | None = None) -> int:
        """Stages of the model with K pipeline ranks (``K * v``)."""
        return K * self.v(chunks)

    def schedule(self, K: int, M: int, chunks: int | None = None) -> dict:
        """The ``{rank: [Action]}`` data for K ranks and M microbatches (ScheduleError on sizes
        the schedule does not allow)."""
        if self.build is None:
            raise ValueError(f"schedule {self.name!r} is known to the planner only; nothing builds it")
        return self.build(K, M, self.v(chunks))

    def overlapped(self, K: int, M: int) -> dict | None:
        """DualPipeV's overlapped F&B pairs (:func:`~.zero_bubble.dualpipev_overlapped`), else None."""
        return dualpipev_overlapped(K, M) if self.name == "dualpipev" else None

    def bubble_fraction(self, K: int, M: int, chunks: int | None = None) -> Fraction | None:
        """Idle fraction with uniform stages and b = f (:func:`~.simulate.bubble_formula`):
        GPipe, 1F1B and interleaved; None for the others (their bubble is a time)."""
        if self.zero_bubble or self.build is None:
            return None
        return bubble_formula(K, M, self.v(chunks))

    def bubble_time(self, K: int, T_F=1, T_I=1, T_W=1, T_FB=None):
        """Bubble time per rank (:func:`~.zero_bubble.bubble_time_formula`): 1F1B and the
        zero-bubble schedules; None for the others."""
        if self.name != "1f1b" and not self.zero_bubble:
            return None
        return bubble_time_formula(self.name, K, T_F, T_I, T_W, T_FB)


def _one_stage(builder):
    def build(K, M, v):
        if v != 1:
            raise ScheduleError(f"this schedule runs one stage per rank (v = 1), got v={v}")
        return builder(K, M)
    return build


REGISTRY: dict[str, ScheduleInfo] = {e.name: e for e in (
    ScheduleInfo("gpipe", "GPipe", (), _one_stage(gpipe_schedule), runtime="ScheduleGPipe", planned=True,
                 torch_name="ScheduleGPipe", formula="(K-1)/(M+K-1)"),
    ScheduleInfo("1f1b", "1F1B", ("pipedream-flush",), _one_stage(one_f_one_b_schedule), runtime="Schedule1F1B",
                 planned=True,
                 torch_name="Schedule1F1B", formula="(K-1)/(M+K-1)"),
    ScheduleInfo("interleaved", "Interleaved 1F1B", ("interleaved 1f1b", "interleaved1f1b", "interleaved-1f1b"),
                 interleaved_schedule, chunks=None, runtime="ScheduleInterleaved1F1B", planned=True,
                 torch_name="ScheduleInterleaved1F1B", formula="(K-1)/(vM+K-1)"),
    ScheduleInfo("zb-h1", "ZB-H1", ("zbh1", "zb_h1"), _one_stage(zb_h1_schedule), runtime="ScheduleZBH1",
                 torch_name="ScheduleInterleavedZeroBubble", zero_bubble=True, formula="(K-1)(T_F+T_I-T_W)"),
    ScheduleInfo("zbv", "ZB-V", ("zb-v", "zb_v"), lambda K, M, v: zbv_schedule(K, M), placement="v", chunks=2,
                 runtime="ScheduleZBVZeroBubble", torch_name="ScheduleZBVZeroBubble", zero_bubble=True,
                 formula="(K-1)T_F when T_F=T_I=T_W"),
    ScheduleInfo("dualpipev", "DualPipeV", ("dualpipe-v", "dualpipe_v"), lambda K, M, v: dualpipev_schedule(K, M),
                 placement="v", chunks=2, runtime="ScheduleDualPipeV", torch_name="ScheduleDualPipeV",
                 zero_bubble=True, formula="(K-1)(F&B+B-3W), F&B=F+B", min_microbatches=lambda K: 2 * K),
    ScheduleInfo("dualpipe", "DualPipe", (), formula="(p/2-1)(F&B+B-3W)", planned=True),
)}

_SPELLINGS = {s: e.name for e in REGISTRY.values() for s in (e.name, e.label.lower()) + e.aliases}


def canonical(name: str) -> str:
    """The canonical name of a spelling (case and surrounding blanks ignored: ``"ZB-H1"``,
    ``"zbh1"`` -> ``"zb-h1"``); an unknown name is returned lower-cased, unchanged
    otherwise (argparse's ``choices`` then names the valid ones)."""
    key = name.strip().lower()
    return _SPELLINGS.get(key, key)


def lookup(name: str) -> ScheduleInfo:
    """The :class:`ScheduleInfo` of any accepted spelling; ValueError naming the choices."""
    key = canonical(name)
    if key not in REGISTRY:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(REGISTRY)}")
    return REGISTRY[key]


def names(runs: bool | None = True, zero_bubble: bool | None = None, planned: bool | None = None) -> tuple:
    """Canonical names in table order; ``runs``: True (default) those with a runtime, False
    the planner-only ones, None all; ``zero_bubble``, ``planned``: filter on those fields
    (None: either)."""
    return tuple(e.name for e in REGISTRY.values()
                 if (runs is None or (e.runtime is not None) == runs)
                 and (zero_bubble is None or e.zero_bubble == zero_bubble)
                 and (planned is None or e.planned == planned))
