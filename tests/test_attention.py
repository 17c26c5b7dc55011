"""scaled_dot_product_attention, rms_norm and RMSNorm against PyTorch: values and gradients, masks, grouped heads,
degenerate sizes, half precision, and the errors of bad input."""

import numpy as np
import pytest
import torch

import ember
from ember.errors import DTypeError, ShapeError
from tests.conftest import check_against_torch

pytestmark = pytest.mark.usefixtures("device")


def sdpa(m, *args, **kwargs):
    return m.nn.functional.scaled_dot_product_attention(*args, **kwargs)


def arrays(seed, *shapes, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


# (query, key, value) shapes: heads, queries L against keys S (L < S, L > S), one query, one key, a batch of 0
SHAPES = {
    "heads": ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 4)),
    "more_queries_than_keys": ((1, 2, 9, 4), (1, 2, 3, 4), (1, 2, 3, 6)),
    "one_query": ((2, 1, 16), (2, 6, 16), (2, 6, 16)),
    "one_key": ((3, 4, 8), (3, 1, 8), (3, 1, 5)),
    "no_batch": ((0, 2, 4, 8), (0, 2, 4, 8), (0, 2, 4, 8)),
    "two_dims": ((5, 8), (6, 8), (6, 3)),
}


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shapes", list(SHAPES))
def test_attention_and_its_gradients_match_torch(shapes, is_causal):
    q, k, v = arrays(1, *SHAPES[shapes])
    check_against_torch(lambda m, q, k, v: sdpa(m, q, k, v, is_causal=is_causal), q, k, v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mask", ["bool", "bool_broadcast", "additive"])
def test_a_mask_restricts_or_shifts_the_scores_as_in_torch(mask):
    q, k, v = arrays(2, (2, 2, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8))
    rng = np.random.default_rng(3)
    if mask == "additive":
        given = rng.standard_normal((2, 1, 5, 7)).astype(np.float32)
    else:
        given = rng.random((5, 7) if mask == "bool_broadcast" else (2, 2, 5, 7)) > 0.4
        given[..., 0] = True  # every query keeps a key
    check_against_torch(lambda m, q, k, v, a: sdpa(m, q, k, v, attn_mask=a), q, k, v, given, rtol=1e-5, atol=1e-6)


def test_a_query_masked_from_every_key_gets_zeros_and_zero_gradients():
    q, k, v = arrays(4, (1, 4, 8), (1, 6, 8), (1, 6, 3))
    mask = np.ones((4, 6), bool)
    mask[1] = False
    out = check_against_torch(lambda m, q, k, v, a: sdpa(m, q, k, v, attn_mask=a), q, k, v, mask, rtol=1e-5,
                              atol=1e-6)[0]
    np.testing.assert_array_equal(out.numpy()[0, 1], 0.0)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_query_attention_shares_each_key_head_with_its_group(kv_heads):
    q, k, v = arrays(5, (2, 4, 6, 8), (2, kv_heads, 6, 8), (2, kv_heads, 6, 8))
    check_against_torch(lambda m, q, k, v: sdpa(m, q, k, v, enable_gqa=True, scale=0.25, is_causal=True), q, k, v,
                        rtol=1e-5, atol=1e-6)


def test_half_precision_attention_with_an_inexact_scale_matches_torch_in_float32():
    q, k, v = (ember.tensor(a).to(ember.float16) for a in arrays(6, (2, 2, 16, 32), (2, 2, 24, 32), (2, 2, 24, 32)))
    out = ember.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.1)
    assert out.dtype is ember.float16
    tq, tk, tv = (torch.tensor(t.numpy()).float() for t in (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, scale=0.1).numpy()
    got = out.numpy().astype(np.float32)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


def test_attention_dropout_keeps_the_weights_unbiased():
    ember.manual_seed(7)
    q, k = (ember.tensor(a) for a in arrays(7, (64, 8), (32, 8)))
    v = ember.ones(32, 16)
    out = ember.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.5).numpy()
    # each output element sums 32 weights (summing to 1), each kept and doubled or dropped: mean 1
    assert abs(out.mean() - 1.0) < 0.1 and out.std() > 0.05
    np.testing.assert_allclose(ember.nn.functional.scaled_dot_product_attention(q, k, v).numpy(), 1.0, rtol=1e-5)


