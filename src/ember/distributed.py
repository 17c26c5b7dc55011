"""Collectives between processes, on ember tensors, with torch.distributed's process groups as the engine (NCCL on
cuda, gloo on cpu): the same calls as torch.distributed, started the same way (`torchrun`, `env://`).

A collective is an op of the graph, `COLLECTIVE`, planned as a kernel of its own and run by torch.distributed on
the buffers ember holds (torch tensors on cuda; on the cpu, NumPy arrays shared with torch without a copy):

- on cuda it is issued in the order of the plan's launches: torch.distributed waits for the stream that computes
  its input, and the launches after it wait for its result; nothing waits on the host;
- a call such as `all_reduce(t)` makes `t` show the result (as torch's in-place call does) and issues the
  collective at once, so every process issues its collectives in the order it calls them, whatever it reads later.
  The gradient averaging of `ember.nn.parallel.DistributedDataParallel` puts the same op inside the training
  step's graph instead, where the plan orders it after the gradients it reads.

Only the default group (every process) is supported; `group=` other than None is refused.
"""

from __future__ import annotations

import datetime
import os
import sys

import numpy as np

from ember import dtypes
from ember.errors import ShapeError
from ember.ir import Op
from ember.ir.ops import NOT_DIFFERENTIABLE, define
from ember.tensor import Tensor, apply


class ReduceOp:
    """How all_reduce and reduce_scatter combine the processes' values (torch.distributed.ReduceOp's names)."""

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"


_REDUCTIONS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)


def _torch_distributed():
    try:
        import torch.distributed as dist
    except ImportError as error:  # the cpu path needs no torch; collectives do
        raise RuntimeError("ember.distributed needs torch (pip install torch): its process groups carry the "
                           "collectives") from error
    return dist


def is_available() -> bool:
    """Whether collectives can run here (torch with torch.distributed is installed)."""
    try:
        return _torch_distributed().is_available()
    except RuntimeError:
        return False


