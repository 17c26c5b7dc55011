"""The runtime's targets: which runtime target realizes each device type's graphs, and what the runtime prepares
from a compiled plan (kept beside the plan, not on it, and dropped with it)."""

from __future__ import annotations

import gc

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
def test_what_is_prepared_from_a_plan_per_thread_is_kept_beside_it_and_dropped_with_it():
    from ember.runtime import launcher

    x = ember.randn(8, 4, device="cuda").realize()
    y = (x * 2).relu().sum(0)
    plan = compile(toposort([y._node]), {id(y._node)}, "triton", CompileContext(multiprocessors=132))
    assert not hasattr(plan, "prepared")
    prepared = launcher.prepared(plan)
    prepared.steps = ["a step"]
    assert launcher.prepared(plan) is prepared and launcher.prepared(plan).steps == ["a step"]
    key = id(plan)
    del plan, prepared
    gc.collect()
    assert key not in launcher._prepared