def test_bad_attention_inputs_name_the_problem():
    q, k, v = (ember.tensor(a) for a in arrays(8, (2, 4, 8), (2, 5, 8), (2, 5, 8)))
    F = ember.nn.functional
    with pytest.raises(ShapeError, match="scaled_dot_product_attention"):
        F.scaled_dot_product_attention(q, ember.tensor(arrays(9, (2, 5, 7))[0]), v)
    with pytest.raises(DTypeError, match="scaled_dot_product_attention"):
        F.scaled_dot_product_attention(q, k.to(ember.float64), v)
    with pytest.raises(ValueError, match="is_causal"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=ember.ones(4, 5, dtype=ember.bool), is_causal=True)
    with pytest.raises(ValueError, match="dropout_p"):
        F.scaled_dot_product_attention(q, k, v, dropout_p=1.0)
    heads = [ember.tensor(a) for a in arrays(10, (1, 3, 4, 8), (1, 2, 4, 8))]
    with pytest.raises(ShapeError, match="enable_gqa"):
        F.scaled_dot_product_attention(heads[0], heads[1], heads[1], enable_gqa=True)


@pytest.mark.parametrize("shape,normalized,weight,eps", [
    ((3, 4, 8), (8,), True, None),
    ((3, 4, 8), (4, 8), False, 1e-3),
    ((1, 1), (1,), True, None),
    ((0, 5), (5,), True, 1e-6),
])
def test_rms_norm_and_its_gradients_match_torch(shape, normalized, weight, eps):
    x, w = arrays(11, shape, normalized)
    inputs = (x, w) if weight else (x,)
    check_against_torch(lambda m, x, *w: m.nn.functional.rms_norm(x, normalized, *w, eps=eps), *inputs,
                        rtol=1e-5, atol=1e-6)


def test_half_precision_rms_norm_uses_float32_and_its_epsilon_as_torch():
    x = arrays(12, (4, 16))[0] * 1e-3  # small values: the default epsilon matters
    got = ember.nn.functional.rms_norm(ember.tensor(x).to(ember.float16), (16,)).numpy()
    want = torch.nn.functional.rms_norm(torch.tensor(x).half(), (16,)).numpy()
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-3, atol=1e-4)


