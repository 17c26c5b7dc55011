"""The GPU runtime on a real device (`pytest -m gpu`): CUDA-graph replays, streams, memory, OOM."""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
import torch

import ember
import ember.nn as nn
import ember.nn.functional as F
from ember.runtime import cuda, plan_cache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("EMBER_INTERPRET", "0") != "0",
                       reason="needs a CUDA GPU (and EMBER_INTERPRET unset)"),
]


def make(dtype=ember.float32, dropout=0.0, width=256):
    ember.manual_seed(0)
    layers = [nn.Linear(64, width), nn.ReLU()] + ([nn.Dropout(dropout)] if dropout else []) + [nn.Linear(width, 10)]
    model = nn.Sequential(*layers).to("cuda").to(dtype)
    opt = ember.optim.Adam(model.parameters(), lr=1e-3)

    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        return loss
    return model, step


def batches(n, dtype=ember.float32, batch=128):
    rng = np.random.default_rng(0)
    for _ in range(n):
        yield (ember.tensor(rng.standard_normal((batch, 64)).astype(np.float32), device="cuda").to(dtype),
               ember.tensor(rng.integers(0, 10, batch), device="cuda"))


@pytest.mark.parametrize("dtype", [ember.float32, ember.bfloat16])
def test_cuda_graph_replay_equals_running_the_python(dtype):
    model, step = make(dtype)
    expected = [step(x, y).item() for x, y in batches(8, dtype)]
    expected_params = [p.numpy() for p in model.parameters()]
    model, step = make(dtype)
    jitted = ember.jit(step)
    got = [jitted(x, y).item() for x, y in batches(8, dtype)]
    assert jitted.stats["replays"] == 6 and jitted.why_not_replayed == []  # replayed as a CUDA graph
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    for a, b in zip((p.numpy() for p in model.parameters()), expected_params):
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=1e-6, atol=1e-7)


def test_a_graph_per_argument_buffer_then_copies():
    """Staging buffers that come back replay their own CUDA graphs without a copy; past GRAPHS_KEPT buffers
    alive at once, arguments are copied into the program's own (and replay a graph of their own)."""
    jit_module = importlib.import_module("ember.jit")  # the module, not the function ember exports

    model, step = make()
    data = list(batches(jit_module.GRAPHS_KEPT + 3))
    expected = [step(x, y).item() for x, y in data * 2]
    model, step = make()
    jitted = ember.jit(step)
    got = [jitted(x, y).item() for x, y in data * 2]
    (entry,) = jitted._entries.values()
    assert jitted.why_not_replayed == [] and len(entry.program.graphs) == jit_module.GRAPHS_KEPT + 1
    assert entry.program.own_arguments is not None
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_two_staging_buffers_replay_two_graphs():
    model, step = make()
    data = list(batches(2))
    expected = [step(x, y).item() for x, y in data * 5]
    model, step = make()
    jitted = ember.jit(step)
    losses = [jitted(x, y) for x, y in data * 5]  # every loss kept: result buffers alternate, then copy
    (entry,) = jitted._entries.values()
    assert len(entry.program.graphs) <= 4 and entry.program.own_arguments is None
    np.testing.assert_allclose([loss.item() for loss in losses], expected, rtol=1e-6)


def test_dropout_steps_replay_as_cuda_graphs_with_fresh_masks():
    model, step = make(dropout=0.3)
    expected = [step(x, y).item() for x, y in batches(6)]
    model, step = make(dropout=0.3)
    jitted = ember.jit(step)
    got = [jitted(x, y).item() for x, y in batches(6)]
    (entry,) = jitted._entries.values()
    assert jitted.stats["replays"] == 4 and jitted.why_not_replayed == [] and entry.program.graphs
    np.testing.assert_allclose(got, expected, rtol=1e-6)  # each replay drew the masks the Python draws


@pytest.mark.parametrize("use_jit", [False, True])
def test_ten_thousand_steps_keep_memory_flat(use_jit):
    model, step = make(width=128)
    if use_jit:
        step = ember.jit(step)
    data = list(batches(4, batch=64))
    for i in range(10_000):
        x, y = data[i % 4]
        loss = step(x, y)
        if i == 200:
            torch.cuda.synchronize()
            settled = torch.cuda.memory_allocated()
    torch.cuda.synchronize()
    assert np.isfinite(loss.item())
    assert torch.cuda.memory_allocated() <= settled + 64 * 1024


def test_two_streams_compute_what_one_does():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((64, 2048)).astype(np.float32), rng.standard_normal((32, 4096)).astype(np.float32)

    def branches():
        x, y = ember.tensor(a, device="cuda"), ember.tensor(b, device="cuda")
        return [t.numpy() for t in ((x.softmax(-1) * 2).sum(0), (y.exp() + 1).log().sum(1))]

    previous = cuda.max_streams
    try:
        cuda.max_streams = 1
        one = branches()
        cuda.max_streams = 2
        plan_cache.clear()
        two = branches()
    finally:
        cuda.max_streams = previous
    for p, q in zip(one, two):
        np.testing.assert_array_equal(p, q)


def test_out_of_memory_is_an_ember_error_and_the_process_goes_on():
    free, _ = torch.cuda.mem_get_info()
    too_big = free // 4 * 2  # float32 elements: twice the free bytes
    with pytest.raises(ember.OutOfMemoryError, match="asked .* MiB free of"):
        (ember.ones(too_big, device="cuda") * 2).numpy()  # the result alone cannot fit
    assert (ember.ones(1024, device="cuda") * 2).sum().item() == 2048


def test_memory_stats_report_the_device():
    x = ember.randn(1024, 1024, device="cuda")
    (x * 2).sum().item()
    stats = ember.memory_stats()
    assert stats["allocated"] >= 4 * 1024 * 1024
    assert stats["peak"] >= stats["allocated"]
    assert stats["cached"] >= stats["allocated"]


def test_direct_launches_follow_pointer_alignment_and_scalars():
    """A warm launch skips Triton's binding and keeps one compiled kernel per specialization class: buffers
    at 4-byte offsets (not 16-byte aligned) and back, and changed runtime scalars, all give torch's values."""
    from ember.runtime import launcher

    base = torch.randn(4099, device="cuda")
    for start, scale in [(0, 1.5), (1, 1.5), (4, 2.25), (0, 0.1), (3, 1.0), (1, -0.7)]:
        t = base[start:start + 4000]
        got = (ember.from_dlpack(t) * scale + 0.25).relu()
        np.testing.assert_allclose(got.numpy(), (t * scale + 0.25).relu().cpu().numpy(), rtol=1e-6, atol=1e-6)
    prepared = [steps for p in plan_cache._plans.values()
                if (steps := getattr(plan_cache.prepared(p), "steps", None))]
    classes = {len(launch._kernels) for steps in prepared for step in steps
               if isinstance(step, launcher._KernelStep) for launch in step.launches}
    assert max(classes) >= 2  # aligned and unaligned pointers ran different kernels
