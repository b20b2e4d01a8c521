"""Kernel side of notebook 12_deepseek_moe's exercises, whose cases are in
:mod:`labkit.grading.exercises.nb12_deepseek_moe` (what runs here and why: :mod:`labkit.grading.kernelside`).
"""
from __future__ import annotations

from ..registry import CheckFailure


def _gate_lines(answer):
    """Kernel side: the learner's dict with each function replaced by ("function", module,
    qualname), so it can travel as data."""
    if callable(answer) and not isinstance(answer, dict):
        answer = answer()          # a function returning the dict (what the notebook asks for)
    if not isinstance(answer, dict):
        return answer
    out = {}
    for name, entry in answer.items():
        if isinstance(entry, (tuple, list)) and len(entry) == 2 and callable(entry[0]):
            where = getattr(entry[0], "__func__", entry[0])
            entry = (("function", str(getattr(where, "__module__", "")), str(getattr(where, "__qualname__", ""))),
                     entry[1])
        out[name] = entry
    return out


def _v3_fields(answer) -> dict:
    """Kernel side: the fields of the MoEConfig the learner's function returns, as a dict."""
    import dataclasses

    from ...moe import MoEConfig

    cfg = answer() if callable(answer) and not isinstance(answer, MoEConfig) else answer
    if not isinstance(cfg, MoEConfig):
        raise CheckFailure(f"deepseek_v3_gate() must return a labkit.moe.MoEConfig, got {type(cfg).__name__}")
    return dataclasses.asdict(cfg)
