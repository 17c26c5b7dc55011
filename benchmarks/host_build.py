"""Host cost of building a lazy training step's graph, against PyTorch eager's whole step, on the CPU.

A plain loop (zero_grad, forward, loss, backward, optimizer step) on the cpu device, float32, one workload at a time:

  mlp     an MLP 64-64-64-64-64-16 with ReLUs, batch 8, MSE, Adam (the issue 33 target row)
  gpt     a GPT of 2 blocks (gpt.py's model: pre-norm, causal attention written out, GELU MLP), width 32,
          4 heads, T 16, batch 2, vocabulary 64, cross entropy, AdamW
  resnet  ResNet-18's layout (benchmarks/cnn.py) with widths 8, 8x8 images, batch 2, cross entropy, SGD momentum

ember's step is timed in parts: building its graph (everything up to the optimizer's realize: zero_grad, forward
and loss, backward, the update's nodes) and evaluating it; PyTorch eager's step is timed whole
(torch.set_num_threads(1)). The target (issue 33): ember's graph building <= PyTorch eager's whole step. Also the
nodes a step's graph has at its realize.

    python benchmarks/host_build.py                       # every workload; appends the tables to RESULTS.md
    python benchmarks/host_build.py --workloads mlp --no-record
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import ember
from ember.ir import toposort
from ember.optim import optimizer as optimizer_module

sys.path.insert(0, str(Path(__file__).parent))
import cnn  # noqa: E402
from gpt import model as gpt_model  # noqa: E402

WIDTHS = [64, 64, 64, 64, 64, 16]
VOCAB, WIDTH, HEADS, BLOCKS, T = 64, 32, 4, 2, 16


def mlp(lib):
    layers = []
    for a, b in zip(WIDTHS[:-1], WIDTHS[1:]):
        layers += [lib.nn.Linear(a, b), lib.nn.ReLU()]
    return lib.nn.Sequential(*layers[:-1])


def gpt(lib):
    """A small GPT written once for torch and ember (gpt.py's model)."""
    return gpt_model(lib, VOCAB, WIDTH, HEADS, BLOCKS, T)


def resnet(lib):
    return cnn.resnet18(lib.nn, 8, (8, 8, 8, 8), "cpu", lib.float32)


def _tokens(lib, y):
    return lib.tensor(y).reshape(-1)


# name: (description, model maker, optimizer maker, input, target, loss, steps)
WORKLOADS = {
    "mlp": (f"MLP {'-'.join(map(str, WIDTHS))}, batch 8, float32, MSE, Adam", mlp,
            lambda lib, ps: lib.optim.Adam(ps, lr=1e-3),
            lambda rng: rng.standard_normal((8, WIDTHS[0]), np.float32),
            lambda rng: rng.standard_normal((8, WIDTHS[-1]), np.float32), "mse_loss", 300),
    "gpt": (f"GPT {BLOCKS} blocks, width {WIDTH}, {HEADS} heads, T {T}, batch 2, vocabulary {VOCAB}, float32, "
            "cross entropy, AdamW", gpt, lambda lib, ps: lib.optim.AdamW(ps, lr=1e-3),
            lambda rng: rng.integers(0, VOCAB, (2, T)), lambda rng: rng.integers(0, VOCAB, 2 * T),
            "cross_entropy", 60),
    "resnet": ("ResNet-18 layout, widths 8, 8x8 images, batch 2, float32, cross entropy, SGD momentum 0.9", resnet,
               lambda lib, ps: lib.optim.SGD(ps, lr=0.1, momentum=0.9),
               lambda rng: rng.standard_normal((2, 3, 8, 8), np.float32), lambda rng: rng.integers(0, 10, 2),
               "cross_entropy", 20),
}
PARTS = ("zero_grad", "forward and loss", "backward", "optimizer's nodes", "evaluation (reference backend)")


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def setup(lib, name: str) -> tuple:
    """The workload in `lib` (torch or ember), from the same seeds: model, optimizer, inputs, targets, loss."""
    _, make, make_opt, x, y, loss, _ = WORKLOADS[name]
    lib.manual_seed(0)
    rng = np.random.default_rng(0)
    model = make(lib)
    as_tensor = torch.from_numpy if lib is torch else ember.tensor
    return (model, make_opt(lib, model.parameters()), as_tensor(x(rng)), as_tensor(y(rng)),
            getattr(lib.nn.functional, loss))


def torch_step_us(name: str, steps: int, warm: int) -> float:
    model, opt, tx, ty, loss_fn = setup(torch, name)
    times = []
    for i in range(steps + warm):
        start = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(tx), ty).backward()
        opt.step()
        if i >= warm:
            times.append(time.perf_counter() - start)
    return median_us(times)


def ember_parts_us(name: str, steps: int, warm: int) -> tuple[dict[str, float], float, int]:
    """The median of each part of ember's step, of the graph building (the first four parts together), and the
    nodes of the step's graph at its realize."""
    model, opt, ex, ey, loss_fn = setup(ember, name)
    parts: dict[str, list[float]] = {p: [] for p in PARTS}
    builds: list[float] = []
    held: list = []
    realize = optimizer_module.realize
    optimizer_module.realize = lambda *tensors: held.extend(tensors)  # the step's realize, timed apart
    nodes = 0
    try:
        for i in range(steps + warm):
            t0 = time.perf_counter()
            opt.zero_grad()
            t1 = time.perf_counter()
            value = loss_fn(model(ex), ey)
            t2 = time.perf_counter()
            value.backward()
            t3 = time.perf_counter()
            opt.step()
            t4 = time.perf_counter()
            nodes = len(toposort([t._node for t in held] + [value._node]))
            realize(*held, value)
            t5 = time.perf_counter()
            held.clear()
            if i >= warm:
                for part, (a, b) in zip(PARTS, [(t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5)]):
                    parts[part].append(b - a)
                builds.append(t4 - t0)
    finally:
        optimizer_module.realize = realize
    return {p: median_us(v) for p, v in parts.items()}, median_us(builds), nodes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"some of {', '.join(WORKLOADS)}")
    parser.add_argument("--steps", type=float, default=1.0, help="a multiple of each workload's step count")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = [f"## host_build: {datetime.date.today()}, {platform.processor() or platform.machine()}, "
             f"{torch.get_num_threads()} torch thread, torch {torch.__version__}, ember {ember.__version__}", ""]
    for name in args.workloads.split(","):
        description, *_, count = WORKLOADS[name]
        steps = max(3, int(count * args.steps))
        warm = max(2, steps // 10)
        eager = torch_step_us(name, steps, warm)
        parts, build, nodes = ember_parts_us(name, steps, warm)
        rows = [("PyTorch eager, whole step", eager), ("ember: building the step's graph", build)]
        rows += [(f"  {part}", us) for part, us in parts.items()]
        lines += [f"{description}, cpu device; median of {steps} steps; the step's graph has {nodes} pending "
                  "nodes at its realize", "", "| part | us |", "| --- | --- |",
                  *(f"| {part} | {us:.0f} |" for part, us in rows), "",
                  f"graph building / PyTorch eager step = {build / eager:.2f} (target <= 1)", ""]
    print("\n".join(lines))
    if not args.no_record:
        with open("benchmarks/RESULTS.md", "a") as results:
            results.write("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
