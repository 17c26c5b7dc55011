"""TransformerEncoderLayer, TransformerDecoderLayer, their stacks and Transformer against PyTorch on the same
weights: outputs and the gradients of every parameter and input, with causal and key padding masks; parameter
names; the clones of a stack; dropout in training; the causal mask; and the errors of bad arguments."""

import numpy as np
import pytest
import torch

import ember

# On the reference backend only: through Triton's interpreter one layer's forward and backward takes ~20 s.
# torch's Transformer builds its encoder with nested tensors enabled and warns when its layers can't use them.
pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor")

D_MODEL, NHEAD, FEEDFORWARD, LAYERS = 16, 4, 32, 2
SRC, TGT, BATCH = 5, 4, 2


def arrays(seed, *shapes):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def layer_kwargs(norm_first=False, batch_first=False, activation="relu", dropout=0.0):
    return dict(dim_feedforward=FEEDFORWARD, dropout=dropout, activation=activation, batch_first=batch_first,
                norm_first=norm_first)


def pair(build, seed=0):
    """`build(nn)` under torch and ember, the ember module loaded with the torch module's weights."""
    torch.manual_seed(seed)
    t = build(torch.nn)
    e = build(ember.nn)
    e.load_state_dict({k: ember.tensor(v.detach().numpy()) for k, v in t.state_dict().items()})
    return t, e


def sequence(seed, length, batch_first):
    shape = (BATCH, length, D_MODEL) if batch_first else (length, BATCH, D_MODEL)
    return arrays(seed, shape)[0]


def padding(length, padded):
    """A (batch, length) key padding mask: True (not attended to) on the last `padded` keys of batch element 1."""
    mask = np.zeros((BATCH, length), bool)
    mask[1, length - padded:] = True
    return mask


def additive(mask):
    """A boolean mask as the float one torch prefers beside a float attn_mask: -inf where True."""
    return np.where(mask, -np.inf, 0.0).astype(np.float32)


def causal_mask(size):
    return ember.nn.Transformer.generate_square_subsequent_mask(size).numpy()


def assert_close(got, want, atol=1e-5):
    np.testing.assert_allclose(got.numpy(), want.detach().numpy(), rtol=1e-4, atol=atol)


def check_module(t, e, inputs, masks=None, call=lambda m, *xs, **masks: m(*xs, **masks)):
    """The modules' outputs, and the gradients of every parameter and input, for one random cotangent."""
    masks = masks or {}
    assert [n for n, _ in e.named_parameters()] == [n for n, _ in t.named_parameters()]
    t_inputs = [torch.tensor(x, requires_grad=True) for x in inputs]
    e_inputs = [ember.tensor(x, requires_grad=True) for x in inputs]
    t_out = call(t, *t_inputs, **{k: torch.tensor(v) for k, v in masks.items()})
    e_out = call(e, *e_inputs, **{k: ember.tensor(v) for k, v in masks.items()})
    assert_close(e_out, t_out)
    cotangent = arrays(99, tuple(t_out.shape))[0]
    (t_out * torch.tensor(cotangent)).sum().backward()
    (e_out * ember.tensor(cotangent)).sum().backward()
    for ei, ti in zip(e_inputs, t_inputs):
        assert_close(ei.grad, ti.grad, atol=1e-4)
    e_params = dict(e.named_parameters())
    for name, p in t.named_parameters():
        assert e_params[name].grad is not None, name
        assert_close(e_params[name].grad, p.grad, atol=1e-4)


LAYOUTS = [(False, False, "relu"), (True, False, "gelu"), (False, True, "gelu"), (True, True, "relu")]


