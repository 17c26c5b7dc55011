"""GPU-runtime benchmark: ember (lazy, ember.jit) against PyTorch eager, torch.compile and torch.compile
with mode="reduce-overhead", on what the runtime decides: launch overhead, CUDA graphs, streams, uploads.

Rows:
 1, 2  one training step (forward, cross entropy, backward, Adam) of an MLP 784-2048-2048-10 at batch
       4096, float32 (TF32 matmuls, for every variant) and bfloat16; with the GPU time of ember's
       kernels alone (profiler) and the FLOP floor (6 * batch * parameters at the measured matmul rate)
 3     a plan of 200 small dependent kernels that cannot fuse: host overhead per step and per kernel
 4     two independent branches of small kernels, ember.runtime.cuda.max_streams = 1 and 2
 5     the DataLoader's upload hidden behind compute: hidden = (upload + compute - loop) / upload

Training steps (rows 1, 2, 5) are timed back to back, as a training loop runs (the host may run ahead
of the GPU), from the first call until the GPU is done, divided by the steps; rows 3 and 4 are timed
one step at a time from the call until the GPU is done, the GPU idle at the start, as fusion.py does.
Every ember result is checked against torch: the losses of the first steps of rows 1 and 2 against
torch eager in the same dtype, the outputs of rows 3 and 4 against torch in float64.

    python benchmarks/runtime.py                      # full sizes on a CUDA GPU, appended to RESULTS.md
    python benchmarks/runtime.py --quick --rows 1,3   # small sizes, some rows; nothing appended
    EMBER_INTERPRET=1 python benchmarks/runtime.py --cpu-smoke   # no GPU: tiny sizes, every code path
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as TF
from common import (
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

import ember
import ember.nn.functional as EF
from ember.data import DataLoader

# (full, --quick, --cpu-smoke)
SIZES = {
    "mlp": ((4096, (784, 2048, 2048, 10)), (1024, (784, 1024, 1024, 10)), (16, (32, 64, 64, 10))),
    "matmul": (8192, 4096, 128),  # square matmul measuring the FLOP rate
    "tiny": ((200, 16), (200, 16), (12, 16)),  # (kernels, width of the square input)
    # (reductions per branch, the two inputs' shapes): shapes differ, so the planner cannot merge the branches'
    # kernels into shared launches (horizontal fusion) and leaves the streams something to overlap
    "branches": ((4, (8, 8192), (16, 4096)), (4, (8, 8192), (16, 4096)), (2, (8, 64), (16, 32))),
    "loader": (16, 8, 3),  # batches per epoch (of the MLP row's batch and width)
}
CHECK_STEPS = 3  # training steps whose losses are compared with torch eager
LOSS_TOL = {"float32": 2e-3, "bfloat16": 3e-2}  # relative; float32 matmuls run in TF32 here


@dataclass
class Line:
    """One line of the table: a variant of a row."""
    row: str
    workload: str
    size: str
    variant: str
    ms: float | None  # per step; None: the variant failed
    detail: str = ""
    check: str = "-"


def matmul_tflops(n: int, dtype: torch.dtype, dev: str, cpu: bool) -> float:
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    return 2 * n**3 / median_ms(lambda: a @ b, 2, 5, cpu) / 1e9


def run_variant(what: str, make: Callable[[], Callable[[], object]], check: Callable[[Callable], object],
                timer: Callable[[Callable], float]) -> tuple[object, float | None, Callable | None]:
    """Make a variant's step, check its first results, then time it; a failing part gives None (the table then
    says "error"), and a variant that fails its setup or its check is not timed."""
    step = guarded(f"{what} (setup)", make)
    if step is None:
        return None, None, None
    checked = guarded(f"{what} (check)", lambda: check(step))
    ms = guarded(what, lambda: timer(step)) if checked is not None else None
    return checked, ms, step


def relative_error(values: list[float], reference: list[float]) -> float:
    return max(abs(v - r) / max(abs(r), 1e-12) for v, r in zip(values, reference))


def verdict(err: float | None, tol: float) -> str:
    return "error" if err is None else f"{err:.1e}" + ("" if err <= tol else " FAIL")


# -- rows 1 and 2: an MLP training step ------------------------------------------------------------

def make_mlp(nn, widths: tuple[int, ...], device: str, dtype):
    """Linear layers with ReLU between them, written once for torch.nn and ember.nn."""
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(a, b, device=device, dtype=dtype))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class MLPWorkload:
    """One initial state and batch, from which each variant builds its own model and optimizer."""

    def __init__(self, batch: int, widths: tuple[int, ...], dtype: str, dev: str):
        self.batch, self.widths, self.dtype, self.dev = batch, widths, dtype, dev
        self.torch_dtype = getattr(torch, dtype)
        self.init = [p.detach() for p in make_mlp(torch.nn, widths, dev, self.torch_dtype).parameters()]
        self.x = torch.randn(batch, widths[0], device=dev, dtype=self.torch_dtype)
        self.y = torch.randint(0, widths[-1], (batch,), device=dev)
        self.parameters = sum(p.numel() for p in self.init)

    def ember_step(self, jit: bool) -> Callable[[], object]:
        model = make_mlp(ember.nn, self.widths, "cuda", ember.dtypes.as_dtype(self.dtype))
        for p, value in zip(model.parameters(), self.init):
            p.data = to_ember(value.clone())
        step = training_step(EF, model, ember.optim.Adam(model.parameters(), lr=1e-3))
        step = ember.jit(step) if jit else step
        x, y = to_ember(self.x), to_ember(self.y)
        return lambda: step(x, y)

    def torch_step(self, mode: str | None, cpu: bool) -> Callable[[], object]:
        """Eager (mode None) or the whole step under torch.compile(mode=...); under --cpu-smoke the
        compiled variants trace with backend="eager" (inductor's CPU compile is too slow for a smoke run)."""
        model = make_mlp(torch.nn, self.widths, self.dev, self.torch_dtype)
        with torch.no_grad():
            for p, value in zip(model.parameters(), self.init):
                p.copy_(value)
        # reduce-overhead replays the optimizer in a CUDA graph: its step count must live on the GPU
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=mode == "reduce-overhead" and not cpu)
        step = training_step(TF, model, optimizer)
        if mode is not None:
            step = torch.compile(step, backend="eager") if cpu else torch.compile(step, mode=mode)
        return lambda: step(self.x, self.y)


