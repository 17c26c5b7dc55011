"""Reverse-mode autodiff: gradients against PyTorch, accumulation, `ember.grad`, grad modes,
detach, retained graphs, in-place updates and half-precision leaves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ember

RNG = np.random.default_rng(2)


def data(*shape, dtype="float32") -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


def leaves(*shapes, dtype="float32"):
    """The same random leaves requiring gradients, for ember and for torch."""
    arrays = [data(*s, dtype=dtype) for s in shapes]
    return ([ember.tensor(a, requires_grad=True) for a in arrays],
            [torch.tensor(a, requires_grad=True) for a in arrays])


def close(e, t, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert e is not None and t is not None
    assert e.shape == tuple(t.shape)
    np.testing.assert_allclose(np.asarray(e.float().numpy()), t.detach().float().numpy(), rtol=rtol, atol=atol)


def composed(lib, x, w, b):
    """A small network step that touches many primitives (matmul, broadcasting, reductions,
    movement, where, exp/log, division, slicing, concatenation)."""
    h = lib.tanh(x @ w + b)
    h = lib.cat([h[:, :2] * 2, h[:, 2:].exp()], 1)
    gate = lib.where(h > 0, h, h * 0.1)
    scaled = gate / (gate.abs().sum(1, keepdim=True) + 1)
    logp = lib.log_softmax(scaled.transpose(0, 1).reshape(-1, 3), 1)
    return -(logp[:, 0].mean() + (x ** 2).mean() * 0.5 + lib.sqrt(w * w + 1).sum() * 0.01)


def test_backward_through_a_composed_expression_matches_torch():
    (x, w, b), (tx, tw, tb) = leaves((6, 4), (4, 5), (5,))
    loss = composed(ember, x, w, b)
    tloss = composed(torch, tx, tw, tb)
    close(loss, tloss)
    loss.backward()
    tloss.backward()
    for e, t in ((x, tx), (w, tw), (b, tb)):
        close(e.grad, t.grad)
        assert e.grad.dtype is ember.float32 and not e.grad.requires_grad


def test_backward_computes_nothing_until_a_gradient_is_read():
    (x,), _ = leaves((3,))
    (x.exp() * 2).sum().backward()
    assert not x.grad._node.realized
    np.testing.assert_allclose(x.grad.numpy(), 2 * np.exp(x.numpy()), rtol=1e-6)


def test_gradients_accumulate_across_backward_calls():
    (x,), (tx,) = leaves((4,))
    (x * x).sum().backward()
    (x.sin()).sum().backward()
    (tx * tx).sum().backward()
    (tx.sin()).sum().backward()
    close(x.grad, tx.grad)
    x.grad = None
    (x * 3).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), np.full(4, 3.0))


def test_backward_with_an_explicit_gradient():
    (x,), (tx,) = leaves((2, 3))
    g = data(2, 3)
    (x.exp() * x).backward(ember.tensor(g))
    (tx.exp() * tx).backward(torch.tensor(g))
    close(x.grad, tx.grad)


def test_diamond_graph_sums_both_paths():
    (x,), (tx,) = leaves((5,))

    def f(lib, v):
        y = v * 2
        return (lib.exp(y) + lib.sin(y) * y).sum() + (v * v + v).sum()

    f(ember, x).backward()
    f(torch, tx).backward()
    close(x.grad, tx.grad)


def test_retain_graph_allows_a_second_backward():
    (x,), (tx,) = leaves((3,))
    y = (x.exp() * x).sum()
    ty = (tx.exp() * tx).sum()
    y.backward(retain_graph=True)
    y.backward()
    ty.backward(retain_graph=True)
    ty.backward()
    close(x.grad, tx.grad)
    with pytest.raises(RuntimeError, match="retain_graph"):
        y.backward()


def test_backward_of_a_non_scalar_needs_a_gradient_and_then_works():
    (x,), (tx,) = leaves((3,))
    y, ty = x * x, tx * tx
    with pytest.raises(RuntimeError, match="gradient"):
        y.backward()
    y.backward(ember.ones(3))
    ty.backward(torch.ones(3))
    close(x.grad, tx.grad)


# -- ember.grad -----------------------------------------------------------------------------

def test_grad_of_leaves_matches_torch_and_leaves_dot_grad_alone():
    (x, w), (tx, tw) = leaves((3, 4), (4,))
    gx, gw = ember.grad((x @ w).tanh().sum(), [x, w])
    tgx, tgw = torch.autograd.grad((tx @ tw).tanh().sum(), [tx, tw])
    close(gx, tgx)
    close(gw, tgw)
    assert x.grad is None and w.grad is None


def test_grad_of_a_non_leaf_input():
    (x,), (tx,) = leaves((4,))
    h, th = x.exp(), tx.exp()
    y, ty = (h * h + h.sin()).sum(), (th * th + th.sin()).sum()
    gh, gx = ember.grad(y, [h, x])
    tgh, tgx = torch.autograd.grad(ty, [th, tx])
    close(gh, tgh)
    close(gx, tgx)
    single = ember.grad((x.exp() * 3).sum(), x)  # one input gives one gradient, not a tuple
    assert isinstance(single, ember.Tensor)
    np.testing.assert_allclose(single.numpy(), 3 * np.exp(x.numpy()), rtol=1e-6)


def test_grad_with_grad_outputs():
    (x,), (tx,) = leaves((2, 3))
    g = data(2, 3)
    (gx,) = ember.grad([x * x.cos()], [x], grad_outputs=[ember.tensor(g)])
    (tgx,) = torch.autograd.grad([tx * tx.cos()], [tx], grad_outputs=[torch.tensor(g)])
    close(gx, tgx)


def test_grad_allow_unused_gives_none_for_an_unused_input():
    (x, unused), _ = leaves((3,), (2,))
    gx, gu = ember.grad((x * 2).sum(), [x, unused], allow_unused=True)
    np.testing.assert_allclose(gx.numpy(), np.full(3, 2.0))
    assert gu is None
    with pytest.raises(RuntimeError, match="allow_unused"):
        ember.grad((x * 2).sum(), [x, unused])


def test_grad_of_an_input_that_does_not_require_grad_raises():
    x = ember.tensor(data(3))
    with pytest.raises(RuntimeError, match="require"):
        ember.grad((x * 2).sum(), x)


# -- grad modes -------------------------------------------------------------------------------

def test_no_grad_context_records_nothing():
    (x,), _ = leaves((3,))
    with ember.no_grad():
        assert not ember.is_grad_enabled()
        y = x * 2
    assert ember.is_grad_enabled()
    assert not y.requires_grad and y.grad_fn is None


def test_a_no_grad_object_switches_on_entry_and_can_be_reused():
    (x,), _ = leaves((3,))
    guard = ember.no_grad()
    assert ember.is_grad_enabled()  # making it switches nothing, as in torch
    for _ in range(2):
        with guard:
            assert not (x * 2).requires_grad
        assert (x * 2).requires_grad


def test_no_grad_as_a_decorator():
    (x,), _ = leaves((3,))

    @ember.no_grad()
    def step(v):
        assert not ember.is_grad_enabled()
        return v * 2

    assert ember.is_grad_enabled()  # making the decorator does not switch anything
    assert not step(x).requires_grad
    assert ember.is_grad_enabled()
    assert step.__name__ == "step"


def test_enable_grad_inside_no_grad():
    (x,), _ = leaves((3,))
    with ember.no_grad():
        with ember.enable_grad():
            y = x * 2
        z = x * 2
    assert y.requires_grad and not z.requires_grad

    @ember.enable_grad()
    def recorded(v):
        return v * 3

    with ember.no_grad():
        assert recorded(x).requires_grad


def test_set_grad_enabled_as_context_function_and_decorator():
    (x,), _ = leaves((3,))
    with ember.set_grad_enabled(False):
        assert not (x * 2).requires_grad
    with ember.set_grad_enabled(True):
        assert (x * 2).requires_grad
    assert ember.is_grad_enabled()
    ember.set_grad_enabled(False)  # called as a function, like torch
    try:
        assert not ember.is_grad_enabled()
        assert not (x * 2).requires_grad
    finally:
        ember.set_grad_enabled(True)
    assert ember.is_grad_enabled()

    @ember.set_grad_enabled(False)
    def off(v):
        return v * 2

    assert not off(x).requires_grad and ember.is_grad_enabled()


def test_grad_mode_is_restored_after_an_exception():
    with pytest.raises(RuntimeError, match="inside"), ember.no_grad():
        raise RuntimeError("failed inside no_grad")
    assert ember.is_grad_enabled()


def test_inference_mode_records_nothing():
    (x,), _ = leaves((2,))
    with ember.inference_mode():
        assert not (x * 2).requires_grad


# -- detach ------------------------------------------------------------------------------------

def test_detach_stops_gradients():
    (x,), (tx,) = leaves((4,))
    (x * x.detach() + x.detach().exp()).sum().backward()
    (tx * tx.detach() + tx.detach().exp()).sum().backward()
    close(x.grad, tx.grad)
    d = x.detach()
    assert not d.requires_grad and d.is_leaf
    np.testing.assert_array_equal(d.numpy(), x.numpy())


def test_detach_in_place_makes_a_leaf():
    (x,), _ = leaves((2,))
    y = x * 2
    y.detach_()
    assert y.is_leaf and not y.requires_grad


# -- in-place and setitem ---------------------------------------------------------------------------

def test_setitem_passes_gradients_to_the_value_and_the_rest_of_the_base():
    (base, value), (tbase, tvalue) = leaves((4, 3), (2, 3))
    weights = data(4, 3)

    def f(lib, b, v):
        out = b * 1
        out[1:3] = v * 2
        return (out * lib.tensor(weights)).sum()

    f(ember, base, value).backward()
    f(torch, tbase, tvalue).backward()
    close(base.grad, tbase.grad)
    close(value.grad, tvalue.grad)


def test_setitem_with_an_index_tensor_passes_gradients():
    (base, value), (tbase, tvalue) = leaves((5, 2), (2, 2))

    def f(lib, b, v):
        out = b * 3
        out[lib.tensor([4, 1])] = v.sin()
        return (out * out).sum()

    f(ember, base, value).backward()
    f(torch, tbase, tvalue).backward()
    close(base.grad, tbase.grad)
    close(value.grad, tvalue.grad)


def test_in_place_ops_on_non_leaves_keep_the_graph():
    (x,), (tx,) = leaves((3,))

    def f(v):
        y = v * 2
        y.add_(1)
        y *= v
        return y.sum()

    f(x).backward()
    f(tx).backward()
    close(x.grad, tx.grad)


def test_in_place_op_on_a_leaf_that_requires_grad_raises():
    (w,), _ = leaves((3,))
    before = w.numpy()
    for update in (lambda: w.add_(1), lambda: w.mul_(2), lambda: w.zero_(), lambda: w.copy_(w * 2)):
        with pytest.raises(RuntimeError, match="leaf"):
            update()
    with pytest.raises(RuntimeError, match="in-place"):
        w[0] = 1.0
    np.testing.assert_array_equal(w.numpy(), before)  # nothing changed
    assert w.requires_grad and w.is_leaf


def test_in_place_update_of_a_leaf_under_no_grad_is_an_sgd_step():
    (w,), (tw,) = leaves((3,))
    for _ in range(3):
        (w * w.exp()).sum().backward()
        (tw * tw.exp()).sum().backward()
        with ember.no_grad():
            w -= 0.1 * w.grad
        with torch.no_grad():
            tw -= 0.1 * tw.grad
        w.grad = tw.grad = None
    close(w, tw)
    assert w.is_leaf and w.requires_grad and w.grad_fn is None


# -- dtypes of gradients ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gradients_of_half_precision_leaves_have_the_leaf_dtype(dtype):
    a = data(6)
    x = ember.tensor(a).to(dtype).requires_grad_()
    tx = torch.tensor(a).to(getattr(torch, dtype)).requires_grad_()
    (x * x.exp()).sum().backward()
    (tx * tx.exp()).sum().backward()
    assert x.grad.dtype is getattr(ember, dtype)
    close(x.grad, tx.grad, rtol=2e-2, atol=2e-2)


def test_gradient_flows_back_through_a_cast_to_the_leaf_dtype():
    (x,), (tx,) = leaves((4,), dtype="float64")
    (x.float() * 3).sum().backward()
    (tx.float() * 3).sum().backward()
    assert x.grad.dtype is ember.float64
    close(x.grad, tx.grad)


def test_integer_results_do_not_require_grad():
    (x,), _ = leaves((4,))
    assert not x.argmax().requires_grad
    assert not (x > 0).requires_grad
    assert not x.long().requires_grad


def test_a_backward_pass_of_a_structure_seen_before_is_built_from_its_template_without_the_vjp_rules(monkeypatch):
    from ember import autograd

    monkeypatch.setattr(autograd, "_templates", {})  # as in a new process
    (x, w, b), (tx, tw, tb) = leaves((4, 3), (3, 3), (3,))
    rules = []
    vjp = autograd._vjp
    monkeypatch.setattr(autograd, "_vjp", lambda fn, g: rules.append(fn.op) or vjp(fn, g))
    for step in range(3):
        rules.clear()
        for p in (x, w, b):
            p.grad = None
        composed(ember, x, w, b).backward()
        assert (len(rules) > 10) == (step == 0)  # the rules run once; later passes are built from the template
        for t in (tx, tw, tb):
            t.grad = None
        composed(torch, tx, tw, tb).backward()
        for e, t in ((x, tx), (w, tw), (b, tb)):
            close(e.grad, t.grad)


def test_a_template_is_kept_per_constant_value_shape_and_leaf_pattern():
    """A rule may read a constant's value (an exponent) or the shapes; which inputs need gradients changes the
    graph: each is a structure of its own, and each pass gets its own gradients."""
    cases = [((3, 2), 0.3, True), ((3, 2), 0.7, True), ((3, 2), 0.7, False), ((5, 2), 0.7, True)]
    for _ in range(2):
        for shape, exponent, both in cases:
            a, b = data(*shape), data(*shape)
            x = ember.tensor(np.abs(a) + 0.5, requires_grad=True)
            y = ember.tensor(b, requires_grad=both)
            tx = torch.tensor(np.abs(a) + 0.5, requires_grad=True)
            ty = torch.tensor(b, requires_grad=both)
            (x ** exponent * y).sum().backward()
            (tx ** exponent * ty).sum().backward()
            close(x.grad, tx.grad)
            assert (y.grad is None) == (not both)
            if both:
                close(y.grad, ty.grad)


def test_gradients_built_from_a_template_accumulate_and_free_the_graph_as_the_rules_do():
    (x, w, b), (tx, tw, tb) = leaves((4, 3), (3, 3), (3,))
    for _ in range(3):  # the second and third passes come from the template, adding to .grad
        loss = composed(ember, x, w, b)
        loss.backward(retain_graph=True)
        loss.backward()
        with pytest.raises(RuntimeError, match="a second time"):
            loss.backward()
        tloss = composed(torch, tx, tw, tb)
        tloss.backward(retain_graph=True)
        tloss.backward()
    for e, t in ((x, tx), (w, tw), (b, tb)):
        close(e.grad, t.grad, rtol=1e-4)


def test_a_post_accumulate_grad_hook_sees_the_leaf_after_each_backward_until_removed():
    w = ember.tensor([1.0, 2.0, 3.0], requires_grad=True)
    seen = []
    handle = w.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.numpy().copy()))
    (w * w).sum().backward()
    (w * 3).sum().backward()
    np.testing.assert_array_equal(seen[0], [2.0, 4.0, 6.0])
    np.testing.assert_array_equal(seen[1], [5.0, 7.0, 9.0])  # accumulated
    handle.remove()
    w.sum().backward()
    assert len(seen) == 2
    with pytest.raises(RuntimeError, match="only a leaf tensor"):
        (w * 2).register_post_accumulate_grad_hook(lambda t: None)
    with pytest.raises(RuntimeError, match="does not require grad"):
        ember.ones(2).register_post_accumulate_grad_hook(lambda t: None)
