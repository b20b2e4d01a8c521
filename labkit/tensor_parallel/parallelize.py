"""Apply a parallelization plan: a table from module names to split rules.

torchtitan's ``parallelize_module(model, mesh, plan)`` idea, on labkit's layers: the plan is a
dict whose keys are qualified module names, ``*`` matching one name part (``"blocks.*"`` is every
block, not their children), and whose values are rules ``rule(module, group) -> module`` that
build the tensor-parallel replacement from the reference module (keeping this rank's shard).
The GPT's plan is :func:`labkit.tensor_parallel.model.gpt_plan`; a composition adds its own rules
(for example the MoE blocks, :mod:`labkit.parallel`).
"""
from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Callable

import torch.nn as nn

__all__ = ["parallelize", "plan_rule_for"]


def _matches(pattern: str, name: str) -> bool:
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(fnmatchcase(n, p) for p, n in zip(parts, names))


def plan_rule_for(plan: dict, name: str) -> Callable | None:
    """The rule of the first key of ``plan`` that matches the qualified module ``name``, or None."""
    for pattern, rule in plan.items():
        if _matches(pattern, name):
            return rule
    return None


def parallelize(model: nn.Module, group, plan: dict) -> nn.Module:
    """Replace, in place, every submodule of ``model`` whose qualified name matches a key of
    ``plan`` with ``rule(submodule, group)`` (outermost match wins; its children are not visited),
    then call ``model.tie_weights()`` when the model has it (a tied embedding and output layer
    must share the new shards). Returns ``model``. Keys that match nothing are allowed (a
    pipeline stage may lack the embedding or the head). Raises what a rule raises (ValueError
    when t does not divide a size), before any communication."""
    def visit(parent: nn.Module, prefix: str) -> None:
        for name, child in list(parent.named_children()):
            full = prefix + name
            rule = plan_rule_for(plan, full)
            if rule is not None:
                setattr(parent, name, rule(child, group))
            else:
                visit(child, full + ".")

    visit(model, "")
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    return model