def mlp_row(row: str, dtype: str, args) -> list[Line]:
    cpu = args.cpu_smoke
    batch, widths = SIZES["mlp"][args.which]
    work = MLPWorkload(batch, widths, dtype, args.dev)
    workload, size = f"mlp step {'f32' if dtype == 'float32' else 'bf16'}", f"{'-'.join(map(str, widths))} x {batch}"
    variants = {
        "ember lazy": lambda: work.ember_step(jit=False),
        "ember.jit": lambda: work.ember_step(jit=True),
        "torch eager": lambda: work.torch_step(None, cpu),
        "torch.compile": lambda: work.torch_step("default", cpu),
        "torch.compile reduce-overhead": lambda: work.torch_step("reduce-overhead", cpu),
    }
    lines, losses = [], {}
    for name, make in variants.items():
        losses[name], ms, step = run_variant(
            f"{row} {name}", make, lambda step: [float(step().item()) for _ in range(CHECK_STEPS)],
            lambda step: loop_ms(step, args.warmup, args.reps, cpu))
        line = Line(row, workload, size, name, ms)
        if name.startswith("torch.compile") and cpu:
            line.detail = "backend='eager' (--cpu-smoke)"
        if name == "ember.jit" and ms is not None:
            line.detail = jit_detail(step, ms, args)
        lines.append(line)
        del step
    reference = losses["torch eager"]
    for line in lines:  # each variant's first losses against torch eager's
        err = relative_error(losses[line.variant], reference) if losses[line.variant] and reference else None
        line.check = "reference" if line.variant == "torch eager" else verdict(err, LOSS_TOL[dtype])
    lines.append(flop_floor(row, workload, size, work, args))
    return lines


