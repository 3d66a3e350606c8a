"""Reduction operators (Horovod's ``ReduceOp`` and its argument rules), shared by the optimizer and the
tensor collectives."""

from __future__ import annotations

import enum
import warnings
from typing import Any

from .errors import IMergeConfigError


class ReduceOp(enum.IntEnum):
    """Horovod's reduction ops (same values as Horovod's ``ReduceOp``)."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average, Sum, Adasum, Min, Max, Product = (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum, ReduceOp.Min,
                                           ReduceOp.Max, ReduceOp.Product)

def reduce_op(op: Any, where: str = "IMerge") -> ReduceOp:
    """``op`` as a ReduceOp; Adasum and unknown values raise IMergeConfigError."""
    try:
        value = ReduceOp(op)
    except ValueError:
        raise IMergeConfigError(f"{where}: unknown reduction op {op!r}; use imerge_hooks.Average, Sum, Min, Max "
                                "or Product") from None
    if value is ReduceOp.Adasum:
        raise IMergeConfigError(f"{where}: op=Adasum is not supported by IMerge (its servers sum gradients); use "
                                "op=imerge_hooks.Average")
    return value


SUMMING_OPS = (ReduceOp.Average, ReduceOp.Sum)


def summing_op(op: Any, where: str) -> ReduceOp:
    """``op`` as a ReduceOp that a sum gives (Average or Sum): what the servers do with gradients, and what a
    sparse allreduce's gathered values add up to. Anything else raises IMergeConfigError naming ``where``."""
    value = reduce_op(op, where)
    if value not in SUMMING_OPS:
        raise IMergeConfigError(f"{where}: op={value.name} is not supported: the values are summed; use "
                                "op=imerge_hooks.Average or op=imerge_hooks.Sum")
    return value


def resolve_op(op: Any, average: bool | None, where: str = "IMerge") -> ReduceOp:
    """Horovod's ``average=`` (deprecated) and ``op=`` rule: only one of them; default Average."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        return ReduceOp.Average if average else ReduceOp.Sum
    return ReduceOp.Average if op is None else reduce_op(op, where)
