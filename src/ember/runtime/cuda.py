"""The "cuda" backend: compiled plans of generated Triton kernels over torch tensors.

Storage is torch CUDA tensors; torch supplies the caching allocator, streams and
the vendor matmul and convolution. With `EMBER_INTERPRET=1` the same device runs
on the CPU: buffers are torch CPU tensors and every generated kernel runs through
Triton's interpreter. That is how CI, which has no GPU, tests the generated code.

A plan (fused kernels, their sources, buffer lifetimes) is cached by the pending
graph's structure, so a repeated training step costs a key and the launches.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pickle
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

INTERPRET = os.environ.get("EMBER_INTERPRET", "0") not in ("", "0")
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"  # must be set before triton is imported

import torch  # noqa: E402

from ember import dtypes  # noqa: E402
from ember.compiler import fusion, passes  # noqa: E402
from ember.compiler.codegen import triton as codegen  # noqa: E402
from ember.device import Device  # noqa: E402
from ember.errors import CompileError, DeviceError, OutOfMemoryError  # noqa: E402
from ember.ir import Node, Op  # noqa: E402

if INTERPRET:
    from ember.runtime import triton_interpreter

    triton_interpreter.apply()


def is_available() -> bool:
    return INTERPRET or torch.cuda.is_available()


def torch_device(device: Device) -> torch.device:
    if not is_available():
        raise DeviceError(f"device {device} is not available: no CUDA GPU was found "
                          "(set EMBER_INTERPRET=1 to run the cuda backend on the CPU through Triton's interpreter)")
    return torch.device("cpu") if INTERPRET else torch.device("cuda", device.index)


# -- transfers ---------------------------------------------------------------------------------

def from_numpy(array: np.ndarray, device: Device) -> torch.Tensor:
    array = np.ascontiguousarray(array).reshape(array.shape)  # ascontiguousarray makes a 0-d array 1-d
    if array.dtype == dtypes.bfloat16.np:
        host = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
        host = torch.from_numpy(array)
    target = torch_device(device)
    return host.to(target, non_blocking=False) if target.type != "cpu" else host.clone()


def to_numpy(buffer: torch.Tensor) -> np.ndarray:
    host = buffer.detach().cpu()
    if host.dtype == torch.bfloat16:
        return host.contiguous().view(torch.int16).numpy().view(dtypes.bfloat16.np)
    return host.numpy()


# -- kernel sources on disk ---------------------------------------------------------------------

def cache_dir(kind: str = "kernels") -> Path:
    root = Path(os.environ.get("EMBER_CACHE_DIR", Path.home() / ".cache" / "ember"))
    path = root / kind
    path.mkdir(parents=True, exist_ok=True)
    return path


_modules: dict[str, object] = {}


def load_source(source: codegen.KernelSource):
    """Write the source to the cache directory (atomically) and import it; Triton needs a real file."""
    if source.name in _modules:
        return _modules[source.name]
    path = cache_dir() / f"{source.name}.py"
    if not path.exists() or path.read_text() != source.text:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source.text)
        os.replace(tmp, path)
    if "kernels" in os.environ.get("EMBER_DEBUG", ""):
        print(f"ember: kernel {source.name} -> {path}", file=sys.stderr)
    spec = importlib.util.spec_from_file_location(source.name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # a generated kernel that does not import is a compiler bug
        raise CompileError(f"generated kernel {source.name} failed to load: {error} (source: {path})") from error
    module.__ember_path__ = path
    _modules[source.name] = module
    return module


# -- plans -------------------------------------------------------------------------------------

@dataclass
class CompiledKernel:
    kernel: fusion.FusedKernel
    source: codegen.KernelSource | None = None
    module: object = None


@dataclass
class Plan:
    lowered: passes.Lowered
    kernels: list[CompiledKernel]
    stored: set[int]
    last_use: dict[int, int] = field(default_factory=dict)  # id(lowered node) -> last kernel reading it
    compile_seconds: float = 0.0


_plans: dict[tuple, Plan] = {}
stats = {"plans_compiled": 0, "plans_loaded": 0, "plan_hits": 0, "launches": 0}


def _plan_path(key: tuple) -> Path:
    """A plan's file: the graph's structure plus what the plan was made with (device, versions)."""
    import triton

    import ember

    gpu = "interpreter" if INTERPRET else torch.cuda.get_device_name()
    identity = repr((key, gpu, ember.__version__, torch.__version__, triton.__version__))
    return cache_dir("plans") / (hashlib.sha256(identity.encode()).hexdigest()[:32] + ".pkl")


def _save_plan(key: tuple, plan: Plan) -> None:
    """Write a plan atomically; the modules are not stored (their sources are, and are re-imported)."""
    position = {id(n): i for i, n in enumerate(plan.lowered.nodes)}
    modules = [ck.module for ck in plan.kernels]
    last_use = plan.last_use
    try:
        for ck in plan.kernels:
            ck.module = None
        plan.last_use = {position[k]: v for k, v in last_use.items() if k in position}
        payload = pickle.dumps((key, plan), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError):
        return  # a plan that cannot be stored is still used in this process
    finally:
        plan.last_use = last_use
        for ck, module in zip(plan.kernels, modules):
            ck.module = module
    path = _plan_path(key)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(payload)
    os.replace(tmp, path)


def _load_plan(key: tuple) -> Plan | None:
    """A plan from disk, or None; an entry that does not load or is not this graph's is rebuilt."""
    path = _plan_path(key)
    if not path.exists():
        return None
    try:
        stored_key, plan = pickle.loads(path.read_bytes())
        if stored_key != key:
            return None
        plan.last_use = {id(plan.lowered.nodes[i]): v for i, v in plan.last_use.items()}
        for ck in plan.kernels:
            if ck.source is not None:
                ck.module = load_source(ck.source)
    except Exception:  # corrupt, truncated or from an incompatible ember: never trusted
        return None
    stats["plans_loaded"] += 1
    return plan


