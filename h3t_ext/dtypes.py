"""Bytes per element of every dtype the project prices: the one definition (the cost model, the planner and the
driver import these names; ``tests/unit/test_dtypes.py`` fails on a second definition).

The sizes are the IEEE 754 / OCP formats' storage widths, as ``torch.<name>.itemsize`` gives them: FP8 is either of
TransformerEngine's 8-bit formats (E4M3, E5M2; ``--fp8-format e4m3|hybrid``), E8M0 the 8-bit power-of-two scale of
MXFP8 block scaling (OCP Microscaling Formats v1.0), BOOL a PyTorch bool tensor (one byte per element, e.g. CUDA's
dropout mask), INT64 a ``torch.long`` (the cross entropy's targets).
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Final, Literal, Mapping, get_args

FP8: Final[int] = 1
"""torch.float8_e4m3fn / torch.float8_e5m2: one byte."""
E8M0: Final[int] = 1
"""torch.float8_e8m0fnu, MXFP8's per-block scale: one byte."""
BF16: Final[int] = 2
"""torch.bfloat16: 8 exponent + 7 mantissa bits + sign."""
FP16: Final[int] = 2
"""torch.float16: IEEE 754 binary16."""
FP32: Final[int] = 4
"""torch.float32: IEEE 754 binary32."""
FP64: Final[int] = 8
"""torch.float64: IEEE 754 binary64."""
INT64: Final[int] = 8
"""torch.int64 (torch.long)."""
BOOL: Final[int] = 1
"""torch.bool: one byte per element."""

DtypeName = Literal["float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "bfloat16", "float16", "float32", "float64",
                    "int64", "bool"]
"""The torch dtype names (``str(torch.bfloat16)`` without ``torch.``) with a size here."""

_BYTES: Mapping[str, int] = MappingProxyType(dict(zip(get_args(DtypeName), (FP8, FP8, E8M0, BF16, FP16, FP32, FP64,
                                                                            INT64, BOOL), strict=True)))


def bytes_per_element(name: DtypeName) -> int:
    """Bytes per element of the torch dtype called ``name`` (e.g. 'bfloat16'); ValueError (one line, naming the
    valid names) for any other name."""
    try:
        return _BYTES[name]
    except (KeyError, TypeError):
        raise ValueError(f"dtype {name!r} is not one of {', '.join(_BYTES)}") from None


__all__ = ["BF16", "BOOL", "E8M0", "FP16", "FP32", "FP64", "FP8", "INT64", "DtypeName", "bytes_per_element"]
