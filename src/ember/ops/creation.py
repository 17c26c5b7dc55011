"""Creation ops: tensors from data, constants, ranges and identity matrices.

Constants are one CONST scalar expanded to the requested shape, so `zeros(4096, 4096)`
costs no memory until a kernel writes something computed from it. At the end, the rules of the
leaf primitives BUFFER, CONST and IOTA (RAND's are in ember/ops/random.py).
"""

from __future__ import annotations

import math
import numbers
import operator

import ml_dtypes
import numpy as np

from ember import dtypes
from ember.device import as_device
from ember.dtypes import DType
from ember.errors import DTypeError, ShapeError, not_a_tensor
from ember.ir import Node, Op
from ember.ir.ops import NOT_DIFFERENTIABLE, define
from ember.ops import movement, pointwise  # modules, not names: both import this one in turn
from ember.runtime import dlpack
from ember.runtime.executor import from_host
from ember.tensor import Tensor, leaf


def _shape(op: str, size) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = tuple(size[0])
    try:
        shape = tuple(operator.index(s) for s in size)
    except TypeError:
        raise TypeError(f"{op}: size must be a sequence of integers, got {size!r}") from None
    if any(s < 0 for s in shape):
        raise ShapeError(f"{op}: negative dimension in size {shape}")
    if math.prod(shape) >= 2**62:
        raise ShapeError(f"{op}: size {shape} has too many elements ({math.prod(shape)})")
    return shape


def _requires_grad(t: Tensor, requires_grad: bool) -> Tensor:
    return t.requires_grad_() if requires_grad else t


def _infer_dtype(array: np.ndarray, data) -> DType:
    if array.dtype == np.float64 and not isinstance(data, np.ndarray):
        return dtypes.default_float  # Python floats become float32, as in torch.tensor
    if array.dtype.kind in "iu" and not isinstance(data, np.ndarray) and array.dtype != np.uint8:
        return dtypes.int64
    if array.dtype.kind == "O" or (array.dtype.kind in "USV" and array.dtype != dtypes.bfloat16.np):
        raise DTypeError(f"tensor: cannot make a tensor from data of type {type(data).__name__} "
                         f"(NumPy sees dtype {array.dtype})")
    return dtypes.from_numpy(array.dtype)


def tensor(data, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """A new tensor holding a copy of `data` (nested lists, scalars, NumPy arrays or Tensors).

    A torch tensor on a GPU is the exception: its memory is shared (as `from_dlpack` does), with no copy
    through the host, and the result stays on its device unless `dtype` or `device` asks for another one
    (then it is converted, a copy). A torch tensor on the CPU is copied, as anything else on the host."""
    if dlpack.is_torch_tensor(data) and data.is_cuda:
        shared = Tensor(dlpack.node_from_torch(data))
        out = pointwise.cast(shared, dtypes.as_dtype(dtype)) if dtype is not None else shared
        return _requires_grad(out.to(as_device(device)) if device is not None else out, requires_grad)
    device = as_device(device)
    if dlpack.is_torch_tensor(data):
        data = dlpack.node_from_torch(data).buffer  # a NumPy view of its memory, copied below
    if isinstance(data, Tensor):
        out = data.detach()
        out = pointwise.cast(out, dtypes.as_dtype(dtype)) if dtype is not None else out
        return _requires_grad(out.to(device), requires_grad)
    if isinstance(data, (list, tuple)) and any(isinstance(v, Tensor) for v in _flatten(data)):
        data = _to_nested(data)
    try:
        array = np.asarray(data)
    except ValueError as e:
        raise ValueError(f"tensor: data of type {type(data).__name__} is not a rectangular array "
                         f"(nested sequences must have equal lengths): {e}") from None
    target = dtypes.as_dtype(dtype) if dtype is not None else _infer_dtype(array, data)
    array = np.array(array, dtype=target.np, copy=True)
    return _requires_grad(Tensor(Node.from_buffer(from_host(array, device), target, device)), requires_grad)


def _flatten(data):
    for v in data:
        if isinstance(v, (list, tuple)):
            yield from _flatten(v)
        else:
            yield v


def _to_nested(data):
    return [_to_nested(v) if isinstance(v, (list, tuple)) else (v.numpy() if isinstance(v, Tensor) else v)
            for v in data]


as_tensor = tensor


def from_numpy(array: np.ndarray) -> Tensor:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"from_numpy: expected a NumPy array, got {type(array).__name__}")
    return tensor(array, dtype=dtypes.from_numpy(array.dtype))


def from_dlpack(x) -> Tensor:
    """A tensor on the memory of `x` (a torch, NumPy, CuPy... array, or a DLPack producer), not a copy:
    a write through `x` is seen by later computations that read the tensor. Memory that is not
    contiguous is copied once."""
    return Tensor(dlpack.node_from_dlpack(x))