def compile_plan(order: list[Node], keep: set[int], sig: passes.Signature) -> Plan:
    start = time.perf_counter()
    lowered = passes.lower(order, keep, sig)
    kernels, stored = fusion.plan(lowered.nodes, lowered.outputs)
    compiled = []
    for k in kernels:
        ck = CompiledKernel(k)
        if k.kind not in ("matmul", "conv2d"):
            ck.source = codegen.generate(k, stored)
            ck.module = load_source(ck.source)
        compiled.append(ck)
    last_use: dict[int, int] = {}
    for i, ck in enumerate(compiled):
        for r in ck.kernel.reads:
            last_use[id(r)] = i
    stats["plans_compiled"] += 1
    return Plan(lowered, compiled, stored, last_use, time.perf_counter() - start)


def plan_for(order: list[Node], keep: set[int]) -> tuple[Plan, passes.Signature]:
    sig = passes.signature(order, keep)
    plan = _plans.get(sig.key)
    if plan is None:
        plan = _load_plan(sig.key)
        if plan is None:
            plan = compile_plan(order, keep, sig)
            _save_plan(sig.key, plan)
        _plans[sig.key] = plan
    else:
        stats["plan_hits"] += 1
    return plan, sig


def run(order: list[Node], keep: set[int]) -> dict[int, torch.Tensor]:
    """Evaluate `order` on the device; return buffers for the nodes whose ids are in `keep`."""
    plan, sig = plan_for(order, keep)
    buffers = execute(plan, sig, order[0].device)
    kept = [n for n in order if id(n) in keep]
    return {id(n): buffers[id(out)] for n, out in zip(kept, plan.lowered.outputs)}


