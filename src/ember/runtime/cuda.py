"""The "cuda" backend: the device, its settings, and the memory plans run in.

Storage is torch CUDA tensors; torch supplies the caching allocator, streams and
the vendor matmul and convolution. With `EMBER_INTERPRET=1` the same device runs
on the CPU: buffers are torch CPU tensors and every generated kernel runs through
Triton's interpreter. That is how CI, which has no GPU, tests the generated code.

This module maps ember devices to torch devices, turns the user's settings into the
compile context, allocates buffers and the arenas of plans' intermediates, and
reports memory. Plans are cached in `plan_cache`, run by `launcher`. A plan's arena
serves one thread (or one ember.jit program): threads running the same plan at the
same time never share intermediates.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import weakref

import torch

from ember import dtypes
from ember.compiler import CompileContext, Plan
from ember.device import Device, get_conv_memory_format, get_matmul_precision, on_matmul_precision
from ember.errors import DeviceError, OutOfMemoryError
from ember.runtime import collector, targets

# the runtime target running this device's plans: generated Triton kernels on the GPU, or (EMBER_INTERPRET=1)
# their interpreted variant, which runs `cuda:0` on the CPU (see runtime/targets.py)
TARGET = targets.for_device("cuda")

# Streams a plan's independent small kernels may spread over when it is captured into a CUDA graph
# (`ember.jit`); 1 runs everything in order. Outside a graph a plan always runs on one stream:
# switching streams and recording events costs the host more per kernel than the overlap saves.
# Inside graphs two streams were within noise of one on an H200 (benchmarks/runtime.py, row 4: the
# planner already splits reductions that would leave the GPU idle), so one is the default.
max_streams = 1
# How generated GEMM kernels run: "auto" times each against its split form (cuBLAS through torch.matmul,
# the prologue and epilogue in kernels of their own) on its first run and keeps the faster; "triton"
# always runs the generated kernel, "cublas" always the split form.
gemm_backend = "auto"
ARENAS_KEPT = 8  # plans whose intermediate arenas a thread keeps allocated between runs (most recently run first)

stats = {"plans_compiled": 0, "plans_loaded": 0, "plan_hits": 0, "launches": 0}


def apply_matmul_precision(precision: str) -> None:
    """cuBLAS and cuDNN take float32 products in TF32 unless the precision is "highest"."""
    tf32 = precision != "highest"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


apply_matmul_precision(get_matmul_precision())
on_matmul_precision(apply_matmul_precision)


def is_available() -> bool:
    return TARGET.interpret or torch.cuda.is_available()


def device_count() -> int:
    """How many cuda devices exist: the GPUs torch sees, or one under the interpreter, which runs
    `cuda:0` on the CPU and so behaves like a machine with one GPU."""
    if TARGET.interpret:
        return 1
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@functools.cache  # checked once per device: every plan execution and every transfer asks
def torch_device(device: Device) -> torch.device:
    """The torch device behind an ember cuda device; DeviceError if it does not exist here."""
    if not is_available():
        raise DeviceError(f"device {device} is not available: no CUDA GPU was found "
                          "(set EMBER_INTERPRET=1 to run the cuda backend on the CPU through Triton's interpreter)")
    count = device_count()
    if device.index >= count:
        found = ("the interpreter (EMBER_INTERPRET=1) runs 1 cuda device" if TARGET.interpret else
                 f"{count} GPU{'s' if count != 1 else ''} found")
        choices = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise DeviceError(f"device {device} does not exist: {found}; use {choices}")
    return torch.device("cpu") if TARGET.interpret else torch.device("cuda", device.index)


@functools.cache  # asked for every plan looked up
def multiprocessors(device: Device) -> int:
    return 132 if TARGET.interpret else torch.cuda.get_device_properties(torch_device(device)).multi_processor_count


@functools.cache
def shared_memory(device: Device) -> int:
    """Bytes of shared memory one block may use on the GPU (0 in the interpreter: unknown)."""
    if TARGET.interpret:
        return 0
    return getattr(torch.cuda.get_device_properties(torch_device(device)), "shared_memory_per_block_optin", 0)


def compile_context(device: Device) -> CompileContext:
    """What the user's settings ask of the compiler now, for plans run on `device`; it keys the plan cache.
    Made once per device and settings (every realization asks)."""
    settings = (device, get_matmul_precision(), gemm_backend, max_streams, multiprocessors(device),
                get_conv_memory_format(), os.environ.get("EMBER_SPLIT_K"))
    context = _contexts.get(settings)
    if context is None:
        context = _contexts[settings] = CompileContext(*settings[1:6], split_k=split_k(),
                                                       shared_memory=shared_memory(device))
    return context


_contexts: dict[tuple, CompileContext] = {}


def split_k() -> bool:
    """GEMMs with few output tiles and a long K split it over several programs per tile, unless
    EMBER_SPLIT_K=0."""
    return os.environ.get("EMBER_SPLIT_K", "1").strip() != "0"


# -- memory ------------------------------------------------------------------------------------

def scratch(what: tuple, target) -> torch.Tensor:
    """A float32 scratch buffer that a kernel's launches share (a split GEMM's partial tiles and sums), kept
    with the prepared launches; each run writes all of it before reading it. `what`: (kind, elements, ...),
    as Param describes."""
    return torch.empty(what[1], dtype=torch.float32, device=target)


class Arena:
    """One allocation holding a plan's intermediates on one device, and their views into it."""

    __slots__ = ("plan", "views", "__weakref__")

    def __init__(self, plan: Plan, target: torch.device, device: Device):
        sched = plan.schedule
        arena = allocate((sched.arena_bytes,), dtypes.uint8, target, device, "intermediates")
        nodes = {id(n): n for ck in plan.kernels for n in ck.kernel.outputs}
        self.plan, self.views = plan, {}
        for key, (offset, size) in sched.slots.items():
            node = nodes[key]
            self.views[key] = arena[offset:offset + size].view(dtypes.to_torch(node.dtype)).view(node.shape)
        with _arenas_lock:
            _arenas.add(self)