@pytest.mark.parametrize("norm_first,batch_first,activation", LAYOUTS)
def test_encoder_layer_outputs_and_gradients_match_torch(norm_first, batch_first, activation):
    kwargs = layer_kwargs(norm_first, batch_first, activation)
    t, e = pair(lambda nn: nn.TransformerEncoderLayer(D_MODEL, NHEAD, **kwargs))
    causal = np.triu(np.ones((SRC, SRC), bool), 1)
    masks = dict(src_mask=additive(causal), src_key_padding_mask=additive(padding(SRC, 2)))
    check_module(t, e, [sequence(1, SRC, batch_first)], masks)


@pytest.mark.parametrize("norm_first,batch_first,activation", LAYOUTS)
def test_decoder_layer_outputs_and_gradients_match_torch(norm_first, batch_first, activation):
    kwargs = layer_kwargs(norm_first, batch_first, activation)
    t, e = pair(lambda nn: nn.TransformerDecoderLayer(D_MODEL, NHEAD, **kwargs))
    tgt, memory = sequence(2, TGT, batch_first), sequence(3, SRC, batch_first)
    masks = dict(tgt_mask=torch.nn.Transformer.generate_square_subsequent_mask(TGT).numpy(),
                 tgt_key_padding_mask=additive(padding(TGT, 1)), memory_key_padding_mask=padding(SRC, 2))
    check_module(t, e, [tgt, memory], masks)


def test_an_unbatched_encoder_layer_matches_torch():
    t, e = pair(lambda nn: nn.TransformerEncoderLayer(D_MODEL, NHEAD, **layer_kwargs(activation="gelu")))
    check_module(t, e, arrays(4, (SRC, D_MODEL)))


def test_a_callable_activation_is_used_as_given():
    t, e = pair(lambda nn: nn.TransformerEncoderLayer(D_MODEL, NHEAD, **layer_kwargs(
        activation=nn.functional.gelu if nn is ember.nn else torch.nn.functional.gelu)))
    assert e.activation is ember.nn.functional.gelu
    check_module(t, e, [sequence(5, SRC, False)])


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_stack_with_a_final_norm_matches_torch(norm_first):
    def build(nn):
        layer = nn.TransformerEncoderLayer(D_MODEL, NHEAD, **layer_kwargs(norm_first, batch_first=True))
        return nn.TransformerEncoder(layer, LAYERS, norm=nn.LayerNorm(D_MODEL), enable_nested_tensor=False)
    t, e = pair(build)
    masks = dict(mask=causal_mask(SRC), src_key_padding_mask=additive(padding(SRC, 2)))
    check_module(t, e, [sequence(6, SRC, True)], masks,
                 call=lambda m, src, **masks: m(src, **masks, is_causal=True))


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_stack_matches_torch(norm_first):
    def build(nn):
        return nn.TransformerDecoder(nn.TransformerDecoderLayer(D_MODEL, NHEAD, **layer_kwargs(norm_first)), LAYERS)
    t, e = pair(build)
    masks = dict(tgt_mask=causal_mask(TGT), memory_key_padding_mask=padding(SRC, 1))
    check_module(t, e, [sequence(7, TGT, False), sequence(8, SRC, False)], masks)


@pytest.mark.parametrize("norm_first,batch_first,activation", [(False, False, "relu"), (True, True, "gelu")])
def test_transformer_outputs_and_gradients_match_torch(norm_first, batch_first, activation):
    kwargs = layer_kwargs(norm_first, batch_first, activation)
    t, e = pair(lambda nn: nn.Transformer(D_MODEL, NHEAD, LAYERS, LAYERS, **kwargs))
    masks = dict(tgt_mask=causal_mask(TGT), src_key_padding_mask=padding(SRC, 2),
                 tgt_key_padding_mask=additive(padding(TGT, 1)), memory_key_padding_mask=padding(SRC, 2))
    check_module(t, e, [sequence(9, SRC, batch_first), sequence(10, TGT, batch_first)], masks)


