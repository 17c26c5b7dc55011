"""What the benchmark scripts share: their command line and row loop, timers, tensors shared between
torch and ember, failure cells, the markdown table and the report appended to RESULTS.md.

A time is measured from the call until the GPU is done (CUDA events, the GPU idle when a step
starts), or with a host timer under --cpu-smoke, where torch runs on the CPU and ember's kernels
through Triton's interpreter so that every code path of a script runs without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import ember
from ember.device import as_device
from ember.ir import Node

RESULTS = Path(__file__).with_name("RESULTS.md")


def select_backend(cpu_smoke: bool, script: str) -> None:
    """Run ember's cuda device through Triton's interpreter under --cpu-smoke; otherwise insist on a GPU.
    Call before ember's cuda runtime is first imported (it reads EMBER_INTERPRET then)."""
    if cpu_smoke:
        os.environ["EMBER_INTERPRET"] = "1"
    elif os.environ.get("EMBER_INTERPRET", "0") not in ("", "0") or not torch.cuda.is_available():
        sys.exit(f"{script} times a CUDA GPU; without one (or with EMBER_INTERPRET=1), add --cpu-smoke")


@dataclass
class Options:
    """A benchmark script's command line, parsed: see parse_options."""

    args: argparse.Namespace  # the options; warmup and reps with their defaults filled in
    which: int  # the index into a script's (full, --quick, --cpu-smoke) sizes
    dev: str  # torch's device: "cuda", or "cpu" under --cpu-smoke
    results_file: Path | None  # where the report is appended (None: nowhere)
    cases: list[tuple[str, Any]]  # (row, what makes it) for every row, from the script's `cases`
    selected: list[str]  # the rows asked for (--rows), in the order given


def parse_options(argv: list[str] | None, script: str, doc: str,
                  cases: Callable[[int, str], Iterable[tuple[str, Any]]], *,
                  compile_smoke: str = "torch.compile with backend='eager'", rows_example: str = "1,3,5",
                  warmup_help: str = "warm-up steps per variant (default 3)",
                  add_options: Callable[[argparse.ArgumentParser], None] | None = None) -> Options:
    """Parse the options every benchmark script takes (--quick, --cpu-smoke, --rows, --warmup, --reps,
    --results) and any `add_options` adds, pick the backend (select_backend) and the sizes, make the rows
    with `cases(which, dev)` (a row may stand in several entries; --rows runs them all), check --rows
    against them and seed torch. `script` names the script in messages, `doc` is its docstring (its first
    line describes it in --help); `compile_smoke` says what torch.compile does under --cpu-smoke."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a fast smoke run on a GPU")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="no GPU: tiny sizes, torch on the CPU, ember through Triton's interpreter, "
                             f"{compile_smoke}, host timers")
    parser.add_argument("--rows", default=None, help=f"rows to run, e.g. {rows_example}")
    parser.add_argument("--warmup", type=int, default=None, help=warmup_help)
    parser.add_argument("--reps", type=int, default=None, help="timed steps per variant (default 20)")
    parser.add_argument("--results", type=Path, default=None,
                        help=f"markdown file to append to (default {RESULTS} for full-size GPU runs only)")
    if add_options is not None:
        add_options(parser)
    args = parser.parse_args(argv)
    select_backend(args.cpu_smoke, script)

    args.warmup = args.warmup if args.warmup is not None else 1 if args.cpu_smoke else 3
    args.reps = args.reps if args.reps is not None else 2 if args.cpu_smoke else 20
    which, dev = (2, "cpu") if args.cpu_smoke else (1 if args.quick else 0, "cuda")
    results_file = args.results or (None if args.quick or args.cpu_smoke else RESULTS)
    made = list(cases(which, dev))
    names = list(dict.fromkeys(row for row, _ in made))  # each row once, in order
    args.rows = args.rows if args.rows is not None else ",".join(names)
    selected = args.rows.split(",")
    if not set(selected) <= set(names):
        parser.error(f"--rows: no row {', '.join(sorted(set(selected) - set(names)))}; "
                     f"rows are {names[0]} to {names[-1]}")
    torch.manual_seed(0)
    return Options(args, which, dev, results_file, made, selected)


def parse_named_rows(argv: list[str] | None, script: str, doc: str, rows: str, variants: Iterable[str],
                     reps: int, smoke_help: str, smoke_reps: int | None = None,
                     add_options: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """Parse the options of a script whose rows are named models and whose columns are variants (--rows, --skip,
    --reps, --cpu-smoke, --results and any `add_options` adds) and pick the backend (select_backend): `args.dev`
    is the torch device, `args.skip` the set of variants left out; under --cpu-smoke `smoke_reps` (where given)
    replaces --reps. `rows` is the default, comma-separated; `smoke_help` says what --cpu-smoke runs."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--rows", default=rows, help=f"rows, comma-separated (default {rows})")
    parser.add_argument("--skip", default="", help=f"variants to leave out, comma-separated, of {tuple(variants)}")
    parser.add_argument("--reps", type=int, default=reps, help=f"timed repetitions per burst (default {reps})")
    parser.add_argument("--cpu-smoke", action="store_true", help=f"no GPU: {smoke_help}")
    parser.add_argument("--results", type=Path, default=None, help="markdown file to append to")
    if add_options is not None:
        add_options(parser)
    args = parser.parse_args(argv)
    select_backend(args.cpu_smoke, script)
    args.dev = "cpu" if args.cpu_smoke else "cuda"
    if args.cpu_smoke and smoke_reps is not None:
        args.reps = smoke_reps
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    return args


