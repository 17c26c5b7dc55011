"""Fixes for bugs of Triton's CPU interpreter that a GPU does not have.

With `EMBER_INTERPRET=1` the cuda backend runs generated kernels through the interpreter, which is
how they are tested without a GPU. These patches make the interpreter compute what the GPU computes,
so a test failure points at the generated code, not at the interpreter. The cuda runtime applies
them when it runs in interpreter mode; nothing else imports this module.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import triton.language as tl
from triton.runtime import interpreter

# The patched internals; a Triton that renamed them is left as it is (its tests then show why).
_Builder = getattr(interpreter, "InterpreterBuilder", None)
_binary_op = getattr(_Builder, "binary_op", None)
_cast_impl = getattr(_Builder, "cast_impl", None)
_create_dot = getattr(_Builder, "create_dot", None)
_Executor = getattr(interpreter, "GridExecutor", None)
_run = _Executor.__dict__.get("__call__") if _Executor is not None else None


def _binary_op_typing_comparisons_as_bool(self, lhs, rhs, op):
    """The interpreter types a comparison's result like its operands, so a scalar comparison that is
    broadcast later (`tile & (scalar > 0)`) turns into floats."""
    out = _binary_op(self, lhs, rhs, op)
    return interpreter.TensorHandle(out.data, tl.int1) if out.data.dtype == np.bool_ else out


def _cast_rounding_bfloat16(self, src, dst_type):
    """The interpreter truncates float32 to bfloat16 and converts nothing else to or from bfloat16;
    a GPU rounds to nearest even, as ml_dtypes does."""
    source, target = src.dtype.scalar, dst_type.scalar
    if tl.bfloat16 not in (source, target):
        return _cast_impl(self, src, dst_type)
    data = src.data.view(ml_dtypes.bfloat16) if source == tl.bfloat16 else src.data
    if target == tl.bfloat16:
        return interpreter.TensorHandle(data.astype(ml_dtypes.bfloat16).view(np.uint16), target)
    return interpreter.TensorHandle(data.astype(interpreter._get_np_dtype(target)), target)


def _dot_reading_bfloat16(self, a, b, d, input_precision, max_num_imprecise_acc):
    """The interpreter keeps bfloat16 tiles as their raw 16 bits and multiplies those as integers."""
    if tl.bfloat16 in (a.dtype.scalar, b.dtype.scalar):
        a, b = (interpreter.TensorHandle(x.data.view(ml_dtypes.bfloat16).astype(np.float32), tl.float32)
                if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
    return _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)


def _run_quietly(self, *args, **kwargs):
    """A GPU computes inf and NaN silently; NumPy, which computes for the interpreter, warns each time."""
    with np.errstate(all="ignore"):
        return _run(self, *args, **kwargs)


def apply() -> None:
    if _binary_op is not None:
        _Builder.binary_op = _binary_op_typing_comparisons_as_bool
    if _cast_impl is not None:
        _Builder.cast_impl = _cast_rounding_bfloat16
    if _create_dot is not None:
        _Builder.create_dot = _dot_reading_bfloat16
    if _run is not None:
        _Executor.__call__ = _run_quietly
