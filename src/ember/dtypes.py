"""dtype objects and PyTorch's type-promotion rules.

Every layer names dtypes through the `DType` objects defined here; NumPy, ml_dtypes
and torch dtypes are converted at the edges with `to_numpy`, `from_numpy` and
`to_torch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True, eq=False)
class DType:
    name: str
    itemsize: int
    kind: str  # "bool", "int", "uint" or "float"
    np: np.dtype

    @property
    def is_floating_point(self) -> bool:
        return self.kind == "float"

    @property
    def is_integer(self) -> bool:
        return self.kind in ("int", "uint")

    @property
    def is_signed(self) -> bool:
        return self.kind in ("int", "float")

    @property
    def category(self) -> int:
        """0 for bool, 1 for integers, 2 for floating point (promotion's coarse order)."""
        return {"bool": 0, "int": 1, "uint": 1, "float": 2}[self.kind]

    def __repr__(self) -> str:
        return f"ember.{self.name}"

    def __reduce__(self):
        return (_by_name, (self.name,))


bool_ = DType("bool", 1, "bool", np.dtype(np.bool_))
uint8 = DType("uint8", 1, "uint", np.dtype(np.uint8))
int8 = DType("int8", 1, "int", np.dtype(np.int8))
int16 = DType("int16", 2, "int", np.dtype(np.int16))
int32 = DType("int32", 4, "int", np.dtype(np.int32))
int64 = DType("int64", 8, "int", np.dtype(np.int64))
float16 = DType("float16", 2, "float", np.dtype(np.float16))
bfloat16 = DType("bfloat16", 2, "float", np.dtype(ml_dtypes.bfloat16))
float32 = DType("float32", 4, "float", np.dtype(np.float32))
float64 = DType("float64", 8, "float", np.dtype(np.float64))

ALL = (bool_, uint8, int8, int16, int32, int64, float16, bfloat16, float32, float64)
FLOATS = (float16, bfloat16, float32, float64)
_BY_NAME = {d.name: d for d in ALL}
_BY_NP = {d.np: d for d in ALL}
ALIASES = {"half": float16, "float": float32, "double": float64, "long": int64, "int": int32,
           "short": int16, "bool": bool_}

default_float = float32


def _by_name(name: str) -> DType:
    return _BY_NAME[name]


def as_dtype(x) -> DType:
    """Accept an ember DType, a name ("float32", "half"), a NumPy dtype or a torch dtype."""
    if isinstance(x, DType):
        return x
    if isinstance(x, str):
        name = x.removeprefix("torch.").removeprefix("ember.")
        if name in _BY_NAME:
            return _BY_NAME[name]
        if name in ALIASES:
            return ALIASES[name]
        raise TypeError(f"unknown dtype {x!r}; expected one of {', '.join(_BY_NAME)}")
    if x is bool:
        return bool_
    if x is int:
        return int64
    if x is float:
        return default_float
    if type(x).__module__ == "torch":
        return as_dtype(str(x))
    try:
        npd = np.dtype(x)
    except TypeError:
        raise TypeError(f"unknown dtype {x!r}") from None
    if npd in _BY_NP:
        return _BY_NP[npd]
    raise TypeError(f"dtype {npd} is not supported by ember; supported: {', '.join(_BY_NAME)}")


def from_numpy(npd: np.dtype) -> DType:
    return as_dtype(npd)


def to_torch(d: DType):
    import torch  # only when asked: the cpu path never loads torch

    return getattr(torch, "bool" if d is bool_ else d.name)


# -- promotion -------------------------------------------------------------------------

def _promote_pair(a: DType, b: DType) -> DType:
    """torch.promote_types for two dtypes."""
    if a is b:
        return a
    if a.category != b.category:
        return a if a.category > b.category else b
    if a.kind == "bool":
        return a
    if a.kind == "float":
        if {a, b} == {float16, bfloat16}:
            return float32
        return a if a.itemsize >= b.itemsize else b
    if a.kind == b.kind:
        return a if a.itemsize >= b.itemsize else b
    # a signed and an unsigned integer: the smallest signed type that holds both
    unsigned, signed = (a, b) if a.kind == "uint" else (b, a)
    if signed.itemsize > unsigned.itemsize:
        return signed
    return {1: int16, 2: int32, 4: int64, 8: int64}[unsigned.itemsize]


def promote_types(*dtypes: DType) -> DType:
    out = dtypes[0]
    for d in dtypes[1:]:
        out = _promote_pair(out, d)
    return out


def scalar_dtype(x) -> DType:
    """The dtype a Python scalar takes on its own, as torch.tensor(x) would give."""
    if isinstance(x, (bool, np.bool_)):
        return bool_
    if isinstance(x, (int, np.integer)):
        return int64
    return default_float


def _combine(higher: DType | None, lower: DType | None) -> DType | None:
    if higher is None:
        return lower
    if lower is None:
        return higher
    if higher.is_floating_point:
        return higher
    if higher is bool_ or lower.is_floating_point:
        return _promote_pair(higher, lower)
    return higher


def result_type(*operands) -> DType:
    """torch.result_type over tensors and Python scalars.

    Operands come in three tiers: tensors with dimensions, zero-dimensional tensors and
    Python scalars. A lower tier only matters when it brings a higher category (bool <
    integer < float), which is why `int8_tensor + 2.5` is float32 but
    `float16_tensor + 2.5` stays float16.
    """
    tiers: list[DType | None] = [None, None, None]
    for x in operands:
        if hasattr(x, "dtype") and hasattr(x, "ndim") and isinstance(x.dtype, DType):
            tier, d = (0 if x.ndim > 0 else 1), x.dtype
        else:
            tier, d = 2, scalar_dtype(x)
        tiers[tier] = d if tiers[tier] is None else _promote_pair(tiers[tier], d)
    out = _combine(tiers[0], _combine(tiers[1], tiers[2]))
    assert out is not None, "result_type needs at least one operand"
    return out


def compute_dtype(d: DType) -> DType:
    """The dtype the reference backend computes in: half types widen to float32."""
    return float32 if d in (float16, bfloat16) else d
