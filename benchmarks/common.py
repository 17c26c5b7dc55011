"""What the benchmark scripts share: timers, tensors shared between torch and ember, failure cells,
the markdown table and the report appended to RESULTS.md.

A time is measured from the call until the GPU is done (CUDA events, the GPU idle when a step
starts), or with a host timer under --cpu-smoke, where torch runs on the CPU and ember's kernels
through Triton's interpreter so that every code path of a script runs without a GPU.
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

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


def to_ember(t: torch.Tensor, requires_grad: bool = False) -> ember.Tensor:
    """Share a torch buffer with ember (ember has no public zero-copy import from torch)."""
    node = Node.from_buffer(t.detach().contiguous(), ember.dtypes.as_dtype(t.dtype), as_device("cuda"))
    return ember.Tensor(node).requires_grad_(requires_grad)


def to_torch(t: ember.Tensor) -> torch.Tensor:
    return t._node.buffer.reshape(t.shape)


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
