"""Templates: a recorded subgraph built again must be the graph the Python builds, and what cannot be
recorded is not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

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
            per_parameter(opt)
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
    # one per momentum setting (the first update, which makes the momentum buffer, is not a template)
    assert sum(t is not None for t in opt._templates.values()) == 2


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


def ops_at_step(opt):
    """The ops of the pending graph `opt.step()` realizes, in order."""
    from ember.runtime import executor

    seen = []
    executor.this_thread.observers.append(lambda order, keep: seen.append([n.op for n in order]))
    try:
        opt.step()
    finally:
        executor.this_thread.observers.pop()
    (ops,) = seen
    return ops


@pytest.mark.parametrize("make,results", [
    (lambda ps: ember.optim.Adam(ps, lr=1e-2), 4),  # the parameter, two moments and the step count
    (lambda ps: ember.optim.AdamW(ps, lr=1e-2, amsgrad=True), 5),
    (lambda ps: ember.optim.SGD(ps, lr=1e-2), 1),
])
def test_each_parameters_update_is_one_template_node_per_result_from_the_first_step(make, results):
    from ember.ir import Op

    params = [ember.tensor(RNG.standard_normal(shape).astype(np.float32), requires_grad=True)
              for shape in [(3, 4), (4,), (3, 4), (1,)]]
    opt = make(params)
    for _ in range(2):
        for p in params:
            p.grad = ember.tensor(RNG.standard_normal(p.shape).astype(np.float32))
            p.grad.realize()
        ops = ops_at_step(opt)
        assert ops.count(Op.TEMPLATE) == results * len(params) and set(ops) == {Op.TEMPLATE}


@pytest.mark.parametrize("change", [dict(betas=(0.8, 0.95)), dict(eps=1e-3), dict(weight_decay=0.3)])
def test_a_changed_setting_gives_a_new_template_whose_constants_are_the_new_ones(device, change):
    """Float settings (betas, eps, weight decay) are constants of the template's plan, not kernel arguments."""
    def run(use_templates):
        params = [ember.tensor(np.linspace(-1, 1, 12, dtype=np.float32).reshape(shape), requires_grad=True,
                               device=device) for shape in [(3, 4), (12,)]]
        opt = ember.optim.AdamW(params, lr=3e-2, weight_decay=0.1)
        if not use_templates:
            per_parameter(opt)
        for step in range(4):
            if step == 2:
                opt.param_groups[0].update(change)
            for p in params:
                p.grad = (p * p.detach() + 0.37).detach()
            opt.step()
        return [p.numpy() for p in params], opt

    expected, _ = run(False)
    got, opt = run(True)
    assert sum(t is not None for t in opt._templates.values()) == 2  # one per setting, for the whole group
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.usefixtures("cuda_backend")
def test_an_update_from_templates_passes_no_float_to_its_kernels_and_gives_each_result_its_value():
    params = [ember.tensor(RNG.standard_normal(shape).astype(np.float32), requires_grad=True, device="cuda")
              for shape in [(5, 3), (7,), (5, 3)]]
    opt = ember.optim.Adam(params, lr=1e-2, betas=(0.85, 0.99), eps=1e-6)
    for p in params:
        p.grad = ember.tensor(RNG.standard_normal(p.shape).astype(np.float32), device="cuda").realize()
    before = [p.numpy() for p in params]
    with ember.explain.capture() as plans:
        opt.step()
    (plan,) = plans
    assert plan.signature.scalars == []  # betas and eps are in the code; the rate is a tensor
    for p, start in zip(params, before):  # each result where it belongs: the first step moves by about lr
        state = opt.state[p]
        assert state["step"].shape == () and state["step"].item() == 1
        np.testing.assert_allclose(state["exp_avg"].numpy(), 0.15 * p.grad.numpy(), rtol=1e-5)
        np.testing.assert_allclose(state["exp_avg_sq"].numpy(), 0.01 * p.grad.numpy() ** 2, rtol=1e-5)
        np.testing.assert_allclose(np.abs(p.numpy() - start), 1e-2, rtol=1e-3)


def test_a_templates_digest_is_its_structure():
    """Two optimizers of one kind make templates of one digest (so a plan file on disk is found again); any
    change of structure or constant gives another."""
    def digests(**kwargs):
        p = ember.tensor(np.ones((2, 3), np.float32), requires_grad=True)
        opt = ember.optim.Adam([p], lr=1e-3, **kwargs)
        p.grad = ember.ones(2, 3)
        opt.step()
        return {t.digest for t in opt._templates.values() if t is not None}

    assert digests() == digests()
    assert digests() != digests(eps=1e-7) and digests() != digests(amsgrad=True)


def per_parameter(opt):
    """`opt` with each update built by its own Python, parameter by parameter (no template)."""
    opt._update_group = lambda batch, group, settings: [opt._update(p, p.grad, state, group) for p, state in batch]
    return opt


@pytest.mark.parametrize("make", [
    lambda ps: ember.optim.Adam(ps, lr=3e-2),
    lambda ps: ember.optim.SGD([{"params": ps[:2], "momentum": 0.9}, {"params": ps[2:]}], lr=0.1),
])
def test_a_group_update_follows_which_parameters_have_gradients_and_what_their_state_holds(make):
    """One multi-tensor update per group and kind of step: parameters without a gradient this step are left
    alone, a parameter whose state holds a non-tensor is updated on its own, and every value is the Python's."""
    def run(use_templates):
        params = [ember.tensor(np.linspace(-1, 1, n, dtype=np.float32), requires_grad=True) for n in (1, 4, 6, 4)]
        opt = make(params)
        if not use_templates:
            per_parameter(opt)
        data = np.random.default_rng(7)
        for step in range(6):
            for k, p in enumerate(params):  # the second parameter has no gradient every other step
                p.grad = None if k == 1 and step % 2 else ember.tensor(data.standard_normal(p.shape).astype(np.float32))
            if step == 3:
                opt.state[params[2]]["note"] = "kept as it is"  # not a tensor: not in a template
            opt.step()
        return [p.numpy() for p in params], opt

    expected, _ = run(False)
    got, opt = run(True)
    assert sum(t is not None for t in opt._templates.values()) >= 2  # with and without the second's gradient
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)


@pytest.mark.usefixtures("cuda_backend")
def test_a_group_on_two_devices_is_one_update_per_device():
    params = [ember.tensor(np.linspace(-1, 1, 5, dtype=np.float32), requires_grad=True, device=d)
              for d in ("cpu", "cuda", "cpu", "cuda")]
    opt = ember.optim.Adam(params, lr=0.1)
    expected = [torch.tensor(np.linspace(-1, 1, 5, dtype=np.float32), requires_grad=True) for _ in params]
    reference = torch.optim.Adam(expected, lr=0.1)
    for step in range(3):
        for p, e in zip(params, expected):
            g = np.full(5, 0.3 + step, np.float32)
            p.grad, e.grad = ember.tensor(g, device=p.device), torch.tensor(g)
        opt.step()
        reference.step()
    assert [p.device.type for p in params] == ["cpu", "cuda", "cpu", "cuda"]
    for p, e in zip(params, expected):
        np.testing.assert_allclose(p.numpy(), e.detach().numpy(), rtol=1e-5, atol=1e-5)  # float32 rounding
    assert sum(t is not None for t in opt._templates.values()) == 2
