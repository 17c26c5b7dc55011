"""Threads and processes share ember: a thread trains as it would alone (its own grad mode, autocast, default
device, random stream, ember.jit recording and plan arenas), and threads or processes compiling the same
kernels and plans into one cache directory all succeed and leave the cache valid."""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
import threading

import numpy as np
import pytest
from conftest import ON_GPU, use_fresh_caches
from test_jit import step_fn

import ember
import ember.nn as nn
from ember.runtime import cuda, disk, plan_cache


def on_cuda(test):
    """A cuda test: on a GPU part of the GPU suite (`pytest -m gpu`), else run on the interpreter."""
    return pytest.mark.gpu(test) if ON_GPU else test


STEPS = 3


def make(seed: int, device: str):
    ember.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    return model, ember.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(seed: int, device: str, steps: int = STEPS, barrier: threading.Barrier | None = None, jit: bool = False):
    """Losses of a few training steps of a model of its own (with `barrier`, each step starts with the
    other threads' steps), and its step function."""
    step = step_fn(*make(seed, device))
    if jit:
        step = ember.jit(step)
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        x, y = rng.standard_normal((6, 8)).astype(np.float32), rng.integers(0, 4, 6)
        if barrier is not None:
            barrier.wait(timeout=60)
        losses.append(step(ember.tensor(x, device=device), ember.tensor(y, device=device)).item())
    return losses, step


@functools.cache
def alone(seed: int, device: str, steps: int = STEPS) -> list[float]:
    """The losses of `train` in one thread, with nothing else running."""
    return train(seed, device, steps)[0]