def for_each_case(opts: Options, run: Callable[[Any], object]) -> None:
    """Make each selected row (opts.cases: (row, a maker of its case)) and `run` it, one at a time to bound
    memory: a setup that fails is reported and skipped; what a case held is freed before the next is made."""
    for row, make in opts.cases:
        if row not in opts.selected:
            continue
        case = guarded(f"{row} setup", make)
        if case is None:
            continue
        print(f"row {case.row}: {case.name} ({case.shape})", flush=True)
        run(case)
        del case, make
        release_memory(opts.args.cpu_smoke)


def release_memory(cpu: bool) -> None:
    """Free what the last row held: torch.compile's graphs, garbage, and (on a GPU) torch's cached blocks."""
    torch._dynamo.reset()  # drop compiled graphs and the tensors their guards hold
    gc.collect()
    if not cpu:
        torch.cuda.empty_cache()


def to_ember(t: torch.Tensor, requires_grad: bool = False) -> ember.Tensor:
    """Share a torch buffer with ember (ember has no public zero-copy import from torch)."""
    node = Node.from_buffer(t.detach().contiguous(), ember.dtypes.as_dtype(t.dtype), as_device("cuda"))
    return ember.Tensor(node).requires_grad_(requires_grad)


def to_torch(t: ember.Tensor) -> torch.Tensor:
    return t._node.buffer.reshape(t.shape)


def training_step(F, model, optimizer, autocast: Callable[[], object] | None = None) -> Callable:
    """One step (forward, cross entropy, backward, update), for torch and ember alike (F: their functional
    module); `autocast` makes the context the forward pass runs in (None: none)."""
    def step(x, y):
        with autocast() if autocast is not None else contextlib.nullcontext():
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss
    return step


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in the Frobenius norm, in float64; NaN propagates, so it never passes."""
    ref = ref.detach().double()
    return ((out.detach().double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def chain_of_reductions(F, h, count: int = 50):
    """`count` reductions, alternating axes, so no two can share a kernel: a `count`-kernel plan."""
    for i in range(count):
        h = h - h.sum(i % 2, keepdim=True) * 0.01
    return h


def median_ms(step: Callable[[], object], warmup: int, reps: int, cpu: bool) -> float:
    """Median time of one step, from the call until the GPU is done, the GPU idle when it starts."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(max(reps, 1)):
        if cpu:
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
        else:
            torch.cuda.synchronize()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
    return statistics.median(times)


def sync(cpu: bool) -> None:
    if not cpu:
        torch.cuda.synchronize()


