"""Fused MLP benchmark: narrow ReLU MLPs (ordinary Linear layers, float16) for inference and training,
ember (lazy and jit) against PyTorch eager, torch.compile (default, max-autotune, reduce-overhead) and the
floor, side by side in one run.

Rows (a network of width w and depth d: w -> w x (d - 1) -> 16, ReLU between the layers):
  I<w>d<d>  inference, batch 2^21, for w in 32, 64, 128 and d in 2, 5, 8
  T<w>d<d>  training step (MSE loss, Adam), batch 2^18, for w in 32, 64, 128 and d in 2, 5, 8

The floor is the larger of the FLOPs at the measured cuBLAS float16 rate and the bytes the step must move
(input rows and outputs; for training also the parameters and Adam's state) at the measured copy rate.
Times: median of single steps, call to GPU done, the GPU idle at the start. ember's kernels: how many fused
kernels its plan of one inference has (1: the whole network is one kernel), or of one training step.
"first step": each variant's first call in the process, until the GPU is done (compiling included; point
EMBER_CACHE_DIR and TRITON_CACHE_DIR at empty directories for a cold start).

    python benchmarks/mlp.py                      # every row, appended to RESULTS.md
    python benchmarks/mlp.py --rows I64d5,T64d5   # some rows
    python benchmarks/mlp.py --variants "torch eager,ember lazy,ember.jit"
    python benchmarks/mlp.py --cpu-smoke          # no GPU: tiny sizes, every code path
    EMBER_SPLIT_K=0 python benchmarks/mlp.py --rows T64d5   # training with unsplit weight-gradient GEMMs
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from common import (  # noqa: E402
    cell,
    device_ms,
    environment,
    gpu_cell,
    guarded,
    markdown_table,
    median_ms,
    parse_options,
    publish,
    release_memory,
    sync,
    to_ember,
    to_torch,
)

import ember  # noqa: E402
from ember.explain import plan  # noqa: E402

VARIANTS = ["torch eager", "torch.compile", "torch.compile max-autotune", "torch.compile reduce-overhead",
            "ember lazy", "ember.jit"]
DEVICE_TIMED = ["torch.compile reduce-overhead", "ember.jit"]  # also timed on the GPU alone (device_ms)
MODES = {"torch eager": None, "torch.compile": "default", "torch.compile max-autotune": "max-autotune",
         "torch.compile reduce-overhead": "reduce-overhead"}
BATCH = {"I": (2**21, 2**14, 300), "T": (2**18, 2**12, 200)}  # full, --quick, --cpu-smoke
OUT_WIDTH = 16
ROWS = [(f"{kind}{w}d{d}", kind, w, d) for kind in ("I", "T") for w in (32, 64, 128) for d in (2, 5, 8)]


def cases(which: int, dev: str):
    return [(row, (kind, w, d, BATCH[kind][which])) for row, kind, w, d in ROWS]


def widths(w: int, d: int) -> list[int]:
    return [w] * d + [OUT_WIDTH]


def torch_model(w: int, d: int, dev: str, dtype=torch.float16) -> torch.nn.Sequential:
    sizes = widths(w, d)
    layers: list[torch.nn.Module] = []
    for i in range(d):
        layers.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i < d - 1:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers).to(dev, dtype)


def compiled(fn: Callable, variant: str, cpu: bool) -> Callable:
    mode = MODES[variant]
    if mode is None:
        return fn
    return torch.compile(fn, backend="eager") if cpu else torch.compile(fn, mode=mode)


def floor_ms(kind: str, w: int, d: int, batch: int, tflops: float | None, gbs: float | None) -> float | None:
    if tflops is None or gbs is None:
        return None
    sizes = widths(w, d)
    macs = sum(a * b for a, b in zip(sizes, sizes[1:]))
    flops = 2 * batch * macs * (3 if kind == "T" else 1)  # training: forward, input and weight gradients
    nbytes = 2 * batch * (sizes[0] + sizes[-1])
    if kind == "T":
        nbytes += (2 + 4 * 4) * (macs + sum(sizes[1:]))  # fp16 parameters and fp32 gradient, master, m, v
    return max(flops / tflops / 1e9, nbytes / gbs / 1e6)


def first_call(fn: Callable[[], object], cpu: bool) -> tuple[object, float]:
    """fn's value and the seconds from the call until the GPU is done: a variant's first step, compiling
    included."""
    sync(cpu)
    start = time.perf_counter()
    out = fn()
    sync(cpu)
    return out, time.perf_counter() - start


def inference(w: int, d: int, batch: int, dev: str, cpu: bool, variants: list[str], warmup: int, reps: int):
    model = torch_model(w, d, dev).eval()
    x = torch.randn(batch, w, device=dev, dtype=torch.float16)
    em = ember.from_torch(model).to("cuda")  # on a GPU: shared; under --cpu-smoke: copied to the interpreter
    ex = to_ember(x)
    with torch.no_grad():
        reference = model.float()(x.float())
        model.half()
    def forward(x):
        with ember.no_grad():
            return em(x)

    kernels = guarded("ember plan", lambda: len(plan(forward(ex)).kernels))  # planned, not run
    times, errors, gpu, firsts = {}, {}, {}, {}
    for variant in variants:
        if variant.startswith("torch"):
            fn = compiled(model, variant, cpu)
            step = lambda fn=fn: fn(x)  # noqa: E731

            def timed(step=step, variant=variant):
                with torch.no_grad():
                    # reduce-overhead's output is overwritten by the next replay
                    out, firsts[variant] = first_call(lambda: step().clone(), cpu)
                    times[variant] = median_ms(step, warmup, reps, cpu)
                    if variant in DEVICE_TIMED:
                        gpu[variant] = device_ms(step, warmup, reps)
                return out
            out = guarded(f"{variant}", timed)
        else:
            fn = ember.jit(forward) if variant == "ember.jit" else forward
            step = lambda fn=fn: fn(ex).realize()  # noqa: E731
            out, firsts[variant] = guarded(variant, lambda step=step: first_call(step, cpu)) or (None, None)
            if out is not None:
                out = to_torch(out)
                times[variant] = guarded(variant, lambda step=step: median_ms(step, warmup, reps, cpu))
                if variant in DEVICE_TIMED:
                    gpu[variant] = guarded(f"{variant} (profiler)", lambda step=step: device_ms(step, warmup, reps))
        if out is not None:
            errors[variant] = guarded(f"{variant} check", lambda out=out: (
                (out.float() - reference).norm() / reference.norm()).item())
    return times, errors, kernels, gpu, firsts


def training(w: int, d: int, batch: int, dev: str, cpu: bool, variants: list[str], warmup: int, reps: int):
    base = torch_model(w, d, dev, torch.float32)
    x = torch.randn(batch, w, device=dev, dtype=torch.float16)
    y = torch.randn(batch, OUT_WIDTH, device=dev, dtype=torch.float16)
    times, losses, gpu, firsts = {}, {}, {}, {}
    kernels = None
    for variant in variants:
        if variant.startswith("torch"):
            model = torch_model(w, d, dev)
            model.load_state_dict(base.state_dict())
            capturable = variant.endswith("reduce-overhead") and not cpu
            opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4, capturable=capturable)

            def torch_step(model=model, opt=opt):
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
                loss.backward()
                opt.step()
                return loss.detach()
            step = compiled(torch_step, variant, cpu)
        else:
            model = torch_model(w, d, dev)
            model.load_state_dict(base.state_dict())
            em = ember.from_torch(model).to("cuda")
            opt = ember.optim.Adam(em.parameters(), lr=1e-3, eps=1e-4)
            ex, ey = to_ember(x), to_ember(y)

            def ember_step(x, y, em=em, opt=opt):
                opt.zero_grad()
                loss = ember.nn.functional.mse_loss(em(x).float(), y.float())
                loss.backward()
                opt.step()
                return loss
            fn = ember.jit(ember_step) if variant == "ember.jit" else ember_step
            step = lambda fn=fn, ex=ex, ey=ey: fn(ex, ey).realize()  # noqa: E731
        first, firsts[variant] = guarded(variant, lambda step=step: first_call(step, cpu)) or (None, None)
        if first is not None:
            losses[variant] = float(first.item())
            if variant.startswith("ember") and kernels is None:  # a steady-state step's plan (one realization)
                def count(ember_step=ember_step, ex=ex, ey=ey):
                    with ember.explain.capture() as plans:
                        ember_step(ex, ey).realize()
                    return sum(len(p.kernels) for p in plans)
                kernels = guarded("ember plan", count)
            times[variant] = guarded(variant, lambda step=step: median_ms(step, warmup, reps, cpu))
            if variant in DEVICE_TIMED:
                gpu[variant] = guarded(f"{variant} (profiler)", lambda step=step: device_ms(step, warmup, reps))
    return times, losses, kernels, gpu, firsts


def main(argv: list[str] | None = None) -> None:
    def options(parser):
        parser.add_argument("--variants", type=lambda v: [x.strip() for x in v.split(",")], default=VARIANTS,
                            help=f"variants to run, comma-separated (default: all of {', '.join(VARIANTS)})")

    opts = parse_options(argv, "mlp.py", __doc__, cases, rows_example="I64d5,T64d5", add_options=options)
    args, dev, cpu = opts.args, opts.dev, opts.args.cpu_smoke
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        sys.exit(f"--variants: no variant {', '.join(sorted(unknown))}")
    variants = [v for v in VARIANTS if v in args.variants]
    from gemm import cublas_tflops

    n = (8192, 2048, 64)[opts.which]
    tflops = guarded("cuBLAS rate", lambda: cublas_tflops(n, dev, args.warmup, args.reps, cpu))
    from fusion import copy_gbs

    gbs = guarded("copy rate", lambda: copy_gbs((1 << 30, 1 << 26, 1 << 16)[opts.which], dev, args.warmup,
                                                args.reps, cpu))
    print(f"cuBLAS fp16 {cell(tflops, '{:.0f}')} TFLOP/s, copy {cell(gbs, '{:.0f}')} GB/s", flush=True)
    lines = []
    made = dict(opts.cases)
    for row in opts.selected:
        kind, w, d, batch = made[row]
        print(f"row {row}", flush=True)
        floor = floor_ms(kind, w, d, batch, tflops, gbs)
        if kind == "I":
            times, errors, kernels, gpu, firsts = inference(w, d, batch, dev, cpu, variants, args.warmup, args.reps)
            check = ", ".join(f"{v}: {cell(e, '{:.1e}')}" for v, e in errors.items() if v.startswith("ember"))
        else:
            times, losses, kernels, gpu, firsts = training(w, d, batch, dev, cpu, variants, args.warmup, args.reps)
            check = "first loss " + ", ".join(f"{v}: {loss_:.4g}" for v, loss_ in losses.items())
        eager = times.get("torch eager")
        best_torch = min((t for v, t in times.items() if v.startswith("torch.compile") and t), default=None)
        best_ember = min((t for v, t in times.items() if v.startswith("ember") and t), default=None)
        lines.append([row, f"{'-'.join(map(str, widths(w, d)))} x {batch}", cell(floor, "{:.3f}"),
                      *[cell(times.get(v), "{:.3f}") if v in variants else "-" for v in VARIANTS],
                      *[gpu_cell(gpu.get(v), "{:.3f}") if v in variants else "-" for v in DEVICE_TIMED],
                      cell(kernels, "{}"),
                      "-" if "torch eager" not in variants else
                      cell(eager / best_ember if eager and best_ember else None, "{:.2f}"),
                      "-" if not any(v.startswith("torch.compile") for v in variants) else
                      cell(best_torch / best_ember if best_torch and best_ember else None, "{:.2f}"),
                      ", ".join(f"{v} {cell(t, '{:.1f}')}" for v, t in firsts.items()), check])
        release_memory(cpu)
    head = ["row", "network x batch", "floor ms", *[f"{v} ms" for v in VARIANTS],
            *[f"{v} GPU ms" for v in DEVICE_TIMED], "ember kernels",
            "eager / ember", "best compile / ember", "first step s", "check"]
    notes = [f"floor: max(FLOPs at the measured cuBLAS float16 rate {cell(tflops, '{:.0f}')} TFLOP/s, bytes at the "
             f"measured copy rate {cell(gbs, '{:.0f}')} GB/s)",
             "ember / torch ratios use the faster ember variant and the fastest torch.compile mode",
             "GPU ms: the summed durations of the GPU work one step runs (CUDA-graph replays included), from "
             "torch's profiler; ms: call to GPU done, launches included",
             "check: inference, ||out - ref|| / ||ref|| against torch in float32 on the same weights; training, "
             "the first step's loss per variant (same weights and data)"]
    publish(f"fused MLP benchmark: {environment(cpu)}", markdown_table(head, lines), notes, opts.results_file)


if __name__ == "__main__":
    main()