def jit_detail(step: Callable[[], object], ms: float, args) -> str:
    if args.cpu_smoke:
        return "kernels' GPU time not measured (--cpu-smoke)"
    gpu = guarded("ember.jit kernels (profiler)", lambda: device_ms(step, 1, args.reps))
    if not gpu:
        return "kernels' GPU time: error"
    return f"its kernels {gpu:.4g} ms on the GPU (profiler); step = {ms / gpu:.3f}x that (target <= 1.05)"


def flop_floor(row: str, workload: str, size: str, work: MLPWorkload, args) -> Line:
    flops = 6 * work.batch * work.parameters
    n = SIZES["matmul"][args.which]
    kind = "bf16" if work.dtype == "bfloat16" else "tf32"
    rate = guarded("matmul rate", lambda: matmul_tflops(n, work.torch_dtype, args.dev, args.cpu_smoke))
    detail = (f"6 x batch x {work.parameters / 1e6:.2f}M params = {flops / 1e9:.1f} GFLOP at "
              f"{cell(rate, '{:.0f}')} TFLOP/s ({kind} torch.matmul {n}^3)")
    return Line(row, workload, size, "FLOP floor", flops / rate / 1e9 if rate else None, detail)


# -- row 3: many small dependent kernels -----------------------------------------------------------

def realized(fn: Callable) -> Callable:
    """`fn` with its results computed before it returns (a step, as optimizer.step() is one)."""
    def step(*args):
        out = fn(*args)
        ember.realize(*(out if isinstance(out, tuple) else (out,)))
        return out
    return step


def ember_variants(fn: Callable, inputs: list) -> dict[str, Callable[[], Callable[[], object]]]:
    """ember lazy and ember.jit with and without a CUDA graph, each a maker of a step on `inputs`."""
    def jitted(cuda_graph: bool):
        step = ember.jit(realized(fn), cuda_graph=cuda_graph)
        return lambda: step(*inputs)
    return {
        "ember lazy": lambda: lambda: realized(fn)(*inputs),
        "ember.jit cuda_graph=False": lambda: jitted(False),
        "ember.jit cuda_graph=True": lambda: jitted(True),
    }


def checked_replay(step: Callable[[], object], fn64: Callable, inputs: list[torch.Tensor]) -> float:
    """The error of the third call's results (for ember.jit: the first replay) against torch in float64:
    ||ember - torch|| / ||torch||, the worst over the outputs."""
    step(), step()
    out = step()
    outs = out if isinstance(out, tuple) else (out,)
    refs = fn64(*[t.double() for t in inputs])
    refs = refs if isinstance(refs, tuple) else (refs,)
    return max(((to_torch(o).double() - r).norm() / r.norm()).item() for o, r in zip(outs, refs))


def tiny_kernels_row(args) -> list[Line]:
    cpu = args.cpu_smoke
    count, width = SIZES["tiny"][args.which]
    x = torch.randn(width, width, device=args.dev)
    ex = to_ember(x)
    fn = lambda h: chain_of_reductions(ember, h, count)  # noqa: E731
    launches = guarded("3 ember.explain.plan", lambda: ember.explain.plan(fn(ex)).launches)
    workload = f"{count} tiny kernels"
    size = f"{width}x{width} f32, {cell(launches, '{}')} launches"
    gpu = None if cpu else guarded("3 GPU alone", lambda: graph_gpu_ms(lambda: fn(ex).realize(), args.reps))
    lines = []
    for name, make in ember_variants(fn, [ex]).items():
        err, ms, _ = run_variant(f"3 {name}", make, lambda step: checked_replay(step, fn, [x]),
                                 lambda step: median_ms(step, args.warmup, args.reps, cpu))
        lines.append(Line("3", workload, size, name, ms, overhead(ms, gpu, launches, cpu), verdict(err, 1e-4)))
    torch_fn = lambda h: chain_of_reductions(torch, h, count)  # noqa: E731
    lines.append(Line("3", workload, size, "torch eager",
                      guarded("3 torch eager", lambda: median_ms(lambda: torch_fn(x), args.warmup, args.reps, cpu))))
    compiled = torch.compile(torch_fn, backend="eager") if cpu else torch.compile(torch_fn, mode="reduce-overhead")
    lines.append(Line("3", workload, size, "torch.compile reduce-overhead",
                      guarded("3 torch.compile reduce-overhead",
                              lambda: median_ms(lambda: compiled(x), args.warmup, args.reps, cpu)),
                      "backend='eager' (--cpu-smoke)" if cpu else ""))
    if not cpu:
        lines.append(Line("3", workload, size, "GPU alone", gpu, "ember's launches replayed in one CUDA graph"))
    return lines


