"""Host cost of building a lazy training step's graph, against PyTorch eager's whole step, on the CPU.

A plain loop (zero_grad, forward, MSE loss, backward, Adam step) over an MLP 64-64-64-64-64-16 with ReLUs, batch 8,
float32, on the cpu device. ember's step is timed in two parts: building its graph (everything up to the
optimizer's realize: forward, backward, the update's nodes) and evaluating it; PyTorch eager's step is timed whole
(torch.set_num_threads(1)). The target (issue 33): ember's graph building <= PyTorch eager's whole step. Also the
nodes a step builds, and, for the parts, each one's median.

    python benchmarks/host_build.py            # prints the table and appends it to RESULTS.md
    python benchmarks/host_build.py --no-record
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import numpy as np
import torch

import ember
from ember import nn
from ember.ir import toposort
from ember.optim import optimizer as optimizer_module

WIDTHS = [64, 64, 64, 64, 64, 16]


def mlp(lib):
    layers = []
    for a, b in zip(WIDTHS[:-1], WIDTHS[1:]):
        layers += [lib.Linear(a, b), lib.ReLU()]
    return lib.Sequential(*layers[:-1])


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((args.batch, WIDTHS[0]), np.float32), rng.standard_normal((args.batch, WIDTHS[-1]),
                                                                                           np.float32)

    model = mlp(torch.nn)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    torch_step = []
    for i in range(args.steps + 30):
        start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(tx), ty).backward()
        opt.step()
        if i >= 30:
            torch_step.append(time.perf_counter() - start)

    model = mlp(nn)
    opt = ember.optim.Adam(model.parameters(), lr=1e-3)
    ex, ey = ember.tensor(x), ember.tensor(y)
    parts: dict[str, list[float]] = {"zero_grad": [], "forward and loss": [], "backward": [], "optimizer's nodes": [],
                                     "evaluation (reference backend)": []}
    held: list = []
    realize = optimizer_module.realize
    optimizer_module.realize = lambda *tensors: held.extend(tensors)  # the step's realize, timed apart
    nodes = 0
    try:
        for i in range(args.steps + 30):
            t0 = time.perf_counter()
            opt.zero_grad()
            t1 = time.perf_counter()
            loss = nn.functional.mse_loss(model(ex), ey)
            t2 = time.perf_counter()
            loss.backward()
            t3 = time.perf_counter()
            opt.step()
            t4 = time.perf_counter()
            nodes = len(toposort([t._node for t in held] + [loss._node]))
            realize(*held, loss)
            t5 = time.perf_counter()
            held.clear()
            if i >= 30:
                for name, (a, b) in zip(parts, [(t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5)]):
                    parts[name].append(b - a)
    finally:
        optimizer_module.realize = realize
    build = [sum(p[k] for p in list(parts.values())[:4]) for k in range(args.steps)]
    rows = [("PyTorch eager, whole step", median_us(torch_step)),
            ("ember: building the step's graph", median_us(build))]
    rows += [(f"  {name}", median_us(v)) for name, v in parts.items()]
    ratio = median_us(build) / median_us(torch_step)
    lines = [f"## host_build: {datetime.date.today()}, {platform.processor() or platform.machine()}, "
             f"{torch.get_num_threads()} torch thread, torch {torch.__version__}, ember {ember.__version__}",
             "", f"MLP {'-'.join(map(str, WIDTHS))}, batch {args.batch}, float32, Adam, cpu device; median of "
             f"{args.steps} steps; the step's graph has {nodes} pending nodes at its realize", "",
             "| part | us |", "| --- | --- |", *(f"| {name} | {us:.0f} |" for name, us in rows), "",
             f"graph building / PyTorch eager step = {ratio:.2f} (target <= 1)", ""]
    print("\n".join(lines))
    if not args.no_record:
        with open("benchmarks/RESULTS.md", "a") as results:
            results.write("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
