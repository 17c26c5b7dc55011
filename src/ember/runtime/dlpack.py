"""DLPack both ways, without copies: ember tensors on other libraries' memory, and theirs on ember's.

An imported tensor's memory becomes the buffer of a realized ember node (a NumPy array on the cpu
device, a torch tensor on cuda), so a later write by the exporting library is seen by every ember
computation that reads the node after it. Exporting realizes a pending tensor first and hands out the
node's buffer; on cuda, the consumer's stream is made to wait for the stream that computed it, as the
protocol asks (torch's own `__dlpack__` does this for the buffer, which lives on the current stream
ember computes on).

Memory is shared when it is contiguous in row-major order, which is what ember's kernels index; other
strides are copied once into a contiguous buffer. NumPy reads DLPack on the cpu without torch; a cuda
producer, or a bfloat16 one, needs torch.
"""

from __future__ import annotations

import functools
import sys

import ml_dtypes
import numpy as np

from ember import dtypes
from ember.device import CPU, Device, as_device
from ember.dtypes import DType
from ember.errors import DeviceError, DTypeError
from ember.ir import Node
from ember.runtime import executor

DL_CPU, DL_CUDA, DL_CUDA_HOST, DL_CUDA_MANAGED = 1, 2, 3, 13


def _torch():
    """torch, imported only for a producer or consumer that needs it (the cpu path needs none)."""
    try:
        import torch  # optional: DLPack with NumPy needs none
    except ImportError:
        raise DeviceError("DLPack: this producer (cuda memory, or bfloat16) needs torch, which is not installed "
                          "(pip install torch)") from None
    return torch


