"""Training end to end: the digits example learns, and a long loop holds no history."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import ember
import ember.nn.functional as F
from ember.data import DataLoader
from ember.examples import digits
from ember.ir import Node


def live_nodes() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is Node)


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import resource

    return pages * resource.getpagesize()


@pytest.mark.slow
def test_digits_example_reaches_95_percent_test_accuracy():
    summary = digits.train(epochs=30, progress=False)
    assert summary.accuracy >= 0.95, str(summary)
    assert summary.steps == 30 * 23
    assert summary.step_plan is not None and 0 < len(summary.step_plan.kernels) < summary.step_plan.unfused


@pytest.mark.slow
def test_two_thousand_training_steps_keep_graph_and_memory_bounded():
    (x, y), _ = digits.load_digits_split()
    ember.manual_seed(0)
    model = digits.make_model(64)
    optimizer = ember.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader((x, y), batch_size=64, shuffle=True, seed=0)
    steps, nodes, memory = 0, [], []
    while steps < 2000:
        for xb, yb in loader:
            loss = F.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
            if steps in (200, 2000):
                nodes.append(live_nodes())
                memory.append(resident_bytes())
            if steps == 2000:
                break
    assert np.isfinite(loss.item())
    assert nodes[1] <= nodes[0] + 10, f"live graph nodes grew from {nodes[0]} to {nodes[1]}"
    assert memory[1] - memory[0] < 32 * 2**20, f"resident memory grew by {(memory[1] - memory[0]) / 2**20:.1f} MiB"


def test_the_loss_is_computed_with_the_optimizer_step_not_again(monkeypatch):
    from ember.compiler.targets import reference

    model = digits.make_model(16)
    optimizer = ember.optim.SGD(model.parameters(), lr=0.1)
    x = ember.randn(8, 64)
    y = ember.randint(0, 10, (8,))
    ember.realize(x, y)
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    calls = []
    monkeypatch.setattr(reference, "evaluate", lambda *a: calls.append(a))
    assert np.isfinite(loss.item())
    assert calls == []


def test_a_step_on_the_cuda_backend_matches_the_reference(cuda_backend):
    (x, y), _ = digits.load_digits_split()
    results = []
    for device in ("cpu", "cuda"):
        ember.manual_seed(3)
        with ember.device(device):
            model = digits.make_model(32)
        optimizer = ember.optim.Adam(model.parameters(), lr=1e-2)
        for start in (0, 64):
            xb = ember.tensor(x[start:start + 64], device=device)
            yb = ember.tensor(y[start:start + 64], device=device)
            loss = F.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        results.append([p.numpy() for p in model.parameters()] + [loss.numpy()])
    for fused, reference in zip(*results):
        np.testing.assert_allclose(fused, reference, rtol=1e-4, atol=1e-5)
