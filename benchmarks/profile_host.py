"""Where the host time of a warm-cache step goes: cProfile of realizing a 50-kernel plan."""

import cProfile
import pstats
import sys

import torch

import ember

sys.path.insert(0, "benchmarks")
from fusion import chain_of_reductions  # noqa: E402

x = ember.tensor(torch.randn(64, 64).numpy(), device="cuda")
for _ in range(3):
    chain_of_reductions(ember, x).realize()
torch.cuda.synchronize()
profiler = cProfile.Profile()
profiler.enable()
for _ in range(20):
    chain_of_reductions(ember, x).realize()
torch.cuda.synchronize()
profiler.disable()
pstats.Stats(profiler).sort_stats("tottime").print_stats(14)