def full(size, fill_value, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    shape = _shape("full", size if isinstance(size, (tuple, list)) else (size,))
    if isinstance(fill_value, Tensor):
        fill_value = fill_value.item()
    dtype = dtypes.as_dtype(dtype) if dtype is not None else dtypes.scalar_dtype(fill_value)
    out = movement.expand(pointwise.scalar(fill_value, dtype, as_device(device)), shape)
    return _requires_grad(out, requires_grad)


def zeros(*size, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    return full(_shape("zeros", size), 0, dtype=dtype or dtypes.default_float, device=device,
                requires_grad=requires_grad)


def ones(*size, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    return full(_shape("ones", size), 1, dtype=dtype or dtypes.default_float, device=device,
                requires_grad=requires_grad)


def empty(*size, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """Uninitialised memory in PyTorch; here simply zeros (reading it is still a bug)."""
    return zeros(*size, dtype=dtype, device=device, requires_grad=requires_grad)


def _like(op: str, x: Tensor, dtype, device) -> tuple[tuple[int, ...], dict]:
    """The shape of `op`'s (`zeros_like`...) result, and its dtype and device: those asked, else x's (an
    ember Tensor, or another library's array, read as a template)."""
    if not isinstance(x, Tensor) and not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise not_a_tensor(op, "input", x)
    return tuple(x.shape), {"dtype": dtype or x.dtype, "device": device or x.device}


def zeros_like(x: Tensor, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    shape, like = _like("zeros_like", x, dtype, device)
    return zeros(shape, **like, requires_grad=requires_grad)


def ones_like(x: Tensor, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    shape, like = _like("ones_like", x, dtype, device)
    return ones(shape, **like, requires_grad=requires_grad)


def empty_like(x: Tensor, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    shape, like = _like("empty_like", x, dtype, device)
    return zeros(shape, **like, requires_grad=requires_grad)


def full_like(x: Tensor, fill_value, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    shape, like = _like("full_like", x, dtype, device)
    return full(shape, fill_value, **like, requires_grad=requires_grad)


def arange(start, end=None, step=1, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """Values start, start+step, ... below end; integer arguments give int64, floats the default float."""
    if end is None:
        start, end = 0, start
    if step == 0:
        raise ValueError("arange: step must be nonzero")
    values = [v.item() if isinstance(v, Tensor) else v for v in (start, end, step)]
    start, end, step = values
    if any(not isinstance(v, numbers.Real) or math.isnan(v) or math.isinf(v) for v in values):
        raise ValueError(f"arange: start, end and step must be finite numbers, got {values}")
    if (end - start) * step < 0:
        raise ValueError(f"arange: the sign of step {step} does not lead from {start} to {end}")
    n = max(math.ceil((end - start) / step), 0)
    if dtype is None:
        dtype = dtypes.int64 if all(isinstance(v, (int, np.integer)) for v in values) else dtypes.default_float
    dtype = dtypes.as_dtype(dtype)
    iota = leaf(Op.IOTA, as_device(device), n=n)
    whole = all(float(v).is_integer() for v in (start, step))
    if whole and (dtype.is_integer or dtype.is_floating_point
                  and max(abs(start), abs(start + n * step)) <= _exact_integers(dtype)):
        # integer positions, each exact in dtype: integer arithmetic, then one exact cast
        start, step = int(start), int(step)
        out = iota * step + start if (start, step) != (0, 1) else iota
    else:
        out = pointwise.cast(iota, dtypes.float64) * step + start
    return _requires_grad(pointwise.cast(out, dtype), requires_grad)


def _exact_integers(dtype: dtypes.DType) -> int:
    """The largest n below which every integer is exact in a float dtype."""
    return 2 ** (ml_dtypes.finfo(dtype.np).nmant + 1)


def linspace(start, end, steps: int, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """`steps` values evenly spaced from start to end, computed from both ends as PyTorch does."""
    if steps < 0:
        raise ValueError(f"linspace: steps must be non-negative, got {steps}")
    dtype = dtypes.as_dtype(dtype) if dtype is not None else dtypes.default_float
    if steps <= 1:
        return _requires_grad(full((steps,), start, dtype=dtype, device=device), requires_grad)
    step = (end - start) / (steps - 1)
    i = pointwise.cast(leaf(Op.IOTA, as_device(device), n=steps), dtypes.float64)
    out = pointwise.where(i < steps // 2, i * step + start, end - (steps - 1 - i) * step)
    return _requires_grad(pointwise.cast(out, dtype), requires_grad)


def logspace(start, end, steps: int, base: float = 10.0, dtype=None, device=None) -> Tensor:
    exponents = linspace(start, end, steps, dtype=dtypes.float64, device=device)
    return pointwise.cast((exponents * math.log(base)).exp(), dtypes.as_dtype(dtype) if dtype else dtypes.default_float)


def eye(n: int, m: int | None = None, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    m = n if m is None else m
    rows = movement.reshape(arange(n, device=device), (n, 1))
    cols = movement.reshape(arange(m, device=device), (1, m))
    out = pointwise.cast(rows == cols, dtypes.as_dtype(dtype) if dtype is not None else dtypes.default_float)
    return _requires_grad(out, requires_grad)


# -- the leaf primitives of data and constants --------------------------------------------------------
# Each primitive's rules side by side: shape and dtype, VJP (none: a leaf has no inputs to pass a gradient
# to), and reference implementation (the attributes as keywords).

def leaf_rule(inputs, attrs) -> tuple[tuple[int, ...], DType]:
    """A leaf of the shape and dtype its attributes name."""
    return tuple(attrs["shape"]), attrs["dtype"]


def _np_buffer(**attrs) -> np.ndarray:
    raise AssertionError("a buffer is realized data: the reference backend reads it and never evaluates it")


def _np_const(shape, dtype: DType, value, fixed: bool = False) -> np.ndarray:
    return np.broadcast_to(np.asarray(value, dtype=dtype.np), shape)


define(Op.BUFFER, shape=leaf_rule, vjp=NOT_DIFFERENTIABLE, reference=_np_buffer)
define(Op.CONST, shape=leaf_rule, vjp=NOT_DIFFERENTIABLE, reference=_np_const)
define(Op.IOTA, shape=lambda inputs, attrs: ((attrs["n"],), dtypes.int64), vjp=NOT_DIFFERENTIABLE,
       reference=lambda n: np.arange(n, dtype=np.int64))
