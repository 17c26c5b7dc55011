"""Where a lazy training step's host time goes on a GPU, for MLP training steps like overhead.py's B1 and B2,
and an Adam step over 100 tensors like its B3.

A plain loop (zero_grad, forward, MSE loss, backward, Adam step), no ember.jit, 30 warm-up steps, then the median
over 90 steps of: building the forward and backward graph; the host time of the whole step (call to return,
the optimizer's realize launching the plan included); and the step with the GPU done (a synchronize before and
after each step). The Adam row times `opt.step()` alone (gradients set once), beside torch.optim.Adam(foreach=True)
timed the same way. Runs against whichever ember is on PYTHONPATH, so two trees compare in one session.

    PYTHONPATH=src python benchmarks/lazy_step.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

import ember
from ember import nn

WORKLOADS = [  # name, widths, batch, dtype
    ("B2-like: MLP 64-64-64-64-64-16, fp16", [64, 64, 64, 64, 64, 16], 2**18, "float16"),
    ("B1-like: MLP 784-2048-2048-10, bf16", [784, 2048, 2048, 10], 4096, "bfloat16"),
]


def run(widths: list[int], batch: int, dtype: str, steps: int = 120, warm: int = 30) -> tuple[float, float, float]:
    ember.manual_seed(0)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers[:-1]).to("cuda").to(getattr(ember, dtype))
    opt = ember.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)
    rng = np.random.default_rng(0)
    x, y = (ember.tensor(rng.standard_normal((batch, w), np.float32), device="cuda").to(getattr(ember, dtype))
            for w in (widths[0], widths[-1]))
    build, host, step = [], [], []
    for i in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        if i >= warm:
            build.append(t1 - t0)
            host.append(t2 - t0)
            step.append(t3 - t0)
    return tuple(statistics.median(v) * 1e3 for v in (build, host, step))


def adam_shapes(count: int = 100, total: int = 20_000_000) -> list[tuple[int, ...]]:
    """`count` tensor shapes of about `total` elements together, matrices and vectors of varied sizes."""
    rng = np.random.default_rng(0)
    weights = rng.uniform(0.2, 1.8, count)
    sizes = (weights / weights.sum() * total).astype(int)
    return [(int(n),) if k % 4 == 3 else (max(1, int(n) // 512), 512) for k, n in enumerate(sizes)]


def timed(step, steps: int = 120, warm: int = 30) -> tuple[float, float]:
    host, done = [], []
    for i in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= warm:
            host.append(t1 - t0)
            done.append(t2 - t0)
    return statistics.median(host) * 1e3, statistics.median(done) * 1e3


def adam_rows() -> list[tuple[str, float, float]]:
    rng = np.random.default_rng(1)
    values = [rng.standard_normal(shape, np.float32) * 0.1 for shape in adam_shapes()]
    params = [torch.tensor(v, device="cuda", requires_grad=True) for v in values]
    for p in params:
        p.grad = torch.randn_like(p)
    torch_opt = torch.optim.Adam(params, lr=1e-3, foreach=True)
    rows = [("torch eager, foreach", *timed(torch_opt.step))]
    ours = [ember.tensor(v, device="cuda", requires_grad=True) for v in values]
    for p in ours:
        p.grad = ember.randn(*p.shape, device="cuda")
    ember.realize(*[p.grad for p in ours])
    opt = ember.optim.Adam(ours, lr=1e-3)
    rows.append(("ember lazy", *timed(opt.step)))
    return rows


def main() -> None:
    print(f"lazy_step: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| workload | forward+backward build ms | host ms | step ms |")
    print("| --- | --- | --- | --- |")
    for name, widths, batch, dtype in WORKLOADS:
        build, host, step = run(widths, batch, dtype)
        print(f"| {name} x {batch} | {build:.3f} | {host:.3f} | {step:.3f} |")
    count = sum(int(np.prod(s)) for s in adam_shapes())
    for name, host, step in adam_rows():
        print(f"| Adam step, 100 tensors, {count / 1e6:.1f}M f32: {name} | - | {host:.3f} | {step:.3f} |")


if __name__ == "__main__":
    main()
