"""The wire formats: Horovod-style compressors and ``Compression`` (none, fp16, bf16), and the ``Config.compression``
name of one."""

from __future__ import annotations

import torch


class Compressor:
    """Horovod's compressor interface: ``compress(tensor) -> (tensor, ctx)``, ``decompress(tensor, ctx)``.

    ``name`` is the wire format (``Config.compression``) an engine uses for it.
    """

    name = "none"

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: object) -> torch.Tensor:
        return tensor


class NoneCompressor(Compressor):
    """No compression (the default)."""


class _CastCompressor(Compressor):
    """Floating tensors travel as ``wire``; other dtypes are left alone (as Horovod's FP16Compressor)."""

    wire = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        return (tensor.to(cls.wire) if tensor.dtype.is_floating_point else tensor), tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: object) -> torch.Tensor:
        return tensor.to(ctx) if isinstance(ctx, torch.dtype) and ctx.is_floating_point else tensor


class FP16Compressor(_CastCompressor):
    """Floating tensors as float16."""

    name = "fp16"
    wire = torch.float16


class BF16Compressor(_CastCompressor):
    """Floating tensors as bfloat16."""

    name = "bf16"
    wire = torch.bfloat16


class Compression:
    """Wire formats, as Horovod's ``Compression``: ``compression=Compression.fp16`` halves float32 bytes.

    Each is a compressor class (``compress``/``decompress``, for the tensor collectives) with a
    ``name`` (``"none"``, ``"fp16"``, ``"bf16"``: the ``Config.compression`` string, which is
    accepted too). In an engine, servers accumulate 16-bit pushes in float32; results travel back
    in the wire format. This changes numerics (gradients are rounded to 16 bits twice).
    """

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


def compression_name(value: object) -> str | None:
    """``Config.compression`` for ``value``: a ``Compression`` member (class or instance), its name, or None.

    Call it where an engine's config is built from user arguments; a custom compressor is refused
    (engines compress on the wire between workers and servers, in one of the three formats).
    """
    if value is None or isinstance(value, str):
        return value
    kind = value if isinstance(value, type) else type(value)
    if issubclass(kind, Compressor) and kind.name in ("none", "fp16", "bf16"):
        return kind.name
    from .errors import IMergeConfigError

    raise IMergeConfigError(f"IMerge: compression={value!r} is not Compression.none, fp16 or bf16; gradients are "
                            "compressed on the wire to the servers in one of those formats, custom compressors "
                            "cannot run there")
