"""The runtime's targets: which runtime target realizes each device type's graphs, and what the runtime prepares
from a compiled plan (kept beside the plan, not on it, and dropped with it)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import ember
from ember.compiler import CompileContext, compile
from ember.errors import DeviceError
from ember.ir import toposort
from ember.runtime import targets


def test_each_device_type_is_realized_by_the_runtime_target_of_its_compiler_target():
    assert targets.for_device("cpu") is targets.REFERENCE
    assert targets.for_device("cuda").name == "triton"
    assert targets.for_device("cuda") in (targets.TRITON, targets.INTERPRETED)
    with pytest.raises(DeviceError, match="no backend for device type 'tpu'"):
        targets.for_device("tpu")


def test_a_plan_is_run_by_the_runtime_target_of_the_compiler_target_it_names():
    x = ember.tensor(np.ones(3, np.float32)) * 2
    plan = compile(toposort([x._node]), {id(x._node)}, "reference", CompileContext())
    assert targets.for_plan(plan) is targets.REFERENCE
    assert targets.running("triton") is targets.for_device("cuda")


@pytest.mark.usefixtures("cuda_backend")
def test_what_is_prepared_from_a_plan_per_thread_is_kept_beside_it_and_dropped_with_the_cache_s_plans():
    from ember.runtime import plan_cache

    x = ember.randn(8, 4, device="cuda").realize()
    y = (x * 2).relu().sum(0)
    plan = compile(toposort([y._node]), {id(y._node)}, "triton", CompileContext(multiprocessors=132))
    assert not hasattr(plan, "prepared")
    prepared = plan_cache.prepared(plan)
    prepared.steps = ["a step"]
    assert plan_cache.prepared(plan) is prepared and plan_cache.prepared(plan).steps == ["a step"]
    alive = weakref.ref(plan)
    del plan, prepared
    plan_cache.clear()
    gc.collect()
    assert alive() is None


@pytest.mark.usefixtures("cuda_backend", "fresh_caches")
def test_a_plan_run_steadily_is_freed_once_the_cache_forgets_it():
    """A steady plan's state (recycled result sets, its replay) refers to the plan: dropped with it all the same."""
    from ember.runtime import plan_cache

    plan_cache.clear()
    w = ember.ones(16, device="cuda").realize()
    for _ in range(6):  # steady: results recycled, the plan's state holds a replay of it
        w = (w * 0.5 + 1).realize()
    (plan,) = [p for p in plan_cache._plans.values() if len(p.lowered.nodes) < 8 and p.lowered.inputs]
    alive = weakref.ref(plan)
    del plan
    plan_cache.clear()
    gc.collect()
    assert alive() is None
    np.testing.assert_allclose(w.numpy(), 2 - 2**-6, rtol=1e-6)  # and what it computed is kept
