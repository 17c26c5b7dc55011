"""Templates: a recorded subgraph built again must be the graph the Python builds, and what cannot be
recorded is not."""

from __future__ import annotations

import numpy as np
import pytest

import ember
import ember.nn as nn
from ember.ir.template import recording, template

RNG = np.random.default_rng(5)


def structure(nodes):
    """The graph behind `nodes` as the plan cache sees it: ops, shapes, dtypes, attributes and wiring."""
    from ember.compiler import signature
    from ember.ir import toposort

    order = toposort(nodes)
    return signature(order, {id(n) for n in nodes}).key


def fn(x, y):
    return ((x * 0.3 + y).relu() - 1.5).sum(0), x.exp()


def test_a_built_template_is_the_graph_the_python_builds():
    x0, y0, x1, y1 = (ember.tensor(RNG.standard_normal((4, 5)).astype(np.float32)) for _ in range(4))
    with recording() as made:
        outs = fn(x0, y0)
    recorded = template([x0._node, y0._node], [o._node for o in outs], made)
    assert recorded is not None and len(recorded) == len(made)  # every node fn made is one its outputs need
    built = recorded.build([x1._node, y1._node])
    written = fn(x1, y1)
    assert structure(built) == structure([o._node for o in written])
    for b, w in zip(built, written):
        np.testing.assert_array_equal(ember.Tensor(b).numpy(), w.numpy())


def test_what_a_template_cannot_rebuild_is_not_recorded():
    x, y, other = (ember.tensor(RNG.standard_normal(6).astype(np.float32)) for _ in range(3))
    with recording() as made:
        out = x * 2 + other  # `other` is not an input
    assert template([x._node], [out._node], made) is None
    with recording() as made:
        out = x + ember.rand(6)  # a random draw must be drawn anew
    assert template([x._node], [out._node], made) is None
    with recording() as made:
        z = x + y
        z.realize()
        out = z * 3
    assert template([x._node, y._node], [out._node], made) is None


@pytest.mark.parametrize("make", [
    lambda ps: ember.optim.Adam(ps, lr=3e-2),
    lambda ps: ember.optim.AdamW(ps, lr=3e-2, weight_decay=0.1, amsgrad=True),
    lambda ps: ember.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
])
def test_optimizer_updates_from_templates_equal_the_python(make):
    def run(use_templates):
        ember.manual_seed(1)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
        opt = make(list(model.parameters()))
        if not use_templates:
            opt._update_from_template = lambda p, g, state, group, settings: opt._update(p, g, state, group)
        data = np.random.default_rng(2)
        for _ in range(4):
            x = ember.tensor(data.standard_normal((5, 6)).astype(np.float32))
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        return [p.numpy() for p in model.parameters()], opt

    expected, _ = run(False)
    got, opt = run(True)
    assert any(t is not None for t in opt._templates.values())
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)


def test_a_template_is_not_recorded_across_a_group_change():
    p = ember.tensor(RNG.standard_normal(4).astype(np.float32), requires_grad=True)
    opt = ember.optim.SGD([p], lr=0.5, momentum=0.5)
    for momentum in (0.5, 0.5, 0.0, 0.0):
        opt.param_groups[0]["momentum"] = momentum
        before = p.numpy().copy()
        p.grad = ember.ones(4)
        opt.step()
        buffer = opt.state[p]["momentum_buffer"].numpy()
        expected = before - 0.5 * (buffer if momentum else np.ones(4, np.float32))
        np.testing.assert_allclose(p.numpy(), expected, rtol=1e-6)
    assert len(opt._templates) == 2  # one per momentum setting


def test_one_node_passed_as_two_inputs_is_not_recorded():
    x = ember.tensor(RNG.standard_normal(4).astype(np.float32))
    with recording() as made:
        out = x * 2 + x
    assert template([x._node, x._node], [out._node], made) is None


def test_a_subclass_with_its_own_update_is_not_built_from_templates():
    """A subclass's _update may read what a template cannot see (group["lr"] here): it runs every time."""
    class Custom(ember.optim.SGD):
        def _update(self, param, grad, state, group):
            state.setdefault("count", ember.zeros(()))
            state["count"].assign(state["count"] + 1)
            param.assign(param - grad * group["lr"])

    p = ember.tensor(np.ones(3, np.float32), requires_grad=True)
    opt = Custom([p], lr=0.5)
    for lr in (0.5, 0.5, 0.0, 0.0):
        opt.param_groups[0]["lr"] = lr
        p.grad = ember.ones(3)
        opt.step()
    np.testing.assert_allclose(p.numpy(), np.zeros(3, np.float32))  # 1 - 0.5 - 0.5, then no change
    assert not opt._templates