_arenas: weakref.WeakSet = weakref.WeakSet()  # every arena alive, for memory_stats
_arenas_lock = threading.Lock()


class _ThisThread(threading.local):
    def __init__(self) -> None:
        self.arenas: dict[tuple, Arena] = {}  # (id(plan), device) -> its arena, most recently run last


this_thread = _ThisThread()


def arena_views(plan: Plan, target: torch.device, device: Device) -> dict[int, torch.Tensor]:
    """Views of the plan's intermediates into this thread's arena for it, kept between the thread's runs of
    the plan. Kernels run in stream order, so the next run cannot overwrite an intermediate the last one
    still reads; another thread running the plan at the same time has an arena of its own."""
    arenas = this_thread.arenas
    arena = arenas.pop((id(plan), device), None)  # a plan may run on several GPUs: one arena on each
    if arena is None or arena.plan is not plan:
        arena = Arena(plan, target, device)
        while len(arenas) >= ARENAS_KEPT:
            arenas.pop(next(iter(arenas)))
    arenas[id(plan), device] = arena
    return arena.views


def release_arenas(keys) -> None:
    """Let go of this thread's arenas for these (id(plan), device) keys: plans not expected to run again here."""
    for key in keys:
        this_thread.arenas.pop(key, None)


def take_arena(plan: Plan, target: torch.device, device: Device) -> Arena:
    """This thread's arena for the plan, or a new one, for a holder of its own (an ember.jit program, whose
    CUDA graphs keep its addresses): the thread's next run of the plan gets another."""
    arena = this_thread.arenas.pop((id(plan), device), None)
    return arena if arena is not None and arena.plan is plan else Arena(plan, target, device)


# called when an allocation fails for want of memory, before it is tried again: each frees what it can do without
# (the thread's cached arenas, the lazy path's spare result sets: runtime.steady) and says whether it freed anything
on_out_of_memory: list = []


def _release_arenas() -> bool:
    """Drop this thread's cached arenas (called when GPU memory runs out): one a run still uses stays alive through
    its views; the others are freed, and their plans' next runs allocate them again. Whether there were any."""
    cached = bool(this_thread.arenas)
    this_thread.arenas.clear()
    return cached


on_out_of_memory.append(_release_arenas)


def allocate(shape: tuple[int, ...], dtype, target: torch.device, device: Device, what: str) -> torch.Tensor:
    for last in (False, True):
        try:
            buffer = torch.empty(shape, dtype=dtypes.to_torch(dtype), device=target)
            return _count(buffer) if TARGET.interpret else buffer
        except torch.cuda.OutOfMemoryError:
            pass
        # buffers that only unreachable cycles hold (frozen ones too) are freed by a full collection
        freed = [release() for release in on_out_of_memory]
        if last or not (collector.refresh() or any(freed)):
            break
    asked = math.prod(shape) * dtype.itemsize
    raise OutOfMemoryError(f"out of GPU memory on {device}: asked {_mib(asked)} for {what} {list(shape)} "
                           f"{dtype.name}; {free_text(target)}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def free_text(target: torch.device) -> str:
    if target.type != "cuda":
        return "free memory unknown"
    free, total = torch.cuda.mem_get_info(target)
    return f"{_mib(free)} free of {_mib(total)}"


def memory_stats(device: Device) -> dict:
    """Bytes "allocated" now, the "peak" since the start, "cached" by the allocator, and the "arena"
    bytes kept for the intermediates of recently run plans (in every thread) and of ember.jit programs.
    Under the interpreter, whose buffers are ordinary CPU tensors, the first three count the buffers the
    executor allocated itself."""
    with _arenas_lock:
        arena = sum(a.plan.schedule.arena_bytes for a in list(_arenas))
    if TARGET.interpret:
        return {"allocated": _interpreted["allocated"], "peak": _interpreted["peak"], "cached": arena,
                "arena": arena}
    target = torch_device(device)
    return {"allocated": torch.cuda.memory_allocated(target), "peak": torch.cuda.max_memory_allocated(target),
            "cached": torch.cuda.memory_reserved(target), "arena": arena}


_interpreted = {"allocated": 0, "peak": 0}


def _count(buffer: torch.Tensor) -> torch.Tensor:
    """Count an interpreter buffer in memory_stats until it is freed."""
    size = buffer.numel() * buffer.element_size()
    _interpreted["allocated"] += size
    _interpreted["peak"] = max(_interpreted["peak"], _interpreted["allocated"])
    weakref.finalize(buffer, _uncount, size)
    return buffer


def _uncount(size: int) -> None:
    _interpreted["allocated"] -= size
