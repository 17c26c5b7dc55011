"""Where the host time of a warm-cache step goes, by cProfile.

    python benchmarks/profile_host.py            # realizing a 50-kernel plan (benchmarks/fusion.py's chain)
    python benchmarks/profile_host.py lazy       # a plain lazy MLP training step (lazy_step.py's B2-like)
    python benchmarks/profile_host.py adam       # a lazy Adam step over 100 tensors (overhead.py's B3)
    python benchmarks/profile_host.py one        # a warm one-kernel realize (overhead.py's A2)
"""

import cProfile
import pstats
import sys
import time

import numpy as np
import torch

import ember

sys.path.insert(0, "benchmarks")
from fusion import chain_of_reductions  # noqa: E402


def chain():
    x = ember.tensor(torch.randn(64, 64).numpy(), device="cuda")
    return lambda: chain_of_reductions(ember, x).realize()


def lazy(widths=(64, 64, 64, 64, 64, 16), batch=2**18):
    ember.manual_seed(0)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [ember.nn.Linear(a, b), ember.nn.ReLU()]
    model = ember.nn.Sequential(*layers[:-1]).to("cuda").to(ember.float16)
    opt = ember.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)
    rng = np.random.default_rng(0)
    x, y = (ember.tensor(rng.standard_normal((batch, w), np.float32), device="cuda").to(ember.float16)
            for w in (widths[0], widths[-1]))

    def step():
        opt.zero_grad()
        ember.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return step


def adam(size=652):
    shapes = [(size, 3 * size // 2), (3 * size // 2,), (3 * size // 4, size // 2), (4 * size,)] * 25
    params = [ember.tensor(torch.randn(s).numpy(), device="cuda", requires_grad=True) for s in shapes]
    for p in params:
        p.grad = ember.tensor(torch.randn(p.shape).numpy(), device="cuda")
    return ember.optim.Adam(params, lr=1e-3).step


def one(size=1024):
    x = ember.tensor(torch.randn(size).numpy(), device="cuda")
    return lambda: (x * 1.5 + 0.5).relu().realize()


step = {"chain": chain, "lazy": lazy, "adam": adam, "one": one}[sys.argv[1] if len(sys.argv) > 1 else "chain"]()
for _ in range(30):
    step()
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(50):
    step()
torch.cuda.synchronize()
print(f"{(time.perf_counter() - start) / 50 * 1e3:.3f} ms per step, back to back, without the profiler")
profiler = cProfile.Profile()
profiler.enable()
for _ in range(50):
    step()
torch.cuda.synchronize()
profiler.disable()
stats = pstats.Stats(profiler)
stats.sort_stats("tottime").print_stats(25)
stats.sort_stats("cumulative").print_stats(40)