def overhead(ms: float | None, gpu: float | None, launches: int | None, cpu: bool) -> str:
    if cpu or ms is None or gpu is None:
        return "host overhead not measured (--cpu-smoke)" if cpu else ""
    host_us = (ms - gpu) * 1e3
    per_kernel = f", {host_us / launches:.2f} us per kernel" if launches else ""
    return f"host overhead {host_us:.0f} us per step{per_kernel}"


# -- row 4: two independent branches ---------------------------------------------------------------

def branches_row(args) -> list[Line]:
    from ember.runtime import cuda

    cpu = args.cpu_smoke
    per_branch, shape_a, shape_b = SIZES["branches"][args.which]
    a, b = torch.randn(*shape_a, device=args.dev), torch.randn(*shape_b, device=args.dev)
    inputs = [to_ember(a), to_ember(b)]
    fn = lambda F, h1, h2: (chain_of_reductions(F, h1, per_branch), chain_of_reductions(F, h2, per_branch))  # noqa: E731
    workload = "two branches"
    size = f"{per_branch} reductions each, on {'x'.join(map(str, shape_a))} and {'x'.join(map(str, shape_b))} f32"
    lines = []
    before = cuda.max_streams
    try:
        for streams in (1, 2):
            cuda.max_streams = streams
            variants = ember_variants(lambda h1, h2: fn(ember, h1, h2), inputs)
            for name in ("ember lazy", "ember.jit cuda_graph=True"):
                err, ms, _ = run_variant(f"4 {name}", variants[name],
                                         lambda step: checked_replay(step, lambda *h: fn(torch, *h), [a, b]),
                                         lambda step: median_ms(step, args.warmup, args.reps, cpu))
                parallel = guarded("4 schedule", lambda: parallel_kernels(fn(ember, *inputs)))
                lines.append(Line("4", workload, size, f"{name}, max_streams={streams}", ms,
                                  f"{cell(parallel, '{}')} kernels in parallel groups", verdict(err, 1e-4)))
    finally:
        cuda.max_streams = before
    return lines


def parallel_kernels(outputs: tuple) -> int:
    """How many kernels of the cached plan for `outputs` run in parallel groups (on side streams)."""
    from ember.ir import toposort
    from ember.runtime import plan_cache

    nodes = [t._node for t in outputs]
    order = toposort(nodes)
    plan, _ = plan_cache.plan_for(order, {id(n) for n in nodes} | {id(n) for n in order if n.is_held()})
    return plan.schedule.parallel_kernels


# -- row 5: uploads hidden behind compute ----------------------------------------------------------

