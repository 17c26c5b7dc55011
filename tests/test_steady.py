"""Steady plans (ember.runtime.steady): a plain lazy training loop whose step runs on recycled result buffers, and
on a GPU replays as a CUDA graph, computes what running every plan into new buffers computes, and never
overwrites a value something still shows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ember
import ember.nn as nn
import ember.nn.functional as F
from ember.runtime import cuda, steady
from tests.conftest import ON_GPU

pytestmark = pytest.mark.usefixtures("cuda_backend", "fresh_caches")


def _model(dropout: float, dtype):
    ember.manual_seed(0)
    layers = [nn.Linear(6, 16), nn.ReLU(), *([nn.Dropout(dropout)] if dropout else []), nn.Linear(16, 3)]
    return nn.Sequential(*layers).to("cuda").to(dtype)


def train(monkeypatch, steps=7, recycle=True, dropout=0.0, dtype=ember.float32, keep=None, each=None):
    """Losses and final parameters of a plain loop; `keep(step, model)` may hold values between steps."""
    with monkeypatch.context() as m:
        if not recycle:
            m.setattr(steady, "_recyclable", lambda plan, prepared: False)
        model = _model(dropout, dtype)
        opt = ember.optim.Adam(model.parameters(), lr=1e-2)
        rng = np.random.default_rng(1)
        x = ember.tensor(rng.standard_normal((5, 6), np.float32), device="cuda").to(dtype)
        y = ember.tensor(rng.standard_normal((5, 3), np.float32), device="cuda").to(dtype)
        losses = []
        for i in range(steps):
            opt.zero_grad()
            loss = F.mse_loss(model(x).float(), y.float())
            loss.backward()
            opt.step()
            losses.append(loss if each == "tensor" else loss.item())
            if keep is not None:
                keep(i, model)
        losses = [v.item() if each == "tensor" else v for v in losses]
        return losses, [p.numpy() for p in model.parameters()]


def _equal(a, b) -> None:
    (la, pa), (lb, pb) = a, b
    assert la == lb
    for u, v in zip(pa, pb):
        np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("dtype", [ember.float32, ember.bfloat16])
def test_a_steady_loop_recycles_its_result_buffers_and_computes_what_new_buffers_do(monkeypatch, dtype):
    before = cuda.stats["steady_runs"]
    recycled = train(monkeypatch, dtype=dtype)
    assert cuda.stats["steady_runs"] - before >= 4  # steps 3 to 7 write the buffers of the step before last
    _equal(recycled, train(monkeypatch, dtype=dtype, recycle=False))
    assert len(set(recycled[0])) == len(recycled[0])  # the loss goes down: every step computed anew


def test_losses_kept_as_tensors_keep_their_values(monkeypatch):
    kept = train(monkeypatch, each="tensor")
    _equal(kept, train(monkeypatch, recycle=False))


def test_parameters_shown_elsewhere_keep_their_values(monkeypatch):
    """A detached copy, a realized view and a DLPack export of parameters, taken mid-loop, show the values of
    their time after later steps recycled the buffers around them."""
    held = {}

    def keep(i, model):
        if i in (2, 3):  # each on a parameter of its own (an export gives its parameter a buffer of its own)
            first, bias, last, _ = model.parameters()
            view = last[1:3]
            view.realize()
            held[i] = [(first.detach(), first.numpy().copy()), (view, view.numpy().copy()),
                       (torch.from_dlpack(bias), bias.numpy().copy())]

    train(monkeypatch, steps=8, keep=keep)
    for i, shown in held.items():
        for value, expected in shown:
            got = value.numpy() if isinstance(value, ember.Tensor) else value.cpu().numpy()
            np.testing.assert_array_equal(got, expected, err_msg=f"a value held at step {i}")
    assert not np.array_equal(held[2][0][1], held[3][0][1])


def test_random_numbers_of_a_recycled_step_are_drawn_afresh(monkeypatch):
    recycled = train(monkeypatch, dropout=0.5)
    _equal(recycled, train(monkeypatch, dropout=0.5, recycle=False))


def test_a_loop_that_alternates_two_steps_computes_the_same(monkeypatch):
    """Two optimizers stepped in turn: each plan's runs read the results of the other's, never a steady chain
    of their own, then do again; the values are those of new buffers each time."""

    def run(recycle: bool):
        with monkeypatch.context() as m:
            if not recycle:
                m.setattr(steady, "_recyclable", lambda plan, prepared: False)
            a, b = _model(0.0, ember.float32), _model(0.0, ember.float32)
            opts = [ember.optim.Adam(a.parameters(), lr=1e-2), ember.optim.SGD(b.parameters(), lr=1e-1)]
            x = ember.tensor(np.random.default_rng(2).standard_normal((4, 6), np.float32), device="cuda")
            out = []
            for i in range(8):
                model, opt = (a, opts[0]) if i % 3 else (b, opts[1])
                opt.zero_grad()
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                out.append(loss.item())
            return out, [p.numpy() for p in (*a.parameters(), *b.parameters())]

    _equal(run(True), run(False))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA GPU (and EMBER_INTERPRET unset)")
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_a_steady_loop_replays_cuda_graphs_that_compute_what_launches_do(monkeypatch, dropout):
    before = cuda.stats["graph_replays"]
    replayed = train(monkeypatch, steps=12, dropout=dropout, dtype=ember.bfloat16)
    assert cuda.stats["graph_replays"] - before >= 6
    _equal(replayed, train(monkeypatch, steps=12, dropout=dropout, dtype=ember.bfloat16, recycle=False))


def test_results_the_compiler_finds_to_be_one_value_share_their_recycled_buffer(monkeypatch):
    """Two Tensors kept from one step whose values the compiler computes once (common subexpressions): the
    step's results include one buffer twice, which recycling keeps shared."""

    def run(recycle: bool):
        with monkeypatch.context() as m:
            if not recycle:
                m.setattr(steady, "_recyclable", lambda plan, prepared: None)
            w = ember.tensor(np.random.default_rng(3).standard_normal((3, 5), np.float32), device="cuda")
            seen = []
            for _ in range(6):
                w = w - 0.1 * w.tanh()
                a, b = w * 2, w * 2  # (2, not a runtime scalar: the two products are one)
                ember.realize(w, a, b)
                seen.append(np.concatenate([a.numpy(), b.numpy()]))
            return seen, [w.numpy()]

    before = cuda.stats["steady_runs"]
    recycled = run(True)
    assert cuda.stats["steady_runs"] - before >= 3
    for u, v in zip(recycled[0], run(False)[0]):
        np.testing.assert_array_equal(u, v)
    np.testing.assert_array_equal(recycled[1][0], run(False)[1][0])


def test_running_out_of_memory_releases_the_spare_sets_and_the_loop_goes_on(monkeypatch):
    """What a failed GPU allocation frees before it is tried again: the spare result sets of steady plans (held
    after a loop ends). The loop that owned them starts over and computes the same values."""
    assert steady.release in cuda.on_out_of_memory

    def keep(i, model):
        if i == 3:
            assert steady.release()  # a steady plan had sets to drop
            assert not steady.release()  # and then none

    before = cuda.stats["steady_runs"]
    released = train(monkeypatch, steps=9, keep=keep)
    assert cuda.stats["steady_runs"] - before >= 5  # steady again after the release
    _equal(released, train(monkeypatch, steps=9, recycle=False))
