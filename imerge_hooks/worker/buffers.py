"""A plan's buffers: for each group of parameters, the flat gradient buffer (``param.grad`` becomes a view
into it), the result and staging buffers and the keys it travels as. Built once per plan epoch
(``GradientEngine.set_layout``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ..cluster import devices
from ..core.layout import Placement, cut_keys, names_in_range, wire_dtype
from ..core.memory import Arena
from ..core.wire import SUPPORTED_DTYPES, KeySpec
from . import streams
from .group import Group


@dataclass
class Layout:
    """What ``build_layout`` made: the groups, each parameter's gradient view (None: not in the plan),
    each swap group member's view into its result, and each parameter's group and presence slot."""

    groups: list[Group]
    views: list[torch.Tensor | None]
    spare: list[torch.Tensor | None]
    group_of: list[int]
    presence_slot: list[int]


def group_sizes(params: Sequence[torch.Tensor], plan: list[list[int]], compression: str) -> list[tuple]:
    """(dtype, device, elements, wire dtype) of each group of ``plan``: its gradients, one presence flag per
    tensor (``had_gradient``) and one "this worker trains" flag (``shadow_round``)."""
    shapes = []
    for gi, members in enumerate(plan):
        dtypes = {params[i].dtype for i in members}
        kinds = {params[i].device for i in members}
        if len(dtypes) != 1 or len(kinds) != 1:
            raise ValueError(f"IMerge: plan group {gi} mixes dtypes/devices {dtypes} {kinds}; "
                             "groups must be homogeneous")
        dtype, device = dtypes.pop(), kinds.pop()
        shapes.append((dtype, device, sum(params[i].numel() for i in members) + len(members) + 1,
                       wire_dtype(dtype, compression)))
    return shapes


def count_keys(params: Sequence[torch.Tensor], plan: list[list[int]], compression: str,
               partition_bytes: int | None, key_spread: int) -> int:
    """How many keys ``plan``'s groups are cut into (``cut_keys``), before any buffer exists."""
    return sum(len(cut_keys(total, wire.itemsize, partition_bytes, key_spread))
               for _, _, total, wire in group_sizes(params, plan, compression))


def build_layout(params: Sequence[torch.Tensor], names: Sequence[str], plan: list[list[int]], compression: str,
                 partition_bytes: int | None, key_spread: int, placement: Placement, key_ids: Iterator[int],
                 host_sums: bool) -> Layout:
    """The groups of ``plan`` (lists of parameter indices, in send order) with their buffers and keys.

    Host buffers of CPU groups come from two huge-page arenas (gradients, results). A parameter's
    current gradient is copied into its view; one without a gradient keeps None. ``host_sums``: the
    workers of this host sum keys on the host (a CUDA group then stages through pinned memory)."""
    shapes = group_sizes(params, plan, compression)
    flats = iter(Arena([(n, d) for d, dev, n, _ in shapes if dev.type == "cpu"]).tensors)
    results = iter(Arena([(n, w) for _, dev, n, w in shapes if dev.type == "cpu"]).tensors)
    layout = Layout([], [None] * len(params), [None] * len(params), [-1] * len(params), [-1] * len(params))
    for gi, members in enumerate(plan):
        dtype, device, total, wire = shapes[gi]
        flat = next(flats) if device.type == "cpu" else _device_buffer(total, dtype, device)
        spans = _gradient_views(params, names, members, flat, layout, gi)
        if device.type == "cpu":
            swap = wire == dtype
            result = next(results)
            staging = None if swap else torch.empty(total, dtype=wire)
        else:
            swap = False
            result, staging = _device_exchange_buffers(total, dtype, wire, device, host_sums)
        if swap:
            for i, (_, off, n) in zip(members, spans):
                layout.spare[i] = result[off:off + n].view_as(params[i])
        ranges = cut_keys(total, wire.itemsize, partition_bytes, key_spread)
        keys = [KeySpec(next(key_ids), (end - start) * wire.itemsize, SUPPORTED_DTYPES[wire],
                        placement.place((end - start) * wire.itemsize), names_in_range(spans, start, end))
                for start, end in ranges]
        layout.groups.append(Group(index=gi, flat=flat, result=result, keys=keys, key_ranges=ranges,
                                   priority=min(members), names=tuple(names[i] for i in members), staging=staging,
                                   members=list(members), swap=swap, presence_at=sum(n for _, _, n in spans)))
    return layout


def _gradient_views(params: Sequence[torch.Tensor], names: Sequence[str], members: list[int], flat: torch.Tensor,
                    layout: Layout, gi: int) -> list[tuple[str, int, int]]:
    """Point each member's gradient at its slice of ``flat``; (name, offset, elements) of each."""
    spans = []
    offset = 0
    for i in members:
        p = params[i]
        view = flat[offset:offset + p.numel()].view_as(p)
        if p.grad is not None:  # a parameter without a gradient keeps None
            view.copy_(p.grad)
            p.grad = view
        layout.views[i] = view
        spans.append((names[i], offset, p.numel()))
        layout.group_of[i] = gi
        layout.presence_slot[i] = len(spans) - 1
        offset += p.numel()
    return spans


def _device_buffer(total: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A gradient or result buffer on a CUDA device, used on its copy stream as well."""
    buffer = torch.zeros(total, dtype=dtype, device=device)
    streams.keep_for_copies(buffer)
    return buffer


def _device_exchange_buffers(total: int, dtype: torch.dtype, wire: torch.dtype, device: torch.device,
                             host_sums: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A CUDA group's (result, staging): on the device where MPI reads device memory (staging only
    to convert to the wire dtype), else in pinned host memory, so the copies are asynchronous.
    Host aggregation sums on the host, so it stages."""
    if devices.mpi_reads_device() and not host_sums:
        staging = None if wire == dtype else _device_buffer(total, wire, device)
        return _device_buffer(total, wire, device), staging
    return (torch.zeros(total, dtype=wire, pin_memory=True),
            torch.empty(total, dtype=wire, pin_memory=True))
