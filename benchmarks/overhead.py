"""System-overhead benchmark: what ember adds around its kernels (building the lazy graph, the plan-cache
lookup, launches, ember.jit's replay) and what a first step costs in a fresh process, side by side with
PyTorch eager, torch.compile and torch.compile(mode="reduce-overhead").

Sections and rows (--rows takes rows or whole sections, e.g. A,B1,B3,C):
 A   host overhead of ember lazy, in microseconds
  A1 graph building: a chain of 1000 pointwise ops (+ y, * 0.5, relu, - 0.25) on 1024 floats, built but
     not realized, per node, on the cuda and the cpu device; torch eager's time per op of the same chain
  A2 a warm one-kernel step, (x * 1.5 + 0.5).relu() on 1024 floats, built and realized: host time (call
     to return), call to GPU done, its kernel's GPU time (profiler) and host-added = call to GPU done -
     kernel (target <= 30 us); torch eager's 3 kernels likewise
  A3 a plan of 200 small dependent kernels that cannot fuse (common.chain_of_reductions): host time per
     launch = (step - GPU time) / launches, ember lazy, ember.jit(cuda_graph=False), ember.jit(cuda_graph=
     True); the GPU time is the lazy step's launches replayed as one CUDA graph; torch eager per op
 B   one step in five variants: torch eager, torch.compile, torch.compile reduce-overhead, ember lazy and
     ember.jit, with the GPU time of ember.jit's kernels (profiler) and jit / kernels (target <= 1.05)
  B1 training step (forward, cross entropy, backward, Adam) of an MLP 784-2048-2048-10, batch 4096, bf16
  B2 training step of an MLP 64-64-64-64-64-16 (ReLU between), batch 2^18, fp16, Adam(eps=1e-4)
  B3 Adam step over 100 tensors, 20.0M float32 parameters (gradients set before; torch: foreach=True)
  B4 bias + GELU over 8192x8192 bf16           B5 6-op pointwise chain over 2^28 fp32
  B6 softmax over 32768x4096 bf16              B7 layer norm forward + backward over 32768x4096 bf16
  B8 cross entropy forward + backward over 16384x32000 bf16
 C   the first step in a fresh process (torch eager, torch.compile, ember lazy, ember.jit): the script runs
     itself once per workload and variant with EMBER_CACHE_DIR, TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR
     in a new empty directory ("cold"), then again with the same directories ("warm"); the child's clock
     starts at the top of this module, before torch and ember are imported, and stops when the first
     step's result is on the host (import time reported apart); --child-timeout stops a runaway child
  C1 the B1 MLP step (target cold <= 10 s, warm <= 2 s)   C2 the B3 Adam step (target cold <= 15 s)
  C3 a ResNet-18 training step, 32x32 images, batch 128, bf16, SGD (benchmarks/cnn.py; cold <= 15 s)
  C4 a first 512x512 float32 matmul + relu

Training steps (B1, B2) are timed back to back, as a training loop runs them (loop_ms); the other B rows
one step at a time from the call until the GPU is done, the GPU idle at the start, as fusion.py times
(median_ms). ember's times include building the graph and the plan-cache lookup. Every ember result is
checked: B1, B2 by their first 5 losses against torch eager's (ember.jit replays from the fourth), B3 by
the change 5 steps make to every parameter against Adam in float64, B4 to B8 by their outputs against
torch one precision higher (fusion.py's check), A and C by values against torch.

    python benchmarks/overhead.py                        # full sizes on a CUDA GPU; appends to RESULTS.md
    python benchmarks/overhead.py --quick --rows A,B3,C1  # small sizes, some rows; nothing appended
    EMBER_INTERPRET=1 python benchmarks/overhead.py --cpu-smoke   # no GPU: tiny sizes, every code path
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

# a first-step child's clock (section C) starts here: after the standard library, before torch and ember
START = time.perf_counter()

import cnn  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as TF  # noqa: E402
from common import (  # noqa: E402
    cell,
    chain_of_reductions,
    device_ms,
    environment,
    graph_gpu_ms,
    guarded,
    loop_ms,
    markdown_table,
    median_ms,
    parse_options,
    publish,
    release_memory,
    sync,
    to_ember,
    to_torch,
    training_step,
)
from fusion import error, forward_backward, widen  # noqa: E402
from runtime import checked_replay, ember_variants, make_mlp, realized  # noqa: E402

import ember  # noqa: E402
import ember.nn.functional as EF  # noqa: E402
from ember.jit import JitFunction  # noqa: E402

IMPORTED = time.perf_counter()

# (full, --quick, --cpu-smoke)
SIZES = {
    "chain": (1000, 1000, 200),  # A1: pointwise ops built
    "small": (1024, 1024, 1024),  # A1, A2: elements of the tensors
    "tiny": ((200, 16), (200, 16), (12, 16)),  # A3: (kernels, width of the square input), as runtime.py row 3
    "mlp": ((4096, (784, 2048, 2048, 10)), (1024, (784, 1024, 1024, 10)), (16, (32, 64, 64, 10))),
    "tiny_mlp": ((2**18, (64,) * 5 + (16,)), (2**16, (64,) * 5 + (16,)), (256, (64,) * 5 + (16,))),
    "adam": (652, 256, 16),  # width of the 100-tensor model (fusion.py's shapes): 20.0M parameters at 652
    "gelu": ((8192, 8192), (2048, 2048), (64, 128)),
    "pointwise": (2**28, 2**24, 2**12),
    "rows": ((32768, 4096), (4096, 4096), (64, 256)),  # softmax, layer norm
    "cross_entropy": ((16384, 32000), (4096, 32000), (64, 1000)),
    "resnet18": ((32, 128), (32, 64), (16, 8)),  # C3: (image size, batch); --cpu-smoke also narrows the network
    "matmul": (512, 512, 512),  # C4
}
VARIANTS = ("torch eager", "torch.compile", "torch.compile reduce-overhead", "ember lazy", "ember.jit")
FIRST_STEP_VARIANTS = ("torch eager", "torch.compile", "ember lazy", "ember.jit")
CHECK_STEPS = 5  # B1-B3: steps whose losses (or parameter changes) are checked; ember.jit replays from the 4th
MAX_CALLS_TO_REPLAY = 10  # calls an ember.jit step gets to start replaying (it needs 3 or 4)
NEXT_STEPS = 4  # C: steps timed after the first (ember.jit records and replays in them)
MARK = "overhead.py first step: "  # a child's JSON line starts with this
CACHE_VARIABLES = {"EMBER_CACHE_DIR": "ember", "TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}
TARGETS = {("C1", "cold"): 10.0, ("C1", "warm"): 2.0, ("C2", "cold"): 15.0, ("C3", "cold"): 15.0}  # seconds
FIRST_STEP_TOL = {"C1": 3e-2, "C2": 1e-3, "C3": 5e-2, "C4": 1e-2}  # relative, against torch eager's child


@dataclass
class Step:
    """One variant's step: `call` runs a step and returns its result; `jit` is the ember.jit function behind
    it (None for the others); `state` gives the values an optimizer step changed, as torch tensors."""
    call: Callable[[], object]
    jit: JitFunction | None = None
    state: Callable[[], list[torch.Tensor]] | None = None


def compiled(fn: Callable, mode: str | None, cpu: bool) -> Callable:
    """`fn` as is (mode None) or under torch.compile(mode=...); under --cpu-smoke torch.compile traces with
    backend="eager" (inductor's CPU compile is too slow for a smoke run)."""
    if mode is None:
        return fn
    return torch.compile(fn, backend="eager") if cpu else torch.compile(fn, mode=mode)


def torch_mode(variant: str) -> str | None:
    """torch.compile's mode for a torch variant; None: eager."""
    modes = {"torch eager": None, "torch.compile": "default", "torch.compile reduce-overhead": "reduce-overhead"}
    return modes[variant]


def host_us(step: Callable[[], object], warmup: int, reps: int, cpu: bool) -> float:
    """Median host time of one call, from the call until it returns (the GPU may still be working), in
    microseconds; the GPU is idle at each call."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(max(reps, 1)):
        sync(cpu)
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e6)
    sync(cpu)
    return statistics.median(times)


def launches_per_call(step: Callable[[], object], calls: int = 3) -> float:
    """Kernel launches ember's launcher makes per call (a CUDA graph replay makes none through it)."""
    from ember.runtime import cuda

    before = cuda.stats["launches"]
    for _ in range(calls):
        step()
    return (cuda.stats["launches"] - before) / calls


def verdict(err: float | None, tol: float) -> str:
    return "error" if err is None else f"{err:.1e}" + ("" if err <= tol else " FAIL")


# -- section A: host overhead ------------------------------------------------------------------------

@dataclass
class ALine:
    row: str
    measurement: str
    variant: str
    us: float | None
    detail: str = ""
    target: str = "-"
    check: str = "-"


def pointwise_chain(h, y, n: int):
    """`n` pointwise ops, + y, * 0.5, relu, - 0.25 in turn (the values stay bounded); torch and ember alike."""
    for i in range(n):
        k = i % 4
        h = h + y if k == 0 else h * 0.5 if k == 1 else h.relu() if k == 2 else h - 0.25
    return h


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return error(out, ref)[1]


def graph_building(args) -> list[ALine]:
    cpu, which, dev = args.cpu_smoke, args.which, args.dev
    n, size = SIZES["chain"][which], SIZES["small"][which]
    x, y = torch.randn(size, device=dev), torch.randn(size, device=dev)
    reference = pointwise_chain(x.double(), y.double(), n)
    what = f"chain of {n} pointwise ops on {size} f32"

    def building(device: str, ex: ember.Tensor, ey: ember.Tensor) -> ALine:
        us = guarded(f"A1 ember {device}", lambda: host_us(lambda: pointwise_chain(ex, ey, n), args.warmup,
                                                             args.reps, cpu=True) / n)
        err = guarded(f"A1 ember {device} (check)",  # the chain realized once
                      lambda: rel_err(torch.from_numpy(pointwise_chain(ex, ey, n).numpy()), reference.cpu()))
        return ALine("A1", "graph building, per node", f"ember lazy, {device} device", us,
                     f"{what}, built and not realized (host time)", "-", verdict(err, 1e-5))

    lines = [building("cuda", to_ember(x), to_ember(y)),
             building("cpu", *(ember.tensor(t.cpu().numpy(), device="cpu") for t in (x, y)))]
    eager = lambda: pointwise_chain(x, y, n)  # noqa: E731
    host = guarded("A1 torch eager", lambda: host_us(eager, args.warmup, args.reps, cpu) / n)
    done = None if cpu else guarded("A1 torch eager (GPU done)",
                                    lambda: median_ms(eager, args.warmup, args.reps, cpu) * 1e3 / n)
    detail = f"{what}, host time per op (call to return)" + (
        "" if cpu else f"; call to GPU done {cell(done, '{:.2f}')} us per op")
    err = guarded("A1 torch eager (check)", lambda: rel_err(eager(), reference))
    lines.append(ALine("A1", "op, per op", "torch eager", host, detail, "-", verdict(err, 1e-5)))
    return lines


def one_kernel(args) -> list[ALine]:
    cpu, size, micro = args.cpu_smoke, SIZES["small"][args.which], 10 * max(args.reps, 1)
    x = torch.randn(size, device=args.dev)
    ex = to_ember(x)
    reference = (x.double() * 1.5 + 0.5).relu()

    def measure(name: str, step: Callable[[], object], kernels: str) -> ALine:
        out = guarded(f"A2 {name} (check)", step)
        err = None if out is None else rel_err(to_torch(out) if isinstance(out, ember.Tensor) else out, reference)
        what = f"(x * 1.5 + 0.5).relu(), {size} f32, {kernels}"
        host = guarded(f"A2 {name} (host)", lambda: host_us(step, args.warmup, micro, cpu))
        if cpu:
            return ALine("A2", "warm one-kernel step, host time", name, host, f"{what}: call to return (host); GPU "
                         "times not measured (--cpu-smoke)", "not measured", verdict(err, 1e-6))
        done = guarded(f"A2 {name} (GPU done)", lambda: median_ms(step, args.warmup, micro, cpu) * 1e3)
        gpu = guarded(f"A2 {name} (profiler)", lambda: device_ms(step, 1, micro) * 1e3)
        added = done - gpu if done is not None and gpu is not None else None
        target = "-" if name != "ember lazy" or added is None else "<= 30: " + ("met" if added <= 30 else "MISSED")
        return ALine("A2", "warm one-kernel step, host-added", name, added,
                     f"{what}: call to return {cell(host, '{:.1f}')} us (host), call to GPU done "
                     f"{cell(done, '{:.1f}')} us, kernels {cell(gpu, '{:.1f}')} us (profiler); host-added = GPU done "
                     "- kernels", target, verdict(err, 1e-6))

    ember_step = lambda: (ex * 1.5 + 0.5).relu().realize()  # noqa: E731
    launches = guarded("A2 launches", lambda: launches_per_call(ember_step))
    return [measure("ember lazy", ember_step, f"{cell(launches, '{:.0f}')} launch"),
            measure("torch eager", lambda: (x * 1.5 + 0.5).relu(), "3 kernels")]


def launch_overhead(args) -> list[ALine]:
    cpu = args.cpu_smoke
    count, width = SIZES["tiny"][args.which]
    x = torch.randn(width, width, device=args.dev)
    ex = to_ember(x)
    fn = lambda h: chain_of_reductions(ember, h, count)  # noqa: E731
    torch_fn = lambda h: chain_of_reductions(torch, h, count)  # noqa: E731
    what = f"{count} dependent reductions on {width}x{width} f32"
    gpu = None if cpu else guarded("A3 GPU alone", lambda: graph_gpu_ms(lambda: fn(ex).realize(), args.reps))
    lazy_launches = None

    def measure(name: str, make: Callable[[], Callable[[], object]]) -> ALine:
        nonlocal lazy_launches
        step = guarded(f"A3 {name} (setup)", make)
        if step is None:
            return ALine("A3", "per launch", name, None)
        err = guarded(f"A3 {name} (check)", lambda: checked_replay(step, torch_fn, [x]))
        launches, counted = guarded(f"A3 {name} launches", lambda: launches_per_call(step)), "counted"
        if name == "ember lazy":
            lazy_launches = launches
        elif not launches:  # a CUDA graph replay launches its kernels inside the graph, not through ember
            launches, counted = lazy_launches, "those of the lazy step"
        ms = guarded(f"A3 {name}", lambda: median_ms(step, args.warmup, args.reps, cpu))
        return per_launch("A3", name, ms, gpu, launches, f"{what}, {cell(launches, '{:.0f}')} launches ({counted})",
                          cpu, verdict(err, 1e-4))

    lines = [measure(name, make) for name, make in ember_variants(fn, [ex]).items()]
    ms = guarded("A3 torch eager", lambda: median_ms(lambda: torch_fn(x), args.warmup, args.reps, cpu))
    torch_gpu = None if cpu else guarded("A3 torch GPU alone", lambda: graph_gpu_ms(lambda: torch_fn(x), args.reps))
    err = guarded("A3 torch eager (check)", lambda: rel_err(torch_fn(x), torch_fn(x.double())))
    lines.append(per_launch("A3", "torch eager", ms, torch_gpu, 3 * count, f"{what}, {3 * count} ops (sum, "
                            "multiply, subtract per reduction)", cpu, verdict(err, 1e-4)))
    return lines


def per_launch(row: str, name: str, ms: float | None, gpu: float | None, launches: float | None, what: str,
               cpu: bool, check: str) -> ALine:
    if cpu:  # no GPU time to take away: the interpreter computes on the host
        us = ms * 1e3 / launches if ms is not None and launches else None
        return ALine(row, "step time per launch", name, us, f"{what}; step {cell(ms and ms * 1e3, '{:.0f}')} us; "
                     "GPU time not separated (--cpu-smoke)", "-", check)
    us = (ms - gpu) * 1e3 / launches if ms is not None and gpu is not None and launches else None
    return ALine(row, "host time per launch", name, us,
                 f"{what}; step {cell(ms and ms * 1e3, '{:.0f}')} us, GPU alone {cell(gpu and gpu * 1e3, '{:.0f}')} us "
                 "(its launches in one CUDA graph)", "-", check)


A_ROWS = {"A1": graph_building, "A2": one_kernel, "A3": launch_overhead}


def a_table(lines: list[ALine]) -> str:
    head = ["row", "measurement", "variant", "us", "detail", "target", "check"]
    return markdown_table(head, [[line.row, line.measurement, line.variant, cell(line.us, "{:.2f}"), line.detail,
                                  line.target, line.check] for line in lines])


# -- section B: five variants of a step --------------------------------------------------------------

@dataclass
class Bench:
    row: str
    workload: str
    size: str
    makers: dict[str, Callable[[], Step]]  # one per VARIANTS entry
    check: Callable[[Step], list]  # what is compared: floats or torch tensors, from a fresh step
    tol: float  # bound on the relative error
    training: bool  # timed back to back (loop_ms) rather than one step at a time (median_ms)
    reference: Callable[[], list] | None = None  # None: torch eager's checked values are the reference


class MLP:
    """A training step of an MLP (runtime.make_mlp; forward, cross entropy, backward, Adam) from one initial
    state and batch, from which each variant builds its own model and optimizer."""

    def __init__(self, batch: int, widths: tuple[int, ...], dtype: torch.dtype, dev: str, eps: float = 1e-8):
        self.widths, self.dtype, self.dev, self.eps = widths, dtype, dev, eps
        self.init = [p.detach() for p in make_mlp(torch.nn, widths, dev, dtype).parameters()]
        self.x = torch.randn(batch, widths[0], device=dev, dtype=dtype)
        self.y = torch.randint(0, widths[-1], (batch,), device=dev)

    def torch_step(self, variant: str, cpu: bool) -> Step:
        mode = torch_mode(variant)
        model = make_mlp(torch.nn, self.widths, self.dev, self.dtype)
        with torch.no_grad():
            for p, value in zip(model.parameters(), self.init):
                p.copy_(value)
        # reduce-overhead replays the optimizer in a CUDA graph: its step count must live on the GPU
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=self.eps,
                                     capturable=mode == "reduce-overhead" and not cpu)
        step = compiled(training_step(TF, model, optimizer), mode, cpu)
        return Step(lambda: step(self.x, self.y))

    def ember_step(self, jit: bool) -> Step:
        model = make_mlp(ember.nn, self.widths, "cuda", ember.dtypes.as_dtype(self.dtype))
        for p, value in zip(model.parameters(), self.init):
            p.data = to_ember(value.clone())
        step = training_step(EF, model, ember.optim.Adam(model.parameters(), lr=1e-3, eps=self.eps))
        step = ember.jit(step) if jit else step
        x, y = to_ember(self.x), to_ember(self.y)
        return Step(lambda: step(x, y), step if jit else None)

    def makers(self, cpu: bool) -> dict[str, Callable[[], Step]]:
        makers = {v: lambda v=v: self.torch_step(v, cpu) for v in VARIANTS if v.startswith("torch")}
        return {**makers, "ember lazy": lambda: self.ember_step(False), "ember.jit": lambda: self.ember_step(True)}


