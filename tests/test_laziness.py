"""Laziness: nothing is computed until a value is needed, each needed node is computed once,
realized history is freed, and random values are a pure function of their graph."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import ember
from ember.compiler.targets import reference
from ember.ir import Node, Op

RNG = np.random.default_rng(3)


def data(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.fixture
def evaluated(monkeypatch) -> list[Node]:
    """Every node the reference backend evaluates, in order."""
    seen: list[Node] = []
    original = reference.evaluate

    def counting(node, args):
        seen.append(node)
        return original(node, args)

    monkeypatch.setattr(reference, "evaluate", counting)
    return seen


def live_nodes() -> int:
    gc.unfreeze()  # every node, those a freeze (ember.runtime.collector) hid from the collector included
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is Node)


def test_building_a_long_expression_evaluates_nothing(evaluated):
    x = ember.randn(8, 8)
    w = ember.tensor(data(8, 8), requires_grad=True)
    y = x
    for i in range(100):
        y = (y @ w).tanh() * 0.5 + i if i % 10 == 0 else y * 1.01 - 0.1
    loss = y.sum()
    assert loss.shape == () and loss.dtype is ember.float32  # metadata needs no computation
    loss.backward()  # nor does building the backward pass
    assert w.grad.shape == (8, 8)
    assert evaluated == []


def test_reading_a_value_evaluates_each_needed_node_once(evaluated):
    x = ember.tensor(data(4, 4))
    y = x
    for _ in range(100):
        y = y * 1.01 + 0.1
    expected = x.numpy()
    for _ in range(100):
        expected = expected * np.float32(1.01) + np.float32(0.1)
    np.testing.assert_allclose(y.numpy(), expected, rtol=1e-5)
    ids = [id(n) for n in evaluated]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 200  # one mul and one add per step, at least
    count = len(evaluated)
    y.numpy()
    y.tolist()
    assert len(evaluated) == count  # a realized value is not recomputed


def test_nodes_not_needed_for_a_value_are_not_evaluated(evaluated):
    x = ember.tensor(data(3))
    unused = x.exp() * 2
    needed = x + 1
    needed.numpy()
    assert all(n is not unused._node for n in evaluated)
    assert not unused._node.realized
    assert len(evaluated) <= 4  # the add and the nodes that broadcast its constant operand


def test_a_realized_tensor_cuts_its_history():
    x = ember.tensor(data(5))
    y = (x.exp() + 1).log().sum()
    assert y._node.inputs  # pending: the graph is still attached
    y.realize()
    assert y._node.realized and y._node.op is Op.BUFFER
    assert y._node.inputs == ()
    assert y._node.attrs == {}


def test_an_intermediate_held_by_a_tensor_is_computed_once_with_its_consumer(evaluated):
    x = ember.tensor(data(6))
    h = x.exp()
    y = (h * 2).sum()
    np.testing.assert_allclose(y.item(), (np.exp(x.numpy()) * 2).sum(), rtol=1e-5)
    assert h._node.realized  # kept, because a live Tensor shows it
    count = len(evaluated)
    np.testing.assert_allclose(h.numpy(), np.exp(x.numpy()), rtol=1e-6)
    assert len(evaluated) == count
    assert sum(1 for n in evaluated if n is h._node) <= 1


def test_an_intermediate_nobody_holds_is_not_kept():
    x = ember.tensor(data(6))
    y = (x.exp() * 2).sum()
    temporary = y._node.inputs[0]
    y.realize()
    assert not temporary.realized


def test_random_values_are_the_same_however_often_the_graph_is_computed(evaluated):
    ember.manual_seed(1234)
    r = ember.rand(1000)
    a, b = r * 1, r + 0
    rand_node = r._node
    del r  # nobody holds the random node, so it is not kept between realizations
    a.numpy()
    b.numpy()
    assert sum(1 for n in evaluated if n is rand_node) == 2  # computed twice...
    np.testing.assert_array_equal(a.numpy(), b.numpy())  # ...with the same values
    assert 0.4 < a.numpy().mean() < 0.6 and a.numpy().min() >= 0 and a.numpy().max() < 1


def test_random_values_depend_only_on_the_seed_and_the_draw():
    ember.manual_seed(7)
    first, second = ember.randn(64), ember.randn(64)
    ember.manual_seed(7)
    again = ember.randn(64)
    np.testing.assert_array_equal(first.numpy(), again.numpy())
    assert not np.array_equal(first.numpy(), second.numpy())
    assert ember.initial_seed() == 7


def test_a_dropout_mask_is_the_same_in_forward_and_backward():
    ember.manual_seed(3)
    x = ember.tensor(np.abs(data(500)) + 0.5, requires_grad=True)
    y = ember.dropout(x, p=0.5)
    y.sum().backward()
    kept = y.numpy() != 0
    assert 100 < kept.sum() < 400
    np.testing.assert_array_equal(x.grad.numpy(), np.where(kept, 2.0, 0.0).astype(np.float32))
    np.testing.assert_allclose(y.numpy()[kept], x.numpy()[kept] * 2, rtol=1e-6)


def test_a_ten_thousand_step_loop_without_realization():
    a = data(7)
    x = ember.tensor(a)
    for _ in range(10_000):
        x = x * 0.5 + 1
    expected = a.copy()
    for _ in range(10_000):
        expected = expected * np.float32(0.5) + np.float32(1)
    np.testing.assert_allclose(x.numpy(), expected, rtol=1e-6)
    assert x._node.inputs == ()


def test_backward_through_a_long_chain():
    a = data(3)
    w = ember.tensor(a, requires_grad=True)
    y = w
    for _ in range(2_000):
        y = y * 0.999 + 0.001
    y.sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), np.full(3, 0.999 ** 2_000), rtol=1e-4)


def test_live_nodes_stay_bounded_over_a_loop_of_realizations():
    x = ember.tensor(data(16))
    w = ember.tensor(data(16), requires_grad=True)

    def step():
        nonlocal x, w
        x = (x * 0.5 + 1).tanh()
        loss = (w * x).exp().mean()
        loss.backward()
        with ember.no_grad():
            w -= 0.01 * w.grad
        w.grad = None
        return loss.item()

    for _ in range(5):
        step()
    baseline = live_nodes()
    for _ in range(100):
        step()
    assert live_nodes() <= baseline + 5
    w.numpy()
    assert live_nodes() <= baseline + 5


def test_steps_on_the_cpu_device_settle_the_garbage_collector_as_new_plans_do(monkeypatch):
    """The cpu device compiles no plans: its 1st, 2nd, 4th, 8th... evaluations freeze what is alive (FREEZES in
    all), the others count as cached steps (which refresh the freeze now and then)."""
    from ember.runtime import collector

    frozen, steps = [], []
    monkeypatch.setattr(collector, "ENABLED", True)
    monkeypatch.setattr(collector, "_freezes", 0)
    monkeypatch.setattr(collector, "_host_steps", 0)
    monkeypatch.setattr(collector, "_refreeze", lambda: frozen.append(collector._host_steps) or False)
    monkeypatch.setattr(collector, "after_step", lambda: steps.append(collector._host_steps))
    monkeypatch.setattr(collector, "FREEZES", 3)
    x = ember.tensor(data(16))
    for _ in range(9):
        (x * 2 + 1).numpy()
    assert frozen == [1, 2, 4] and steps == [3, 5, 6, 7, 8, 9]