def execute(plan: Plan, sig: passes.Signature, device: Device) -> dict[int, torch.Tensor]:
    target = torch_device(device)
    buffers: dict[int, torch.Tensor] = {id(p): leaf.buffer for p, leaf in zip(plan.lowered.inputs, sig.inputs)}
    outputs = {id(o) for o in plan.lowered.outputs}
    try:
        for i, ck in enumerate(plan.kernels):
            kernel = ck.kernel
            for o in kernel.outputs:
                if id(o) not in buffers:
                    buffers[id(o)] = torch.empty(o.shape, dtype=dtypes.to_torch(o.dtype), device=target)
            if kernel.kind == "matmul":
                node = kernel.outputs[0]
                a, b = (_on_vendor_device(_view(x, buffers)) for x in node.inputs)
                out = buffers[id(node)]
                if a.device == out.device:
                    torch.matmul(a, b, out=out)
                else:
                    out.copy_(torch.matmul(a, b))
            elif kernel.kind == "conv2d":
                _conv2d(kernel.outputs[0], buffers)
            else:
                for launch in ck.source.launches:
                    _launch(ck, launch, buffers, sig)
            for r in kernel.reads:  # free what no later kernel reads
                if plan.last_use.get(id(r)) == i and id(r) not in outputs and r.op is not Op.BUFFER:
                    buffers.pop(id(r), None)
    except torch.cuda.OutOfMemoryError as error:
        free, total = torch.cuda.mem_get_info(target)
        raise OutOfMemoryError(f"out of GPU memory running a plan of {len(plan.kernels)} kernels on {device}: "
                               f"{free / 2**20:.0f} MiB free of {total / 2**20:.0f} MiB ({error})") from None
    return buffers


def _view(node: Node, buffers: dict[int, torch.Tensor]) -> torch.Tensor:
    """A strided torch view of a stored node through the movement ops above it."""
    if id(node) in buffers:
        return buffers[id(node)]
    base = _view(node.inputs[0], buffers)
    a = node.attrs
    if node.op is Op.RESHAPE:
        return base.reshape(a["shape"])
    if node.op is Op.PERMUTE:
        return base.permute(*a["order"])
    if node.op is Op.EXPAND:
        return base.expand(*a["shape"])
    if node.op is Op.SLICE:
        return base[tuple(slice(start, stop, step) for start, stop, step in a["slices"])]
    raise CompileError(f"{node.op.label} has no strided view; the planner should have stored its input")


def _on_vendor_device(operand: torch.Tensor) -> torch.Tensor:
    """Where torch can multiply or convolve the operand: cuBLAS and cuDNN take no integers, torch's CPU
    kernels do (integer matmuls and convolutions are rare enough to pay the copies)."""
    return operand.cpu() if operand.is_cuda and not operand.dtype.is_floating_point else operand


def _conv2d(node: Node, buffers: dict[int, torch.Tensor]) -> None:
    x, w = (_on_vendor_device(_view(i, buffers)) for i in node.inputs)
    if x.numel() == 0 or w.numel() == 0:  # torch gets the shape wrong without input channels; a sum of nothing
        buffers[id(node)].zero_()
        return
    a = node.attrs
    out = torch.nn.functional.conv2d(x, w, None, a["stride"], a["padding"], a["dilation"], a["groups"])
    buffers[id(node)].copy_(out)


def _launch(ck: CompiledKernel, launch: codegen.Launch, buffers: dict[int, torch.Tensor],
            sig: passes.Signature) -> None:
    if launch.grid == 0:
        return
    args = []
    for arg in launch.args:
        if arg.kind in ("read", "write"):
            args.append(buffers[id(arg.value)])
        elif arg.kind in ("size", "bound"):
            args.append(arg.value)
        elif arg.kind == "scalar":
            args.append(sig.scalars[arg.value])
        elif arg.kind == "seed":
            args.append(sig.seeds[arg.value][0])
        elif arg.kind == "offset":
            args.append(sig.seeds[arg.value][1])
    fn = getattr(ck.module, launch.function)
    try:
        fn[(launch.grid,)](*args, **launch.constexprs, num_warps=launch.num_warps)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as error:
        raise CompileError(f"kernel {launch.function} failed: {error} "
                           f"(source: {getattr(ck.module, '__ember_path__', '?')})") from error
    stats["launches"] += 1
