"""An index out of range is an IndexError naming the op, the index and the size, on every device: on the cpu at
the call (a known index) or when computed; on cuda at the next host read after the kernel that found it (the
kernels record it in flags on the device, copied to the host without a wait), and later work runs as usual.
In-range negative indices follow torch: indexing and take_along_dim count them from the end, the others refuse
them. Through the interpreter here; on a GPU these run in the GPU suite (`pytest -m gpu`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from conftest import ON_GPU, TORCH

import ember
import ember.nn as nn
import ember.nn.functional as F
from ember import vision
from ember.runtime import index_checks

pytestmark = [pytest.mark.usefixtures("cuda_backend"), *([pytest.mark.gpu] if ON_GPU else [])]

rng = np.random.default_rng(0)
X = rng.standard_normal((5, 3)).astype(np.float32)
W = rng.standard_normal((10, 4)).astype(np.float32)


@dataclass
class Case:
    op: str  # the op an error names
    dim: int  # the dimension the index picks along, and its size
    size: int
    fn: Callable  # the op as a function of the library (ember or torch), its input and the index
    input: np.ndarray
    bad: list  # an index with one value out of range: `out_of_range`
    out_of_range: int
    good: list  # an index in range, with negative values where torch counts them from the end


CASES = {
    "embedding": Case("embedding", 0, 10, lambda m, w, i: m.nn.functional.embedding(i, w), W, [1, 1000, 3], 1000,
                      [1, 9, 0]),
    "gather": Case("gather", 0, 5, lambda m, x, i: m.gather(x, 0, i), X, [[0, 7, 2]], 7, [[0, 4, 2]]),
    "index_select": Case("index_select", 1, 3, lambda m, x, i: m.index_select(x, 1, i), X, [2, 3], 3, [2, 0, 2]),
    "indexing": Case("index", 0, 5, lambda m, x, i: x[i] * 2, X, [1, -6], -6, [1, -5, -1, 4]),
    "indexing two dims": Case("index", 1, 3, lambda m, x, i: x[i, i], X, [0, 2, 4], 4, [0, -3, -1]),
    "take_along_dim": Case("take_along_dim", 1, 3, lambda m, x, i: m.take_along_dim(x, i, 1), X,
                           [[0], [1], [2], [3], [0]], 3, [[0], [-1], [2], [-3], [1]]),
    "scatter_add": Case("scatter_add", 0, 5, lambda m, x, i: (m.cat([x, x, x[:1]]) * 0).scatter_add(0, i, x), X[:2],
                        [[0, 5, 1], [4, 4, 4]], 5, [[0, 3, 1], [4, 4, 4]]),
    "cross_entropy": Case("cross_entropy", 1, 3, lambda m, x, t: m.nn.functional.cross_entropy(x, t), X,
                          [0, 7, 2, 1, 0], 7, [0, -100, 2, 1, 0]),
    "nll_loss": Case("nll_loss", 1, 3,
                     lambda m, x, t: m.nn.functional.nll_loss(x.log_softmax(1), t, reduction="none"), X,
                     [0, 1, 2, 3, 0], 3, [0, 1, -100, 2, 0]),
    "one_hot": Case("one_hot", 1, 5, lambda m, x, i: m.nn.functional.one_hot(i, 5) * 2, X, [1, 5], 5, [1, 4, 0]),
}


def _on(device, x, index):
    return ember.tensor(x, device=device), ember.tensor(np.array(index, dtype=np.int64), device=device)


def _message(case: Case, index: int) -> str:
    return re.escape(f"{case.op}: index {index} is out of bounds for dimension {case.dim} with size {case.size}")


def _torch(case: Case, index):
    return case.fn(TORCH, torch.from_numpy(case.input), torch.from_numpy(np.array(index, dtype=np.int64))).numpy()


def _ember(case: Case, device: str, index) -> ember.Tensor:
    return case.fn(ember, *_on(device, case.input, index))


@pytest.mark.parametrize("name", CASES)
def test_an_index_out_of_range_is_reported_at_the_host_read_naming_the_op_index_and_size(name):
    case = CASES[name]
    out = _ember(case, "cuda", case.bad)
    out.realize()  # computed without waiting for the device: nothing is known yet
    with pytest.raises(IndexError, match=_message(case, case.out_of_range)):
        out.numpy()
    # the flag is cleared: the same plan with an index in range computes as torch does
    np.testing.assert_allclose(_ember(case, "cuda", case.good).numpy(), _torch(case, case.good), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", CASES)
def test_on_the_cpu_the_same_error_comes_at_the_call_or_when_the_index_is_computed(name):
    case = CASES[name]
    with pytest.raises(IndexError, match=_message(case, case.out_of_range)):
        _ember(case, "cpu", case.bad).numpy()  # at the call where the op reads the index as given
    x, index = _on("cpu", case.input, case.bad)
    computed = case.fn(ember, x, index + 0)
    with pytest.raises(IndexError, match=_message(case, case.out_of_range)):
        computed.numpy()
    np.testing.assert_allclose(_ember(case, "cpu", case.good).numpy(), _torch(case, case.good), rtol=1e-5, atol=1e-6)


def test_on_the_cpu_an_index_given_as_data_is_refused_at_the_call():
    w, index = _on("cpu", W, [[1, 10]])
    with pytest.raises(IndexError, match=_message(CASES["embedding"], 10)):
        ember.embedding(index, w)


@pytest.mark.parametrize("name", ["embedding", "gather", "index_select", "scatter_add", "cross_entropy", "one_hot"])
def test_a_negative_index_raises_where_torch_refuses_it(name):
    case = CASES[name]
    index = np.array(case.good)
    index.flat[-1] = -1
    with pytest.raises((IndexError, RuntimeError)):
        _torch(case, index)
    with pytest.raises(IndexError, match=_message(case, -1)):
        _ember(case, "cuda", index).numpy()


def test_every_host_read_reports_an_index_out_of_range():
    w, bad = _on("cuda", W, [1, 1000])
    reads = {"item": lambda t: t.sum().item(), "tolist": lambda t: t.tolist(), "numpy": lambda t: t.numpy(),
             "a transfer to the cpu": lambda t: t.to("cpu").numpy(), "print": lambda t: str(t)}
    for read in reads.values():
        out = ember.embedding(bad, w)
        with pytest.raises(IndexError, match="embedding: index 1000 is out of bounds"):
            read(out)


def test_a_read_after_the_error_and_other_work_runs_as_usual():
    w, bad = _on("cuda", W, [3, 10])
    with pytest.raises(IndexError):
        ember.embedding(bad, w).numpy()
    y = ember.tensor(X, device="cuda")
    np.testing.assert_allclose((y @ y.T).relu().numpy(), np.maximum(X @ X.T, 0), rtol=1e-5, atol=1e-6)
    assert ember.embedding(bad - 1, w).tolist() == W[[2, 9]].tolist()


def test_setting_items_at_an_index_out_of_range_raises_at_the_assignment_which_reads_the_positions():
    x = ember.tensor(X, device="cuda")
    index = ember.tensor(np.array([0, 5]), device="cuda")
    with pytest.raises(IndexError, match=re.escape("index: index 5 is out of bounds for dimension 0 with size 5")):
        x[index] = 1.0
    x[index - 1] = 1.0
    np.testing.assert_array_equal(x.numpy(), np.concatenate([X[:4], np.ones((1, 3), np.float32)]))


def test_a_plan_without_index_checks_copies_no_flags():
    x = ember.tensor(X, device="cuda")
    y = (x * 2 + 1).realize()
    assert getattr(y._node.buffer, index_checks.CARRIED, None) is None
    plain = ember.explain.plan(x * 3 - 1)
    assert not any(a.kind == "flag" for source in plain.sources.values() for launch in source.launches
                   for a in launch.args)


def test_a_training_step_with_a_token_out_of_range_raises_at_the_loss_and_the_next_step_trains():
    ember.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3)).to("cuda")
    opt = ember.optim.SGD(model.parameters(), lr=0.1)

    def step(tokens, labels):
        opt.zero_grad()
        loss = F.cross_entropy(model(ember.tensor(np.array(tokens), device="cuda")),
                               ember.tensor(np.array(labels), device="cuda"))
        loss.backward()
        opt.step()
        return loss

    with pytest.raises(IndexError, match="embedding: index 12 is out of bounds for dimension 0 with size 10"):
        step([1, 12, 3], [0, 1, 2]).item()
    with pytest.raises(IndexError, match="cross_entropy: index 3 is out of bounds for dimension 1 with size 3"):
        step([1, 2, 3], [0, 3, 2]).item()
    weight, linear_w, linear_b = (torch.from_numpy(p.numpy()).requires_grad_() for p in model.parameters())
    tokens, labels = torch.tensor([4, 5, 9]), torch.tensor([2, 0, 1])
    expected = TORCH.cross_entropy(TORCH.embedding(tokens, weight) @ linear_w.T + linear_b, labels)
    expected.backward()
    assert step(tokens.tolist(), labels.tolist()).item() == pytest.approx(expected.item(), rel=1e-5)
    np.testing.assert_allclose(model[0].weight.numpy(), (weight - 0.1 * weight.grad).detach().numpy(), rtol=1e-5,
                               atol=1e-6)


def test_under_jit_the_replay_that_found_an_index_out_of_range_reports_it_and_later_replays_compute():
    w = ember.tensor(W, device="cuda")

    @ember.jit
    def step(index):
        return (ember.embedding(index, w) * 2).sum(1)

    def call(index):
        return step(ember.tensor(np.array(index), device="cuda"))

    for _ in range(3):
        np.testing.assert_allclose(call([1, 2, 3]).numpy(), W[[1, 2, 3]].sum(1) * 2, rtol=1e-5)
    replays = step.stats["replays"]
    assert replays >= 1
    bad = call([1, 20, 3])
    with pytest.raises(IndexError, match="embedding: index 20 is out of bounds for dimension 0 with size 10"):
        bad.numpy()
    np.testing.assert_allclose(call([7, 8, 0]).numpy(), W[[7, 8, 0]].sum(1) * 2, rtol=1e-5)
    assert step.stats["replays"] == replays + 2 and step.stats["captures"] == 1  # replayed, never recorded again


def test_crop_resize_checks_image_indices_and_runtime_boxes_against_the_batch_and_frame():
    images = ember.tensor(rng.integers(0, 256, (2, 8, 12, 3), dtype=np.uint8), device="cuda")
    indices = ember.tensor(np.array([1, 2]), device="cuda")
    boxes = ember.tensor(np.array([[0, 0, 4, 4], [2, 1, 6, 5]]), device="cuda")
    with pytest.raises(IndexError, match="crop_resize: index 2 is out of bounds for dimension 0 with size 2"):
        vision.crop_resize(images, boxes, (3, 3), indices=indices).numpy()
    outside = ember.tensor(np.array([[0, 0, 4, 4], [9, 1, 6, 5]]), device="cuda")  # columns 9 to 14 of 12
    with pytest.raises(IndexError, match="crop_resize: index 1[2-4] is out of bounds for dimension 2 with size 12"):
        vision.crop_resize(images, outside, (3, 3), interpolation="nearest").numpy()
    inside = vision.crop_resize(images, boxes, (3, 3), interpolation="nearest").numpy()
    expected = vision.crop_resize(images, [[0, 0, 4, 4], [2, 1, 6, 5]], (3, 3), interpolation="nearest").numpy()
    np.testing.assert_array_equal(inside, expected)


@pytest.mark.skipif(not ON_GPU, reason="the interpreter's device has no streams to wait for")
def test_on_a_gpu_computing_with_index_checks_does_not_wait_for_the_device():
    w, index = _on("cuda", W, [1, 2, 3])
    for _ in range(2):  # compiled, and its steps prepared
        ember.embedding(index, w).realize()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = ember.embedding(index, w)
        out.realize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    np.testing.assert_array_equal(out.numpy(), W[[1, 2, 3]])


def test_a_read_of_a_value_that_does_not_depend_on_the_bad_index_raises_nothing_and_leaves_the_error_to_one_that_does():
    w, bad = _on("cuda", W, [1, 1000])
    x = ember.tensor(X, device="cuda")
    gathered, doubled = ember.embedding(bad, w), x * 2
    ember.realize(gathered, doubled)  # one plan computes both
    np.testing.assert_allclose(doubled.numpy(), X * 2)
    np.testing.assert_allclose((x - 1).numpy(), X - 1)
    with pytest.raises(IndexError, match="embedding: index 1000 is out of bounds for dimension 0 with size 10"):
        (gathered.sum(1) * 3).tolist()  # computed from it by a later plan
    np.testing.assert_allclose(gathered[0].numpy(), W[1])  # reported once; the in-range rows are as computed


def test_a_parameter_updated_from_a_bad_index_carries_the_error_into_the_next_steps_loss():
    ember.manual_seed(1)
    table = nn.Embedding(10, 4).to("cuda")
    opt = ember.optim.SGD(table.parameters(), lr=0.1)

    def step(tokens):
        opt.zero_grad()
        loss = table(ember.tensor(np.array(tokens), device="cuda")).square().mean()
        loss.backward()
        opt.step()
        return loss

    step([1, 12, 3])  # not read: its plan's check stays set
    with pytest.raises(IndexError, match="embedding: index 12 is out of bounds for dimension 0 with size 10"):
        step([4, 5, 6, 7]).item()  # another plan (another batch size), reading the updated table
    assert np.isfinite(step([4, 5, 6, 7]).item())