def init_process_group(backend: str | None = None, init_method: str | None = None, timeout=None,
                       world_size: int = -1, rank: int = -1, **kwargs) -> None:
    """Join the default process group, as torch.distributed.init_process_group (`env://` by default: the
    MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE that torchrun sets). The backend defaults to NCCL where ember's
    default device is a GPU, else gloo; with NCCL each process takes the GPU of its LOCAL_RANK. `timeout` (seconds
    or a timedelta) bounds how long a collective waits for the others (torch's default: 10 minutes for NCCL)."""
    dist = _torch_distributed()
    if backend is None:
        backend = "nccl" if _on_gpu() else "gloo"
    if backend == "nccl" and "LOCAL_RANK" in os.environ:  # "cuda" names this process's GPU from here on
        import torch

        from ember.device import set_device

        set_device(int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    options = {"timeout": timeout} if timeout is not None else {}
    dist.init_process_group(backend, init_method=init_method or ("env://" if world_size < 0 else None),
                            world_size=world_size, rank=rank, **options, **kwargs)


def _on_gpu() -> bool:
    """Whether ember's default device is a real GPU (under EMBER_INTERPRET the cuda device is the CPU's)."""
    from ember.device import default_device
    from ember.runtime import targets

    return default_device().type == "cuda" and targets.running("triton").interpret is False


def is_initialized() -> bool:
    return is_available() and _torch_distributed().is_initialized()


def get_rank(group=None) -> int:
    _check_group(group, "get_rank")
    return _torch_distributed().get_rank()


def get_world_size(group=None) -> int:
    _check_group(group, "get_world_size")
    return _torch_distributed().get_world_size()


def get_backend(group=None) -> str:
    _check_group(group, "get_backend")
    return str(_torch_distributed().get_backend())


def barrier(group=None) -> None:
    """Wait until every process has called barrier."""
    _check_group(group, "barrier")
    _torch_distributed().barrier()


def destroy_process_group(group=None) -> None:
    """Leave the default process group. The CUDA graphs of steps that ran collectives (ember.jit programs and
    steady lazy steps) are reset first: NCCL's teardown would wait for them forever; such a step captures
    anew if it runs again (in a new group)."""
    _check_group(group, "destroy_process_group")
    if "ember.runtime.graphs" in sys.modules:  # no graph was ever captured otherwise
        from ember.runtime import graphs, steady

        steady.release()
        graphs.reset_collective_graphs()
    _torch_distributed().destroy_process_group()


class _Done:
    """What an `async_op=True` call returns: the collective is already ordered before whatever reads its result."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def all_reduce(tensor: Tensor, op: str = ReduceOp.SUM, group=None, async_op: bool = False):
    """Combine `tensor` over every process; each then holds the result in `tensor`."""
    _expect(tensor, "all_reduce", group, op)
    _show(tensor, collective(tensor, "all_reduce", op))
    return _Done() if async_op else None


def broadcast(tensor: Tensor, src: int, group=None, async_op: bool = False):
    """Give every process rank `src`'s `tensor`."""
    _expect(tensor, "broadcast", group)
    _show(tensor, collective(tensor, "broadcast", source=_rank_in_world(src, "broadcast")))
    return _Done() if async_op else None


def all_gather_into_tensor(output_tensor: Tensor, input_tensor: Tensor, group=None, async_op: bool = False):
    """Every process's `input_tensor`, concatenated along the first dimension in rank order, into `output_tensor`."""
    _expect(input_tensor, "all_gather_into_tensor", group)
    gathered = collective(input_tensor, "all_gather")
    _same_layout(output_tensor, gathered, "all_gather_into_tensor")
    _show(output_tensor, gathered)
    return _Done() if async_op else None


def all_gather(tensor_list: list, tensor: Tensor, group=None, async_op: bool = False):
    """Every process's `tensor`, one per entry of `tensor_list` (in rank order)."""
    _expect(tensor, "all_gather", group)
    world = get_world_size()
    if len(tensor_list) != world:
        raise ValueError(f"all_gather: tensor_list has {len(tensor_list)} entries for a world of {world} processes")
    gathered = collective(tensor.reshape(1, *tensor.shape), "all_gather")
    for k, t in enumerate(tensor_list):
        _same_layout(t, gathered[k], "all_gather")
        _show(t, gathered[k])
    return _Done() if async_op else None


def reduce_scatter_tensor(output: Tensor, input: Tensor, op: str = ReduceOp.SUM, group=None, async_op: bool = False):
    """`input` combined over every process, split along its first dimension into world-size parts: this process's
    part, into `output`."""
    _expect(input, "reduce_scatter_tensor", group, op)
    part = collective(input, "reduce_scatter", op)
    _same_layout(output, part, "reduce_scatter_tensor")
    _show(output, part)
    return _Done() if async_op else None


def reduce_scatter(output: Tensor, input_list: list, op: str = ReduceOp.SUM, group=None, async_op: bool = False):
    """The k-th entries of every process's `input_list` combined, into process k's `output`."""
    from ember.ops.movement import stack

    _expect(output, "reduce_scatter", group, op)
    world = get_world_size()
    if len(input_list) != world:
        raise ValueError(f"reduce_scatter: input_list has {len(input_list)} entries for a world of {world} processes")
    part = collective(stack(list(input_list)).reshape(world, -1), "reduce_scatter", op).reshape(output.shape)
    _same_layout(output, part, "reduce_scatter")
    _show(output, part)
    return _Done() if async_op else None


def collective(tensor: Tensor, kind: str, reduce: str = ReduceOp.SUM, source: int = 0) -> Tensor:
    """The COLLECTIVE op on `tensor` (lazy, differentiable nowhere): "all_reduce", "broadcast", "all_gather" (along
    the first dimension) or "reduce_scatter" (of the first dimension)."""
    return apply(Op.COLLECTIVE, tensor, collective=kind, reduce=reduce, source=source, world=get_world_size())


# -- checks ------------------------------------------------------------------------------------------------------

def _check_group(group, op: str) -> None:
    if group is not None:
        raise NotImplementedError(f"ember.distributed.{op}: only the default group (group=None) is supported")


def _expect(tensor, op: str, group, reduce: str | None = None) -> None:
    _check_group(group, op)
    if not isinstance(tensor, Tensor):
        raise TypeError(f"ember.distributed.{op}: expected an ember Tensor, got {type(tensor).__name__}")
    if not is_initialized():
        raise RuntimeError(f"ember.distributed.{op}: the default process group is not initialized; call "
                           "ember.distributed.init_process_group() first")
    if reduce is not None and reduce not in _REDUCTIONS:
        raise ValueError(f"ember.distributed.{op}: op must be one of ReduceOp's {_REDUCTIONS}, got {reduce!r}")
    if reduce == ReduceOp.AVG and not tensor.dtype.is_floating_point:
        raise TypeError(f"ember.distributed.{op}: ReduceOp.AVG needs a floating-point tensor, got {tensor.dtype}")


def _rank_in_world(src: int, op: str) -> int:
    world = get_world_size()
    if not 0 <= src < world:
        raise ValueError(f"ember.distributed.{op}: src {src} is not a rank of the world of {world} processes")
    return src


def _same_layout(out: Tensor, value: Tensor, op: str) -> None:
    if not isinstance(out, Tensor):
        raise TypeError(f"ember.distributed.{op}: expected an ember Tensor for the output, got {type(out).__name__}")
    if out.shape != value.shape or out.dtype is not value.dtype or out.device != value.device:
        raise ShapeError(f"ember.distributed.{op}: the output is {out.shape} {out.dtype} on {out.device}, the "
                         f"result {value.shape} {value.dtype} on {value.device}")


def _show(tensor: Tensor, value: Tensor) -> None:
    """`tensor` shows `value` from now on, and the collective is issued now (every process in its call order)."""
    tensor._show(value._node)
    tensor.realize()


# -- the COLLECTIVE primitive --------------------------------------------------------------------------------------

def _shape(inputs, attrs):
    (x,) = inputs
    kind, world = attrs["collective"], attrs["world"]
    if kind in ("all_reduce", "broadcast"):
        return x.shape, x.dtype
    if not x.shape:
        raise ShapeError(f"{kind}: a tensor with no dimensions cannot be gathered or scattered along its first")
    if kind == "all_gather":
        return (world * x.shape[0], *x.shape[1:]), x.dtype
    if kind == "reduce_scatter":
        if x.shape[0] % world:
            raise ShapeError(f"reduce_scatter: the first dimension, {x.shape[0]}, does not split into {world} "
                             "equal parts (one per process)")
        return (x.shape[0] // world, *x.shape[1:]), x.dtype
    raise ValueError(f"unknown collective {kind!r}")


def run_collective(attrs: dict, x, out) -> None:
    """Run one collective with torch.distributed from torch tensor `x` into torch tensor `out` (contiguous). Gloo
    has no average, reduce-scatter or half-precision sums: those are computed from what it has (a sum divided, an
    all-reduce's own part, float32)."""
    import torch

    dist = _torch_distributed()
    kind, reduce = attrs["collective"], attrs["reduce"]
    gloo = dist.get_backend() == "gloo"
    wide = gloo and x.dtype in (torch.float16, torch.bfloat16)
    if kind == "broadcast":
        out.copy_(x)
        dist.broadcast(out, attrs["source"])
        return
    if kind == "all_gather":
        source = x.contiguous()
        if gloo:
            dist.all_gather(list(out.chunk(attrs["world"])), source)
        else:
            dist.all_gather_into_tensor(out, source)
        return
    work = x.float() if wide else x.clone() if kind == "reduce_scatter" or out.data_ptr() == x.data_ptr() else x
    ops = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
           "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.SUM if gloo else dist.ReduceOp.AVG}
    if kind == "reduce_scatter" and not gloo:
        dist.reduce_scatter_tensor(out, work.contiguous(), ops[reduce])
        return
    if work is x:  # all_reduce in the output's buffer
        out.copy_(x)
        work = out
    dist.all_reduce(work, ops[reduce])
    if reduce == "avg" and gloo:
        work.div_(attrs["world"])
    if kind == "reduce_scatter":
        work = work.chunk(attrs["world"])[dist.get_rank()]
    if work is not out:
        out.copy_(work)


def _reference(x: np.ndarray, **attrs) -> np.ndarray:
    """The collective on the cpu device: NumPy buffers lent to torch (half types as float32)."""
    import torch

    half = x.dtype in (dtypes.float16.np, dtypes.bfloat16.np)
    source = np.array(x, dtype=np.float32 if half else x.dtype, order="C")  # a copy (0-d stays 0-d)
    shape, _ = _shape([_Shaped(x.shape)], attrs)
    out = np.empty(shape, source.dtype)
    run_collective(attrs, torch.from_numpy(source), torch.from_numpy(out))
    return out.astype(x.dtype, copy=False)


class _Shaped:
    """A stand-in for a node in the shape rule: what it reads of one (shape and dtype)."""

    def __init__(self, shape):
        self.shape, self.dtype = shape, None


define(Op.COLLECTIVE, shape=_shape, vjp=NOT_DIFFERENTIABLE, reference=_reference)
