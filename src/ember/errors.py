"""The errors ember raises for misuse, each naming the op and its operands."""

from __future__ import annotations

import numbers

import numpy as np

from ember.dtypes import DType


class EmberError(Exception):
    """Base class of ember's own errors."""


class ShapeError(EmberError, ValueError):
    """Operand shapes that do not fit the op (broadcasting, matmul, reshape, dims)."""


class DTypeError(EmberError, TypeError):
    """Operand dtypes that the op does not accept."""


class DeviceError(EmberError, RuntimeError):
    """Operands on different devices, or a device that does not exist."""


class CompileError(EmberError, RuntimeError):
    """A generated kernel failed to compile; the message gives the path of its source."""


class OutOfMemoryError(EmberError, MemoryError):
    """A device ran out of memory; the message gives the sizes asked and free."""


class UnsupportedOperatorError(EmberError, NotImplementedError):
    """An operator of an imported model (ONNX) that ember cannot translate: the message names the node, its
    op type and opset, and what about it is unsupported."""


def describe(x) -> str:
    """One operand as an error message shows it, whatever it is: an ember Tensor by its shape, dtype and
    device; another library's array (torch, NumPy) by its type, shape, dtype and device; a number as
    itself; anything else by its type and a short repr. Never computes a value."""
    if isinstance(getattr(x, "dtype", None), DType) and hasattr(x, "shape") and hasattr(x, "device"):
        return f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype.name}, device={x.device})"
    if x is None or isinstance(x, (numbers.Number, np.generic)):
        return repr(x)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        try:
            device = f", device={x.device}" if hasattr(x, "device") and not isinstance(x, np.ndarray) else ""
            return f"{type_name(x)}(shape={tuple(x.shape)}, dtype={x.dtype}{device})"
        except Exception:  # an object that only looks like an array
            pass
    return f"{type_name(x)} {_short(x)}"


def _short(x) -> str:
    """A repr of at most 80 characters; the items of a list or tuple described as `describe` does."""
    if isinstance(x, (list, tuple)):
        items = [_short(v) if isinstance(v, (list, tuple)) else describe(v) for v in x[:4]]
        inner = ", ".join(items) + (", ..." if len(x) > 4 else "")
        text = f"[{inner}]" if isinstance(x, list) else f"({inner}{',' if len(x) == 1 else ''})"
    else:
        try:
            text = repr(x)
        except Exception:
            text = "<unprintable>"
    return text if len(text) <= 80 else text[:77] + "..."


def type_name(x) -> str:
    """The type of `x` as a user would write it: `str`, `torch.Tensor`, `numpy.ndarray`."""
    cls = type(x)
    module = cls.__module__.lstrip("_")  # io.BytesIO, not _io.BytesIO
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def not_a_tensor(op: str, name: str, x) -> TypeError:
    """The error for a value that is not an ember Tensor where `op` needs one as its argument `name`."""
    return TypeError(f"{op}: {name} must be an ember Tensor, got {describe(x)}{conversion_hint(x)}")


def conversion_hint(x) -> str:
    """How to make an ember Tensor of another library's array or of a list, as the end of a message."""
    if type(x).__module__.split(".")[0] == "torch":
        return "; convert it with ember.tensor(x) (a copy) or ember.from_dlpack(x) (the same memory)"
    if isinstance(x, (np.ndarray, list, tuple)):
        return "; convert it with ember.tensor(x)"
    return ""


def operands(*xs) -> str:
    return ", ".join(describe(x) for x in xs)


def device_mismatch(op: str, *xs) -> DeviceError:
    """The error for one op given operands on several devices: each operand, and the moves that fix it."""
    devices = sorted({str(x.device) for x in xs if hasattr(x, "device")})
    moves = " or ".join(f'.to("{d}")' for d in devices)
    return DeviceError(f"{op}: operands are on different devices ({' and '.join(devices)}): {operands(*xs)}; "
                       f"move them to one device first with {moves}")


def index_out_of_bounds(op: str, index: int, dim: int, size: int) -> IndexError:
    """The error for an index outside its dimension, the same from the call (an index known there), the
    reference backend and a generated kernel's check (reported at the next host read)."""
    return IndexError(f"{op}: index {index} is out of bounds for dimension {dim} with size {size}")