def test_rms_norm_module_matches_torch_parameters_repr_and_values():
    t, e = torch.nn.RMSNorm((4, 6), eps=1e-4), ember.nn.RMSNorm((4, 6), eps=1e-4)
    assert [n for n, _ in e.named_parameters()] == [n for n, _ in t.named_parameters()] == ["weight"]
    assert repr(e) == repr(t) and repr(ember.nn.RMSNorm(6, elementwise_affine=False)) == repr(
        torch.nn.RMSNorm(6, elementwise_affine=False))
    x = arrays(13, (3, 4, 6))[0]
    np.testing.assert_allclose(e(ember.tensor(x)).numpy(), t(torch.tensor(x)).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_bad_rms_norm_inputs_name_the_problem():
    x = ember.tensor(arrays(14, (3, 8))[0])
    with pytest.raises(ShapeError, match="rms_norm"):
        ember.nn.functional.rms_norm(x, (4,))
    with pytest.raises(ShapeError, match="rms_norm"):
        ember.nn.functional.rms_norm(x, (8,), ember.ones(4))
    with pytest.raises(DTypeError, match="rms_norm"):
        ember.nn.functional.rms_norm(ember.tensor(np.arange(8).reshape(1, 8)), (8,))


def _mha_pair(seed, embed_dim, heads, **kwargs):
    torch.manual_seed(seed)
    t = torch.nn.MultiheadAttention(embed_dim, heads, **kwargs)
    e = ember.nn.MultiheadAttention(embed_dim, heads, **kwargs)
    e.load_state_dict({k: ember.tensor(v.detach().numpy()) for k, v in t.state_dict().items()})
    return t, e


def _close(got, want, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(got.numpy(), want.detach().numpy(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("case", ["self", "cross_kdim_vdim", "batch_first_no_bias", "unbatched"])
@pytest.mark.parametrize("need_weights,average", [(True, True), (True, False), (False, True)])
def test_multihead_attention_outputs_weights_and_gradients_match_torch(case, need_weights, average):
    kwargs = {"cross_kdim_vdim": dict(kdim=6, vdim=5), "batch_first_no_bias": dict(batch_first=True, bias=False)}
    t, e = _mha_pair(0, 8, 2, **kwargs.get(case, {}))
    dims = (kwargs.get(case, {}).get("kdim", 8), kwargs.get(case, {}).get("vdim", 8))
    if case == "unbatched":
        shapes = ((4, 8), (6, 8), (6, 8))
    elif case == "batch_first_no_bias":
        shapes = ((3, 4, 8), (3, 6, 8), (3, 6, 8))
    else:
        shapes = ((4, 3, 8), (6, 3, dims[0]), (6, 3, dims[1]))
    q, k, v = arrays(20, *shapes)
    if case == "self":
        k = v = q
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    eq, ek, ev = (ember.tensor(a, requires_grad=True) for a in (q, k, v))
    tout, tw = t(tq, tk, tv, need_weights=need_weights, average_attn_weights=average)
    eout, ew = e(eq, ek, ev, need_weights=need_weights, average_attn_weights=average)
    _close(eout, tout)
    assert (ew is None) == (tw is None)
    if tw is not None:
        _close(ew, tw)
    cot = arrays(21, tuple(tout.shape))[0]
    (tout * torch.tensor(cot)).sum().backward()
    (eout * ember.tensor(cot)).sum().backward()
    for te, ee in ((tq, eq), (tk, ek), (tv, ev)):
        _close(ee.grad, te.grad, atol=1e-4)
    eparams = dict(e.named_parameters())
    assert list(eparams) == [n for n, _ in t.named_parameters()]
    for name, p in t.named_parameters():
        _close(eparams[name].grad, p.grad, atol=1e-4)


@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_masks_keys_as_torch_does(need_weights):
    t, e = _mha_pair(1, 8, 4, batch_first=True)
    x = arrays(22, (2, 5, 8))[0]
    causal = np.triu(np.ones((5, 5), bool), 1)  # True: not attended to
    padding = np.zeros((2, 5), bool)
    padding[1, 3:] = True
    heads = arrays(23, (8, 5, 5))[0]  # a float mask per batch element and head
    for attn_mask, kpm in ((causal, padding), (heads, None), (None, padding)):
        tout, _ = t(*(torch.tensor(x),) * 3, key_padding_mask=None if kpm is None else torch.tensor(kpm),
                    attn_mask=None if attn_mask is None else torch.tensor(attn_mask), need_weights=need_weights)
        eout, _ = e(*(ember.tensor(x),) * 3, key_padding_mask=None if kpm is None else ember.tensor(kpm),
                    attn_mask=None if attn_mask is None else ember.tensor(attn_mask), need_weights=need_weights)
        _close(eout, tout)


def test_multihead_attention_matches_torch_parameters_repr_and_bad_input_errors():
    t, e = _mha_pair(2, 8, 2, kdim=4)
    assert repr(e) == repr(t)
    assert [n for n, _ in e.named_parameters()] == [n for n, _ in t.named_parameters()]
    with pytest.raises(ValueError, match="num_heads"):
        ember.nn.MultiheadAttention(10, 3)
    with pytest.raises(ShapeError, match="MultiheadAttention"):
        e(ember.ones(4, 2, 8), ember.ones(6, 2, 8), ember.ones(6, 2, 8))  # keys of width 8, kdim 4
    with pytest.raises(ValueError, match="is_causal"):
        e(ember.ones(4, 2, 8), ember.ones(6, 2, 4), ember.ones(6, 2, 8), is_causal=True)