def loop_ms(step: Callable[[], object], warmup: int, reps: int, cpu: bool, bursts: int = 3) -> float:
    """Time per step of `reps` steps run back to back (median of `bursts` bursts), from the first call
    until the device is done."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(bursts):
        sync(cpu)
        start = time.perf_counter()
        for _ in range(max(reps, 1)):
            step()
        sync(cpu)
        times.append((time.perf_counter() - start) * 1e3 / max(reps, 1))
    return statistics.median(times)


def device_ms(step: Callable[[], object], warmup: int, reps: int) -> float:
    """Device time of one step: the summed durations of the GPU work it runs (kernels, copies, memsets, those
    replayed from CUDA graphs too), from the profiler; NaN where it saw none (no GPU). No launch overhead and
    no idle gaps between kernels, unlike median_ms."""
    if not torch.cuda.is_available():
        return math.nan  # the profiler refuses to record CUDA activity without a GPU
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(max(reps, 1)):
            step()
        torch.cuda.synchronize()
    # The device's own events, as the profiler table's "Self CUDA time total" counts them: a host event may
    # hold its kernels' times again, and a user annotation spans other device events.
    durations = [event.self_device_time_total for event in prof.events()
                 if event.device_type == DeviceType.CUDA and not event.is_user_annotation]
    return sum(durations) / 1e3 / max(reps, 1) if durations else math.nan


TOP_KERNELS = 8  # kernels named in a step's breakdown, the costliest first

# GPU kernels by who wrote them, from their names: ember's generated kernels are named ember_<kind>_<digest>
# (cuDNN's and FlashAttention's attention kernels before convolutions: their names hold "cudnn" and "fprop" too;
# nvjet_* are cuBLAS's Hopper GEMMs)
_KERNEL_KINDS = (("attention (torch)", ("sdpa", "flash", "fmha", "attention")),
                 ("cuDNN convolution", ("conv", "cudnn", "implicit_gemm", "dgrad", "wgrad", "fprop", "nhwc", "nchw")),
                 ("cuBLAS matmul", ("gemm", "cutlass", "cublas", "nvjet")),
                 ("copies, fills and foreach (torch)", ("copy", "memcpy", "memset", "fill", "multi_tensor_apply")))
COPIES = _KERNEL_KINDS[-1][0]


def kernel_kind(name: str) -> str:
    """The kind of a GPU kernel, from its name: "ember <kind>" for ember's generated ones."""
    if name.startswith("ember_"):
        return f"ember {name.split('_')[1]}"
    lowered = name.lower()
    return next((kind for kind, words in _KERNEL_KINDS if any(w in lowered for w in words)), "other (torch)")


def step_breakdown(step: Callable[[], object], reps: int) -> dict:
    """Where a warm step's time goes, on a GPU: "wall" ms per step (back to back, until the GPU is done),
    "host" ms per step (until the calls return, the GPU left to finish), "gpu" ms of device work per step, and
    "kinds": that device time by kernel kind (kernel_kind), with launch counts, "top": the kernels taking the
    most of it, by name, as (name, ms, launches), and "kernels": every kernel so, the costliest first. Device time
    well below the wall time means the host issues the work slower than the GPU runs it."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        step()
    host = (time.perf_counter() - start) * 1e3 / reps
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) * 1e3 / reps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    kinds: dict[str, list] = {}
    names: dict[str, list] = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA and not event.is_user_annotation:
            for table, key in ((kinds, kernel_kind(event.name)), (names, event.name)):
                entry = table.setdefault(key, [0.0, 0])
                entry[0] += event.self_device_time_total / 1e3 / reps
                entry[1] += 1 / reps
    ranked = sorted(((name, ms, count) for name, (ms, count) in names.items()), key=lambda item: -item[1])
    copies = [item for item in ranked if kernel_kind(item[0]) == COPIES][:TOP_KERNELS // 2]
    return {"wall": wall, "host": host, "gpu": sum(ms for ms, _ in kinds.values()), "kinds": kinds,
            "top": ranked[:TOP_KERNELS], "copies": copies, "kernels": ranked}


def breakdown_lines(label: str, b: dict) -> list[str]:
    """step_breakdown's result `b` for the variant named `label`, as report lines."""
    kinds = ", ".join(f"{kind} {ms:.2f} ms ({count:.0f} launches)" for kind, (ms, count) in
                      sorted(b["kinds"].items(), key=lambda item: -item[1][0]))
    def named(items):
        return "; ".join(f"{name[:90]} {ms:.2f} ms ({count:.0f})" for name, ms, count in items)
    lines = [f"{label}: wall {b['wall']:.2f} ms per step, host {b['host']:.2f} ms until the calls return, GPU busy "
             f"{b['gpu']:.2f} ms: {kinds}", f"{label}: the costliest kernels: {named(b.get('top', []))}"]
    if b.get("copies"):
        lines.append(f"{label}: the costliest of its {COPIES}: {named(b['copies'])}")
    return lines


