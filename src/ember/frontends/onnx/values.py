"""Values crossing between ONNX and ember: ONNX element types as ember dtypes, NumPy arrays (inputs,
initializers, constant attributes) as ember tensors, and ember tensors back as the arrays ONNX declares.

ember has no unsigned integers wider than 8 bits and none of ONNX's narrow formats: uint16 and uint32 are held as
int32 and int64, uint64 as int64 (exact for values below 2**63); the 8-bit and 4-bit floats as float32, the 4-bit
and 2-bit integers as int8 and uint8 (exact: every value of theirs is one of those). A Cast to a narrow format
rounds to that format's values (`NARROW`); `to_array` gives the declared type back at the graph's outputs.
"""

from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import ember
from ember import dtypes
from ember.device import Device
from ember.tensor import Tensor


class NarrowFloat(NamedTuple):
    """A float format narrower than ember's: mantissa bits, smallest normal exponent, largest finite value, what a
    cast gives for a value beyond it without saturation (inf or NaN), and for an infinity with it."""
    mantissa: int
    min_exponent: int
    largest: float
    overflow: float
    saturated_infinity: float


class NarrowInt(NamedTuple):
    low: int
    high: int


class PowerOfTwo(NamedTuple):
    """float8e8m0: an exponent alone, 2**(e - 127) for e in 0..254 (255 is NaN)."""
    bias: int


NARROW = {
    np.dtype(ml_dtypes.float8_e4m3fn): NarrowFloat(3, -6, 448.0, np.nan, 448.0),
    np.dtype(ml_dtypes.float8_e4m3fnuz): NarrowFloat(3, -7, 240.0, np.nan, 240.0),
    np.dtype(ml_dtypes.float8_e5m2): NarrowFloat(2, -14, 57344.0, np.inf, 57344.0),
    np.dtype(ml_dtypes.float8_e5m2fnuz): NarrowFloat(2, -15, 57344.0, np.nan, 57344.0),
    np.dtype(ml_dtypes.float4_e2m1fn): NarrowFloat(1, 0, 6.0, 6.0, 6.0),
    np.dtype(ml_dtypes.int4): NarrowInt(-8, 7), np.dtype(ml_dtypes.uint4): NarrowInt(0, 15),
    np.dtype(ml_dtypes.int2): NarrowInt(-2, 1), np.dtype(ml_dtypes.uint2): NarrowInt(0, 3),
    np.dtype(ml_dtypes.float8_e8m0fnu): PowerOfTwo(127),
}

# How ember holds the NumPy types it lacks.
_WIDENED = {np.dtype(np.uint16): np.dtype(np.int32), np.dtype(np.uint32): np.dtype(np.int64),
            np.dtype(np.uint64): np.dtype(np.int64),
            **{npd: np.dtype(np.int8 if isinstance(f, NarrowInt) and f.low < 0 else np.uint8
                             if isinstance(f, NarrowInt) else np.float32) for npd, f in NARROW.items()}}


class UnsupportedType(TypeError):
    """An ONNX element type ember holds no tensor of (strings, complex numbers, 8-bit and smaller floats)."""


def numpy_type(elem_type: int) -> np.dtype:
    """The NumPy dtype of an ONNX element type (TensorProto.FLOAT ...)."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))


def held_type(npd: np.dtype) -> np.dtype:
    """The NumPy dtype ember holds values of `npd` in."""
    npd = _WIDENED.get(np.dtype(npd), np.dtype(npd))
    try:
        dtypes.from_numpy(npd)
    except TypeError:
        raise UnsupportedType(f"ember holds no tensors of {npd}") from None
    return npd


def ember_dtype(elem_type: int) -> dtypes.DType:
    """The ember dtype that holds an ONNX element type."""
    try:
        return dtypes.from_numpy(held_type(numpy_type(elem_type)))
    except (KeyError, ValueError, TypeError):
        raise UnsupportedType(f"ember holds no tensors of {TensorProto.DataType.Name(elem_type).lower()}") from None


def to_tensor(array, device: Device) -> Tensor:
    """An ember tensor holding a NumPy array (or scalar) on `device`."""
    array = np.asarray(array)
    return ember.tensor(array.astype(held_type(array.dtype), copy=False), device=device)


def proto_array(proto: onnx.TensorProto) -> np.ndarray:
    """A TensorProto (an initializer, a constant attribute) as a NumPy array."""
    return numpy_helper.to_array(proto)


def to_array(t: Tensor, declared: np.dtype | None = None) -> np.ndarray:
    """An ember tensor's value as NumPy, in the type the graph declares where ember holds it widened."""
    array = t.numpy()
    if declared is not None and np.dtype(declared) in _WIDENED and array.dtype != declared:
        return array.astype(declared)
    return array
