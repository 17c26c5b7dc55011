"""Attention as one fused kernel: the hand-written form (softmax of scaled, masked q @ kᵀ, times v) is recognised in
its usual spellings and computes what torch computes, values and gradients; a causal mask made of indices becomes
the kernel's causal flag; the forward is one kernel and the backward one, with no L x S value stored; shapes that
cross tiles, half precision, and what is left as written (dropout, a softmax over another axis)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import ember
from ember.compiler.fused import KernelKind
from ember.explain import plan
from ember.ir import Op
from tests.conftest import check_against_torch

pytestmark = pytest.mark.usefixtures("device")


def arrays(seed, *shapes, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def causal_keep(m, length, keys, device):
    """A boolean (length, keys) mask, True where query i may attend to key j <= i, made of indices."""
    if m is not ember:
        return torch.ones(length, keys, dtype=torch.bool).tril()
    return ember.ones(length, keys, dtype=ember.bool, device=device).tril()


def spelled(form: str):
    """Attention written by hand, in one of the spellings people use."""
    def fn(m, q, k, v, device="cpu"):
        d, length, keys = q.shape[-1], q.shape[-2], k.shape[-2]
        scores = q @ k.transpose(-2, -1)
        if form == "masked_fill_tril":
            scores = (scores * (1 / math.sqrt(d))).masked_fill(~causal_keep(m, length, keys, device), float("-inf"))
        elif form == "masked_fill_triu":
            upper = (torch.ones(length, keys, dtype=torch.bool) if m is not ember
                     else ember.ones(length, keys, dtype=ember.bool, device=device)).triu(1)
            scores = scores.masked_fill(upper, float("-inf")) / math.sqrt(d)
        elif form == "where_keep":
            never = torch.tensor(-math.inf) if m is not ember else ember.full((), -math.inf, device=device)
            scores = m.where(causal_keep(m, length, keys, device), scores / math.sqrt(d), never)
        elif form == "scaled_query":
            scores = (q * d ** -0.5) @ k.transpose(-2, -1)
        elif form == "plain":
            pass
        weights = m.nn.functional.softmax(scores, dim=-1)
        return weights @ v
    return fn


FORMS = {"masked_fill_tril": True, "masked_fill_triu": True, "where_keep": True, "scaled_query": False,
         "plain": False}


@pytest.mark.parametrize("form", list(FORMS))
def test_hand_written_attention_is_one_node_and_matches_torch(form, device):
    q, k, v = arrays(1, (2, 3, 9, 8), (2, 3, 11, 8), (2, 3, 11, 6))
    fn = spelled(form)
    out = fn(ember, *(ember.tensor(a, device=device) for a in (q, k, v)), device)
    assert out._node.op is Op.ATTENTION
    assert out._node.attrs["causal"] is FORMS[form]
    check_against_torch(lambda m, q, k, v: fn(m, q, k, v, device), q, k, v, rtol=1e-5, atol=1e-5)


def test_an_added_mask_and_a_boolean_mask_of_data_are_inputs_of_the_kernel(device):
    q, k, v = arrays(2, (2, 2, 7, 16), (2, 2, 12, 16), (2, 2, 12, 16))
    rng = np.random.default_rng(3)
    bias = rng.standard_normal((2, 1, 7, 12)).astype(np.float32)
    keep = rng.random((7, 12)) > 0.3
    keep[:, 0] = True

    def added(m, q, k, v, b):
        return m.nn.functional.softmax(q @ k.transpose(-2, -1) * 0.25 + b, dim=-1) @ v

    given = [ember.tensor(a, device=device) for a in (q, k, v)]
    out = added(ember, *given, ember.tensor(bias, device=device))
    assert out._node.op is Op.ATTENTION and out._node.attrs["mask"] == "add"
    check_against_torch(added, q, k, v, bias, rtol=1e-5, atol=1e-5)

    def kept(m, q, k, v, a):
        return m.nn.functional.softmax((q @ k.transpose(-2, -1)).masked_fill(~a, float("-inf")) * 0.25, dim=-1) @ v

    out = kept(ember, *given, ember.tensor(keep, device=device))
    assert out._node.op is Op.ATTENTION and out._node.attrs["mask"] == "keep"
    check_against_torch(kept, q, k, v, keep, rtol=1e-5, atol=1e-5)


def test_a_row_masked_whole_is_nan_written_by_hand_and_zeros_through_sdpa(device):
    q, k, v = arrays(4, (1, 4, 8), (1, 6, 8), (1, 6, 8))
    keep = np.ones((4, 6), bool)
    keep[2] = False
    eq, ek, ev = (ember.tensor(a, device=device) for a in (q, k, v))
    mask = ember.tensor(keep, device=device)
    by_hand = ember.nn.functional.softmax((eq @ ek.transpose(-2, -1)).masked_fill(~mask, float("-inf")), -1) @ ev
    assert by_hand._node.op is Op.ATTENTION
    expected = torch.softmax((torch.tensor(q) @ torch.tensor(k).mT).masked_fill(~torch.tensor(keep), -math.inf),
                             -1) @ torch.tensor(v)
    np.testing.assert_allclose(by_hand.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)  # NaN where torch's is
    assert np.isnan(by_hand.numpy()[0, 2]).all()
    fused = ember.nn.functional.scaled_dot_product_attention(eq, ek, ev, attn_mask=mask)
    assert fused._node.op is Op.ATTENTION
    np.testing.assert_array_equal(fused.numpy()[0, 2], 0.0)


@pytest.mark.parametrize("shapes", [
    ((1, 2, 70, 40), (1, 2, 130, 40), (1, 2, 130, 24)),  # queries and keys over several tiles, with tails
    ((2, 1, 1, 8), (2, 1, 1, 8), (2, 1, 1, 8)),  # one query, one key
    ((1, 3, 0, 8), (1, 3, 5, 8), (1, 3, 5, 8)),  # no queries
    ((1, 3, 4, 8), (1, 3, 0, 8), (1, 3, 0, 8)),  # no keys: zeros
])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_across_tiles_and_at_degenerate_sizes_matches_torch(shapes, is_causal):
    q, k, v = arrays(5, *shapes)
    check_against_torch(lambda m, q, k, v: m.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal),
                        q, k, v, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_half_precision_attention_matches_torch_within_rounding(dtype, device):
    import ml_dtypes
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    q, k, v = (a.astype(np_dtype) for a in arrays(6, (2, 2, 33, 32), (2, 2, 47, 32), (2, 2, 47, 32)))
    given = [ember.tensor(a, device=device) for a in (q, k, v)]
    assert ember.nn.functional.scaled_dot_product_attention(*given, is_causal=True)._node.op is Op.ATTENTION
    check_against_torch(lambda m, q, k, v: m.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                        q, k, v, rtol=2e-2, atol=2e-2, grad_rtol=3e-2, grad_atol=3e-2)


def test_forward_and_backward_are_one_kernel_each_and_store_no_scores(device):
    q, k, v = (ember.tensor(a, device=device).requires_grad_() for a in arrays(7, (2, 4, 64, 16), (2, 4, 64, 16),
                                                                             (2, 4, 64, 16)))
    for t in (q, k, v):
        t.numpy()
    out = spelled("masked_fill_tril")(ember, q, k, v, device)
    out = out + ember.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.2)  # draws never stored
    loss = (out * out).sum()
    grads = ember.grad(loss, [q, k, v])
    if device == "cpu":
        return  # the reference backend runs node by node: no plan of kernels
    kernels = plan(loss, *grads).kernels
    attention = [k for k in kernels if k.kind is KernelKind.ATTENTION]
    results = sorted(tuple(sorted(o.attrs["result"] for o in k.outputs)) for k in attention)
    assert results == [("dk", "dq", "dv")] * 2 + [("lse", "out")] * 2  # two attentions, each two kernels
    scores = 2 * 4 * 64 * 64
    assert all(o.numel < scores for k in kernels for o in k.outputs), "an L x S value is stored"


def test_dropout_is_drawn_inside_the_kernels_as_the_unfused_graph_draws_it(device):
    """SDPA's dropout and dropout written by hand on the weights are the kernel's: the same draws (one seed) give the
    same values and gradients as the graph computed without the fused kernel, forward and backward."""
    arrays_ = arrays(10, (2, 2, 21, 16), (2, 2, 30, 16), (2, 2, 30, 16), (2, 2, 21, 16))
    results = []
    for form in ("sdpa", "by_hand", "unfused"):
        q, k, v = (ember.tensor(a, device=device).requires_grad_() for a in arrays_[:3])
        ember.manual_seed(7)
        if form == "sdpa":
            out = ember.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)).masked_fill(~causal_keep(ember, 21, 30, device), float("-inf")) / 4
            weights = ember.nn.functional.dropout(ember.nn.functional.softmax(scores, -1), 0.3, True)
            out = weights @ v if form == "by_hand" else (weights.unsqueeze(-1) * v.unsqueeze(-3)).sum(-2)
        assert (out._node.op is Op.ATTENTION) == (form != "unfused")
        grads = ember.grad(out, [q, k, v], ember.tensor(arrays_[3], device=device))
        results.append([out.numpy(), *(g.numpy() for g in grads)])
    for fused in results[:2]:
        for a, b in zip(fused, results[2]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    q, k, v = (ember.tensor(a, device=device) for a in arrays_[:3])
    undropped = ember.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).numpy()
    assert np.abs(results[0][0] - undropped).max() > 1e-2  # the weights were dropped


def test_what_is_not_attention_is_left_as_written(device):
    q, k, v = (ember.tensor(a, device=device) for a in arrays(8, (2, 5, 8), (2, 5, 8), (2, 5, 8)))
    scores = q @ k.transpose(-2, -1)
    assert (ember.nn.functional.softmax(scores, dim=1) @ v)._node.op is Op.MATMUL  # over the queries
    half = ember.tensor(np.full((2, 5, 5), 0.5, np.float32), device=device)
    by_tensor = ember.nn.functional.softmax(scores * half, dim=-1)
    assert (by_tensor @ v)._node.op is Op.MATMUL
    draws = ember.rand(2, 5, 5, device=device)  # not dropout's own form: a mask made apart, then applied
    assert ((ember.nn.functional.softmax(scores, dim=-1) * (draws >= 0.5)) @ v)._node.op is Op.MATMUL