def graph_gpu_ms(step: Callable[[], object], reps: int) -> float:
    """GPU time of one step alone: its launches captured in a CUDA graph, replays timed."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return median_ms(graph.replay, 3, reps, cpu=False)


def guarded(what: str, fn: Callable[[], object]):
    """Run `fn`; on failure print why to stderr and return None (the table then says "error")."""
    try:
        return fn()
    except Exception as e:  # a failing variant must not stop the other rows
        print(f"error in {what}: {type(e).__name__}: {str(e)[:500]}", file=sys.stderr)
        if os.environ.get("EMBER_BENCH_TRACEBACK"):
            traceback.print_exc()
        return None


def vision_model(row: str, smoke: bool):
    """A torchvision model in eval mode and a batch of float32 inputs, on the CPU: row "resnet50" (ResNet-50),
    "mobilenet_v3" (MobileNetV3-Large) or "vit_b_16" (ViT-B/16), batch 32 at 224x224; under --cpu-smoke (`smoke`)
    a small stand-in of each (ResNet-18, MobileNetV3-Small, a two-layer ViT) on two small images. The caller has the
    tests folder on its path (model_libraries)."""
    from model_libraries import library

    models = library("torchvision").models
    torch.manual_seed(0)
    if smoke:
        model = {"resnet50": lambda: models.resnet18(num_classes=10),
                 "mobilenet_v3": lambda: models.mobilenet_v3_small(num_classes=10),
                 "vit_b_16": lambda: models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                                              hidden_dim=32, mlp_dim=64, num_classes=10)}[row]()
        size, batch = (32 if row == "vit_b_16" else 64), 2
    else:
        model = {"resnet50": models.resnet50, "mobilenet_v3": models.mobilenet_v3_large,
                 "vit_b_16": models.vit_b_16}[row]()
        size, batch = 224, 32
    if row == "vit_b_16":  # torchvision starts the head at zero
        torch.nn.init.normal_(model.heads.head.weight, std=0.02)
    return model.eval(), torch.randn(batch, 3, size, size)


def check_outputs(lines: list[dict], error: Callable[[Any, Any], float], tolerance: float,
                  reference: str = "torch eager") -> None:
    """Turn each line's "output" into its "check" cell: "reference" for the `reference` variant's, else the `error` of
    the output against the reference's, marked FAIL above `tolerance` ("error" where either is missing). Lines are
    dicts with "row" and "variant"; the reference is the row's."""
    outputs = {line["row"]: line.get("output") for line in lines if line["variant"] == reference}
    for line in lines:
        out, expected = line.pop("output", None), outputs.get(line["row"])
        if line["variant"] == reference:
            line["check"] = "reference"
        elif out is not None and expected is not None:
            err = error(out, expected)
            line["check"] = f"{err:.1e}" + ("" if err <= tolerance else " FAIL")
        else:
            line["check"] = "error"


def speedup(lines: list[dict], line: dict, variant: str) -> str:
    """The cell of `line`'s speed-up over the variant of its row whose name starts with `variant` (from "ms")."""
    base = next((other.get("ms") for other in lines if other["row"] == line["row"] and
                 other["variant"].startswith(variant)), None)
    return cell(base / line["ms"] if base and line.get("ms") else None, "{:.2f}x")


def cell(value, fmt: str = "{:.4g}") -> str:
    return "error" if value is None else fmt.format(value)


def markdown_table(head: list[str], lines: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    rows = [head, ["-" * n for n in widths], *lines]
    return "\n".join("| " + " | ".join(str(x).ljust(n) for x, n in zip(r, widths)) + " |" for r in rows)


def environment(cpu: bool) -> str:
    import triton

    gpu = "CPU (--cpu-smoke: torch on the CPU, ember through Triton's interpreter)" if cpu else (
        torch.cuda.get_device_name())
    return (f"{datetime.date.today()}, {gpu}, torch {torch.__version__}, triton {triton.__version__}, "
            f"ember {ember.__version__}, CUDA {torch.version.cuda}")


def publish(title: str, table: str, notes: list[str], results_file: Path | None) -> None:
    """Print the report (a heading, the table, the notes) and append it to `results_file`, if any."""
    report = "\n".join([f"## {title}", "", table, "", *[f"- {n}" for n in notes], ""])
    print("\n" + report)
    if results_file is not None:
        with open(results_file, "a") as f:
            f.write(report + "\n")
        print(f"appended to {results_file}")


def gpu_cell(value: float | None, fmt: str = "{:.4f}") -> str:
    """A cell of a GPU-time column: "-" for NaN, which device_ms returns where there is no GPU."""
    return "-" if value is not None and math.isnan(value) else cell(value, fmt)
