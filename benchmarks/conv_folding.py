"""Convolution folding benchmark: eval-mode inference of torchvision CNNs imported with ember.from_torch, run by
ember.jit with per-channel affines folded into the convolutions before them (compiler/conv_folding.py) and with the
fold turned off, against torch eager; with each plan's convolutions folded, kernels and bytes moved.

Rows (float32, eval mode, batch 32 at 224x224, onnx.py's models):
 mobilenet_v3  torchvision's MobileNetV3-Large: the batch norms after the projection convolutions of blocks without
               a residual feed the next block's convolution, so those fold (5 of 62 convolutions)
 resnet50      torchvision's ResNet-50: every batch norm feeds a ReLU or a residual add, which takes it in; nothing
               folds and nothing should change (a check that the fold costs nothing there)

"fold off" compiles the same graph with the fold replaced by the identity, from an empty plan cache (in memory and
on disk), so the two plans are compiled alike but for the fold. A batch is timed back to back (median of 3 bursts
of --reps); every variant's output is checked against torch eager's (relative error, Frobenius norm).

    python benchmarks/conv_folding.py                # on a CUDA GPU, appended to RESULTS.md
    python benchmarks/conv_folding.py --rows mobilenet_v3 --reps 50
    python benchmarks/conv_folding.py --cpu-smoke    # no GPU: tiny models through Triton's interpreter
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

VARIANTS = ("torch eager", "ember.jit from_torch", "ember.jit from_torch, fold off")
TOLERANCE = 1e-3  # relative; TF32 may be on for the GPU variants


def make(row: str, smoke: bool):
    """(torch model in eval mode, a batch of inputs) of a row, on the CPU: onnx.py's models, with the running
    statistics of a trained network rather than the initial zeros and ones."""
    from common import vision_model

    model, x = vision_model(row, smoke)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
    return model, x


@contextlib.contextmanager
def folding_off():
    """Plans compiled inside are compiled without the fold, from empty plan caches."""
    from ember.compiler import conv_folding
    from ember.runtime import plan_cache

    fold, cache = conv_folding.fold_affines, os.environ.get("EMBER_CACHE_DIR")
    with tempfile.TemporaryDirectory() as folder:
        conv_folding.fold_affines = lambda lowered, context, costs: lowered
        os.environ["EMBER_CACHE_DIR"] = folder
        plan_cache.clear()
        try:
            yield
        finally:
            conv_folding.fold_affines = fold
            if cache is None:
                os.environ.pop("EMBER_CACHE_DIR")
            else:
                os.environ["EMBER_CACHE_DIR"] = cache
            plan_cache.clear()


def plan_figures(forward, x) -> dict:
    """The plan of one lazy forward: its convolutions (folded of all), kernels and the bytes its kernels read and
    write."""
    import ember
    from ember.ir import Op

    with ember.explain.capture() as plans:
        ember.realize(forward(x))
    kernels = [k for p in plans for k in p.kernels]
    convolutions = [c for k in kernels for c in k.cores if c.op is Op.CONV2D]
    moved = sum(n.numel * n.dtype.itemsize for k in kernels for n in (*k.reads, *k.outputs))
    return {"folded": f"{sum('folded' in c.attrs for c in convolutions)}/{len(convolutions)}",
            "kernels": len(kernels), "moved_mib": moved / 2**20}


def ember_run(model, x, smoke: bool, reps: int) -> dict:
    from common import loop_ms, to_ember

    import ember

    module = ember.from_torch(model.to("cpu" if smoke else "cuda")).eval()
    if smoke:  # ember's cuda device through the interpreter, on copies of the CPU model's parameters
        module.to("cuda")
    ex = ember.tensor(x.numpy(), device="cuda") if smoke else to_ember(x)

    def forward(t):
        with ember.no_grad():
            return module(t)
    figures = plan_figures(forward, ex)
    step = ember.jit(forward)
    out = step(ex)
    figures["ms"] = loop_ms(lambda: ember.realize(step(ex)), 2, reps, smoke)
    return {**figures, "output": torch.from_numpy(out.numpy())}


def torch_run(model, x, smoke: bool, reps: int) -> dict:
    from common import loop_ms

    model, x = model.to(x.device), x

    def step():
        with torch.no_grad():
            return model(x)
    return {"ms": loop_ms(step, 2, reps, smoke), "output": step().cpu()}


def run_row(row: str, args) -> list[dict]:
    from common import check_outputs, guarded, rel_error, release_memory

    model, x = make(row, args.cpu_smoke)
    lines = []
    for variant in VARIANTS:
        if variant in args.skip:
            continue
        print(f"  {row}: {variant}", flush=True)
        if variant == "torch eager":
            result = guarded(f"{row} {variant}", lambda: torch_run(model, x.to(args.dev), args.cpu_smoke, args.reps))
        else:
            with folding_off() if variant.endswith("fold off") else contextlib.nullcontext():
                result = guarded(f"{row} {variant}", lambda: ember_run(model, x, args.cpu_smoke, args.reps))
        lines.append({"row": row, "variant": variant, **(result or {})})
        release_memory(args.cpu_smoke)
    check_outputs(lines, lambda out, reference: rel_error(out.float(), reference.float()), TOLERANCE)
    return lines


def main(argv: list[str] | None = None) -> None:
    from common import cell, environment, markdown_table, parse_named_rows, publish, speedup

    args = parse_named_rows(argv, "conv_folding.py", __doc__, "mobilenet_v3,resnet50", VARIANTS, 20,
                            "tiny models, torch on the CPU, ember through Triton's interpreter", smoke_reps=2)
    lines = [line for row in args.rows.split(",") for line in run_row(row, args)]

    body = [[line["row"], line["variant"], cell(line.get("ms")), speedup(lines, line, "torch eager"),
             speedup(lines, line, "ember.jit from_torch, fold off"), line.get("folded", "-"),
             str(line.get("kernels", "-")),
             cell(line.get("moved_mib"), "{:.1f}") if "moved_mib" in line else "-", line["check"]] for line in lines]
    table = markdown_table(["row", "variant", "ms per batch", "vs torch eager", "vs fold off", "convs folded",
                            "kernels", "MiB moved", "output check"], body)
    notes = ["eval-mode inference in float32 (batch norms on running statistics); the models imported by "
             "ember.from_torch",
             "convs folded: forward convolutions that took the per-channel affine after them, of all; MiB moved: what "
             "the plan's kernels read and write (vendor calls counted by their operands and results)",
             f"output check: relative error (Frobenius norm) against torch eager's, tolerance {TOLERANCE}"]
    results = args.results or (None if args.cpu_smoke else HERE / "RESULTS.md")
    publish(f"Convolution folding benchmark: {environment(args.cpu_smoke)}", table, notes, results)


if __name__ == "__main__":
    main()