def test_modules_and_parameters_are_named_and_ordered_as_in_torch():
    t = torch.nn.Transformer(D_MODEL, NHEAD, LAYERS, LAYERS, FEEDFORWARD, bias=False)
    e = ember.nn.Transformer(D_MODEL, NHEAD, LAYERS, LAYERS, FEEDFORWARD, bias=False)
    assert [n for n, _ in e.named_modules()] == [n for n, _ in t.named_modules()]
    assert [n for n, _ in e.named_parameters()] == [n for n, _ in t.named_parameters()]
    assert {n: tuple(p.shape) for n, p in e.state_dict().items()} == \
        {n: tuple(p.shape) for n, p in t.state_dict().items()}
    assert type(e.encoder.layers) is ember.nn.ModuleList and len(e.decoder.layers) == LAYERS


def test_a_stack_clones_its_layer_into_independent_layers_with_its_values():
    layer = ember.nn.TransformerEncoderLayer(D_MODEL, NHEAD, FEEDFORWARD)
    layer.linear1.weight.numpy()  # realized values are cloned too, not only pending ones
    stack = ember.nn.TransformerEncoder(layer, 3)
    first, second = stack.layers[0], stack.layers[1]
    for name, p in layer.named_parameters():
        for clone in stack.layers:
            cloned = dict(clone.named_parameters())[name]
            assert cloned is not p and isinstance(cloned, ember.nn.Parameter) and cloned.requires_grad
            np.testing.assert_array_equal(cloned.numpy(), p.numpy())
    with ember.no_grad():
        first.linear1.weight.fill_(1.0)
    assert not np.all(second.linear1.weight.numpy() == 1.0) and not np.all(layer.linear1.weight.numpy() == 1.0)
    assert len(list(stack.parameters())) == 3 * len(list(layer.parameters()))


def test_dropout_applies_in_training_only():
    layer = ember.nn.TransformerEncoderLayer(D_MODEL, NHEAD, FEEDFORWARD, dropout=0.5)
    src = ember.tensor(sequence(11, SRC, False))
    assert not np.allclose(layer(src).numpy(), layer(src).numpy())
    layer.eval()
    np.testing.assert_array_equal(layer(src).numpy(), layer(src).numpy())


def test_eval_mode_with_dropout_matches_torch():
    t, e = pair(lambda nn: nn.TransformerDecoderLayer(D_MODEL, NHEAD, **layer_kwargs(dropout=0.3)))
    t.eval(), e.eval()
    check_module(t, e, [sequence(12, TGT, False), sequence(13, SRC, False)])


def test_generate_square_subsequent_mask_matches_torch():
    for size in (1, 4, 7):
        got = ember.nn.Transformer.generate_square_subsequent_mask(size)
        assert got.dtype is ember.float32
        np.testing.assert_array_equal(got.numpy(), torch.nn.Transformer.generate_square_subsequent_mask(size).numpy())
    assert ember.nn.Transformer.generate_square_subsequent_mask(3, dtype=ember.float64).dtype is ember.float64


def test_bad_arguments_name_the_problem():
    for layer in (ember.nn.TransformerEncoderLayer, ember.nn.TransformerDecoderLayer):
        with pytest.raises(ValueError, match=f"{layer.__name__}: d_model \\(10\\) must be a positive multiple of"):
            layer(10, 3)
        with pytest.raises(ValueError, match=f"{layer.__name__}: activation should be relu, gelu or a callable"):
            layer(D_MODEL, NHEAD, activation="swish")
    with pytest.raises(ValueError, match="nhead"):
        ember.nn.Transformer(10, 4, 1, 1, FEEDFORWARD)
    model = ember.nn.Transformer(D_MODEL, NHEAD, 1, 1, FEEDFORWARD)
    with pytest.raises(ember.errors.ShapeError, match="batch size"):
        model(ember.ones(SRC, 2, D_MODEL), ember.ones(TGT, 3, D_MODEL))
    with pytest.raises(ember.errors.ShapeError, match="d_model=16"):
        model(ember.ones(SRC, 2, 8), ember.ones(TGT, 2, 8))