def is_torch_tensor(x) -> bool:
    """Whether x is a torch tensor, asked without importing torch (one exists only once torch is)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def node_from_dlpack(x) -> Node:
    """A realized node whose buffer is the memory of `x` (any object with `__dlpack__`)."""
    if not hasattr(x, "__dlpack__") or not hasattr(x, "__dlpack_device__"):
        raise TypeError(f"from_dlpack: expected an object with __dlpack__ and __dlpack_device__, "
                        f"got {type(x).__name__}")
    kind, _ = x.__dlpack_device__()
    if kind == DL_CPU and not is_torch_tensor(x):
        try:
            return _node_from_numpy(np.from_dlpack(x))
        except BufferError:  # a dtype NumPy cannot read (bfloat16): torch can
            pass
    if kind not in (DL_CPU, DL_CUDA, DL_CUDA_HOST, DL_CUDA_MANAGED):
        raise DeviceError(f"from_dlpack: DLPack device type {kind} is not supported; ember runs on cpu and cuda")
    torch = _torch()
    t = x if isinstance(x, torch.Tensor) else torch.from_dlpack(x)
    return node_from_torch(t)


def node_from_torch(t) -> Node:
    """A realized node on the torch tensor's memory (its device: cpu, or cuda:N)."""
    torch = _torch()
    t = t.detach()
    dtype = _dtype_of(t.dtype)
    if not t.is_contiguous():
        t = t.contiguous()  # ember's kernels index row-major memory
    if t.device.type == "cpu":
        if dtype is dtypes.bfloat16:  # NumPy has no bfloat16: the same bits, viewed through ml_dtypes
            return _node_from_numpy(t.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
        return _node_from_numpy(t.numpy())
    if t.device.type != "cuda":
        raise DeviceError(f"from_dlpack: a torch tensor on {t.device} cannot be shared; ember runs on cpu and cuda")
    device = as_device(f"cuda:{t.device.index}")
    from ember.runtime import cuda  # torch: only for a cuda tensor

    if cuda.torch_device(device).type != "cuda":
        raise DeviceError(f"from_dlpack: a tensor on {t.device} cannot be used while the cuda device runs "
                          "through the interpreter (EMBER_INTERPRET=1)")
    return Node.from_buffer(t, dtype, device)


def nodes_on_torch(tensors: list, device: Device) -> list[Node]:
    """Realized nodes of ember's cuda `device` on the torch tensors' memory, many at once (a torch.compile graph's
    hundreds of inputs every call): their buffers as they are, where `device`'s memory is theirs (a GPU's, or the
    CPU's where the cuda device runs through the interpreter); a tensor that is not contiguous is copied."""
    by_dtype = _torch_dtypes()
    return [Node.from_buffer(t if t.is_contiguous() else t.contiguous(), by_dtype.get(t.dtype) or _dtype_of(t.dtype),
                             device) for t in tensors]


def torch_buffers(nodes: list[Node]) -> list:
    """The torch buffers of realized cuda nodes, to hand to torch as its own tensors (what `torch.from_dlpack` of
    each gives, without a capsule per node). A result of an ember.jit replay is handed over as a tensor of its own on
    the same memory, no copy: the step's next replay sees the memory shared and writes another set of buffers
    until torch lets go (a torch.compile graph's saved activations and gradients are dropped within the step; a
    step whose results torch keeps longer has its results copied from then on). A steady plan's results, which a
    later run writes whenever no ember node shows them, are copied first, as `export` copies them, all in one
    batched copy."""
    torch = _torch()
    moved: dict[int, Node] = {}
    shared: dict[int, torch.Tensor] = {}
    for node in nodes:
        buffer = node.buffer
        if getattr(executor.transient.get(node), "lends", False):
            shared[id(node)] = buffer.detach() if buffer.is_contiguous() else buffer.contiguous()
        elif node in executor.transient or executor.recycled.get(id(buffer)) is buffer:
            moved[id(node)] = node
        elif not buffer.is_contiguous():
            node.buffer = buffer.contiguous()
    if moved:
        sources = [node.buffer for node in moved.values()]
        copies = [torch.empty_like(b) for b in sources]
        torch._foreach_copy_(copies, sources)
        for node, copy in zip(moved.values(), copies):
            node.buffer = copy
            executor.transient.pop(node, None)
    return [shared[id(node)] if id(node) in shared else node.buffer for node in nodes]


@functools.cache
def _torch_dtypes() -> dict:
    """torch's dtypes to ember's."""
    return {dtypes.to_torch(d): d for d in dtypes.ALL}


def _dtype_of(torch_dtype) -> DType:
    try:
        return dtypes.as_dtype(torch_dtype)
    except TypeError:
        raise DTypeError(f"from_dlpack: dtype {torch_dtype} is not supported by ember; supported: "
                         f"{', '.join(d.name for d in dtypes.ALL)}") from None


def _node_from_numpy(array: np.ndarray) -> Node:
    dtype = dtypes.from_numpy(array.dtype)
    return Node.from_buffer(np.require(array, requirements="C"), dtype, CPU)


def dlpack_device(device: Device) -> tuple[int, int]:
    """Where a tensor on `device` lives, as DLPack names it (the interpreter's cuda device is the CPU)."""
    if device.type == "cpu":
        return (DL_CPU, 0)
    from ember.runtime import cuda  # torch: only for a cuda tensor

    return (DL_CUDA, device.index) if cuda.torch_device(device).type == "cuda" else (DL_CPU, 0)


def export(node: Node, **protocol):
    """The DLPack capsule of a realized node's buffer; `protocol` holds __dlpack__'s keyword arguments
    (stream, max_version, dl_device, copy), passed on to the buffer's own exporter."""
    buffer = _shareable(node)
    if isinstance(buffer, np.ndarray) and buffer.dtype == ml_dtypes.bfloat16:
        torch = _torch()  # NumPy exports no bfloat16; torch does, over the same memory
        buffer = torch.from_numpy(buffer.view(np.int16)).view(torch.bfloat16)
        protocol.pop("stream", None)
    elif isinstance(buffer, np.ndarray):
        protocol.pop("stream", None)  # NumPy's exporter takes no stream: host memory needs no ordering
    return buffer.__dlpack__(**{k: v for k, v in protocol.items() if v is not None})


def _shareable(node: Node):
    """The node's buffer, made contiguous and writable once (a constant is a read-only broadcast view), and
    its own (a result of an ember.jit replay or of a steady plan shows a buffer a later run may write)."""
    if node in executor.transient or executor.recycled.get(id(node.buffer)) is node.buffer:
        node.buffer = node.buffer.clone()
        executor.transient.pop(node, None)
    buffer = node.buffer
    if isinstance(buffer, np.ndarray):
        if not (buffer.flags.c_contiguous and buffer.flags.writeable):
            buffer = np.array(buffer, copy=True, order="C")
            node.buffer = buffer
    elif not buffer.is_contiguous():
        buffer = buffer.contiguous()
        node.buffer = buffer
    return buffer


def copy_tensors(targets: list, values: list) -> None:
    """targets[i].copy_(values[i]) for each i, as few multi-tensor copies as torch can make of it: one per group
    of targets and values alike in device and dtype, and in sizes and strides pair by pair (torch copies a list
    that mixes them one tensor after another: a batch norm's running statistics with its int64 counter)."""
    import torch

    groups: dict[tuple, tuple[list, list]] = {}
    for target, value in zip(targets, values):
        if target.shape != value.shape or target.stride() != value.stride():
            target.copy_(value)
            continue
        group = groups.setdefault((target.device, target.dtype, value.device, value.dtype), ([], []))
        group[0].append(target)
        group[1].append(value)
    for group_targets, group_values in groups.values():
        torch._foreach_copy_(group_targets, group_values)