def in_threads(*calls) -> list:
    """Run each call (a function and its arguments) in a thread of its own, all at once: their results,
    or the first error raised in any of them."""
    results, errors = [None] * len(calls), []

    def run(i, fn, *args):
        try:
            results[i] = fn(*args)
        except BaseException as error:
            errors.append(error)
            for arg in args:  # the others stop waiting for this one
                if isinstance(arg, threading.Barrier):
                    arg.abort()

    threads = [threading.Thread(target=run, args=(i, *call)) for i, call in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def assert_trained_as_alone(seeds: list[int], device: str, together: list) -> None:
    for seed, (losses, _) in zip(seeds, together):
        np.testing.assert_allclose(losses, alone(seed, device), rtol=1e-6, atol=1e-7, err_msg=f"model {seed}")


@pytest.fixture
def empty_caches(monkeypatch, tmp_path) -> None:
    """No plan and no kernel module compiled yet, in memory or on disk."""
    use_fresh_caches(monkeypatch, tmp_path)
    monkeypatch.setattr(disk, "_modules", {})


@on_cuda
def test_threads_training_their_own_models_on_cuda_from_an_empty_cache_train_as_alone(cuda_backend, empty_caches):
    barrier = threading.Barrier(2)
    together = in_threads((train, 1, "cuda", STEPS, barrier), (train, 2, "cuda", STEPS, barrier))
    assert_trained_as_alone([1, 2], "cuda", together)


def test_threads_training_their_own_models_on_cpu_train_as_alone():
    barrier = threading.Barrier(2)
    together = in_threads((train, 1, "cpu", STEPS, barrier), (train, 2, "cpu", STEPS, barrier))
    assert_trained_as_alone([1, 2], "cpu", together)


@on_cuda
def test_threads_running_the_same_cached_plans_at_once_keep_their_intermediates_apart(cuda_backend):
    train(0, "cuda", steps=2)  # the plans both threads run (a first step and the next ones), compiled beforehand
    compiled, barrier = cuda.stats["plans_compiled"], threading.Barrier(2)
    together = in_threads((train, 1, "cuda", STEPS, barrier), (train, 2, "cuda", STEPS, barrier))
    assert cuda.stats["plans_compiled"] == compiled
    assert_trained_as_alone([1, 2], "cuda", together)


@on_cuda
def test_a_thread_recording_an_ember_jit_step_sees_none_of_another_threads_lazy_steps(cuda_backend):
    barrier = threading.Barrier(2)
    (jitted, step), (lazy, _) = in_threads((train, 1, "cuda", 4, barrier, True), (train, 2, "cuda", 4, barrier))
    assert step.stats["replays"] == 1  # calls as written until two ran the same plans, one recorded, one replayed
    np.testing.assert_allclose(jitted, alone(1, "cuda", 4), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(lazy, alone(2, "cuda", 4), rtol=1e-6, atol=1e-7)


# -- settings and observers are per thread -----------------------------------------------------------

def test_grad_mode_autocast_and_default_device_set_in_one_thread_leave_another_alone(cuda_backend):
    inside, done = threading.Event(), threading.Event()
    seen = {}

    def with_settings():
        with ember.no_grad(), ember.autocast("cpu", dtype=ember.bfloat16), ember.device("cuda"):
            inside.set()
            done.wait(timeout=60)
            seen["own"] = ember.is_grad_enabled(), ember.zeros(2).device.type

    def without():
        inside.wait(timeout=60)
        w = ember.randn(3, 3, requires_grad=True)
        seen["other"] = ember.is_grad_enabled(), ember.zeros(2).device.type, (w @ w).dtype, (w @ w).requires_grad
        done.set()

    in_threads((with_settings,), (without,))
    assert seen["own"] == (False, "cuda")
    assert seen["other"] == (True, "cpu", ember.float32, True)


def test_explain_capture_in_one_thread_plans_only_its_own_realizations():
    inside, done = threading.Event(), threading.Event()

    def capturing():
        with ember.explain.capture() as plans:
            inside.set()
            done.wait(timeout=60)
            (ember.ones(3) * 2).numpy()
        return [p.lowered.outputs[0].shape for p in plans]

    def elsewhere():
        inside.wait(timeout=60)
        (ember.ones(5) + 1).numpy()
        done.set()

    planned, _ = in_threads((capturing,), (elsewhere,))
    assert planned == [(3,)]


def test_a_template_recording_in_one_thread_lists_only_the_nodes_that_thread_makes():
    from ember.ir.template import recording

    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()

    def record(entered, leave_after, left=None):
        with recording() as made:
            x = ember.ones(4) * 3
            entered.set()
            leave_after.wait(timeout=60)
        if left is not None:
            left.set()
        return made, x._node

    def second():  # opens its recording inside the first one's, closes it after
        first_in.wait(timeout=60)
        return record(second_in, first_out)

    (made_1, x_1), (made_2, x_2) = in_threads((record, first_in, second_in, first_out), (second,))
    assert x_1 in made_1 and x_1 not in made_2
    assert x_2 in made_2 and x_2 not in made_1
    after = (ember.ones(2) * 5)._node  # made with no recording open: listed nowhere
    assert after not in made_1 and after not in made_2


# -- processes sharing one cache directory -----------------------------------------------------------

def _train_in_process(cache_dir: str, barrier, losses) -> None:
    os.environ["EMBER_CACHE_DIR"] = cache_dir
    barrier.wait(timeout=120)  # every process compiles the same kernels and plans at the same time
    losses.put(train(1, "cuda", steps=1)[0])


@pytest.mark.slow
@on_cuda
def test_processes_compiling_the_same_plans_into_one_cache_all_succeed_and_leave_it_valid(cuda_backend,
                                                                                         empty_caches, tmp_path):
    context = multiprocessing.get_context("spawn")
    barrier, losses = context.Barrier(2), context.Queue()
    processes = [context.Process(target=_train_in_process, args=(str(tmp_path), barrier, losses)) for _ in range(2)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=300)
    assert [p.exitcode for p in processes] == [0, 0]
    results = [losses.get(timeout=10) for _ in processes]

    compiled, loaded = cuda.stats["plans_compiled"], cuda.stats["plans_loaded"]
    here, _ = train(1, "cuda", steps=1)  # every plan from the processes' files
    assert cuda.stats["plans_compiled"] == compiled and cuda.stats["plans_loaded"] > loaded
    assert results == [here, here]
    assert not [f for f in tmp_path.rglob("*") if f.name.endswith(".tmp")]  # no temporary file left behind


def test_a_corrupt_plan_file_is_compiled_again_never_trusted(cuda_backend, empty_caches, tmp_path):
    x = ember.tensor(np.random.default_rng(0).standard_normal(5).astype(np.float32), device="cuda")
    want = (x.exp() + 1).numpy()
    (plan_file,) = (tmp_path / "plans").iterdir()
    plan_file.write_bytes(plan_file.read_bytes()[:40])  # a writer cut off halfway
    plan_cache.clear()
    compiled = cuda.stats["plans_compiled"]
    np.testing.assert_array_equal((x.exp() + 1).numpy(), want)
    assert cuda.stats["plans_compiled"] == compiled + 1


def test_cache_files_are_readable_by_other_users_as_open_would_make_them(tmp_path):
    """A cache directory may be shared: entries get the mode a plain open() gives (umask applied), not 0600."""
    import os

    from ember.runtime import disk

    mask = os.umask(0o022)
    try:
        disk.write_atomically(tmp_path / "entry.py", "x = 1\n")
    finally:
        os.umask(mask)
    assert (tmp_path / "entry.py").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("kept", [1, 2])
def test_threads_recording_backward_templates_into_a_full_table_train_as_alone(monkeypatch, kept):
    """Every new structure of a backward pass drops the oldest template (a table of one or two): threads doing it
    at once each keep training as alone."""
    from ember import autograd

    monkeypatch.setattr(autograd, "_templates", {})
    monkeypatch.setattr(autograd, "TEMPLATES_KEPT", kept)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between almost any two bytecodes
    try:
        for _ in range(3):
            barrier = threading.Barrier(4)
            seeds = [1, 2, 3, 4]
            together = in_threads(*((train, seed, "cpu", STEPS, barrier) for seed in seeds))
            assert_trained_as_alone(seeds, "cpu", together)
    finally:
        sys.setswitchinterval(interval)
