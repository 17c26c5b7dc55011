"""The schedule: intermediates share an arena by lifetime; independent small kernels run side by side."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import ember
from ember.compiler import schedule
from ember.ir import toposort
from ember.runtime import cuda, plan_cache

pytestmark = pytest.mark.usefixtures("cuda_backend")


def planned(*tensors):
    nodes = [t._node for t in tensors]
    order = toposort(nodes)
    plan, _ = plan_cache.plan_for(order, {id(n) for n in nodes})
    return plan


def lifetimes(plan):
    """(first, last) launch position of every arena slot, a parallel group counting as one position."""
    time = list(range(len(plan.kernels)))
    for start, stop in plan.schedule.groups:
        for p in range(start, stop):
            time[p] = start
    span = {}
    for position, ck in enumerate(plan.kernels):
        for n in ck.kernel.outputs:
            if id(n) in plan.schedule.slots:
                span[id(n)] = (time[position], time[position])
        for n in ck.kernel.reads:
            if id(n) in span:
                span[id(n)] = (span[id(n)][0], time[position])
    return span


def chain_of_reductions(x, depth=6):
    """Each normalisation reads the previous one through a reduction, so every stage is stored."""
    for _ in range(depth):
        x = x - x.max(dim=1, keepdim=True).values
        x = x.exp() / x.exp().sum(dim=0, keepdim=True)
    return x


def deep_mlp(x, depth=8):
    """Every layer's product and activation is stored (a matmul reads stored operands; layers 160 wide are
    too wide to chain into one MLP kernel)."""
    weights = [ember.randn(x.shape[-1], 160, device=x.device) * 0.1] + [
        ember.randn(160, 160, device=x.device) * 0.1 for _ in range(depth - 1)]
    ember.realize(*weights)
    for w in weights:
        x = (x @ w).relu()
    return x


@pytest.mark.slow
def test_intermediates_share_an_arena_far_smaller_than_their_sum():
    plan = planned(deep_mlp(ember.randn(64, 64, device="cuda")))
    sched = plan.schedule
    assert len(sched.slots) >= 6
    # a chain of layers needs two intermediates alive at a time: the arena holds two, not all of them
    assert sched.arena_bytes <= 2 * max(size for _, size in sched.slots.values()) < sched.intermediate_bytes / 3


def test_slots_sharing_memory_never_live_at_the_same_time():
    x = ember.randn(64, 96, device="cuda")
    branches = [chain_of_reductions(x * k, depth=3) for k in (1.0, 2.0, 3.0)]
    plan = planned(*branches)
    span = lifetimes(plan)
    slots = list(plan.schedule.slots.items())
    for i, (a, (offset_a, size_a)) in enumerate(slots):
        for b, (offset_b, size_b) in slots[i + 1:]:
            if offset_a < offset_b + size_b and offset_b < offset_a + size_a:  # they share bytes
                (start_a, end_a), (start_b, end_b) = span[a], span[b]
                assert end_a < start_b or end_b < start_a
            assert offset_a % schedule.ALIGN == 0


@pytest.mark.slow
def test_results_through_the_arena_equal_the_reference():
    data = np.random.default_rng(1).standard_normal((64, 96)).astype(np.float32)
    expected = chain_of_reductions(ember.tensor(data)).numpy()
    got = chain_of_reductions(ember.tensor(data, device="cuda")).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_independent_small_kernels_form_a_parallel_group(monkeypatch):
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((8, 300)).astype(np.float32), rng.standard_normal((16, 200)).astype(np.float32)

    def branches(device):
        x, y = ember.tensor(a, device=device), ember.tensor(b, device=device)
        return (x.softmax(-1) * 2).sum(0), (y.exp() + 1).log().sum(1)

    monkeypatch.setattr(cuda, "max_streams", 2)
    plan = planned(*branches("cuda"))
    assert plan.schedule.groups and plan.schedule.parallel_kernels >= 2
    assert len(set(plan.schedule.streams)) == 2
    for got, expected in zip(branches("cuda"), branches("cpu")):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)

    monkeypatch.setattr(cuda, "max_streams", 1)
    plan_cache.clear()
    assert not planned(*branches("cuda")).schedule.groups


def test_explain_reports_the_arena_and_the_streams():
    x = ember.randn(64, 96, device="cuda")
    text = str(ember.explain.plan(chain_of_reductions(x)))
    assert "share an arena of" in text


@pytest.mark.slow
def test_memory_stats_follow_what_is_allocated():
    before = ember.memory_stats("cuda")
    x = ember.randn(512, 512, device="cuda") * 2
    ember.realize(x)
    during = ember.memory_stats("cuda")
    assert during["allocated"] >= before["allocated"] + 512 * 512 * 4
    assert during["peak"] >= during["allocated"]
    del x
    gc.collect()
    assert ember.memory_stats("cuda")["allocated"] <= during["allocated"] - 512 * 512 * 4
    with pytest.raises(ember.DeviceError, match="memory_stats"):
        ember.memory_stats("cpu")


@pytest.mark.slow
def test_out_of_memory_names_the_sizes_and_the_process_goes_on(monkeypatch):
    empty = torch.empty

    def refusing(*shape, **kwargs):
        if shape and shape[0] == (1000, 1000):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return empty(*shape, **kwargs)

    monkeypatch.setattr(cuda.torch, "empty", refusing)
    big = ember.ones(1000, 1000, device="cuda") * 3
    with pytest.raises(ember.OutOfMemoryError, match=r"asked 3\.8 MiB for a result \[1000, 1000\] float32"):
        big.numpy()
    monkeypatch.setattr(cuda.torch, "empty", empty)
    assert big.sum().item() == 3_000_000  # the graph stayed pending and computes once memory is there


# -- the cyclic garbage collector ---------------------------------------------------------------------

class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_new_plan_freezes_what_is_alive_and_a_refresh_collects_frozen_cycles(monkeypatch, fresh_caches):
    import weakref

    from ember.runtime import collector

    monkeypatch.setattr(collector, "ENABLED", True)
    monkeypatch.setattr(collector, "_freezes", 0)
    held = _Cycle()
    gone = weakref.ref(held)
    (ember.randn(37, 3, device="cuda") * 1.25 + 0.5).numpy()  # empty caches: a new plan
    assert collector._freezes == 1 and gc.get_freeze_count() > 0
    del held
    gc.collect()  # the collector does not look at frozen objects
    assert gone() is not None
    monkeypatch.setattr(collector, "_refreshed", collector._refreshed - collector.REFRESH_SECONDS)
    monkeypatch.setattr(collector, "_steps", collector.REFRESH_STEPS - 1)
    (ember.randn(37, 3, device="cuda") * 1.25 + 0.5).numpy()  # the same plan, cached: the 500th step since
    assert gone() is None and gc.get_freeze_count() > 0
    gc.unfreeze()


def test_gc_freeze_0_leaves_the_collector_alone(monkeypatch, fresh_caches):
    from ember.runtime import collector

    monkeypatch.setattr(collector, "ENABLED", False)
    monkeypatch.setattr(collector, "_freezes", 0)
    gc.unfreeze()
    compiled = cuda.stats["plans_compiled"]
    (ember.randn(41, 3, device="cuda") * 1.75 - 0.5).numpy()
    assert cuda.stats["plans_compiled"] == compiled + 1  # a new plan, which would have frozen
    assert collector._freezes == 0 and gc.get_freeze_count() == 0


@pytest.mark.slow
def test_an_allocation_refused_for_memory_is_tried_again_after_a_full_collection(monkeypatch):
    from ember.runtime import collector

    empty, refreshes = torch.empty, []

    def refusing_once(*shape, **kwargs):
        if shape and shape[0] == (999, 1001) and not refreshes:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return empty(*shape, **kwargs)

    def refresh():
        refreshes.append(1)
        return True

    monkeypatch.setattr(cuda.torch, "empty", refusing_once)
    monkeypatch.setattr(collector, "refresh", refresh)
    assert (ember.ones(999, 1001, device="cuda") * 2).sum().item() == 2 * 999 * 1001
    assert refreshes == [1]


def test_an_allocation_refused_for_memory_frees_the_threads_cached_arenas_first(monkeypatch):
    """When memory runs out, the arenas this thread keeps for plans it ran before (caches: each plan's next run
    allocates its own again) are let go before the allocation is tried again; the values stay right."""
    from ember.runtime import collector

    x = ember.randn(300, 40, device="cuda")
    (x.tanh() * 2 + x.sin()).sum().numpy()  # a plan with intermediates: its arena stays cached
    assert cuda.this_thread.arenas
    empty, cached_when_retried = torch.empty, []

    def refusing_until_released(*shape, **kwargs):
        if shape and shape[0] == (997, 1003):
            if not cached_when_retried:
                cached_when_retried.append(None)
                raise torch.cuda.OutOfMemoryError("CUDA out of memory")
            cached_when_retried[0] = bool(cuda.this_thread.arenas)
        return empty(*shape, **kwargs)

    monkeypatch.setattr(cuda.torch, "empty", refusing_until_released)
    monkeypatch.setattr(collector, "refresh", lambda: False)  # nothing else to free
    assert (ember.ones(997, 1003, device="cuda") * 2).sum().item() == 2 * 997 * 1003
    assert cached_when_retried == [False]
