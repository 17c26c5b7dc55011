"""The errors ember raises for misuse, each naming the op and its operands."""

from __future__ import annotations


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


def describe(x) -> str:
    """One operand as an error message shows it: shape, dtype and device, or the scalar."""
    if hasattr(x, "shape") and hasattr(x, "device"):
        return f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype.name}, device={x.device})"
    return repr(x)


def operands(*xs) -> str:
    return ", ".join(describe(x) for x in xs)


def device_mismatch(op: str, *xs) -> DeviceError:
    """The error for one op given operands on several devices: each operand, and the moves that fix it."""
    devices = sorted({str(x.device) for x in xs if hasattr(x, "device")})
    moves = " or ".join(f'.to("{d}")' for d in devices)
    return DeviceError(f"{op}: operands are on different devices ({' and '.join(devices)}): {operands(*xs)}; "
                       f"move them to one device first with {moves}")
