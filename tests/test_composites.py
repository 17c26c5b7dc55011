"""Composite ops (ember.ir.ops.define_composite): one node while a step's graph is built and looked up, the same
primitives as the op spelled out once compiled, and the same values and gradients as torch, on both backends."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ember
import ember.nn.functional as F
from ember.compiler import CompileContext, passes
from ember.explain import plan
from ember.ir import Op, toposort

pytestmark = pytest.mark.usefixtures("device")

RNG = np.random.default_rng(7)
TOL = {"float32": (1e-5, 1e-5), "float16": (2e-3, 2e-3), "bfloat16": (2e-2, 2e-2)}


def pair(shape, dtype, grad=True):
    values = RNG.standard_normal(shape).astype(np.float32)
    e = ember.tensor(values).to(getattr(ember, dtype)).requires_grad_(grad)
    t = torch.tensor(values).to(getattr(torch, dtype)).requires_grad_(grad)
    return e, t


def close(e, t, dtype):
    rtol, atol = TOL[dtype]
    scale = max(1.0, float(t.detach().float().abs().max())) if t.numel() else 1.0
    np.testing.assert_allclose(e.float().numpy(), t.detach().float().numpy(), rtol=rtol, atol=atol * scale)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(("x_shape", "out_features", "bias"), [
    ((5, 7), 3, True), ((2, 4, 7), 3, False), ((7,), 1, True), ((0, 7), 3, True), ((5, 0), 3, True),
    ((5, 7), 0, True), ((1, 1), 1, True)])
def test_linear_is_one_node_until_compiled_and_matches_torch_forward_and_backward(x_shape, out_features, bias, dtype):
    (x, tx), (w, tw) = pair(x_shape, dtype), pair((out_features, x_shape[-1]), dtype)
    b, tb = pair((out_features,), dtype) if bias else (None, None)
    for _ in range(2):  # the second backward comes from its template
        for t in (x, w, b, tx, tw, tb):
            if t is not None:
                t.grad = None
        out = F.linear(x, w, b)
        assert out._node.op is Op.LINEAR
        expected = torch.nn.functional.linear(tx, tw, tb)
        close(out, expected, dtype)
        (out.float() * 1.7).sum().backward()
        (expected.float() * 1.7).sum().backward()
        for e, t in ((x, tx), (w, tw), (b, tb)):
            if e is not None:
                close(e.grad, t.grad, dtype)


def test_linear_plans_as_the_primitives_it_is_made_of():
    x, _ = pair((33, 20), "float32", grad=False)
    w, _ = pair((12, 20), "float32", grad=False)
    b, _ = pair((12,), "float32", grad=False)
    composite = F.linear(x, w, b).tanh()
    spelled_out = (x @ w.mT + b).tanh()
    assert len(toposort([composite._node])) < len(toposort([spelled_out._node]))
    expanded, _ = passes.expand_composites(toposort([composite._node]), {id(composite._node)})
    assert [n.op for n in expanded] == [n.op for n in toposort([spelled_out._node])]
    assert [k.kind for k in plan(composite).kernels] == [k.kind for k in plan(spelled_out).kernels]
    np.testing.assert_array_equal(composite.numpy(), spelled_out.numpy())


def test_linear_operands_that_need_promotion_or_a_vector_weight_take_the_primitives_and_match_torch():
    x, tx = pair((4, 6), "float16")
    w, tw = pair((3, 6), "float16")
    b, tb = pair((3,), "float32")  # promotes the result to float32, as in torch
    out = F.linear(x, w, b)
    assert out._node.op is not Op.LINEAR and out.dtype is ember.float32
    close(out, torch.nn.functional.linear(tx.float(), tw.float(), tb), "float16")
    v, tv = pair((6,), "float32")
    x32, tx32 = pair((4, 6), "float32")
    close(F.linear(x32, v), torch.nn.functional.linear(tx32, tv), "float32")


@pytest.mark.parametrize(("made", "op"), [(lambda x: x + ember.tensor(np.ones(x.shape, np.float32)), "buffer"),
                                          (lambda x: x + ember.rand(*x.shape), "rand")])
def test_an_expansion_that_would_add_an_argument_to_the_plan_is_a_compile_error(monkeypatch, made, op):
    """A buffer or a random draw made by an expansion would be an argument the graph's signature does not have
    (the plan is looked up by the graph as built)."""
    from ember.errors import CompileError
    from ember.ir.ops import RULES
    from ember.tensor import Tensor

    x, _ = pair((2, 3), "float32", grad=False)
    w, _ = pair((3, 3), "float32", grad=False)
    out = F.linear(x, w)
    monkeypatch.setattr(RULES[Op.LINEAR], "expand", lambda inputs, attrs: made(Tensor(inputs[0]))._node)
    with pytest.raises(CompileError, match=f"linear: its expansion makes a {op} node"):
        ember.compiler.compile(toposort([out._node]), {id(out._node)}, "triton", CompileContext())


def test_the_floats_an_expansion_makes_are_part_of_the_plans_code(monkeypatch):
    """A float constant an expansion makes comes from the node's attributes and shapes, which the plan's key
    holds: it is written into the kernels, not passed to them."""
    from ember.ir.ops import RULES
    from ember.tensor import Tensor

    x, _ = pair((2, 3), "float32", grad=False)
    w, _ = pair((3, 3), "float32", grad=False)
    out = F.linear(x, w)
    monkeypatch.setattr(RULES[Op.LINEAR], "expand", lambda inputs, attrs: (Tensor(inputs[0]) * 0.3 - 1.7)._node)
    compiled = ember.compiler.compile(toposort([out._node]), {id(out._node)}, "triton", CompileContext())
    assert not [n for n in compiled.lowered.nodes if "arg" in n.attrs]
    np.testing.assert_allclose(out.numpy(), x.numpy() * np.float32(0.3) - np.float32(1.7), rtol=1e-6)


ACTIVATIONS = [("relu", {}, Op.RELU), ("gelu", {}, Op.GELU), ("gelu", {"approximate": "tanh"}, Op.GELU),
               ("silu", {}, Op.SILU)]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(("name", "kwargs", "op"), ACTIVATIONS, ids=lambda v: str(v) if isinstance(v, str) else "")
def test_an_activation_is_one_node_with_the_values_and_gradients_of_torch(name, kwargs, op, dtype):
    x, tx = pair((5, 7), dtype)
    out = getattr(F, name)(x, **kwargs)
    assert out._node.op is op and out.dtype is x.dtype
    expected = getattr(torch.nn.functional, name)(tx.float(), **kwargs)
    close(out, expected, dtype)
    g = RNG.standard_normal((5, 7)).astype(np.float32)
    out.backward(ember.tensor(g).to(x.dtype))
    expected.backward(torch.tensor(g))
    close(x.grad, tx.grad, dtype)


def test_an_activation_of_integers_keeps_its_dtype_and_is_no_composite():
    x = ember.tensor(np.array([-2, 0, 3], np.int64))
    out = F.relu(x)
    assert out.dtype is ember.int64 and out._node.op is not Op.RELU
    np.testing.assert_array_equal(out.numpy(), [0, 0, 3])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_mse_loss_is_one_node_with_the_values_and_gradients_of_torch(reduction, dtype):
    x, tx = pair((6, 5), dtype)
    y, ty = pair((6, 5), dtype, grad=False)
    out = F.mse_loss(x, y, reduction=reduction)
    assert out._node.op is Op.MSE_LOSS and out.dtype is x.dtype
    expected = torch.nn.functional.mse_loss(tx, ty, reduction=reduction)
    close(out, expected.float(), dtype)
    out.sum().backward()
    expected.sum().backward()
    close(x.grad, tx.grad.float(), dtype)


def test_mse_loss_of_broadcast_operands_is_the_primitives():
    x, tx = pair((6, 5), "float32")
    y, ty = pair((5,), "float32", grad=False)
    with pytest.warns(UserWarning, match="broadcast"):
        out = F.mse_loss(x, y)
    assert out._node.op is not Op.MSE_LOSS
    close(out, torch.nn.functional.mse_loss(tx, ty.expand(6, 5)), "float32")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(("name", "op"), [("softmax", Op.SOFTMAX), ("log_softmax", Op.LOG_SOFTMAX)])
@pytest.mark.parametrize(("dim", "as_dtype"), [(-1, None), (0, None), (1, "float32")])
def test_softmax_is_one_node_with_the_values_and_gradients_of_torch(name, op, dim, as_dtype, dtype):
    x, tx = pair((4, 9), dtype)
    out = getattr(F, name)(x, dim=dim, dtype=as_dtype and getattr(ember, as_dtype))
    expected = getattr(torch.nn.functional, name)(tx, dim=dim, dtype=as_dtype and getattr(torch, as_dtype))
    assert out._node.op is op and out.dtype.name == str(expected.dtype).removeprefix("torch.")
    close(out, expected.float(), as_dtype or dtype)
    g = RNG.standard_normal((4, 9)).astype(np.float32)
    out.backward(ember.tensor(g).to(out.dtype))
    expected.backward(torch.tensor(g).to(expected.dtype))
    close(x.grad, tx.grad.float(), dtype)


@pytest.mark.parametrize(("dtype", "params"), [("float32", "float32"), ("float16", "float16"),
                                               ("bfloat16", "float32"), ("float32", None), ("float16", "bias")])
def test_layer_norm_is_one_node_with_the_values_and_gradients_of_torch(dtype, params):
    x, tx = pair((3, 4, 6), dtype)
    w, tw = pair((4, 6), params if params in TOL else dtype)
    b, tb = pair((4, 6), params if params in TOL else dtype)
    if params is None:
        (w, tw), (b, tb) = (None, None), (None, None)
    if params == "bias":
        w, tw = None, None
    out = F.layer_norm(x, (4, 6), w, b, eps=1e-3)
    expected = torch.nn.functional.layer_norm(tx, (4, 6), tw, tb, eps=1e-3)
    assert out._node.op is Op.LAYER_NORM and out.dtype is x.dtype
    close(out, expected.float(), dtype)
    (out.float() * out.float()).sum().backward()
    # the gradients against torch's in float64 from the same inputs: torch's own float16 gradients differ from
    # those by up to the tolerance (over 60 random inputs: 0.0077 at most, ember's 0.0050)
    exact = [t.detach().double().requires_grad_() if t is not None else None for t in (tx, tw, tb)]
    reference = torch.nn.functional.layer_norm(*exact[:1], (4, 6), *exact[1:], eps=1e-3)
    (reference * reference).sum().backward()
    rtol, atol = TOL[dtype]
    for ours, theirs in zip((x, w, b), exact):
        if ours is not None:  # a sum of squares over the batch: its gradient is as large as that sum
            np.testing.assert_allclose(ours.grad.float().numpy(), theirs.grad.float().numpy(), rtol=rtol,
                                       atol=atol * max(1.0, float(theirs.grad.abs().max())))


def test_layer_norm_with_parameters_of_a_wider_type_than_float32_inputs_is_the_primitives():
    x, tx = pair((2, 5), "float32")
    w = ember.tensor(RNG.standard_normal(5)).to(ember.float64)
    out = F.layer_norm(x, (5,), w)
    assert out._node.op is not Op.LAYER_NORM and out.dtype is ember.float64
    close(out, torch.nn.functional.layer_norm(tx.double(), (5,), torch.tensor(w.numpy())), "float32")


@pytest.mark.parametrize(("dtype", "affine"), [("float32", True), ("float16", True), ("bfloat16", False)])
def test_batch_norm_in_training_is_one_node_per_result_with_torchs_values_gradients_and_statistics(dtype, affine):
    shape = (4, 3, 5, 2)
    values = RNG.standard_normal(shape).astype(np.float32) * 2 + 0.7
    ours = ember.nn.BatchNorm2d(3, affine=affine)
    theirs = torch.nn.BatchNorm2d(3, affine=affine)
    if affine:
        ours.weight.data = ember.tensor(RNG.standard_normal(3).astype(np.float32))
        with torch.no_grad():
            theirs.weight.copy_(torch.tensor(ours.weight.numpy()))
    for step in range(2):
        x = ember.tensor(values * (step + 1)).to(getattr(ember, dtype)).requires_grad_(True)
        tx = torch.tensor(values * (step + 1)).to(getattr(torch, dtype)).requires_grad_(True)
        out = ours(x)
        expected = torch.nn.functional.batch_norm(tx, theirs.running_mean, theirs.running_var, theirs.weight,
                                                  theirs.bias, True, 0.1, 1e-5)
        assert out._node.op is Op.BATCH_NORM and ours.running_var._node.op is Op.BATCH_NORM
        close(out, expected.float(), dtype)
        g = RNG.standard_normal(shape).astype(np.float32)
        out.backward(ember.tensor(g).to(out.dtype))
        expected.backward(torch.tensor(g).to(expected.dtype))
        close(x.grad, tx.grad.float(), dtype)
        np.testing.assert_allclose(ours.running_mean.numpy(), theirs.running_mean.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ours.running_var.numpy(), theirs.running_var.numpy(), rtol=1e-5, atol=1e-6)
    if affine:
        close(ours.weight.grad, theirs.weight.grad, "float32" if dtype == "float32" else "float16")


@pytest.mark.parametrize("momentum", [None, "tensor"])
def test_batch_norm_with_a_cumulative_or_tensor_momentum_is_the_primitives(momentum):
    x, tx = pair((6, 2, 3), "float32")
    ours, theirs = ember.nn.BatchNorm1d(2, momentum=None), torch.nn.BatchNorm1d(2, momentum=None)
    if momentum == "tensor":
        ours, theirs = ember.nn.BatchNorm1d(2), torch.nn.BatchNorm1d(2)
        out = F.batch_norm(x, ours.running_mean, ours.running_var, training=True, momentum=ember.tensor(0.1))
        expected = torch.nn.functional.batch_norm(tx, theirs.running_mean, theirs.running_var, training=True)
    else:
        out, expected = ours(x), theirs(tx)
    assert out._node.op is not Op.BATCH_NORM
    close(out, expected, "float32")
    np.testing.assert_allclose(ours.running_var.numpy(), theirs.running_var.numpy(), rtol=1e-5)


def test_a_composites_gradient_is_derived_once_per_kind_of_node_then_built_from_its_template(monkeypatch):
    """Without backward templates (a structure seen for the first time), each composite node's VJP would build its
    decomposition again and differentiate it; it does that once per kind of node."""
    from ember import autograd

    structure = autograd._structure
    monkeypatch.setattr(autograd, "_structure", lambda roots, functions: (None, *structure(roots, functions)[1:]))
    derived = []
    grad = autograd.grad
    monkeypatch.setattr(autograd, "grad", lambda *a, **k: derived.append(1) or grad(*a, **k))
    for step in range(3):
        x, tx = pair((7, 13), "float32")
        if step == 1:
            derived.clear()
        out = (F.gelu(x, approximate="tanh") * F.softmax(x, dim=-1)).sum()
        out.backward()
        (torch.nn.functional.gelu(tx, approximate="tanh") * torch.softmax(tx, dim=-1)).sum().backward()
        close(x.grad, tx.grad, "float32")
    assert derived == []


def test_a_backward_pass_through_composites_is_still_recorded_as_a_template(monkeypatch):
    from ember import autograd

    monkeypatch.setattr(autograd, "_templates", {})
    # the second GELU's gradient is built from the first one's template, inside the backward pass's recording
    model = ember.nn.Sequential(ember.nn.Linear(5, 6), ember.nn.GELU(), ember.nn.Linear(6, 6), ember.nn.GELU(),
                                ember.nn.LayerNorm(6), ember.nn.Linear(6, 2))
    for _ in range(3):
        x, _ = pair((4, 5), "float32", grad=False)
        F.mse_loss(model(x), ember.zeros(4, 2)).backward()
    assert len(autograd._templates) == 1 and None not in autograd._templates.values()


@pytest.mark.parametrize(("shape", "reduction", "smoothing"), [((5, 7), "mean", 0.0), ((3, 4, 2, 2), "sum", 0.2),
                                                               ((6,), "none", 0.0), ((4, 3), "none", 0.1)])
def test_cross_entropy_of_class_indices_is_one_node_with_torchs_values_and_gradients(shape, reduction, smoothing):
    """Its expansion holds a log-softmax, itself a composite: the compiler expands that in turn."""
    x, tx = pair(shape, "float32")
    classes = shape[0] if len(shape) == 1 else shape[1]
    target = RNG.integers(0, classes, shape[:0] if len(shape) == 1 else (shape[0], *shape[2:]))
    if target.ndim:
        target.flat[0] = -100  # ignored
    out = F.cross_entropy(x, ember.tensor(target), reduction=reduction, label_smoothing=smoothing)
    expected = torch.nn.functional.cross_entropy(tx, torch.tensor(target), reduction=reduction,
                                                 label_smoothing=smoothing)
    assert out._node.op is Op.CROSS_ENTROPY
    close(out, expected, "float32")
    out.sum().backward()
    expected.sum().backward()
    close(x.grad, tx.grad, "float32")
    expanded, _ = passes.expand_composites(toposort([out._node]), {id(out._node)})
    assert not [n for n in expanded if n.op.kind is Op.CROSS_ENTROPY.kind]


def test_cross_entropy_with_class_weights_is_the_primitives():
    x, tx = pair((4, 3), "float32")
    w, tw = pair((3,), "float32", grad=False)
    target = np.array([0, 2, 1, 2])
    out = F.cross_entropy(x, ember.tensor(target), weight=w)
    assert out._node.op is not Op.CROSS_ENTROPY
    close(out, torch.nn.functional.cross_entropy(tx, torch.tensor(target), weight=tw), "float32")
