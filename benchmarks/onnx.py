"""ONNX benchmark: torchvision models exported with torch.onnx.export and run for inference by onnxruntime (its CUDA
execution provider where installed, else its CPU one), by ember (`ember.from_onnx`, lazily and under ember.jit) and
by torch itself (eager and torch.compile), with time per batch and first-call time.

Rows (float32, batch 32 at 224x224):
 resnet50       torchvision's ResNet-50
 mobilenet_v3   torchvision's MobileNetV3-Large
 vit_b_16       torchvision's ViT-B/16

A batch is timed back to back (median of 3 bursts of --reps), from the first call until the GPU is done; "first
call" is a variant's first batch until its output is on the host (for ember: the import's graph building,
compilation and tuning; point EMBER_CACHE_DIR and TRITON_CACHE_DIR at empty directories for a cold start). Every
variant's output is checked against torch eager's (relative error, max norm).

    python benchmarks/onnx.py                        # on a CUDA GPU, appended to RESULTS.md
    python benchmarks/onnx.py --rows resnet50 --reps 50
    python benchmarks/onnx.py --cpu-smoke            # no GPU: tiny models on the cpu (ember's reference backend)
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
# This script's name is the onnx package's: its folder goes last on the path, so that `import onnx` finds the package.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != HERE] + [str(HERE), str(HERE.parent / "tests")]

VARIANTS = ("torch eager", "torch.compile", "onnxruntime", "ember from_onnx", "ember.jit from_onnx")
ROWS = ("resnet50", "mobilenet_v3", "vit_b_16")
TOLERANCE = 1e-3  # relative; TF32 may be on for the GPU variants


def export(model, x, folder: str, row: str) -> str:
    path = str(Path(folder) / f"{row}.onnx")
    torch.onnx.export(model, (x,), path, dynamo=False, opset_version=18)
    return path


def sync(smoke: bool) -> None:
    if not smoke:
        torch.cuda.synchronize()


def measure(run, smoke: bool, reps: int) -> dict:
    """First-call time, then the median time per batch of 3 bursts; `run()` returns the output as NumPy when asked
    (`run(host=True)`), else whatever keeps it on the device."""
    start = time.perf_counter()
    output = run(host=True)
    first = time.perf_counter() - start
    run()
    times = []
    for _ in range(3):
        sync(smoke)
        start = time.perf_counter()
        for _ in range(reps):
            run()
        sync(smoke)
        times.append((time.perf_counter() - start) * 1e3 / reps)
    return {"first_s": first, "ms": statistics.median(times), "output": output}


def torch_runner(model, x, compiled: bool, smoke: bool):
    model = model.to(x.device)
    forward = torch.compile(model, backend="eager" if smoke else "inductor") if compiled else model

    def run(host: bool = False):
        with torch.no_grad():
            out = forward(x)
        return out.cpu().numpy() if host else out
    return run


def onnxruntime_runner(path: str, x):
    import onnxruntime

    available = onnxruntime.get_available_providers()
    provider = "CUDAExecutionProvider" if x.is_cuda and "CUDAExecutionProvider" in available else \
        "CPUExecutionProvider"
    session = onnxruntime.InferenceSession(path, providers=[provider])
    name = session.get_inputs()[0].name
    if provider == "CUDAExecutionProvider":  # inputs and outputs stay on the GPU (I/O binding)
        binding = session.io_binding()
        binding.bind_input(name, "cuda", 0, np.float32, list(x.shape), x.data_ptr())
        binding.bind_output(session.get_outputs()[0].name, "cuda")

        def run(host: bool = False):
            session.run_with_iobinding(binding)
            return binding.copy_outputs_to_cpu()[0] if host else None
    else:
        feed = {name: x.cpu().numpy()}

        def run(host: bool = False):
            return session.run(None, feed)[0]
    return run, provider


def ember_runner(path: str, x, jitted: bool, smoke: bool):
    from common import to_ember

    import ember

    module = ember.from_onnx(path, device="cpu" if smoke else "cuda")
    ex = ember.tensor(x.numpy()) if smoke else to_ember(x)

    def forward(t):
        with ember.no_grad():
            return module(t)
    step = ember.jit(forward) if jitted else forward

    def run(host: bool = False):
        out = step(ex)
        if host:
            return out.numpy()
        ember.realize(out)
        return out
    return run


def run_row(row: str, args) -> list[dict]:
    from common import check_outputs, guarded, release_memory, vision_model

    model, x_cpu = vision_model(row, args.cpu_smoke)
    x = x_cpu.to(args.dev)
    lines = []
    with tempfile.TemporaryDirectory() as folder:
        path = guarded(f"{row} export", lambda: export(model, x_cpu, folder, row))
        for variant in VARIANTS:
            if variant in args.skip or (path is None and "torch" not in variant):
                continue
            print(f"  {row}: {variant}", flush=True)
            label = variant
            if variant.startswith("torch"):
                run = guarded(f"{row} {variant} (setup)",
                              lambda v=variant: torch_runner(model, x, v == "torch.compile", args.cpu_smoke))
            elif variant == "onnxruntime":
                made = guarded(f"{row} onnxruntime (setup)", lambda: onnxruntime_runner(path, x))
                run, label = (made[0], f"onnxruntime {made[1]}") if made else (None, variant)
            else:
                run = guarded(f"{row} {variant} (setup)",
                              lambda v=variant: ember_runner(path, x, v.startswith("ember.jit"), args.cpu_smoke))
            result = guarded(f"{row} {variant}", lambda r=run: measure(r, args.cpu_smoke, args.reps)) if run else None
            lines.append({"row": row, "variant": label, **(result or {})})
            release_memory(args.cpu_smoke)
    check_outputs(lines, lambda out, reference: float(np.abs(out - reference).max() / np.abs(reference).max()),
                  TOLERANCE)
    return lines


def main(argv: list[str] | None = None) -> None:
    from common import cell, environment, markdown_table, parse_named_rows, publish, speedup

    args = parse_named_rows(argv, "onnx.py", __doc__, ",".join(ROWS), VARIANTS, 20,
                            "tiny models on the cpu (ember's reference backend, onnxruntime's CPU provider, "
                            "torch.compile with backend='eager')", smoke_reps=2)
    lines = []
    for row in args.rows.split(","):
        lines += run_row(row, args)

    body = [[line["row"], line["variant"], cell(line.get("ms")), speedup(lines, line, "torch eager"),
             speedup(lines, line, "onnxruntime"), cell(line.get("first_s"), "{:.3g}"), line["check"]] for line in lines]
    table = markdown_table(["row", "variant", "ms per batch", "vs torch eager", "vs onnxruntime", "first call s",
                            "output check"], body)
    notes = ["inference in float32; the models exported by torch.onnx.export (TorchScript exporter, opset 18)",
             *(["--cpu-smoke: ember runs on its cpu device (the reference backend), not the interpreter"]
               if args.cpu_smoke else []),
             f"output check: relative error (max norm) against torch eager's, tolerance {TOLERANCE}"]
    results = args.results or (None if args.cpu_smoke else HERE / "RESULTS.md")
    publish(f"ONNX benchmark: {environment(args.cpu_smoke)}", table, notes, results)


if __name__ == "__main__":
    main()
