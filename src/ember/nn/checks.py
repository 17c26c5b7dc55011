"""What the functional modules (functional, loss_functions, resampling) share: their argument check for float
inputs, and the dtype half-precision inputs are computed in."""

from __future__ import annotations

from ember import dtypes
from ember.errors import DTypeError, operands
from ember.ops.pointwise import cast
from ember.tensor import Tensor, expect_tensors


def check_float(fn: str, *tensors: Tensor) -> None:
    for t in tensors:
        expect_tensors(fn, input=t)
        if not t.dtype.is_floating_point:
            raise DTypeError(f"{fn}: expected floating-point tensors, got {operands(*tensors)}")


def opmath(x: Tensor) -> Tensor:
    """Half-precision inputs are normalised in float32, as PyTorch does."""
    return cast(x, dtypes.float32) if x.dtype in (dtypes.float16, dtypes.bfloat16) else x