def loader_row(args) -> list[Line]:
    cpu = args.cpu_smoke
    batch, widths = SIZES["mlp"][args.which]
    batches = SIZES["loader"][args.which]
    rng = np.random.default_rng(0)
    data = (rng.standard_normal((batches * batch, widths[0]), dtype=np.float32),
            rng.integers(0, widths[-1], batches * batch))
    model = make_mlp(ember.nn, widths, "cuda", ember.float32)
    step = ember.jit(training_step(EF, model, ember.optim.Adam(model.parameters(), lr=1e-3)))
    workload, size = "dataloader upload hidden", f"{batches} batches of {batch}x{widths[0]} f32, mlp f32 ember.jit"

    def epoch_ms(prefetch: int, compute: bool) -> float:
        loader = DataLoader(data, batch_size=batch, shuffle=True, drop_last=True, seed=0, device="cuda",
                            prefetch=prefetch)
        for xb, yb in loader:  # warm-up: compiles and records the step
            if compute:
                step(xb, yb)
        sync(cpu)
        start = time.perf_counter()
        for xb, yb in loader:
            if compute:
                step(xb, yb)
        sync(cpu)
        return (time.perf_counter() - start) * 1e3 / len(loader)

    def compute_ms() -> float:
        xb, yb = next(iter(DataLoader(data, batch_size=batch, device="cuda", prefetch=0)))
        return loop_ms(lambda: step(xb, yb), args.warmup, args.reps, cpu)

    upload = guarded("5 upload only", lambda: epoch_ms(0, compute=False))
    compute = guarded("5 compute only", compute_ms)
    lines = [Line("5", workload, size, "upload only (a)", upload, "cut + upload per batch, prefetch=0"),
             Line("5", workload, size, "compute only (b)", compute, "step on a batch already on the device")]
    for prefetch in (1, 0):
        loop = guarded(f"5 loop prefetch={prefetch}", lambda prefetch=prefetch: epoch_ms(prefetch, compute=True))
        hidden = (upload + compute - loop) / upload if None not in (upload, compute, loop) else None
        lines.append(Line("5", workload, size, f"loop, prefetch={prefetch} (c)", loop,
                          f"hidden = (a + b - c) / a = {cell(hidden and 100 * hidden, '{:.0f}')}%"))
    return lines


# -- the table -------------------------------------------------------------------------------------

ROWS = {"1": lambda args: mlp_row("1", "float32", args), "2": lambda args: mlp_row("2", "bfloat16", args),
        "3": tiny_kernels_row, "4": branches_row, "5": loader_row}


def table(lines: list[Line]) -> str:
    eager = {line.row: line.ms for line in lines if line.variant == "torch eager"}
    head = ["row", "workload", "size", "variant", "ms per step", "vs torch eager", "detail", "check"]
    body = []
    for line in lines:
        base = eager.get(line.row)
        speedup = "-" if base is None or line.variant in ("FLOP floor", "GPU alone") else cell(
            base / line.ms if base and line.ms else None, "{:.2f}x")
        body.append([line.row, line.workload, line.size, line.variant, cell(line.ms), speedup, line.detail,
                     line.check])
    return markdown_table(head, body)


def main(argv: list[str] | None = None) -> None:
    opts = parse_options(argv, "runtime.py", __doc__, lambda which, dev: ROWS.items(), rows_example="1,3")
    args, selected, results_file = opts.args, opts.selected, opts.results_file
    args.which, args.dev = opts.which, opts.dev  # the rows read them from args
    torch.backends.cuda.matmul.allow_tf32 = True  # float32 matmuls in TF32, for ember (through torch) and torch
    ember.manual_seed(0)

    lines: list[Line] = []
    for row in selected:
        print(f"row {row}", flush=True)
        lines += guarded(f"row {row}", lambda row=row: ROWS[row](args)) or [Line(row, "", "", "setup", None)]
        release_memory(args.cpu_smoke)

    notes = ["rows 1, 2, 5: time per step of steps run back to back (median of 3 bursts), first call to GPU "
             "done; rows 3, 4: median of single steps, call to GPU done, GPU idle at the start",
             "float32 matmuls run in TF32 (torch.backends.cuda.matmul.allow_tf32) for every variant; "
             f"loss check: the first {CHECK_STEPS} losses against torch eager, relative tolerance "
             f"{LOSS_TOL['float32']} (f32) / {LOSS_TOL['bfloat16']} (bf16); rows 3, 4: outputs against torch "
             "float64, tolerance 1e-4",
             "torch.compile variants compile the whole step, optimizer.step() included; reduce-overhead uses "
             "Adam(capturable=True)"]
    if args.cpu_smoke:
        notes.append("--cpu-smoke: times mean nothing (torch on the CPU, ember's kernels through Triton's "
                     "interpreter); torch.compile variants ran with backend='eager', since inductor's CPU "
                     "compile takes too long for a smoke run; GPU-only measurements are skipped")
    publish(f"runtime benchmark: {environment(args.cpu_smoke)}"
            + (" (--quick sizes)" if args.quick and not args.cpu_smoke else ""), table(lines), notes, results_file)


if __name__ == "__main__":
    main()