def losses(step: Step) -> list[float]:
    return [float(step.call().item()) for _ in range(CHECK_STEPS)]


def mlp_bench(row: str, key: str, dtype: torch.dtype, tol: float, eps: float = 1e-8) -> Callable:
    def make(args) -> Bench:
        batch, widths = SIZES[key][args.which]
        mlp = MLP(batch, widths, dtype, args.dev, eps)
        name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
        return Bench(row, f"mlp training step, {name}, Adam" + ("" if eps == 1e-8 else f"(eps={eps:g})"),
                     f"{'-'.join(map(str, widths))} x {batch}", mlp.makers(args.cpu_smoke), losses, tol, True)
    return make


class AdamSet:
    """100 parameters (fusion.py's Adam shapes) with gradients already computed, and their Adam step."""

    def __init__(self, size: int, dev: str):
        shapes = [(size, 3 * size // 2), (3 * size // 2,), (3 * size // 4, size // 2), (4 * size,)] * 25
        self.init = [torch.randn(s, device=dev) for s in shapes]
        self.grads = [torch.randn(s, device=dev) for s in shapes]
        self.count = sum(p.numel() for p in self.init)

    def torch_params(self, dtype=None) -> list[torch.Tensor]:
        params = [p.to(dtype or p.dtype).clone().requires_grad_() for p in self.init]
        for p, g in zip(params, self.grads):
            p.grad = g.to(dtype or g.dtype)
        return params

    def torch_step(self, variant: str, cpu: bool) -> Step:
        mode = torch_mode(variant)
        params = self.torch_params()
        optimizer = torch.optim.Adam(params, lr=1e-3, foreach=True, capturable=mode == "reduce-overhead" and not cpu)
        return Step(compiled(optimizer.step, mode, cpu), state=lambda: [p.detach() for p in params])

    def ember_step(self, jit: bool) -> Step:
        params = [to_ember(p.clone(), requires_grad=True) for p in self.init]
        for p, g in zip(params, self.grads):
            p.grad = to_ember(g)
        optimizer = ember.optim.Adam(params, lr=1e-3)
        step = ember.jit(optimizer.step) if jit else optimizer.step
        return Step(step, step if jit else None, lambda: [to_torch(p) for p in params])

    def changes(self, step: Step) -> list[torch.Tensor]:
        """The change CHECK_STEPS steps make to every parameter (ember.jit replays from the fourth)."""
        for _ in range(CHECK_STEPS):
            step.call()
        return [p - p0 for p, p0 in zip(step.state(), self.init)]

    def reference(self) -> list[torch.Tensor]:
        params = self.torch_params(torch.float64)
        optimizer = torch.optim.Adam(params, lr=1e-3, foreach=True)
        for _ in range(CHECK_STEPS):
            optimizer.step()
        return [p.detach() - p0.double() for p, p0 in zip(params, self.init)]

    def makers(self, cpu: bool) -> dict[str, Callable[[], Step]]:
        makers = {v: lambda v=v: self.torch_step(v, cpu) for v in VARIANTS if v.startswith("torch")}
        return {**makers, "ember lazy": lambda: self.ember_step(False), "ember.jit": lambda: self.ember_step(True)}


def adam_bench(args) -> Bench:
    adam = AdamSet(SIZES["adam"][args.which], args.dev)
    return Bench("B3", "adam step, 100 tensors (torch: foreach)", f"{adam.count / 1e6:.3g}M f32",
                 adam.makers(args.cpu_smoke), adam.changes, 1e-3, False, adam.reference)


def op_bench(row: str, name: str, size: str, fwd: Callable, inputs: list[torch.Tensor], tol: float,
             wrt: tuple[int, ...] = (), upstream: torch.Tensor | None = None) -> Callable:
    """A step of `fwd(F, *inputs)`, written once for torch.nn.functional and ember.nn.functional (fusion.py's
    workloads); with `wrt`, it also returns the gradients of those inputs for the upstream gradient. ember.jit
    takes the inputs as its arguments (a replay reads them where they are)."""
    def make(args) -> Bench:
        cpu = args.cpu_smoke
        for i in wrt:
            inputs[i].requires_grad_()
        ember_inputs = [to_ember(t, i in wrt) for i, t in enumerate(inputs)]
        ember_upstream = None if upstream is None else to_ember(upstream)

        def ember_fn(*xs):
            return forward_backward(lambda *a: fwd(EF, *a), ember.grad, list(xs), wrt, ember_upstream)

        def torch_maker(variant: str) -> Callable[[], Step]:
            def made():
                f = compiled(lambda *a: fwd(TF, *a), torch_mode(variant), cpu)
                return Step(lambda: forward_backward(f, torch.autograd.grad, inputs, wrt, upstream))
            return made

        def jitted():
            step = ember.jit(realized(ember_fn))
            return Step(lambda: step(*ember_inputs), step)

        def reference():
            wide = [widen(t).requires_grad_(i in wrt) for i, t in enumerate(inputs)]
            return [r.detach() for r in forward_backward(lambda *a: fwd(TF, *a), torch.autograd.grad, wide, wrt,
                                                         None if upstream is None else widen(upstream))]

        makers = {v: torch_maker(v) for v in VARIANTS if v.startswith("torch")}
        makers.update({"ember lazy": lambda: Step(lambda: realized(ember_fn)(*ember_inputs)), "ember.jit": jitted})
        return Bench(row, name, size, makers, outputs, tol, False, reference)
    return make


def outputs(step: Step) -> list[torch.Tensor]:
    """The outputs of the third call (for ember.jit: its first replay), as torch tensors."""
    step.call(), step.call()
    return [to_torch(o) if isinstance(o, ember.Tensor) else o.detach() for o in step.call()]


def op_benches() -> dict[str, Callable]:
    """B4-B8, each a maker of its Bench given the args (the inputs are made then, one row at a time)."""
    def bf16(*shape, which, dev):
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16)

    def gelu(args):
        m, k = SIZES["gelu"][args.which]
        b = lambda *s: bf16(*s, which=args.which, dev=args.dev)  # noqa: E731
        return op_bench("B4", "bias + gelu (erf)", f"{m}x{k} bf16", lambda F, x, bias: F.gelu(x + bias),
                        [b(m, k), b(k)], 1e-2)(args)

    def pointwise(args):
        n = SIZES["pointwise"][args.which]
        six = lambda F, x, y: ((x * 1.5 + 0.5).tanh() * y - x).sigmoid()  # noqa: E731 - 6 ops
        return op_bench("B5", "pointwise chain, 6 ops", f"2^{n.bit_length() - 1} f32", six,
                        [torch.randn(n, device=args.dev), torch.randn(n, device=args.dev)], 1e-5)(args)

    def softmax(args):
        r, c = SIZES["rows"][args.which]
        return op_bench("B6", "softmax fwd", f"{r}x{c} bf16", lambda F, x: F.softmax(x, -1),
                        [bf16(r, c, which=args.which, dev=args.dev)], 1e-2)(args)

    def layer_norm(args):
        r, c = SIZES["rows"][args.which]
        b = lambda *s: bf16(*s, which=args.which, dev=args.dev)  # noqa: E731
        return op_bench("B7", "layer norm fwd+bwd", f"{r}x{c} bf16",
                        lambda F, x, w, bias: F.layer_norm(x, (c,), w, bias), [b(r, c), b(c), b(c)], 1e-2,
                        wrt=(0, 1, 2), upstream=b(r, c))(args)

    def cross_entropy(args):
        n, v = SIZES["cross_entropy"][args.which]
        return op_bench("B8", "cross entropy fwd+bwd", f"{n}x{v} bf16", lambda F, x, t: F.cross_entropy(x, t),
                        [bf16(n, v, which=args.which, dev=args.dev), torch.randint(0, v, (n,), device=args.dev)],
                        1e-2, wrt=(0,))(args)

    return {"B4": gelu, "B5": pointwise, "B6": softmax, "B7": layer_norm, "B8": cross_entropy}


B_ROWS = {"B1": mlp_bench("B1", "mlp", torch.bfloat16, 3e-2),
          # float16's smallest subnormal is 6e-8: Adam's default eps (1e-8) is 0 and a first update divides by 0
          "B2": mlp_bench("B2", "tiny_mlp", torch.float16, 1e-2, eps=1e-4),
          "B3": adam_bench, **op_benches()}


def max_rel_error(values: list, reference: list) -> float:
    """The worst relative error over a step's checked values: |v - r| / |r| for floats (losses),
    ||v - r|| / ||r|| for tensors (fusion.py's error)."""
    if len(values) != len(reference):
        raise ValueError(f"{len(values)} values against {len(reference)} references")
    return max(abs(v - r) / max(abs(r), 1e-12) if isinstance(r, float) else rel_err(v, r)
               for v, r in zip(values, reference))


def warm_jit(row: str, step: Step, notes: list[str], cpu: bool) -> None:
    """Call an ember.jit step until it replays; say so in the notes when it does not, or replays without
    a CUDA graph on a GPU."""
    for _ in range(MAX_CALLS_TO_REPLAY):
        if step.jit.stats["replays"]:
            break
        step.call()
    why = "; ".join(step.jit.why_not_replayed)
    if not step.jit.stats["replays"]:
        notes.append(f"{row}: WARNING: ember.jit is not replaying after {step.jit.stats['calls']} calls: its time is "
                     f"of the step run as written" + (f" (why_not_replayed: {why})" if why else ""))
    elif why and not cpu:  # under --cpu-smoke: "no GPU: the interpreter replays launch by launch"
        notes.append(f"{row}: ember.jit replays without a CUDA graph: {why}")


def run_bench(bench: Bench, args, notes: list[str]) -> dict:
    """Each variant made fresh, checked, then timed; a failing part leaves None (the table says "error"),
    and a variant whose setup or check raised is not timed."""
    result = {"bench": bench, "ms": {}, "err": {}, "kernels": None}
    reference = guarded(f"{bench.row} reference", bench.reference) if bench.reference is not None else None
    for name in VARIANTS:
        print(f"  {name}", flush=True)
        reference = run_variant(bench, name, reference, result, args, notes)
        release_memory(args.cpu_smoke)
    return result


def run_variant(bench: Bench, name: str, reference: list | None, result: dict, args, notes: list[str]) -> list | None:
    """Make, check and time one variant into `result`; returns the reference (torch eager's values where
    the bench has none of its own)."""
    cpu, row = args.cpu_smoke, bench.row
    step = guarded(f"{row} {name} (setup)", bench.makers[name])
    values = None if step is None else guarded(f"{row} {name} (check)", lambda: bench.check(step))
    if values is None:
        return reference
    if bench.reference is None and name == "torch eager":
        reference, result["err"][name] = values, 0.0
    elif reference is not None:
        result["err"][name] = guarded(f"{row} {name} (error)", lambda: max_rel_error(values, reference))
    if step.jit is not None:
        if not step.jit.stats["replays"]:
            notes.append(f"{row}: ember.jit had not replayed by its checked call ({step.jit.stats}): the check "
                         "covers the step run as written")
        guarded(f"{row} ember.jit (warm-up)", lambda: warm_jit(row, step, notes, cpu))
    timer = loop_ms if bench.training else median_ms
    ms = result["ms"][name] = guarded(f"{row} {name}", lambda: timer(step.call, args.warmup, args.reps, cpu))
    if name == "ember.jit" and ms is not None and not cpu:
        result["kernels"] = guarded(f"{row} ember.jit kernels (profiler)", lambda: device_ms(step.call, 1, args.reps))
    return reference


def ratio(a: float | None, b: float | None) -> str:
    return cell(a / b if a and b else None, "{:.2f}")


def b_table(results: list[dict], cpu: bool) -> str:
    head = ["row", "workload", "size", "torch eager ms", "torch.compile ms", "reduce-overhead ms", "ember lazy ms",
            "ember.jit ms", "jit kernels ms", "ember lazy / eager", "ember.jit / eager", "jit / kernels", "check"]
    body = []
    for res in results:
        b, ms, err = res["bench"], res["ms"], res["err"]
        checks = [f"{short}: {verdict(err.get(v), b.tol)}" for v, short in (("ember lazy", "lazy"),
                                                                           ("ember.jit", "jit"))]
        checks += [f"{v}: {verdict(err.get(v), b.tol)}" for v in VARIANTS[:3]
                   if err.get(v) is None or err[v] > b.tol]
        if b.reference is None and "torch eager" not in err:
            checks.append("no reference (torch eager failed)")
        jit_kernels = "-" if cpu else ratio(ms.get("ember.jit"), res["kernels"])
        body.append([b.row, b.workload, b.size, *[cell(ms.get(v)) for v in VARIANTS],
                     "-" if cpu else cell(res["kernels"]), ratio(ms.get("ember lazy"), ms.get("torch eager")),
                     ratio(ms.get("ember.jit"), ms.get("torch eager")), jit_kernels, ", ".join(checks)])
    return markdown_table(head, body)


# -- section C: the first step in a fresh process -----------------------------------------------------

def resnet_makers(args) -> dict[str, Callable[[], Step]]:
    image_size, batch = SIZES["resnet18"][args.which]
    work = cnn.Workload(image_size, batch, False, cnn.WIDTHS[args.which], args.dev)
    return {"torch eager": lambda: Step(work.torch_step(None, False, args.cpu_smoke)),
            "torch.compile": lambda: Step(work.torch_step("default", False, args.cpu_smoke)),
            "ember lazy": lambda: Step(work.ember_step(jit=False)),
            "ember.jit": lambda: Step(work.ember_step(jit=True))}


def matmul_makers(args) -> dict[str, Callable[[], Step]]:
    n = SIZES["matmul"][args.which]
    a, w = torch.randn(n, n, device=args.dev), torch.randn(n, n, device=args.dev)

    def ember_step(jit: bool) -> Step:
        fn = lambda a, w: (a @ w).relu()  # noqa: E731
        step = ember.jit(fn) if jit else fn
        ea, ew = to_ember(a), to_ember(w)
        return Step(lambda: step(ea, ew))

    def torch_step(mode: str | None) -> Step:
        fn = compiled(lambda a, w: torch.relu(a @ w), mode, args.cpu_smoke)
        return Step(lambda: fn(a, w))

    return {"torch eager": lambda: torch_step(None), "torch.compile": lambda: torch_step("default"),
            "ember lazy": lambda: ember_step(False), "ember.jit": lambda: ember_step(True)}


def host_sum(t) -> float:
    """The sum of a result, copied to the host (torch: .cpu(); ember: .numpy())."""
    value = t.numpy() if isinstance(t, ember.Tensor) else t.detach().cpu().numpy()
    return float(value.astype("float64").sum())


def first_param_sum(step: Step) -> float:
    step.call()
    return float(step.state()[0].double().sum().item())


# row: (workload, its variants' makers given args, one step returning its result on the host)
C_ROWS = {
    "C1": ("mlp step (B1)", lambda args: mlp_bench("C1", "mlp", torch.bfloat16, 3e-2)(args).makers,
           lambda step: float(step.call().item())),
    "C2": ("adam step (B3)", lambda args: adam_bench(args).makers, first_param_sum),
    "C3": ("resnet18 step, bf16, SGD", resnet_makers, lambda step: float(step.call().item())),
    "C4": ("matmul + relu, f32", matmul_makers, lambda step: host_sum(step.call())),
}


def first_step_child(args) -> None:
    """In a fresh process: make the variant's step, run it until its first result is on the host, then
    NEXT_STEPS more; print the times (seconds from START) as one JSON line."""
    _, makers, result = C_ROWS[args.first_step]
    step = makers(args)[args.impl]()
    first = result(step)
    first_s = time.perf_counter() - START
    for _ in range(NEXT_STEPS):
        result(step)
    next_s = time.perf_counter() - START - first_s
    print(MARK + json.dumps({"import_s": IMPORTED - START, "first_s": first_s, "next_s": next_s, "result": first}),
          flush=True)


@dataclass
class CLine:
    row: str
    workload: str
    variant: str
    cache: str
    import_s: float | None = None
    first_s: float | None = None
    next_s: float | None = None
    process_s: float | None = None
    result: float | None = None
    status: str = "ok"  # "ok", "error" or "timeout"
    check: str = "-"


def run_child(row: str, variant: str, cache: str, env: dict, args) -> CLine:
    line = CLine(row, C_ROWS[row][0], variant, cache)
    size = ["--cpu-smoke"] if args.cpu_smoke else ["--quick"] if args.quick else []
    command = [sys.executable, os.path.abspath(__file__), "--first-step", row, "--impl", variant, *size]
    start = time.perf_counter()
    # a session of its own, so that a timeout ends its workers (torch.compile's) with it
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        out, err = child.communicate(timeout=args.child_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        print(f"timeout in {row} {variant} ({cache}): stopped after {args.child_timeout} s", file=sys.stderr)
        line.status = "timeout"
        return line
    line.process_s = time.perf_counter() - start
    found = [text for text in out.splitlines() if text.startswith(MARK)]
    if child.returncode != 0 or not found:
        print(f"error in {row} {variant} ({cache}): exit status {child.returncode}\n{err[-3000:]}", file=sys.stderr)
        line.status = "error"
        return line
    for key, value in json.loads(found[-1][len(MARK):]).items():
        setattr(line, key, value)
    return line


def first_steps(rows: list[str], args) -> list[CLine]:
    lines = []
    for row in rows:
        print(f"row {row}: {C_ROWS[row][0]}", flush=True)
        for variant in args.c_variants:
            with tempfile.TemporaryDirectory(prefix="ember-overhead-") as tmp:
                env = dict(os.environ, **{name: os.path.join(tmp, sub) for name, sub in CACHE_VARIABLES.items()})
                for cache in ("cold", "warm"):
                    print(f"  {variant}, {cache}", flush=True)
                    lines.append(run_child(row, variant, cache, env, args))
    for line in lines:  # each result against torch eager's in the same row and pass
        ref = next((r.result for r in lines if (r.row, r.cache, r.variant) == (line.row, line.cache, "torch eager")
                    and r.status == "ok"), None)
        if line.variant == "torch eager":
            line.check = "reference" if line.status == "ok" else "error"
        elif line.status == "ok" and ref is not None:
            line.check = verdict(abs(line.result - ref) / max(abs(ref), 1e-12), FIRST_STEP_TOL[line.row])
        else:
            line.check = line.status if line.status != "ok" else "no reference"
    return lines


def seconds(line: CLine, value: float | None) -> str:
    return line.status if line.status != "ok" else cell(value, "{:.3g}")


def c_table(lines: list[CLine], cpu: bool) -> str:
    head = ["row", "workload", "variant", "caches", "import s", "first result s", f"next {NEXT_STEPS} steps s",
            "process s", "target", "check"]
    body = []
    for line in lines:
        value = functools.partial(seconds, line)
        limit = TARGETS.get((line.row, line.cache))
        target = "-"
        if limit is not None and line.variant.startswith("ember"):
            target = f"<= {limit:g}: " + ("n/a (--cpu-smoke)" if cpu else "not measured" if line.first_s is None
                                          else "met" if line.first_s <= limit else "MISSED")
        body.append([line.row, line.workload, line.variant, line.cache, value(line.import_s), value(line.first_s),
                     value(line.next_s), value(line.process_s), target, line.check])
    return markdown_table(head, body)


# -- the report -------------------------------------------------------------------------------------

ROWS = [*A_ROWS, *B_ROWS, *C_ROWS]


def expand_sections(argv: list[str]) -> list[str]:
    """--rows may name whole sections: A, B and C stand for their rows."""
    def expand(value: str) -> str:
        return ",".join(",".join(r for r in ROWS if r[0] == part) if part in ("A", "B", "C") else part
                        for part in value.split(","))
    out, i = list(argv), 0
    while i < len(out):
        if out[i] == "--rows" and i + 1 < len(out):
            out[i + 1] = expand(out[i + 1])
        elif out[i].startswith("--rows="):
            out[i] = "--rows=" + expand(out[i][len("--rows="):])
        i += 1
    return out


def main(argv: list[str] | None = None) -> None:
    def options(parser):
        parser.add_argument("--child-timeout", type=float, default=600,
                            help="seconds a first-step child (section C) may run before it is stopped (default 600)")
        parser.add_argument("--c-variants", type=lambda v: [x.strip() for x in v.split(",")],
                            default=list(FIRST_STEP_VARIANTS),
                            help="section C's variants, comma-separated (default: all of "
                                 f"{', '.join(FIRST_STEP_VARIANTS)})")
        parser.add_argument("--first-step", choices=list(C_ROWS), default=None, help=argparse.SUPPRESS)
        parser.add_argument("--impl", choices=FIRST_STEP_VARIANTS, default=None, help=argparse.SUPPRESS)

    argv = expand_sections(sys.argv[1:] if argv is None else argv)
    opts = parse_options(argv, "overhead.py", __doc__, lambda which, dev: [(row, None) for row in ROWS],
                         rows_example="A,B1,B3,C", add_options=options)
    args = opts.args
    args.which, args.dev = opts.which, opts.dev  # the rows read them from args
    ember.manual_seed(0)
    if args.first_step is not None:
        first_step_child(args)
        return

    a_lines: list[ALine] = []
    b_results: list[dict] = []
    notes: list[str] = []
    c_rows = []
    for row in opts.selected:
        if row in A_ROWS:
            print(f"row {row}", flush=True)
            a_lines += guarded(f"row {row}", lambda row=row: A_ROWS[row](args)) or [ALine(row, "setup", "", None)]
        elif row in B_ROWS:
            bench = guarded(f"{row} setup", lambda row=row: B_ROWS[row](args))
            if bench is not None:
                print(f"row {row}: {bench.workload} ({bench.size})", flush=True)
                b_results.append(run_bench(bench, args, notes))
            del bench
        else:
            c_rows.append(row)
        release_memory(args.cpu_smoke)
    c_lines = first_steps(c_rows, args) if c_rows else []

    sections = []
    if a_lines:
        sections.append("### A. host overhead (us)\n\n" + a_table(a_lines))
        notes.append("A: host times are medians of single calls, call to return (the GPU idle at each call); A2 "
                     f"times {10 * max(args.reps, 1)} calls per figure; GPU done: CUDA events around the call; "
                     "kernels: the profiler's sum of the step's kernel durations; A3's GPU time: the lazy step's "
                     "launches captured in one CUDA graph and replayed (runtime.py row 3)")
    if b_results:
        sections.append("### B. steps, five variants\n\n" + b_table(b_results, args.cpu_smoke))
        notes.append("B: B1, B2: time per step of steps run back to back (median of 3 bursts), first call to GPU "
                     "done; B3-B8: median of single steps, call to GPU done, the GPU idle at the start; ratios are "
                     "of times (below 1: faster than the denominator); jit kernels: the profiler's sum of the "
                     "durations of the GPU work one ember.jit step launches (target: ember.jit / kernels <= 1.05)")
        notes.append(f"B check: B1, B2: the first {CHECK_STEPS} losses against torch eager's (relative, bf16 3e-2, "
                     f"fp16 1e-2); B3: the change {CHECK_STEPS} steps make to every parameter against Adam in float64 "
                     "(1e-3); B4-B8: the third call's outputs (ember.jit's first replay) against torch one precision "
                     "higher (||out - ref|| / ||ref||, bf16 1e-2, f32 1e-5); torch.compile variants are listed only "
                     "when off")
        notes.append("B: torch.compile variants compile the whole step (optimizer included); reduce-overhead uses "
                     "Adam(capturable=True), and its CUDA graphs copy inputs that are not parameters (B4-B8's) into "
                     "their own buffers each call; ember.jit in B4-B8 takes the inputs as arguments and reads them "
                     "where they are")
    if c_lines:
        sections.append("### C. first step in a fresh process (s)\n\n" + c_table(c_lines, args.cpu_smoke))
        notes.append("C: each variant runs in a new process, its caches (EMBER_CACHE_DIR, TRITON_CACHE_DIR, "
                     "TORCHINDUCTOR_CACHE_DIR) in a new empty directory (cold), then again on the same ones (warm); "
                     "import: torch, ember and the benchmark modules (ember's cuda runtime and Triton load in the "
                     "first step); first result: from the top of the script (before torch is imported) until the "
                     f"first step's result is on the host (C2: a parameter's sum after one step); next {NEXT_STEPS} "
                     "steps: the steps after it, each read back (ember.jit records and starts replaying in them); "
                     "process: the child's wall time, interpreter start and exit included; targets apply to ember "
                     "lazy and ember.jit's first result; check: the first result against torch eager's child")
    if args.cpu_smoke:
        notes.append("--cpu-smoke: times mean nothing (torch on the CPU, ember's kernels through Triton's interpreter, "
                     "tiny sizes); torch.compile variants ran with backend='eager'; GPU times, host-added time and "
                     "jit / kernels are not measured; targets do not apply")
    publish(f"overhead benchmark: {environment(args.cpu_smoke)}"
            + (" (--quick sizes)" if args.quick and not args.cpu_smoke else ""), "\n\n".join(sections), notes,
            opts.results_file)


if __name__ == "__main__":
    main()
