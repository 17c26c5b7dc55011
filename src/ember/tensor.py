"""Tensor: a lazy handle on a Node.

Building a Tensor expression builds graph; a value is computed when it is read
(`.numpy()`, `.item()`, `print`) or when `ember.realize` is called. `apply` is the
single place where a primitive is added to the graph and recorded for autograd.
"""

from __future__ import annotations

import copy
import weakref

import numpy as np

from ember import autograd, dtypes
from ember.device import Device, as_device, check_memory_format
from ember.dtypes import DType
from ember.errors import describe, not_a_tensor
from ember.ir import Node, Op
from ember.ir.ops import define_composite
from ember.runtime import executor
from ember.runtime.executor import realize as _realize_nodes
from ember.runtime.executor import to_host


class Tensor:
    __slots__ = ("_node", "requires_grad", "_grad", "_grad_fn", "__weakref__")
    __array_priority__ = 1000  # numpy scalars on the left defer to Tensor's operators

    def __init__(self, node: Node, requires_grad: bool = False, grad_fn: autograd.Function | None = None):
        self._node = node
        self.requires_grad = requires_grad
        self._grad: Tensor | None = None
        self._grad_fn = grad_fn
        _hold(node, self)

    # -- properties --------------------------------------------------------------------
    @property
    def grad(self) -> Tensor | None:
        return self._grad

    @grad.setter
    def grad(self, value: Tensor | None) -> None:
        recorder = executor.this_thread.recorder
        if recorder is not None:
            recorder.note_grad(self, self._grad, value)
        self._grad = value

    @property
    def shape(self) -> tuple[int, ...]:
        return self._node.shape

    @property
    def dtype(self) -> DType:
        return self._node.dtype

    @property
    def device(self) -> Device:
        return self._node.device

    @property
    def ndim(self) -> int:
        return len(self._node.shape)

    @property
    def is_leaf(self) -> bool:
        return self._grad_fn is None

    @property
    def grad_fn(self) -> autograd.Function | None:
        return self._grad_fn

    def numel(self) -> int:
        return self._node.numel

    def dim(self) -> int:
        return self.ndim

    def size(self, dim: int | None = None):
        if dim is None:
            return self.shape
        from ember.ops.movement import normalize_dim  # the op modules import this one: they load after it

        return self.shape[normalize_dim("size", dim, self.ndim)]

    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    # -- realization -------------------------------------------------------------------
    def realize(self) -> Tensor:
        _realize_nodes([self._node])
        return self

    def numpy(self) -> np.ndarray:
        """The value as a new NumPy array (computing it if it is pending)."""
        self.realize()
        return np.array(to_host(self._node.buffer, self.device), dtype=self.dtype.np, copy=True)

    def item(self):
        if self.numel() != 1:
            raise RuntimeError(f"item(): a Tensor with {self.numel()} elements cannot be converted to a scalar "
                               f"(shape {self.shape})")
        return self.numpy().reshape(()).item()

    def tolist(self):
        value = self.numpy()
        if self.dtype is dtypes.bfloat16:
            value = value.astype(np.float32)
        return value.tolist()

    def __array__(self, dtype=None, copy=None):
        value = self.numpy()
        return value if dtype is None else value.astype(dtype)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """The DLPack capsule of this tensor's memory, shared, not copied (computed first if pending)."""
        from ember.runtime import dlpack  # torch: only when a tensor is shared

        self.realize()
        return dlpack.export(self._node, stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        from ember.runtime import dlpack  # torch: only when a tensor is shared

        return dlpack.dlpack_device(self.device)

    def __repr__(self) -> str:
        value = self.numpy()
        if self.dtype is dtypes.bfloat16:
            value = value.astype(np.float32)
        body = np.array2string(value, separator=", ", prefix="tensor(", threshold=1000, edgeitems=3,
                               precision=4, suppress_small=False, floatmode=_float_mode(value))
        body = body.replace(", ...,", ",  ...,")  # PyTorch writes an elided run as " ..."
        extras = []
        if self.device.type != "cpu":
            extras.append(f"device='{self.device}'")
        if self.numel() == 0 and self.ndim != 1:
            extras.append(f"size={self.shape}")
        if self.dtype not in (dtypes.float32, dtypes.int64, dtypes.bool_):
            extras.append(f"dtype={self.dtype!r}")
        if self._grad_fn is not None:
            extras.append(f"grad_fn=<{self._grad_fn.op.label}>")
        elif self.requires_grad:
            extras.append("requires_grad=True")
        return "tensor(" + body + "".join(", " + e for e in extras) + ")"

    __str__ = __repr__

    def __format__(self, format_spec: str) -> str:
        """As torch: a 0-d tensor formats as its Python value (`f"{loss:.4f}"`); another tensor only with an
        empty spec, as str() (a spec raises TypeError)."""
        if self.ndim == 0:
            return format(self.item(), format_spec)
        return object.__format__(self, format_spec)

    def __len__(self) -> int:
        if self.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d tensor")
        return (self[i] for i in range(self.shape[0]))

    def __bool__(self) -> bool:
        if self.numel() != 1:
            raise RuntimeError(f"Boolean value of a Tensor with {self.numel()} elements is ambiguous "
                               f"(shape {self.shape}); use .any() or .all()")
        return bool(self.item())

    def __float__(self) -> float:
        return float(self._scalar("float"))

    def __int__(self) -> int:
        return int(self._scalar("int"))

    def _scalar(self, conversion: str):
        if self.numel() != 1:  # Python's conversions raise ValueError, as PyTorch's do
            raise ValueError(f"{conversion}(): only one-element tensors can be converted to Python scalars, "
                             f"not shape {self.shape}")
        return self.item()

    def __index__(self) -> int:
        if self.dtype.is_floating_point or self.numel() != 1:
            raise TypeError(f"only integer tensors of a single element can be converted to an index "
                            f"(got shape {self.shape}, dtype {self.dtype.name})")
        return int(self.item())

    __hash__ = object.__hash__

    # -- autograd ----------------------------------------------------------------------
    def backward(self, gradient: Tensor | None = None, retain_graph: bool = False) -> None:
        autograd.backward(self, gradient, retain_graph=retain_graph)

    def requires_grad_(self, requires_grad: bool = True) -> Tensor:
        if requires_grad and not self.dtype.is_floating_point:
            raise RuntimeError(f"only floating-point tensors can require gradients, not {self.dtype.name}")
        if not self.is_leaf and not requires_grad:
            raise RuntimeError("requires_grad_(False) on a non-leaf tensor; use detach()")
        self.requires_grad = requires_grad
        return self

    def detach(self) -> Tensor:
        return Tensor(self._node)

    @property
    def data(self) -> Tensor:
        return self.detach()

    @data.setter
    def data(self, value: Tensor) -> None:
        """Show `value` from now on, whatever its shape or dtype, outside autograd (torch's `p.data = v`)."""
        recorder = executor.this_thread.recorder
        if recorder is not None:
            recorder.note_rebind(self, self._node)
        self._node = value._node
        _hold(value._node, self)

    def __deepcopy__(self, memo: dict) -> Tensor:
        """A copy with this value (its graph node, which nothing changes: an update gives a tensor a new node),
        its requires_grad and a copy of its gradient; as PyTorch, only a graph leaf can be copied."""
        if self._grad_fn is not None:
            raise RuntimeError("deepcopy: only tensors created by the user (graph leaves) can be deep-copied, as in "
                               "PyTorch; detach() it first")
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        Tensor.__init__(copied, self._node, self.requires_grad)
        copied._grad = copy.deepcopy(self._grad, memo)
        return copied

    def detach_(self) -> Tensor:
        self._grad_fn = None
        self.requires_grad = False
        return self

    # -- placement and casts -----------------------------------------------------------
    def to(self, *args, **kwargs) -> Tensor:
        """`.to(dtype)`, `.to(device)`, `.to(device, dtype)` or `.to(other_tensor)`."""
        dtype, device = to_arguments(args, kwargs)
        out = self
        if dtype is not None:
            from ember.ops.pointwise import cast  # the op modules load after this one

            out = cast(out, dtypes.as_dtype(dtype))
        if device is not None and as_device(device) != out.device:
            out = apply(Op.COPY, out, device=as_device(device))
        return out

    def cpu(self) -> Tensor:
        return self.to("cpu")

    def cuda(self, index: int | None = None) -> Tensor:
        return self.to("cuda" if index is None else f"cuda:{index}")

    def type(self, dtype=None):
        if dtype is None:
            return f"ember.{self.dtype.name}"
        return self.to(dtype)

    def float(self) -> Tensor:
        return self.to(dtypes.float32)

    def double(self) -> Tensor:
        return self.to(dtypes.float64)

    def half(self) -> Tensor:
        return self.to(dtypes.float16)

    def bfloat16(self) -> Tensor:
        return self.to(dtypes.bfloat16)

    def int(self) -> Tensor:
        return self.to(dtypes.int32)

    def long(self) -> Tensor:
        return self.to(dtypes.int64)

    def short(self) -> Tensor:
        return self.to(dtypes.int16)

    def char(self) -> Tensor:
        return self.to(dtypes.int8)

    def byte(self) -> Tensor:
        return self.to(dtypes.uint8)

    def bool(self) -> Tensor:
        return self.to(dtypes.bool_)

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    # -- in-place updates --------------------------------------------------------------
    def _show(self, node: Node) -> None:
        """Show `node` from now on: an update built without ops (of this Tensor's shape and dtype, outside
        autograd), as `assign` would."""
        recorder = executor.this_thread.recorder
        if recorder is not None:
            recorder.note_rebind(self, self._node)
        self._node = node
        _hold(node, self)

    def assign(self, value, op: str = "assign") -> Tensor:
        """Make this Tensor show `value` from now on (same shape); the core of every `x.op_()`."""
        # the op modules import this one: they load after it
        from ember.ops.movement import broadcast_to
        from ember.ops.pointwise import cast, converted

        value = converted(op, "value", value, like=self)
        if value.device != self.device:
            value = value.to(self.device)
        if value.shape != self.shape:
            value = broadcast_to(value, self.shape, op=op)
        if value.dtype is not self.dtype:
            value = cast(value, self.dtype)
        if self.is_leaf and self.requires_grad and autograd.is_grad_enabled():
            raise RuntimeError("a leaf Tensor that requires grad is being used in an in-place operation; "
                               "wrap the update in `with ember.no_grad():`")
        recorder = executor.this_thread.recorder
        if recorder is not None:
            recorder.note_rebind(self, self._node)
        self._node = value._node
        _hold(value._node, self)
        if autograd.is_grad_enabled() and value.requires_grad:
            self._grad_fn, self.requires_grad = value._grad_fn, True
        elif not self.is_leaf:
            self._grad_fn, self.requires_grad = value._grad_fn, value.requires_grad
        return self

    def register_post_accumulate_grad_hook(self, hook):
        """Call `hook(self)` each time backward() has accumulated a gradient into this leaf's `.grad`; returns a
        handle whose `remove()` takes the hook away."""
        return autograd.register_post_accumulate_grad_hook(self, hook)

    def copy_(self, src) -> Tensor:
        return self.assign(src, op="copy_")

    def zero_(self) -> Tensor:
        return self.assign(0)

    def fill_(self, value) -> Tensor:
        return self.assign(value, op="fill_")


def to_arguments(args: tuple, kwargs: dict) -> tuple:
    """The (dtype, device) a `.to(...)` call asks for, None for what it leaves as it is."""
    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", None)
    device = kwargs.pop("device", None)
    kwargs.pop("non_blocking", None)
    kwargs.pop("copy", None)
    if "memory_format" in kwargs:  # the layout of activations is the compiler's (see ember.set_conv_memory_format)
        check_memory_format("to", kwargs.pop("memory_format"))
    if kwargs:
        raise TypeError(f"to(): unexpected arguments {sorted(kwargs)}")
    for a in args:
        if isinstance(a, Tensor):
            dtype, device = a.dtype, a.device
        elif isinstance(a, Device):
            device = a
        elif isinstance(a, str):  # a dtype name, else a device ("tpu" then fails as a device)
            try:
                dtype = dtypes.as_dtype(a)
            except TypeError:
                device = a
        elif type(a).__name__ == "device":
            device = str(a)
        elif (hasattr(a, "__array__") and not isinstance(a, type)) or isinstance(a, (list, tuple)):
            raise TypeError(f"to: expected a dtype, a device or an ember Tensor, got {describe(a)}")
        else:
            dtype = a
    return dtype, device


def _float_mode(value: np.ndarray) -> str:
    """PyTorch prints floats with four decimals ("0.5000"), or as "2." when every value is whole
    and no exponent is needed; NumPy's "fixed" and "maxprec" modes give those two forms."""
    if value.dtype.kind != "f":
        return "maxprec"
    magnitudes = np.abs(value[np.isfinite(value) & (value != 0)].astype(np.float64))
    if magnitudes.size == 0:
        return "maxprec"
    whole = bool(np.all(magnitudes == np.round(magnitudes)))
    exponent = magnitudes.max() > 1e8 or magnitudes.max() / magnitudes.min() > 1000
    return "maxprec" if whole and not exponent else "fixed"


def _hold(node: Node, tensor: Tensor) -> None:
    handles = node.handles
    if len(handles) >= 4:
        handles[:] = [r for r in handles if r() is not None]
    handles.append(weakref.ref(tensor))


def expect_tensors(op: str, **arguments) -> None:
    """Raise ember's TypeError, naming `op`, the argument and what it got, for each of `arguments` (by
    their names in `op`'s signature) that is not an ember Tensor."""
    for name, value in arguments.items():
        if not isinstance(value, Tensor):
            raise not_a_tensor(op, name, value)


def apply(op: Op, *inputs: Tensor, **attrs) -> Tensor:
    """Add primitive `op` to the graph; record it for autograd when an input needs gradients."""
    try:
        nodes = tuple(t._node for t in inputs)
    except AttributeError:  # an op that let another library's array through
        raise not_a_tensor(op.label, "input", next(t for t in inputs if not isinstance(t, Tensor))) from None
    node = Node.make(op, nodes, **attrs)
    if (autograd.is_grad_enabled() and node.dtype.is_floating_point and autograd.differentiable(op)
            and any(t.requires_grad for t in inputs)):
        return Tensor(node, True, autograd.Function(op, attrs, inputs, node))
    return Tensor(node)


def composite(op: Op, shape, decomposition) -> None:
    """Declare composite `op` (see ember.ir.ops): `decomposition(*inputs, **attrs)` computes it from Tensors
    with primitives. The compiler expands a node of it with that function; its gradient is that of the
    decomposition, derived from the VJP rules of the primitives it is made of (once per kind of node: see
    autograd.composite_vjp)."""
    def expand(inputs: tuple[Node, ...], attrs: dict) -> Node:
        with autograd.no_grad():
            return decomposition(*(Tensor(n) for n in inputs), **attrs)._node

    def vjp(g: Tensor, xs: list[Tensor], out: Tensor, attrs: dict) -> tuple:
        inputs = [x.detach().requires_grad_(x.dtype.is_floating_point) for x in xs]
        with autograd.enable_grad():
            value = decomposition(*inputs, **attrs)
        wanted = [x for x in inputs if x.requires_grad]
        grads = iter(autograd.grad(value, wanted, g, allow_unused=True) if wanted else ())
        return tuple(next(grads) if x.requires_grad else None for x in inputs)

    define_composite(op, shape=shape, vjp=autograd.composite_vjp(vjp), expand=expand)


def leaf(op: Op, device: Device, **attrs) -> Tensor:
    return Tensor(Node.make(op, (), device=device, **attrs))


def realize(*tensors: Tensor) -> None:
    """Compute the values of these tensors (and of everything pending they depend on) in one go."""
    _realize_nodes([t._node for t in tensors])
