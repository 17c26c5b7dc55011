"""The "cuda" backend: compiled plans of generated Triton kernels over torch tensors.

Storage is torch CUDA tensors; torch supplies the caching allocator, streams and
the vendor matmul and convolution. With `EMBER_INTERPRET=1` the same device runs
on the CPU: buffers are torch CPU tensors and every generated kernel runs through
Triton's interpreter. That is how CI, which has no GPU, tests the generated code.

A plan (fused kernels, their sources, buffer lifetimes) is cached by the pending
graph's structure, so a repeated training step costs a key and the launches.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import math
import os
import pickle
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ember import dtypes
from ember.compiler import fusion, passes, pipeline, schedule
from ember.compiler.codegen import triton as codegen
from ember.compiler.context import CompileContext
from ember.device import Device, get_matmul_precision
from ember.errors import CompileError, DeviceError, OutOfMemoryError
from ember.ir import Node, Op
from ember.runtime import autotune, jit, triton_interpreter

# ember's choice, read once: generated kernels are interpreted (see triton_interpreter), whatever
# Triton's own TRITON_INTERPRET says
INTERPRET = os.environ.get("EMBER_INTERPRET", "0") not in ("", "0")


def apply_matmul_precision(precision: str) -> None:
    """cuBLAS and cuDNN take float32 products in TF32 unless the precision is "highest"."""
    tf32 = precision != "highest"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


apply_matmul_precision(get_matmul_precision())


def is_available() -> bool:
    return INTERPRET or torch.cuda.is_available()


def device_count() -> int:
    """How many cuda devices exist: the GPUs torch sees, or one under the interpreter, which runs
    `cuda:0` on the CPU and so behaves like a machine with one GPU."""
    if INTERPRET:
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
        found = ("the interpreter (EMBER_INTERPRET=1) runs 1 cuda device" if INTERPRET else
                 f"{count} GPU{'s' if count != 1 else ''} found")
        choices = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise DeviceError(f"device {device} does not exist: {found}; use {choices}")
    return torch.device("cpu") if INTERPRET else torch.device("cuda", device.index)


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
    _modules[source.name] = triton_interpreter.runnable(module, INTERPRET)
    return module


# -- plans -------------------------------------------------------------------------------------

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
_capturing = False  # a Replay is being captured into a CUDA graph
ARENAS_KEPT = 8  # plans whose intermediate arenas stay allocated between runs (most recently run first)


@dataclass
class CompiledKernel:
    kernel: fusion.FusedKernel
    source: codegen.KernelSource | None = None
    module: object = None
    split: list[CompiledKernel] = field(default_factory=list)  # a GEMM's split form, compiled
    choice: dict | None = None  # a GEMM's: "chosen" ("triton" or "cublas"), "triton_ms", "cublas_ms", "config"


def _loaded(kernel: fusion.FusedKernel, compiled: pipeline.Compiled) -> CompiledKernel:
    """A planned kernel with its generated source imported (and its split form's)."""
    ck = CompiledKernel(kernel, compiled.sources.get(id(kernel)))
    if ck.source is not None:
        ck.module = load_source(ck.source)
    if kernel.core is not None:
        ck.split = [_loaded(part, compiled) for part in kernel.split]
    return ck


def compile_context() -> CompileContext:
    """What the user's settings ask of the compiler now; it keys the plan cache."""
    return CompileContext(get_matmul_precision(), gemm_backend, max_streams)


@dataclass
class Plan:
    lowered: passes.Lowered
    kernels: list[CompiledKernel]  # in launch order
    stored: set[int]
    schedule: schedule.Schedule
    compile_seconds: float = 0.0
    steps: list | None = field(default=None, repr=False)  # launch recipes, rebuilt after loading


_plans: dict[tuple, Plan] = {}
stats = {"plans_compiled": 0, "plans_loaded": 0, "plan_hits": 0, "launches": 0}


def _plan_path(key: tuple, context: CompileContext) -> Path:
    """A plan's file: the graph's structure plus what the plan was made with (device, versions, settings)."""
    import triton

    import ember

    gpu = "interpreter" if INTERPRET else torch.cuda.get_device_name()
    identity = repr((key, gpu, context, ember.__version__, _code_digest(),
                     torch.__version__, triton.__version__))
    return cache_dir("plans") / (hashlib.sha256(identity.encode()).hexdigest()[:32] + ".pkl")


@functools.cache
def _code_digest() -> str:
    """ember's own source: a plan stored by another build of the compiler is not this one's."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _save_plan(key: tuple, context: CompileContext, plan: Plan) -> None:
    """Write a plan atomically; modules and launch recipes are not stored (sources are, and are re-imported)."""
    position = {id(n): i for i, n in enumerate(plan.lowered.nodes)}
    every = [c for ck in plan.kernels for c in (ck, *ck.split)]
    modules = [ck.module for ck in every]
    slots, steps = plan.schedule.slots, plan.steps
    try:
        for ck in every:
            ck.module = None
        plan.steps = None
        plan.schedule.slots = {position[k]: v for k, v in slots.items()}
        payload = pickle.dumps((key, plan), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError):
        return  # a plan that cannot be stored is still used in this process
    finally:
        plan.schedule.slots, plan.steps = slots, steps
        for ck, module in zip(every, modules):
            ck.module = module
    path = _plan_path(key, context)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(payload)
    os.replace(tmp, path)


def _load_plan(key: tuple, context: CompileContext) -> Plan | None:
    """A plan from disk, or None; an entry that does not load or is not this graph's is rebuilt."""
    path = _plan_path(key, context)
    if not path.exists():
        return None
    try:
        stored_key, plan = pickle.loads(path.read_bytes())
        if stored_key != key:
            return None
        plan.schedule.slots = {id(plan.lowered.nodes[i]): v for i, v in plan.schedule.slots.items()}
        for ck in plan.kernels:
            for c in (ck, *ck.split):
                if c.source is not None:
                    c.module = load_source(c.source)
    except Exception:  # corrupt, truncated or from an incompatible ember: never trusted
        return None
    stats["plans_loaded"] += 1
    return plan


def _multiprocessors() -> int:
    return 132 if INTERPRET else torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def _is_small(ck: CompiledKernel, sms: int) -> bool:
    """Whether a kernel leaves most of the GPU idle, so another may run beside it."""
    if ck.kernel.kind in fusion.VENDOR_KINDS:  # its grid comes from the tuned configuration
        return math.prod(ck.kernel.space) < 64 * 64 * sms  # fewer 64 x 64 tiles than SMs
    return max((launch.grid for launch in ck.source.launches), default=0) < sms // 2


def compile_plan(order: list[Node], keep: set[int], sig: passes.Signature, context: CompileContext) -> Plan:
    start = time.perf_counter()
    compiled = pipeline.compile(order, keep, sig, context)
    loaded = [_loaded(k, compiled) for k in compiled.kernels]
    sms = _multiprocessors()
    sched = schedule.schedule(compiled.kernels, compiled.lowered.outputs, [_is_small(ck, sms) for ck in loaded],
                              context.max_streams)
    loaded = [loaded[i] for i in sched.order]
    stats["plans_compiled"] += 1
    return Plan(compiled.lowered, loaded, compiled.stored, sched, time.perf_counter() - start)


def plan_for(order: list[Node], keep: set[int]) -> tuple[Plan, passes.Signature]:
    sig = passes.signature(order, keep)
    context = compile_context()
    plan = _plans.get((sig.key, context))
    if plan is None:
        plan = _load_plan(sig.key, context)
        if plan is None:
            plan = compile_plan(order, keep, sig, context)
            _save_plan(sig.key, context, plan)
        _plans[sig.key, context] = plan
    else:
        stats["plan_hits"] += 1
    return plan, sig


def run(order: list[Node], keep: set[int]) -> dict[int, torch.Tensor]:
    """Evaluate `order` on the device; return buffers for the nodes whose ids are in `keep`."""
    plan, sig = plan_for(order, keep)
    device = order[0].device
    inputs = [leaf.buffer for leaf in sig.inputs]
    outputs = execute(plan, sig, device, inputs)
    kept = [n for n in order if id(n) in keep]
    values = {id(n): out for n, out in zip(kept, outputs)}
    if jit.recording():
        jit.record_plan(plan, sig, device, inputs, outputs, kept)
    return values


# -- execution ---------------------------------------------------------------------------------

def execute(plan: Plan, sig: passes.Signature, device: Device, inputs: list[torch.Tensor],
            outputs: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
    """Run a plan on `inputs` (one buffer per input of the lowered graph); return one buffer per
    output. `outputs` may name buffers to write results into (None where the plan should allocate)."""
    target = torch_device(device)
    buffers: dict[int, torch.Tensor] = {id(p): b for p, b in zip(plan.lowered.inputs, inputs)}
    buffers.update(_arena_views(plan, target, device))
    given = outputs or ()
    result = []
    for i, o in enumerate(plan.lowered.outputs):
        if id(o) not in buffers:
            out = given[i] if i < len(given) else None
            buffers[id(o)] = out if out is not None else _allocate(o.shape, o.dtype, target, device, "a result")
        result.append(buffers[id(o)])
    if plan.steps is None:
        plan.steps = [_step(ck) for ck in plan.kernels]
    try:
        if plan.schedule.groups and _capturing:
            _run_streams(plan, buffers, sig, target)
        else:
            for step in plan.steps:
                step(buffers, sig)
    except torch.cuda.OutOfMemoryError as error:
        raise OutOfMemoryError(f"out of GPU memory running a plan of {len(plan.kernels)} kernels on {device}: "
                               f"{_free_text(target)} ({error})") from None
    return result


def _run_streams(plan: Plan, buffers: dict[int, torch.Tensor], sig: passes.Signature, target) -> None:
    """Launch in schedule order; each parallel group forks from the main stream and joins back into it."""
    main = torch.cuda.current_stream(target)
    streams = [main, *_side_streams(target)]
    groups = dict(plan.schedule.groups)
    position, count = 0, len(plan.steps)
    while position < count:
        stop = groups.get(position)
        if stop is None:
            plan.steps[position](buffers, sig)
            position += 1
            continue
        used = {plan.schedule.streams[p] for p in range(position, stop)} - {0}
        fork = main.record_event()
        for s in used:
            streams[s].wait_event(fork)
        for p in range(position, stop):
            with torch.cuda.stream(streams[plan.schedule.streams[p]]):
                plan.steps[p](buffers, sig)
        for s in used:
            main.wait_event(streams[s].record_event())
        position = stop


_side: dict = {}


def _side_streams(target) -> list:
    if target not in _side:
        _side[target] = [torch.cuda.Stream(target) for _ in range(max(max_streams - 1, 1))]
    return _side[target]


_arenas: dict[tuple, tuple[Plan, dict[int, torch.Tensor]]] = {}  # (id(plan), device) -> views, newest last


def _arena_views(plan: Plan, target, device: Device) -> dict[int, torch.Tensor]:
    """Views of the plan's intermediates into its arena, kept between runs of the plan. Kernels run in
    stream order, so the next run cannot overwrite an intermediate the last one still reads."""
    entry = _arenas.pop((id(plan), device), None)  # a plan may run on several GPUs: one arena on each
    if entry is None or entry[0] is not plan:
        sched = plan.schedule
        arena = _allocate((sched.arena_bytes,), dtypes.uint8, target, device, "intermediates")
        nodes = {id(n): n for ck in plan.kernels for n in ck.kernel.outputs}
        views = {}
        for key, (offset, size) in sched.slots.items():
            node = nodes[key]
            views[key] = arena[offset:offset + size].view(dtypes.to_torch(node.dtype)).view(node.shape)
        entry = (plan, views)
        while len(_arenas) >= ARENAS_KEPT:
            _arenas.pop(next(iter(_arenas)))
    _arenas[id(plan), device] = entry
    return entry[1]


def _allocate(shape: tuple[int, ...], dtype, target, device: Device, what: str) -> torch.Tensor:
    try:
        buffer = torch.empty(shape, dtype=dtypes.to_torch(dtype), device=target)
        return _count(buffer) if INTERPRET else buffer
    except torch.cuda.OutOfMemoryError:
        asked = math.prod(shape) * dtype.itemsize
        raise OutOfMemoryError(f"out of GPU memory on {device}: asked {_mib(asked)} for {what} {list(shape)} "
                               f"{dtype.name}; {_free_text(target)}") from None


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _free_text(target) -> str:
    if target.type != "cuda":
        return "free memory unknown"
    free, total = torch.cuda.mem_get_info(target)
    return f"{_mib(free)} free of {_mib(total)}"


def memory_stats(device: Device) -> dict:
    """Bytes "allocated" now, the "peak" since the start, "cached" by the allocator, and the "arena"
    bytes kept for the intermediates of recently run plans. Under the interpreter, whose buffers
    are ordinary CPU tensors, the first three count the buffers the executor allocated itself."""
    arena = sum(p.schedule.arena_bytes for p, _ in _arenas.values())
    if INTERPRET:
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


def _step(ck: CompiledKernel):
    """A callable running one fused kernel from the buffers of a run; its argument lists are
    prepared once per plan, so a plan-cache hit costs little more than the launches."""
    kernel = ck.kernel
    if kernel.core is not None:
        return _GemmStep(ck)
    if kernel.kind is fusion.KernelKind.MATMUL:
        return functools.partial(_matmul, kernel.outputs[0])
    if kernel.kind is fusion.KernelKind.CONV2D:
        return functools.partial(_conv2d, kernel.outputs[0])
    launches = [_prepared_launch(ck, launch) for launch in ck.source.launches if launch.grid]
    return functools.partial(_run_launches, launches, ck)


_ARG_KINDS = {"read": 0, "write": 0, "size": 1, "bound": 1, "scalar": 2, "seed": 3, "offset": 4}


def _prepared_launch(ck: CompiledKernel, launch: codegen.Launch, config: autotune.Config | None = None):
    recipe = [(_ARG_KINDS[a.kind], id(a.value) if a.kind in ("read", "write") else a.value) for a in launch.args]
    if config is not None:  # a GEMM: grid and block sizes from its tuned configuration
        batch, m, n, _ = launch.gemm
        return getattr(ck.module, launch.function), config.grid(batch, m, n), recipe, config.launch_options()
    options = dict(launch.constexprs, num_warps=launch.num_warps)
    return getattr(ck.module, launch.function), (launch.grid,), recipe, options


def gemm_problem(ck: CompiledKernel) -> autotune.Problem:
    launch = ck.source.launches[0]
    return autotune.Problem.of(launch, ck.kernel.core.dtype, launch.layout)


class _GemmStep:
    """A generated GEMM kernel, or its split form (cuBLAS plus separate kernels), whichever is chosen.

    The configuration comes from profiling the bare GEMM of its problem; the choice between the two
    forms from timing both on the first run with real buffers (both compute the same outputs from the
    same inputs, so running either any number of times leaves the right values)."""

    def __init__(self, ck: CompiledKernel):
        self.ck = ck
        self.problem = gemm_problem(ck)
        self.configs = autotune.configs_for(self.problem)
        self.launches = {c: [_prepared_launch(ck, ck.source.launches[0], c)] for c in self.configs}
        self.fused = self.launches[self.configs[0]]
        self.split = [_step(c) for c in ck.split]
        self.workspace = ck.kernel.split_stored_nodes()
        identities = {Op.SUM: 0.0, Op.MAX: -math.inf, Op.MIN: math.inf}
        self.atomic = [(id(o), identities[op]) for o, op in codegen.epilogue_reduction_outputs(ck.kernel)]
        if ck.choice is not None and ck.choice.get("config"):  # a plan loaded from disk keeps its choice
            self._use(autotune.Config(**ck.choice["config"]))

    def _use(self, config: autotune.Config) -> None:
        if config not in self.launches:
            self.launches[config] = [_prepared_launch(self.ck, self.ck.source.launches[0], config)]
        self.fused = self.launches[config]

    def __call__(self, buffers: dict[int, torch.Tensor], sig: passes.Signature) -> None:
        if self._chosen(buffers, sig) != "triton":
            self._run_split(buffers, sig)
            return
        try:
            self._run_fused(self.fused, buffers, sig)
        except CompileError as error:
            if "out of resource" not in str(error):
                raise
            # the epilogue needs more registers or shared memory than this GPU has with this configuration
            self.ck.choice = {"chosen": "cublas", "triton_ms": None, "cublas_ms": None, "config": None,
                              "why": str(error)}
            self._run_split(buffers, sig)

    def _run_fused(self, launches: list, buffers: dict[int, torch.Tensor], sig: passes.Signature) -> None:
        for key, identity in self.atomic:  # the tiles' partial reductions are combined into these
            buffers[key].fill_(identity)
        _run_launches(launches, self.ck, buffers, sig)

    def _run_split(self, buffers: dict[int, torch.Tensor], sig: passes.Signature) -> None:
        target = torch_device(self.ck.kernel.core.device)
        for n in self.workspace:
            buffers[id(n)] = _allocate(n.shape, n.dtype, target, n.device, "a GEMM's split intermediate")
        for step in self.split:
            step(buffers, sig)

    def _writes_its_inputs(self, buffers: dict[int, torch.Tensor]) -> bool:
        """Whether an output is bound to an input's buffer (a state updated in place): running the
        kernel more than once, as timing does, would then apply the update more than once."""
        kernel = self.ck.kernel
        read = {buffers[id(n)].data_ptr() for n in kernel.reads if id(n) in buffers}
        return any(buffers[id(o)].data_ptr() in read for o in kernel.outputs)

    def _chosen(self, buffers: dict[int, torch.Tensor], sig: passes.Signature) -> str:
        if gemm_backend != "auto":
            return gemm_backend
        choice = self.ck.choice
        if choice is None:
            choice = {"chosen": "triton", "triton_ms": None, "cublas_ms": None, "config": None}
            if autotune.worth_tuning(self.problem) and not _capturing and not self._writes_its_inputs(buffers):
                runs = {c: functools.partial(self._run_fused, launches, buffers, sig)
                        for c, launches in self.launches.items()}
                choice = autotune.timed_choice(self.ck.source.name, self.problem, runs,
                                               lambda: self._run_split(buffers, sig))
                if choice.get("config"):
                    self._use(autotune.Config(**choice["config"]))
            self.ck.choice = choice
        return choice["chosen"]


def _run_launches(launches: list, ck: CompiledKernel, buffers: dict[int, torch.Tensor],
                  sig: passes.Signature) -> None:
    for fn, grid, recipe, options in launches:
        args = []
        for kind, value in recipe:
            if kind == 0:
                args.append(buffers[value])
            elif kind == 1:
                args.append(value)
            elif kind == 2:
                args.append(sig.scalars[value])
            else:
                args.append(sig.seeds[value][kind - 3])
        try:
            fn.run(*args, grid=grid, warmup=False, **options)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as error:
            raise CompileError(f"kernel {fn.__name__} failed: {error} "
                               f"(source: {getattr(ck.module, '__ember_path__', '?')})") from error
    stats["launches"] += len(launches)


# -- replay ------------------------------------------------------------------------------------

@dataclass
class ReplayStep:
    """One recorded plan bound to fixed buffers."""

    plan: Plan
    sig: passes.Signature
    device: Device
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (destination, source)
    seed_draws: list[int] = field(default_factory=list)  # per entry of sig.seeds: its draw, or -1 if fixed


class Replay:
    """Recorded plans re-run on fixed buffers: as one CUDA graph when it can be, else launch by launch."""

    def __init__(self, steps: list[ReplayStep]):
        self.steps = steps
        self.graph = None
        self.why_no_graph = ""
        self.arenas = [_arena_views(s.plan, torch_device(s.device), s.device) for s in steps]  # kept alive

    def capture_graph(self) -> None:
        """Record the replay as one CUDA graph (fixed kernel arguments: no fresh random offsets)."""
        if INTERPRET:
            self.why_no_graph = "no GPU: the interpreter replays launch by launch"
            return
        if any(d >= 0 for s in self.steps for d in s.seed_draws):
            self.why_no_graph = "the step draws random numbers, which need fresh offsets each replay"
            return
        target = torch_device(self.steps[0].device)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(target)
        global _capturing
        try:
            _capturing = True
            with torch.cuda.graph(graph):
                self._launch(None)
        except Exception as error:  # e.g. a kernel that synchronises; replays stay correct without the graph
            self.why_no_graph = f"capture failed: {error}"
            return
        finally:
            _capturing = False
        self.graph = graph

    def run(self, draws: list[tuple[int, int]] | None) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._launch(draws)

    def _launch(self, draws: list[tuple[int, int]] | None) -> None:
        for step in self.steps:
            sig = step.sig
            if draws is not None and step.seed_draws:
                seeds = [draws[d] if d >= 0 else fixed for d, fixed in zip(step.seed_draws, sig.seeds)]
                sig = passes.Signature(sig.key, sig.inputs, sig.scalars, seeds)
            execute(step.plan, sig, step.device, step.inputs, step.outputs)
            for destination, source in step.copies:
                destination.copy_(source)


def _matmul(node: Node, buffers: dict[int, torch.Tensor], sig: passes.Signature) -> None:
    a, b = (_on_vendor_device(_view(x, buffers)) for x in node.inputs)
    out = buffers[id(node)]
    if a.device == out.device:
        torch.matmul(a, b, out=out)
    else:
        out.copy_(torch.matmul(a, b))


def _conv2d(node: Node, buffers: dict[int, torch.Tensor], sig: passes.Signature) -> None:
    x, w = (_on_vendor_device(_view(i, buffers)) for i in node.inputs)
    if x.numel() == 0 or w.numel() == 0:  # torch gets the shape wrong without input channels; a sum of nothing
        buffers[id(node)].zero_()
        return
    a = node.attrs
    out = torch.nn.functional.conv2d(x, w, None, a["stride"], a["padding"], a["dilation"], a["groups"])
    buffers[id(node)].copy_(out)


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
