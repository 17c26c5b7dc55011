"""The executor of compiled plans on the cuda device: launches from argument lists prepared once per
plan, the GEMM steps (generated kernel or split form, chosen by timing), launches whose one source serves
several tile configurations (an attention kernel's: the fastest chosen by timing), the vendor matmul and
convolution through torch, and streams for plans captured into CUDA graphs.

What a run uses besides its inputs and outputs (a `Workspace`: the plan's arena of intermediates and its
prepared steps, whose launches hold the kernels' scratch buffers) is the running thread's own, or an
ember.jit program's: runs of one plan in several threads at once share nothing they write. What is prepared
from a plan is kept beside it by the plan cache (`plan_cache.prepared`), never on the compiled plan.

This is the triton target's runner (see runtime/targets.py); its variant, the interpreter, prepares the same
steps with kernels loaded and launched for Triton's interpreter, and compiles nothing ahead of the first run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import weakref
from typing import TYPE_CHECKING

import torch

from ember.compiler import CompiledKernel, KernelKind, ParamKind, Plan, Signature
from ember.device import Device
from ember.errors import CompileError, OutOfMemoryError
from ember.ir import Node
from ember.runtime import (
    autotune,
    compiling,
    cuda,
    disk,
    executor,
    index_checks,
    plan_cache,
    steady,
    targets,
    triton_launch,
    vendor,
)

if TYPE_CHECKING:
    from ember.compiler import Launch


class _ThisThread(threading.local):
    capturing = False  # a Replay is being captured into a CUDA graph by this thread
    alternative: int | None = None  # the configuration launches with alternatives run with (see `alternative`)

    def __init__(self) -> None:
        self.side_streams: dict = {}  # torch device -> streams a captured plan's parallel groups run on
        self.communication: dict = {}  # torch device -> the stream collectives run on beside the launches


this_thread = _ThisThread()
_stats = cuda.stats


@dataclasses.dataclass
class Workspace:
    """What runs of a plan write besides their outputs: its arena, and its steps as prepared for it."""

    arena: cuda.Arena
    steps: list | None = None


def take_workspace(plan: Plan, device: Device) -> Workspace:
    """This thread's workspace for the plan, for a holder of its own (an ember.jit program): the thread's
    next run of the plan prepares another."""
    local = plan_cache.prepared(plan)
    steps = getattr(local, "steps", None)
    local.steps = None
    return Workspace(cuda.take_arena(plan, cuda.torch_device(device), device), steps)


def run(order: list[Node], keep: set[int]) -> dict[int, torch.Tensor]:
    """Evaluate `order` on the device; return buffers for the nodes whose ids are in `keep`."""
    plan, sig = plan_cache.plan_for(order, keep)
    device = order[0].device
    inputs = [leaf.buffer for leaf in sig.inputs]
    recorder = executor.this_thread.recorder
    outputs = steady.run(plan, sig, device, inputs) if recorder is None else execute(plan, sig, device, inputs)
    kept = [n for n in order if id(n) in keep]
    values = {id(n): out for n, out in zip(kept, outputs)}
    if recorder is not None:
        recorder.record_plan(plan, sig, device, inputs, outputs, kept)
    return values


def execute(plan: Plan, sig: Signature, device: Device, inputs: list[torch.Tensor],
            outputs: list[torch.Tensor | None] | None = None, draws: torch.Tensor | None = None,
            workspace: Workspace | None = None) -> list[torch.Tensor]:
    """Run a plan on `inputs` (one buffer per input of the lowered graph); return one buffer per
    output. `outputs` may name buffers to write results into (None where the plan should allocate);
    `draws` the device buffer holding sig.seeds (else they are uploaded); `workspace` the arena and
    steps to run with (else this thread's)."""
    target = cuda.torch_device(device)
    buffers: dict[int, torch.Tensor] = {id(p): b for p, b in zip(plan.lowered.inputs, inputs)}
    if sig.seeds:
        buffers[DRAWS] = draws if draws is not None else upload_draws(sig.seeds, target)
    if workspace is None:
        local = plan_cache.prepared(plan)
        steps = getattr(local, "steps", None)
        buffers.update(cuda.arena_views(plan, target, device))
    else:
        steps = workspace.steps
        buffers.update(workspace.arena.views)
    given = outputs or ()
    result = []
    for i, o in enumerate(plan.lowered.outputs):
        if id(o) not in buffers:
            out = given[i] if i < len(given) else None
            buffers[id(o)] = out if out is not None else cuda.allocate(o.shape, o.dtype, target, device, "a result")
        result.append(buffers[id(o)])
    if steps is None:
        settings = RunSettings.of(plan)
        steps = _steps(plan, device, settings)
        if not settings.interpret:
            _compile_all(steps, buffers, sig, target)
        if workspace is None:
            local.steps = steps
        else:
            workspace.steps = steps
    try:
        if plan.schedule.groups and this_thread.capturing:
            _run_streams(plan, steps, buffers, sig, target)
        else:
            for step in steps:
                step(buffers, sig)
    except torch.cuda.OutOfMemoryError as error:
        raise OutOfMemoryError(f"out of GPU memory running a plan of {len(plan.kernels)} kernels on {device}: "
                               f"{cuda.free_text(target)} ({error})") from None
    (checks,) = index_flags(steps) or (None,)
    index_checks.carry(plan.lowered.sources, checks, inputs, result)
    return result


def upload_draws(seeds: list[tuple[int, int]], target, into: torch.Tensor | None = None) -> torch.Tensor:
    """(seed, offset) pairs as the int64 device buffer random kernels read (written into `into` if given)."""
    host = torch.tensor([_int64(v) for pair in seeds for v in pair], dtype=torch.int64)
    if (target if into is None else into.device).type == "cuda":
        host = host.pin_memory()  # the copy waits neither for the GPU nor lets the memory be reused before it is read
    if into is None:
        return host.to(target, non_blocking=True)
    into.copy_(host, non_blocking=True)
    return into


def _int64(value: int) -> int:
    """A seed or offset as the signed 64-bit word the kernels read (seeds are taken modulo 2^64, as the
    reference generator takes them)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _run_streams(plan: Plan, steps: list, buffers: dict[int, torch.Tensor], sig: Signature, target) -> None:
    """Launch in schedule order; each parallel group forks from the main stream and joins back into it."""
    main = torch.cuda.current_stream(target)
    streams = [main, *_side_streams(target, plan.context.max_streams)]
    groups = dict(plan.schedule.groups)
    position, count = 0, len(steps)
    while position < count:
        stop = groups.get(position)
        if stop is None:
            steps[position](buffers, sig)
            position += 1
            continue
        used = {plan.schedule.streams[p] for p in range(position, stop)} - {0}
        fork = main.record_event()
        for s in used:
            streams[s].wait_event(fork)
        for p in range(position, stop):
            with torch.cuda.stream(streams[plan.schedule.streams[p]]):
                steps[p](buffers, sig)
        for s in used:
            main.wait_event(streams[s].record_event())
        position = stop


def _side_streams(target, streams: int) -> list:
    """This thread's side streams on the device (a stream is captured into one graph at a time), at least
    `streams` - 1 of them."""
    side = this_thread.side_streams.setdefault(target, [])
    side += [torch.cuda.Stream(target) for _ in range(max(streams - 1, 1) - len(side))]
    return side


# -- steps -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RunSettings:
    """How a plan's steps run besides what its compile context says: read once, when they are prepared, and
    passed down to them."""

    interpret: bool  # its runtime target's variant: kernels run in Triton's interpreter (RuntimeTarget.interpret)
    autotune: str  # how much GEMM tuning searches (autotune.mode: EMBER_AUTOTUNE)

    @staticmethod
    def of(plan: Plan) -> RunSettings:
        interpret = targets.for_plan(plan).interpret
        return RunSettings(interpret, autotune.mode(interpret))


def _steps(plan: Plan, device: Device, settings: RunSettings) -> list:
    """A plan's steps: one per kernel, then, where its kernels check indices, the copy of their flags to the
    host (see index_checks)."""
    flags = index_checks.flags_for(plan.lowered.nodes, device)
    steps = [_step(ck, flags, plan.context.gemm_backend, settings) for ck in plan.kernels]
    _share_split_forms(plan, steps)
    for position, waits in plan.schedule.joins.items():  # collectives run beside the launches up to these
        joined = _Join([steps[p] for p in waits], steps[position] if position < len(steps) else None)
        if position < len(steps):
            steps[position] = joined
        else:
            steps.append(joined)
    return steps if flags is None else [*steps, CopyFlags(flags)]


def _share_split_forms(plan: Plan, steps: list) -> None:
    """A value the split forms of two GEMMs both store (an operand's prologue both read: a cross entropy's logits
    gradient, which the input's and the weight's gradient GEMMs recompute in their mainloops) is computed by the
    first of them whose split form runs; a later one reads it (`_GemmStep.taken`). Only where every other GEMM
    storing it runs before that one, none beside it in its parallel group of a captured graph (on another stream,
    it could still be writing the value)."""
    group = {p: start for start, stop in plan.schedule.groups for p in range(start, stop)}
    storers: dict[int, list[int]] = {}  # id(value) -> the positions of the GEMMs whose split forms store it
    for position, step in enumerate(steps):
        if isinstance(step, _GemmStep):
            for n in step.workspace:
                storers.setdefault(id(n), []).append(position)
    for key, positions in storers.items():
        for position in positions[1:]:
            beside = group.get(position) is not None and any(
                group.get(other) == group.get(position) for other in positions if other != position)
            if not beside:
                steps[position].taken.add(key)


def _step(ck: CompiledKernel, flags: index_checks.IndexFlags | None, gemm_backend: str, settings: RunSettings):
    """A callable running one fused kernel from the buffers of a run; its argument lists are
    prepared once per plan, so a plan-cache hit costs little more than the launches. `flags`: where the
    plan's index checks record what they find; `gemm_backend`: the plan's setting (CompileContext)."""
    kernel = ck.kernel
    if kernel.core is not None:
        return _GemmStep(ck, flags, gemm_backend, settings)
    if kernel.kind is KernelKind.MATMUL:
        return functools.partial(vendor.matmul, kernel.outputs[0])
    if kernel.kind is KernelKind.SORT:
        return functools.partial(vendor.argsort, kernel.outputs[0])
    if kernel.kind is KernelKind.COLLECTIVE:
        return _CollectiveStep(kernel.outputs[0])
    if kernel.kind is KernelKind.CONV2D:
        return functools.partial(vendor.conv2d, kernel.outputs[0])
    return _KernelStep(ck, flags, settings)


@dataclasses.dataclass
class CopyFlags:
    """The last step of a plan whose kernels check indices: their flags to the host, after its launches."""

    flags: index_checks.IndexFlags

    def __call__(self, buffers: dict[int, torch.Tensor], sig: Signature) -> None:
        self.flags.copy_out()


def index_flags(steps: list | None) -> list[index_checks.IndexFlags]:
    """The flags a plan's prepared steps copy to the host (none, or one: the last step)."""
    return [steps[-1].flags] if steps and isinstance(steps[-1], CopyFlags) else []


class _KernelStep:
    """A generated kernel (one launch, or a few for a staged reduction or an MLP kernel's gradients)."""

    def __init__(self, ck: CompiledKernel, flags: index_checks.IndexFlags | None, settings: RunSettings):
        self.ck, self.flags, self.interpret, self.tuning = ck, flags, settings.interpret, settings.autotune
        self.scratch: dict = {}  # what one launch leaves for the next (an MLP kernel's gradient partials)
        self.launches = self._prepare(ck.source)

    def _prepare(self, source) -> list:
        module, device = disk.load_source(source, self.interpret), self.ck.kernel.outputs[0].device
        return [_TunedLaunch(module, launch, device, self.interpret, self.tuning, self.scratch, self.flags)
                if len(launch.alternatives) > 1 else
                _prepared_launch(module, launch, device, self.interpret, scratch=self.scratch, flags=self.flags)
                for launch in source.launches if launch.grid]

    def __call__(self, buffers: dict[int, torch.Tensor], sig: Signature) -> None:
        try:
            _run_launches(self.launches, self.ck, buffers, sig)
        except CompileError as error:
            fallback = self.ck.fallback
            if fallback is None or "out of resource" not in str(error):
                raise
            # an MLP kernel holding its weights on chip needs more shared memory than this GPU has: stream them
            self.ck = dataclasses.replace(self.ck, source=fallback, fallback=None)
            self.launches = self._prepare(fallback)
            _run_launches(self.launches, self.ck, buffers, sig)

    def compile_jobs(self, buffers: dict[int, torch.Tensor], sig: Signature) -> list:
        return _compile_jobs(self.launches, buffers, sig)


def _compile_jobs(launches: list, buffers: dict[int, torch.Tensor], sig: Signature) -> list:
    """Calls compiling these launches for the arguments of a run, without running them (a launch with
    alternatives: each configuration it may run with)."""
    jobs = []
    for launch in launches:
        try:
            args = launch.arguments(buffers, sig.scalars)
        except KeyError:  # a buffer made during the run (a split GEMM's intermediate): compiled when it runs
            continue
        for each in launch.to_compile() if isinstance(launch, _TunedLaunch) else [launch]:
            jobs.append(functools.partial(compiling.compile_and_load, each.fn, args, each.grid, each.options))
    return jobs


def _compile_all(steps: list, buffers: dict[int, torch.Tensor], sig: Signature, target) -> None:
    """Compile every kernel a plan's first run needs, in parallel: its kernels, the candidates of GEMM
    problems not yet tuned, then (once those are timed) its GEMM kernels under the winning configurations."""
    def on_device(jobs: list) -> list:
        return [functools.partial(_on, target, job) for job in jobs]

    steps = [step.step if isinstance(step, _Join) else step for step in steps]

    compiling.run(on_device([job for step in steps if hasattr(step, "compile_jobs")
                             for job in step.compile_jobs(buffers, sig)]))
    compiling.run(on_device([job for step in steps if isinstance(step, _GemmStep)
                             for job in step.tuned_compile_jobs(buffers, sig)]))


def _on(target, job) -> None:
    with torch.cuda.device(target):  # a pool's thread starts on the first GPU
        job()


# per kind of kernel argument: a buffer (0), a value passed as it is (1), or a runtime scalar (2)
_ARG_KINDS = {ParamKind.READ: 0, ParamKind.WRITE: 0, ParamKind.DRAWS: 0, ParamKind.SIZE: 1, ParamKind.BOUND: 1,
              ParamKind.SCRATCH: 1, ParamKind.FLAG: 1, ParamKind.SCALAR: 2}
DRAWS = 0  # the key of a run's (seed, offset) pairs among its buffers (no node's id is 0)


def _prepared_launch(module, launch: Launch, device: Device, interpret: bool, config: autotune.Config | None = None,
                     scratch: dict | None = None, flags: index_checks.IndexFlags | None = None
                     ) -> triton_launch.Launch:
    """`interpret`: the module's kernels run in Triton's interpreter; `scratch`: the scratch buffers of the
    kernel's launches, shared between them (one launch writes what the next reads), made here as the launches
    first name them; `flags`: the plan's index checks' flags."""
    scratch = {} if scratch is None else scratch
    for a in launch.args:
        if a.kind is ParamKind.SCRATCH and a.value not in scratch:
            scratch[a.value] = cuda.scratch(a.value, cuda.torch_device(device))
    recipe = [(_ARG_KINDS[a.kind], id(a.value) if a.kind in (ParamKind.READ, ParamKind.WRITE)
               else DRAWS if a.kind is ParamKind.DRAWS else scratch[a.value] if a.kind is ParamKind.SCRATCH
               else flags.slot(a.value) if a.kind is ParamKind.FLAG
               else a.value)
              for a in launch.args]
    fn = getattr(module, launch.function)
    if config is not None and launch.gemm is not None:  # a GEMM: grid and block sizes from its tuned configuration
        batch, m, n, _ = launch.gemm
        return triton_launch.Launch(fn, config.grid(batch, m, n, launch.splits), recipe, config.launch_options(),
                                    interpret)
    return triton_launch.Launch(fn, (launch.grid,), recipe, launch.options(), interpret)


@contextlib.contextmanager
def alternative(index: int):
    """Within the block, this thread runs every launch with alternatives under its `index`-th configuration (its
    default where it has fewer), untimed: how the tests check that each configuration computes the same values."""
    outer = this_thread.alternative
    this_thread.alternative = index
    try:
        yield
    finally:
        this_thread.alternative = outer


class _TunedLaunch:
    """A launch whose one source serves several configurations (Launch.alternatives, its default first), run as a
    prepared launch under one of them.

    Which one is decided on its first run with real buffers: where tuning is on (EMBER_AUTOTUNE) and the launch's
    work is worth it (autotune.launch_worth_tuning), the choice the disk cache holds for its function, else each
    configuration timed there (autotune.timed_tiling) and the fastest kept. Elsewhere the default runs: under the
    interpreter, below the threshold, and where an output is bound to an input's buffer (timing runs the launch
    again and again). A run captured into a CUDA graph runs the cached choice or the default, and leaves timing to
    a later run."""

    def __init__(self, module, launch: Launch, device: Device, interpret: bool, tuning: str, scratch: dict,
                 flags: index_checks.IndexFlags | None):
        self.function = launch.function
        self.names = [str(c) for c in launch.alternatives]
        self.launches = [_prepared_launch(module, dataclasses.replace(
            launch, constexprs=c.constexprs, grid=c.grid, num_warps=c.num_warps, num_stages=c.num_stages,
            alternatives=()), device, interpret, scratch=scratch, flags=flags) for c in launch.alternatives]
        self.tuning = tuning if autotune.launch_worth_tuning(launch.work, tuning) else "0"
        self.reads = [i for i, a in enumerate(launch.args) if a.kind is ParamKind.READ]
        self.writes = [i for i, a in enumerate(launch.args) if a.kind is ParamKind.WRITE]
        self.chosen: int | None = None  # the configuration's index, once decided
        self.choice: dict | None = None  # the timed choice: "chosen" (a configuration's name) and "ms"
        self.fn = self.launches[0].fn

    def arguments(self, buffers: dict[int, torch.Tensor], scalars: list) -> list:
        return self.launches[0].arguments(buffers, scalars)  # the same recipe under every configuration

    def to_compile(self) -> list[triton_launch.Launch]:
        """The configurations a first run may launch: each of them where it will time them, else the one it will
        run."""
        if self.chosen is None and autotune.enabled(self.tuning):
            entry = autotune.cached_tiling(self.function, self.names, self.tuning)
            if entry is None:
                return self.launches
            return [self.launches[self._index(entry)]]
        return [self.launches[self.chosen or 0]]

    def __call__(self, args: list) -> None:
        forced = this_thread.alternative
        if forced is not None:
            self.launches[forced if forced < len(self.launches) else 0](args)
            return
        if self.chosen is None:
            self._choose(args)
        self.launches[self.chosen or 0](args)

    def _choose(self, args: list) -> None:
        """Decide the configuration, timing them on `args` if need be (see the class); while a CUDA graph is
        captured, nothing is decided."""
        if not autotune.enabled(self.tuning):
            self.chosen = 0
            return
        entry = autotune.cached_tiling(self.function, self.names, self.tuning)
        if entry is None:
            if this_thread.capturing:
                return
            if self._writes_its_inputs(args):
                self.chosen = 0
                return
            runs = {name: functools.partial(launch, args) for name, launch in zip(self.names, self.launches)}
            entry = autotune.timed_tiling(self.function, runs, self.tuning)
        self.choice, self.chosen = entry, self._index(entry)

    def _index(self, entry: dict) -> int:
        """The chosen configuration's index (the default where none ran)."""
        return self.names.index(entry["chosen"]) if entry["chosen"] is not None else 0

    def _writes_its_inputs(self, args: list) -> bool:
        """Whether an output is bound to an input's buffer: running the launch more than once, as timing does,
        would then read what it wrote."""
        read = {args[i].data_ptr() for i in self.reads}
        return any(args[i].data_ptr() in read for i in self.writes)



def gemm_problem(ck: CompiledKernel) -> autotune.Problem:
    launch = ck.source.launches[0]
    return autotune.Problem.of(launch, ck.kernel.core.dtype, launch.layout)


class _GemmStep:
    """A generated GEMM kernel, or its split form (cuBLAS plus separate kernels), whichever is chosen.

    The configuration comes from profiling the bare GEMM of its problem; the choice between the two
    forms from timing both on the first run with real buffers (both compute the same outputs from the
    same inputs, so running either any number of times leaves the right values)."""

    def __init__(self, ck: CompiledKernel, flags: index_checks.IndexFlags | None, backend: str,
                 settings: RunSettings):
        self.ck, self.flags, self.backend = ck, flags, backend  # backend: "auto", "triton" or "cublas"
        self.interpret, self.tuning = settings.interpret, settings.autotune
        self.module = disk.load_source(ck.source, self.interpret)
        self.device = ck.kernel.core.device
        self.problem = gemm_problem(ck)
        self.configs: list[autotune.Config] = []  # best first, known once the problem is tuned
        self.launches: dict[autotune.Config, list] = {}
        self.fused: list = []
        self.scratch: dict = {}  # a split GEMM's scratch, one set for every configuration (they run one at a time)
        self.split = [_step(c, flags, backend, settings) for c in ck.split]
        self.workspace = ck.workspace
        self.taken: set[int] = set()  # workspace values an earlier GEMM's split form stores (_share_split_forms)
        self.allocated: dict[int, weakref.ref] = {}  # id(value) -> the buffer this split form last made for it
        self.atomic = [(id(o), identity) for o, identity in ck.atomic_outputs]
        self.choice: dict | None = None  # "chosen" ("triton" or "cublas"), "triton_ms", "cublas_ms", "config"

    def _tuned(self) -> None:
        if not self.configs:
            self.configs = autotune.configs_for(self.problem, self.tuning)
            for c in self.configs:
                self._prepare(c)
            self.fused = self.launches[self.configs[0]]

    def _prepare(self, config: autotune.Config) -> None:
        """The kernel's launches under `config`: the GEMM's, then (a split GEMM) the one that finishes it."""
        self.launches[config] = [_prepared_launch(self.module, launch, self.device, self.interpret, config,
                                                  self.scratch, self.flags) for launch in self.ck.source.launches]

    def compile_jobs(self, buffers: dict[int, torch.Tensor], sig: Signature) -> list:
        """The first wave: the bare GEMM's candidates if its problem is not tuned yet, and the split form
        where it may run."""
        profiling = autotune.needs_profiling(self.problem, self.tuning)
        jobs = autotune.compile_jobs(self.problem, self.tuning) if profiling else []
        choice = self._cached_choice()
        if self.backend == "cublas" or (choice or {}).get("chosen") != "triton":
            jobs += [job for step in self.split if hasattr(step, "compile_jobs")
                     for job in step.compile_jobs(buffers, sig)]
        return jobs

    def tuned_compile_jobs(self, buffers: dict[int, torch.Tensor], sig: Signature) -> list:
        """The second wave (tuning the bare GEMM now if needed): the fused kernel under the configurations
        it may run with."""
        if self.backend == "cublas" or (self._cached_choice() or {}).get("chosen") == "cublas":
            return []
        self._tuned()
        return [job for launches in self.launches.values() for job in _compile_jobs(launches, buffers, sig)]

    def _cached_choice(self) -> dict | None:
        if self.choice is None and autotune.worth_tuning(self.problem, self.tuning):
            return autotune.cached_choice(self.ck.source.name, self.problem, self.tuning)
        return self.choice

    def _use(self, config: autotune.Config) -> None:
        if config not in self.launches:
            self._prepare(config)
        self.fused = self.launches[config]

    def __call__(self, buffers: dict[int, torch.Tensor], sig: Signature) -> None:
        self._tuned()
        if self._chosen(buffers, sig) != "triton":
            self._run_split(buffers, sig)
            return
        try:
            self._run_fused(self.fused, buffers, sig)
        except CompileError as error:
            if "out of resource" not in str(error):
                raise
            # the epilogue needs more registers or shared memory than this GPU has with this configuration
            self.choice = {"chosen": "cublas", "triton_ms": None, "cublas_ms": None, "config": None,
                           "why": str(error)}
            self._run_split(buffers, sig)

    def _run_fused(self, launches: list, buffers: dict[int, torch.Tensor], sig: Signature) -> None:
        for key, identity in self.atomic:  # the tiles' partial reductions are combined into these
            buffers[key].fill_(identity)
        _run_launches(launches, self.ck, buffers, sig)

    def _run_split(self, buffers: dict[int, torch.Tensor], sig: Signature) -> None:
        target = cuda.torch_device(self.ck.kernel.core.device)
        # values an earlier GEMM's split form computed in this run (buffers made by this one, in an earlier
        # timing run, do not count: each timed run computes all it needs)
        ready = {key for key in self.taken if key in buffers and (
            (made := self.allocated.get(key)) is None or made() is not buffers[key])}
        for n in self.workspace:
            if id(n) not in ready:
                buffers[id(n)] = cuda.allocate(n.shape, n.dtype, target, n.device, "a GEMM's split intermediate")
                self.allocated[id(n)] = weakref.ref(buffers[id(n)])
        for part, step in zip(self.ck.split, self.split):
            if not ready or not all(id(o) in ready for o in part.kernel.outputs):
                step(buffers, sig)

    def _writes_its_inputs(self, buffers: dict[int, torch.Tensor]) -> bool:
        """Whether an output is bound to an input's buffer (a state updated in place): running the
        kernel more than once, as timing does, would then apply the update more than once."""
        kernel = self.ck.kernel
        read = {buffers[id(n)].data_ptr() for n in kernel.reads if id(n) in buffers}
        return any(buffers[id(o)].data_ptr() in read for o in kernel.outputs)

    def _chosen(self, buffers: dict[int, torch.Tensor], sig: Signature) -> str:
        if self.backend != "auto":
            return self.backend
        choice = self.choice
        if choice is None:
            choice = {"chosen": "triton", "triton_ms": None, "cublas_ms": None, "config": None}
            if autotune.worth_tuning(self.problem, self.tuning) and not this_thread.capturing \
                    and not self._writes_its_inputs(buffers):
                runs = {c: functools.partial(self._run_fused, launches, buffers, sig)
                        for c, launches in self.launches.items()}
                choice = autotune.timed_choice(self.ck.source.name, self.problem, runs,
                                               lambda: self._run_split(buffers, sig), self.tuning)
                if choice.get("config"):
                    self._use(autotune.Config(**choice["config"]))
            self.choice = choice
        return choice["chosen"]


def _run_launches(launches: list, ck: CompiledKernel, buffers: dict[int, torch.Tensor], sig: Signature) -> None:
    for launch in launches:
        args = launch.arguments(buffers, sig.scalars)
        try:
            launch(args)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as error:
            raise CompileError(f"kernel {launch.fn.__name__} failed: {error} "
                               f"(source: {disk.source_path(ck.source)})") from error
    _stats["launches"] += len(launches)


class _CollectiveStep:
    """A collective of the process group on the node's buffers (ember.distributed). On a GPU it is issued on the
    thread's communication stream once the launches before it are done, and the launches after it go on beside
    it: the `_Join` before the first that reads its result (or at the plan's end) makes the main stream wait
    for it. Elsewhere (gloo on the host's tensors) it runs at once."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.done: torch.cuda.Event | None = None  # recorded on the communication stream after the collective
        self.device: torch.device | None = None

    def __call__(self, buffers: dict[int, torch.Tensor], sig: Signature) -> None:
        from ember import distributed

        x, out = vendor.view(self.node.inputs[0], buffers), buffers[id(self.node)]
        if out.device.type != "cuda":
            distributed.run_collective(self.node.attrs, x, out)
            return
        comm = this_thread.communication.get(out.device)
        if comm is None:
            comm = this_thread.communication[out.device] = torch.cuda.Stream(out.device)
        comm.wait_stream(torch.cuda.current_stream(out.device))
        with torch.cuda.stream(comm):
            distributed.run_collective(self.node.attrs, x, out)
            self.done = comm.record_event()
        self.device = out.device

    def join(self) -> None:
        """The current stream (the main one) waits for the collective."""
        if self.done is not None:
            torch.cuda.current_stream(self.device).wait_event(self.done)
            self.done = None


@dataclasses.dataclass
class _Join:
    """Wait for collectives running beside the main stream, then launch `step` (None: the plan's end)."""

    collectives: list[_CollectiveStep]
    step: object | None

    def __call__(self, buffers: dict[int, torch.Tensor], sig: Signature) -> None:
        for collective in self.collectives:
            collective.join()
        if self.step is not None:
            self.step(buffers, sig)
