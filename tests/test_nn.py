"""ember.nn against torch.nn: layers, module API, initialisation, functional ops and losses."""

import math

import numpy as np
import pytest

import ember
import ember.nn.functional as F
from ember import nn
from ember.ir import toposort
from ember.optim import SGD

torch = pytest.importorskip("torch")
TF = torch.nn.functional


def rng(seed=0):
    return np.random.default_rng(seed)


def copy_weights(src: "torch.nn.Module", dst: nn.Module) -> None:
    dst.load_state_dict({k: ember.tensor(v.detach().numpy()) for k, v in src.state_dict().items()})


def close(actual, expected, rtol=1e-5, atol=1e-6):
    expected = expected.detach().numpy() if isinstance(expected, torch.Tensor) else expected
    np.testing.assert_allclose(np.asarray(actual.numpy() if isinstance(actual, ember.Tensor) else actual),
                               expected, rtol=rtol, atol=atol)


def check_layer(tlayer, elayer, x, rtol=1e-5, atol=1e-6, grad_input=True):
    """Forward, input gradient and parameter gradients of an ember layer match the torch layer's."""
    copy_weights(tlayer, elayer)
    tx = torch.tensor(x, requires_grad=grad_input)
    ex = ember.tensor(x, requires_grad=grad_input)
    tout, eout = tlayer(tx), elayer(ex)
    close(eout, tout, rtol, atol)
    weights = rng(99).standard_normal(tuple(tout.shape)).astype(np.float32)
    (tout * torch.tensor(weights)).sum().backward()
    (eout * ember.tensor(weights)).sum().backward()
    if grad_input:
        close(ex.grad, tx.grad, rtol, atol)
    tparams = dict(tlayer.named_parameters())
    eparams = dict(elayer.named_parameters())
    assert tparams.keys() == eparams.keys()
    for name, tp in tparams.items():
        close(eparams[name].grad, tp.grad, rtol, atol)


def randn(*shape, seed=0):
    return rng(seed).standard_normal(shape).astype(np.float32)


# -- layers against torch -----------------------------------------------------------------

LAYERS = {
    "linear": (lambda m: m.Linear(5, 3), (4, 5)),
    "linear_no_bias_3d_input": (lambda m: m.Linear(5, 3, bias=False), (2, 4, 5)),
    "conv2d": (lambda m: m.Conv2d(3, 4, 3), (2, 3, 7, 6)),
    "conv2d_stride_padding_dilation": (lambda m: m.Conv2d(2, 4, (3, 2), stride=2, padding=(2, 1), dilation=(1, 2)),
                                       (2, 2, 9, 8)),
    "conv2d_groups_no_bias": (lambda m: m.Conv2d(4, 6, 3, padding=1, groups=2, bias=False), (1, 4, 5, 5)),
    "conv2d_padding_same": (lambda m: m.Conv2d(2, 3, 4, padding="same"), (1, 2, 6, 6)),
    "conv2d_reflect_padding": (lambda m: m.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"), (2, 2, 5, 6)),
    "conv_transpose2d": (lambda m: m.ConvTranspose2d(3, 4, 3), (2, 3, 5, 6)),
    "conv_transpose2d_everything": (lambda m: m.ConvTranspose2d(4, 6, (3, 2), stride=(2, 3), padding=(1, 0),
                                                                output_padding=(1, 2), groups=2, dilation=(1, 2)),
                                    (2, 4, 4, 5)),
    "conv_transpose2d_no_bias_unbatched": (lambda m: m.ConvTranspose2d(2, 3, 2, stride=2, bias=False), (2, 3, 3)),
    "batchnorm1d_2d_input": (lambda m: m.BatchNorm1d(4), (6, 4)),
    "batchnorm1d_3d_input": (lambda m: m.BatchNorm1d(3, affine=False), (4, 3, 5)),
    "batchnorm2d": (lambda m: m.BatchNorm2d(3), (4, 3, 5, 5)),
    "layernorm": (lambda m: m.LayerNorm(6), (3, 4, 6)),
    "layernorm_2d_shape": (lambda m: m.LayerNorm((4, 6), eps=1e-3), (3, 4, 6)),
    "layernorm_no_bias": (lambda m: m.LayerNorm(6, bias=False), (5, 6)),
    "relu": (lambda m: m.ReLU(), (4, 7)),
    "leaky_relu": (lambda m: m.LeakyReLU(0.2), (4, 7)),
    "gelu": (lambda m: m.GELU(), (4, 7)),
    "gelu_tanh": (lambda m: m.GELU(approximate="tanh"), (4, 7)),
    "silu": (lambda m: m.SiLU(), (4, 7)),
    "tanh": (lambda m: m.Tanh(), (4, 7)),
    "sigmoid": (lambda m: m.Sigmoid(), (4, 7)),
    "softmax": (lambda m: m.Softmax(dim=1), (4, 7)),
    "log_softmax": (lambda m: m.LogSoftmax(dim=-1), (3, 4, 7)),
    "max_pool2d": (lambda m: m.MaxPool2d(2), (2, 3, 6, 6)),
    "max_pool2d_stride_padding": (lambda m: m.MaxPool2d(3, stride=2, padding=1), (2, 2, 7, 7)),
    "avg_pool2d": (lambda m: m.AvgPool2d(2), (2, 3, 6, 6)),
    "avg_pool2d_padding_exclude_pad": (lambda m: m.AvgPool2d(3, 2, padding=1, count_include_pad=False),
                                       (2, 2, 7, 7)),
    "adaptive_avg_pool2d": (lambda m: m.AdaptiveAvgPool2d((2, 3)), (2, 3, 6, 7)),
    "adaptive_avg_pool2d_to_1": (lambda m: m.AdaptiveAvgPool2d(1), (2, 3, 5, 5)),
    "flatten": (lambda m: m.Flatten(), (2, 3, 4, 5)),
    "identity": (lambda m: m.Identity(), (2, 3)),
    "dropout_p0": (lambda m: m.Dropout(0.0), (4, 5)),
    "sequential_mlp": (lambda m: m.Sequential(m.Linear(6, 8), m.ReLU(), m.Linear(8, 3)), (5, 6)),
    "sequential_convnet": (lambda m: m.Sequential(m.Conv2d(2, 4, 3, padding=1), m.BatchNorm2d(4), m.ReLU(),
                                                  m.MaxPool2d(2), m.Flatten(), m.Linear(4 * 3 * 3, 5)),
                           (3, 2, 6, 6)),
}


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_forward_and_gradients_match_torch(name):
    make, shape = LAYERS[name]
    torch.manual_seed(0)
    tlayer, elayer = make(torch.nn), make(nn)
    check_layer(tlayer, elayer, randn(*shape), rtol=1e-4, atol=1e-5)


def test_embedding_forward_and_weight_gradient_match_torch_and_padding_row_gets_none():
    torch.manual_seed(0)
    tlayer, elayer = torch.nn.Embedding(10, 4, padding_idx=2), nn.Embedding(10, 4, padding_idx=2)
    copy_weights(tlayer, elayer)
    idx = np.array([[1, 2, 3], [2, 9, 1]])
    tout, eout = tlayer(torch.tensor(idx)), elayer(ember.tensor(idx))
    close(eout, tout)
    w = randn(2, 3, 4)
    (tout * torch.tensor(w)).sum().backward()
    (eout * ember.tensor(w)).sum().backward()
    close(elayer.weight.grad, tlayer.weight.grad)
    assert not elayer.weight.grad.numpy()[2].any()


def test_modulelist_registers_its_modules_parameters():
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(3, 3) for _ in range(2)])
            self.blocks.append(nn.Linear(3, 2))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    model = Stack()
    assert [n for n, _ in model.named_parameters()] == [
        "blocks.0.weight", "blocks.0.bias", "blocks.1.weight", "blocks.1.bias", "blocks.2.weight", "blocks.2.bias"]
    assert len(model.blocks) == 3 and isinstance(model.blocks[-1], nn.Linear)
    assert model(ember.randn(4, 3)).shape == (4, 2)


# -- module API ---------------------------------------------------------------------------

class Net(nn.Module):
    def __init__(self, m=nn):
        super().__init__()
        self.conv = m.Conv2d(1, 2, 3)
        self.bn = m.BatchNorm2d(2)
        self.head = m.Sequential(m.Flatten(), m.Linear(2 * 2 * 2, 3), m.Dropout(0.5))

    def forward(self, x):
        return self.head(self.bn(self.conv(x)).relu())


class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        m = torch.nn
        self.conv = m.Conv2d(1, 2, 3)
        self.bn = m.BatchNorm2d(2)
        self.head = m.Sequential(m.Flatten(), m.Linear(2 * 2 * 2, 3), m.Dropout(0.5))


def test_names_of_parameters_buffers_and_state_dict_keys_match_torch():
    ours, theirs = Net(), TorchNet()
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert [n for n, _ in ours.named_buffers()] == [n for n, _ in theirs.named_buffers()]
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert [n for n, _ in ours.named_children()] == ["conv", "bn", "head"]
    assert [type(m).__name__ for m in ours.modules()][1:] == [type(m).__name__ for m in theirs.modules()][1:]
    assert all(isinstance(p, nn.Parameter) and p.requires_grad and p.is_leaf for p in ours.parameters())


def test_repr_matches_torch():
    def build(m):
        return m.Sequential(m.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), m.BatchNorm2d(8), m.ReLU(),
                            m.MaxPool2d(2), m.AdaptiveAvgPool2d(1), m.Flatten(), m.Dropout(0.1), m.Linear(8, 4),
                            m.LayerNorm(4), m.GELU(approximate="tanh"), m.Embedding(5, 4, padding_idx=0))
    assert repr(build(nn)) == repr(build(torch.nn))


def test_shared_parameters_are_listed_once():
    lin = nn.Linear(3, 3)
    model = nn.Sequential(lin, nn.ReLU(), lin)
    assert len(list(model.parameters())) == 2
    assert list(model.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_train_and_eval_switch_every_submodule_and_dropout():
    model = Net()
    x = ember.tensor(randn(8, 1, 4, 4))
    assert model.training and model.head[2].training
    train_out = model(x).numpy()
    assert (train_out == 0).mean() > 0.2
    model.eval()
    assert not any(m.training for m in model.modules())
    a, b = model(x).numpy(), model(x).numpy()
    np.testing.assert_array_equal(a, b)
    model.train()
    assert all(m.training for m in model.modules())


def test_dropout_in_training_zeroes_about_p_and_scales_the_rest():
    drop = nn.Dropout(0.3)
    out = drop(ember.ones(100_000)).numpy()
    assert abs((out == 0).mean() - 0.3) < 0.01
    np.testing.assert_allclose(out[out != 0], 1 / 0.7, rtol=1e-6)
    drop.eval()
    np.testing.assert_array_equal(drop(ember.ones(10)).numpy(), np.ones(10))


def test_zero_grad_sets_gradients_to_none_or_zero():
    model = nn.Linear(3, 2)
    model(ember.randn(4, 3)).sum().backward()
    assert model.weight.grad is not None
    model.zero_grad(set_to_none=False)
    np.testing.assert_array_equal(model.weight.grad.numpy(), np.zeros((2, 3)))
    model.zero_grad()
    assert model.weight.grad is None and model.bias.grad is None


def test_requires_grad_false_freezes_parameters():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    model[0].requires_grad_(False)
    model(ember.randn(2, 3)).sum().backward()
    assert model[0].weight.grad is None and model[1].weight.grad is not None


def test_apply_visits_every_module_for_custom_init():
    model = Net()
    model.apply(lambda m: nn.init.constant_(m.weight, 0.5) if isinstance(m, nn.Linear) else None)
    np.testing.assert_array_equal(model.head[1].weight.numpy(), np.full((3, 8), 0.5, np.float32))


def test_to_dtype_casts_floating_parameters_in_place_and_keeps_integer_buffers():
    model = Net()
    weight = model.conv.weight
    before = weight.numpy()
    model.to(ember.float64)
    assert model.conv.weight is weight and weight.dtype is ember.float64 and weight.requires_grad
    np.testing.assert_array_equal(weight.numpy(), before.astype(np.float64))
    assert model.bn.running_mean.dtype is ember.float64
    assert model.bn.num_batches_tracked.dtype is ember.int64
    assert model(ember.randn(2, 1, 4, 4, dtype=ember.float64)).dtype is ember.float64


def test_register_buffer_persistent_false_is_left_out_of_state_dict():
    model = nn.Module()
    model.register_buffer("kept", ember.zeros(2))
    model.register_buffer("scratch", ember.zeros(2), persistent=False)
    assert list(model.state_dict()) == ["kept"]
    assert [n for n, _ in model.named_buffers()] == ["kept", "scratch"]


def test_assigning_a_plain_tensor_to_a_parameter_name_is_an_error():
    lin = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="parameter 'weight'"):
        lin.weight = ember.zeros(2, 2)


# -- state_dict loading -------------------------------------------------------------------

def test_load_state_dict_copies_values_into_the_same_parameter_objects():
    a, b = Net(), Net()
    weight = b.conv.weight
    b.load_state_dict(a.state_dict())
    assert b.conv.weight is weight
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        np.testing.assert_array_equal(pa.numpy(), pb.numpy(), err_msg=name)


def test_load_state_dict_names_missing_and_unexpected_keys():
    model = nn.Linear(3, 2)
    with pytest.raises(RuntimeError, match='Missing key\\(s\\) in state_dict: "bias"'):
        model.load_state_dict({"weight": ember.zeros(2, 3)})
    with pytest.raises(RuntimeError, match='Unexpected key\\(s\\) in state_dict: "extra"'):
        model.load_state_dict({"weight": ember.zeros(2, 3), "bias": ember.zeros(2), "extra": ember.zeros(1)})
    result = model.load_state_dict({"weight": ember.zeros(2, 3), "extra": ember.zeros(1)}, strict=False)
    assert result.missing_keys == ["bias"] and result.unexpected_keys == ["extra"]
    np.testing.assert_array_equal(model.weight.numpy(), np.zeros((2, 3)))


def test_load_state_dict_shape_mismatch_fails_even_when_not_strict_and_copies_nothing():
    model = nn.Linear(3, 2)
    before = model.bias.numpy()
    with pytest.raises(RuntimeError, match=r"size mismatch for weight: .*\(3, 2\).*\(2, 3\)"):
        model.load_state_dict({"weight": ember.zeros(3, 2), "bias": ember.ones(2)}, strict=False)
    np.testing.assert_array_equal(model.bias.numpy(), before)


# -- BatchNorm running statistics -------------------------------------------------------------

@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_running_stats_follow_torch_in_training_and_are_used_in_eval(momentum):
    torch.manual_seed(0)
    tbn, ebn = torch.nn.BatchNorm2d(3, momentum=momentum), nn.BatchNorm2d(3, momentum=momentum)
    copy_weights(tbn, ebn)
    for step in range(3):
        x = randn(4, 3, 3, 3, seed=step) * (step + 1) + step
        close(ebn(ember.tensor(x)), tbn(torch.tensor(x)), rtol=1e-4, atol=1e-5)
    close(ebn.running_mean, tbn.running_mean, rtol=1e-5)
    close(ebn.running_var, tbn.running_var, rtol=1e-5)
    assert ebn.num_batches_tracked.item() == tbn.num_batches_tracked.item() == 3
    tbn.eval()
    ebn.eval()
    x = randn(2, 3, 3, 3, seed=10)
    close(ebn(ember.tensor(x)), tbn(torch.tensor(x)), rtol=1e-4, atol=1e-5)
    close(ebn.running_mean, tbn.running_mean)  # eval leaves the statistics alone
    assert ebn.num_batches_tracked.item() == 3


def test_batchnorm_running_stat_update_keeps_no_graph_alive_across_steps():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = SGD(model.parameters(), lr=0.1)
    sizes = []
    for step in range(6):
        loss = model(ember.tensor(randn(8, 4, seed=step))).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        running_mean = model[1].running_mean
        assert not running_mean.requires_grad and running_mean.grad_fn is None
        pending = toposort([running_mean._node, model[1].running_var._node])
        assert all(n.numel <= 4 for n in pending)  # only the update itself, no activations of the forward pass
        sizes.append(len(pending))
    assert len(set(sizes)) == 1, sizes  # and no chain of updates that grows with the steps


def test_batchnorm_without_running_stats_uses_batch_statistics_in_eval():
    torch.manual_seed(0)
    tbn, ebn = torch.nn.BatchNorm1d(3, track_running_stats=False), nn.BatchNorm1d(3, track_running_stats=False)
    tbn.eval()
    ebn.eval()
    x = randn(5, 3)
    close(ebn(ember.tensor(x)), tbn(torch.tensor(x)), rtol=1e-4, atol=1e-5)
    assert list(ebn.state_dict()) == list(tbn.state_dict())


def test_batchnorm_with_one_value_per_channel_in_training_is_an_error():
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        nn.BatchNorm1d(3)(ember.randn(1, 3))


# -- default initialisation -------------------------------------------------------------------

def test_default_initialisations_follow_torch():
    ember.manual_seed(0)
    lin = nn.Linear(200, 300)
    bound = 1 / math.sqrt(200)
    w, b = lin.weight.numpy(), lin.bias.numpy()
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.99 * bound
    assert abs(w.std() - bound / math.sqrt(3)) < 0.01 * bound and np.abs(b).max() <= bound
    conv = nn.Conv2d(4, 8, 3)
    bound = 1 / math.sqrt(4 * 9)
    assert np.abs(conv.weight.numpy()).max() <= bound and np.abs(conv.bias.numpy()).max() <= bound
    emb = nn.Embedding(1000, 50).weight.numpy()
    assert abs(emb.mean()) < 0.01 and abs(emb.std() - 1) < 0.01
    norm = nn.LayerNorm(5)
    np.testing.assert_array_equal(norm.weight.numpy(), np.ones(5))
    np.testing.assert_array_equal(norm.bias.numpy(), np.zeros(5))
    bn = nn.BatchNorm1d(5)
    for t, value in ((bn.weight, 1), (bn.bias, 0), (bn.running_mean, 0), (bn.running_var, 1)):
        np.testing.assert_array_equal(t.numpy(), np.full(5, value, np.float32))


@pytest.mark.parametrize("nonlinearity,param", [("linear", None), ("relu", None), ("tanh", None), ("sigmoid", None),
                                                ("leaky_relu", None), ("leaky_relu", 0.2), ("selu", None),
                                                ("conv2d", None)])
def test_calculate_gain_matches_torch(nonlinearity, param):
    assert nn.init.calculate_gain(nonlinearity, param) == pytest.approx(
        torch.nn.init.calculate_gain(nonlinearity, param))


@pytest.mark.parametrize("fn,kwargs,spread", [
    ("uniform_", {"a": -2.0, "b": 3.0}, ("uniform", -2.0, 3.0)),
    ("normal_", {"mean": 1.0, "std": 2.0}, ("normal", 1.0, 2.0)),
    ("xavier_uniform_", {"gain": 2.0}, ("uniform", None, 2.0 * math.sqrt(6 / (300 + 200)))),
    ("xavier_normal_", {}, ("normal", 0.0, math.sqrt(2 / (300 + 200)))),
    ("kaiming_uniform_", {"nonlinearity": "relu"}, ("uniform", None, math.sqrt(6 / 200))),
    ("kaiming_normal_", {"mode": "fan_out", "nonlinearity": "relu"}, ("normal", 0.0, math.sqrt(2 / 300))),
])
def test_init_functions_draw_from_torchs_distributions(fn, kwargs, spread):
    ember.manual_seed(1)
    p = nn.Parameter(ember.zeros(300, 200))
    out = getattr(nn.init, fn)(p, **kwargs)
    assert out is p and p.requires_grad and p.is_leaf
    values = p.numpy()
    kind, a, b = spread
    if kind == "uniform":
        lo, hi = (-b, b) if a is None else (a, b)
        assert values.min() >= lo and values.max() <= hi
        assert abs(values.min() - lo) < 0.01 * (hi - lo) and abs(values.max() - hi) < 0.01 * (hi - lo)
    else:
        assert abs(values.mean() - a) < 0.02 * b and abs(values.std() - b) < 0.02 * b


def test_constant_zeros_and_ones_init():
    p = nn.Parameter(ember.randn(3, 2))
    np.testing.assert_array_equal(nn.init.constant_(p, 0.25).numpy(), np.full((3, 2), 0.25, np.float32))
    np.testing.assert_array_equal(nn.init.zeros_(p).numpy(), np.zeros((3, 2)))
    np.testing.assert_array_equal(nn.init.ones_(p).numpy(), np.ones((3, 2)))


# -- losses against torch -------------------------------------------------------------------

def loss_pair(efn, tfn, inputs, kwargs_e, kwargs_t=None, grad_of=(0,), rtol=1e-5, atol=1e-6):
    """The loss and the gradients of the listed inputs match torch's."""
    kwargs_t = kwargs_e if kwargs_t is None else kwargs_t
    ts = [torch.tensor(a, requires_grad=i in grad_of) for i, a in enumerate(inputs)]
    es = [ember.tensor(a, requires_grad=i in grad_of) for i, a in enumerate(inputs)]
    convert_t = {k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in kwargs_t.items()}
    convert_e = {k: ember.tensor(v) if isinstance(v, np.ndarray) else v for k, v in kwargs_e.items()}
    tout, eout = tfn(*ts, **convert_t), efn(*es, **convert_e)
    close(eout, tout, rtol, atol)
    g = rng(5).standard_normal(tuple(tout.shape)).astype(np.float32)
    (tout * torch.tensor(g)).sum().backward()
    (eout * ember.tensor(g)).sum().backward()
    for i in grad_of:
        close(es[i].grad, ts[i].grad, rtol, atol)


def class_targets(shape, classes, ignore=None, seed=1):
    t = rng(seed).integers(0, classes, shape)
    if ignore is not None:
        t.reshape(-1)[::3] = ignore
    return t


CE_CASES = [
    dict(),
    dict(weight=True),
    dict(ignore_index=2),
    dict(ignore_index=-100, use_ignore=True),
    dict(weight=True, ignore_index=-1, use_ignore=True),
    dict(label_smoothing=0.1),
    dict(label_smoothing=0.2, weight=True),
    dict(label_smoothing=0.1, ignore_index=-100, use_ignore=True),
    dict(label_smoothing=0.15, weight=True, ignore_index=-5, use_ignore=True),
]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", range(len(CE_CASES)))
@pytest.mark.parametrize("shape", [(6, 5), (3, 5, 2, 3)])
def test_cross_entropy_with_class_index_targets_matches_torch(shape, case, reduction):
    options = dict(CE_CASES[case])
    n, c, rest = shape[0], shape[1], shape[2:]
    x = randn(*shape) * 2
    ignore = options.get("ignore_index") if options.pop("use_ignore", False) else None
    target = class_targets((n, *rest), c, ignore)
    kwargs = {"reduction": reduction}
    if options.pop("weight", False):
        kwargs["weight"] = rng(3).uniform(0.2, 2.0, c).astype(np.float32)
    kwargs.update(options)
    loss_pair(F.cross_entropy, TF.cross_entropy, [x, target], kwargs)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weight,label_smoothing", [(False, 0.0), (True, 0.0), (False, 0.2), (True, 0.1)])
@pytest.mark.parametrize("shape", [(4, 6), (2, 6, 3)])
def test_cross_entropy_with_probability_targets_matches_torch(shape, weight, label_smoothing, reduction):
    x = randn(*shape)
    probs = rng(2).dirichlet(np.ones(shape[1]), size=(shape[0], *shape[2:])).astype(np.float32)
    probs = np.moveaxis(probs, -1, 1).copy()
    kwargs = {"reduction": reduction, "label_smoothing": label_smoothing}
    if weight:
        kwargs["weight"] = rng(3).uniform(0.2, 2.0, shape[1]).astype(np.float32)
    loss_pair(F.cross_entropy, TF.cross_entropy, [x, probs], kwargs, grad_of=(0, 1))


def test_cross_entropy_of_one_unbatched_sample_matches_torch():
    loss_pair(F.cross_entropy, TF.cross_entropy, [randn(5), np.array(3)], {"label_smoothing": 0.1})


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weight,ignore", [(False, False), (True, False), (True, True)])
def test_nll_loss_matches_torch(weight, ignore, reduction):
    x = TF.log_softmax(torch.tensor(randn(6, 4)), 1).numpy()
    kwargs = {"reduction": reduction, "ignore_index": 1 if ignore else -100}
    if weight:
        kwargs["weight"] = rng(3).uniform(0.2, 2.0, 4).astype(np.float32)
    loss_pair(F.nll_loss, TF.nll_loss, [x, class_targets(6, 4)], kwargs)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name,kwargs", [("mse_loss", {}), ("l1_loss", {}), ("smooth_l1_loss", {}),
                                         ("smooth_l1_loss", {"beta": 0.5}), ("smooth_l1_loss", {"beta": 0.0})])
def test_regression_losses_match_torch(name, kwargs, reduction):
    loss_pair(getattr(F, name), getattr(TF, name), [randn(4, 5), randn(4, 5, seed=1)],
              {"reduction": reduction, **kwargs}, grad_of=(0, 1))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weight", [False, True])
def test_binary_cross_entropy_matches_torch(weight, reduction):
    p = rng(0).uniform(0.02, 0.98, (4, 3)).astype(np.float32)
    t = rng(1).uniform(0, 1, (4, 3)).astype(np.float32)
    kwargs = {"reduction": reduction}
    if weight:
        kwargs["weight"] = rng(3).uniform(0.5, 2, (4, 3)).astype(np.float32)
    loss_pair(F.binary_cross_entropy, TF.binary_cross_entropy, [p, t], kwargs, rtol=1e-4)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weight,pos_weight", [(False, False), (True, False), (False, True), (True, True)])
def test_binary_cross_entropy_with_logits_matches_torch(weight, pos_weight, reduction):
    x = randn(5, 3) * 4
    t = (rng(1).uniform(0, 1, (5, 3)) > 0.5).astype(np.float32)
    kwargs = {"reduction": reduction}
    if weight:
        kwargs["weight"] = rng(3).uniform(0.5, 2, (5, 3)).astype(np.float32)
    if pos_weight:
        kwargs["pos_weight"] = rng(4).uniform(0.5, 3, 3).astype(np.float32)
    loss_pair(F.binary_cross_entropy_with_logits, TF.binary_cross_entropy_with_logits, [x, t], kwargs,
              grad_of=(0, 1))


def test_binary_cross_entropy_with_logits_is_stable_for_huge_logits():
    x = ember.tensor([-1000.0, 1000.0, 0.0])
    t = ember.tensor([1.0, 0.0, 1.0])
    loss = F.binary_cross_entropy_with_logits(x, t, reduction="none").numpy()
    np.testing.assert_allclose(loss, [1000.0, 1000.0, math.log(2)], rtol=1e-6)


def test_loss_modules_match_their_functions():
    x, target = randn(6, 5), class_targets(6, 5)
    weight = rng(3).uniform(0.2, 2.0, 5).astype(np.float32)
    ours = nn.CrossEntropyLoss(weight=ember.tensor(weight), label_smoothing=0.1, ignore_index=0)
    theirs = torch.nn.CrossEntropyLoss(weight=torch.tensor(weight), label_smoothing=0.1, ignore_index=0)
    close(ours(ember.tensor(x), ember.tensor(target)), theirs(torch.tensor(x), torch.tensor(target)))
    close(nn.MSELoss(reduction="sum")(ember.tensor(x), ember.tensor(x * 2)),
          torch.nn.MSELoss(reduction="sum")(torch.tensor(x), torch.tensor(x * 2)), rtol=1e-5)


# -- functional ops and errors --------------------------------------------------------------------

def test_functional_layer_norm_and_batch_norm_match_torch():
    x = randn(4, 3, 5)
    w, b = randn(5, seed=1), randn(5, seed=2)
    close(F.layer_norm(ember.tensor(x), (5,), ember.tensor(w), ember.tensor(b)),
          TF.layer_norm(torch.tensor(x), (5,), torch.tensor(w), torch.tensor(b)), rtol=1e-5, atol=1e-5)
    rm, rv = randn(3, seed=3), np.abs(randn(3, seed=4)) + 0.5
    close(F.batch_norm(ember.tensor(x), ember.tensor(rm), ember.tensor(rv)),
          TF.batch_norm(torch.tensor(x), torch.tensor(rm), torch.tensor(rv)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_layer_norm_of_half_input_with_float32_parameters_matches_torch(device, dtype, request):
    if device == "cuda":
        request.getfixturevalue("cuda_backend")
    x = torch.tensor(randn(4, 3, 6)).to(getattr(torch, dtype)).requires_grad_()
    w, b = (torch.tensor(randn(6, seed=s)).requires_grad_() for s in (1, 2))
    expected = TF.layer_norm(x, (6,), w, b)
    expected.backward(torch.ones_like(expected))
    ex, ew, eb = (ember.tensor(t.detach(), device=device).requires_grad_() for t in (x, w, b))
    out = F.layer_norm(ex, (6,), ew, eb)
    assert out.dtype.name == dtype and out.device == ember.device(device).device
    grads = ember.grad(out.sum(), [ex, ew, eb])
    close(out.float(), expected.float(), rtol=1e-2, atol=1e-2)
    for mine, theirs in zip(grads, (x.grad, w.grad, b.grad)):
        assert mine.dtype.name == str(theirs.dtype).removeprefix("torch.")
        close(mine.float(), theirs.float(), rtol=2e-2, atol=2e-2)


def test_functional_reexports_take_torchs_arguments():
    x = randn(2, 3, 4, 4)
    pairs = [
        (F.relu(ember.tensor(x), inplace=False), TF.relu(torch.tensor(x))),
        (F.leaky_relu(ember.tensor(x), 0.1), TF.leaky_relu(torch.tensor(x), 0.1)),
        (F.elu(ember.tensor(x)), TF.elu(torch.tensor(x))),
        (F.softplus(ember.tensor(x), beta=2.0), TF.softplus(torch.tensor(x), beta=2.0)),
        (F.softmax(ember.tensor(x), dim=1), TF.softmax(torch.tensor(x), dim=1)),
        (F.pad(ember.tensor(x), (1, 2, 0, 1), value=3.0), TF.pad(torch.tensor(x), (1, 2, 0, 1), value=3.0)),
        (F.dropout(ember.tensor(x), 0.5, training=False), TF.dropout(torch.tensor(x), 0.5, training=False)),
        (F.one_hot(ember.tensor(np.array([0, 2, 1])), 4), TF.one_hot(torch.tensor([0, 2, 1]), 4)),
        (F.max_pool2d(ember.tensor(x), 2), TF.max_pool2d(torch.tensor(x), 2)),
    ]
    for ours, theirs in pairs:
        close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_relu_inplace_replaces_the_input_tensor():
    x = ember.tensor([-1.0, 2.0])
    out = F.relu(x, inplace=True)
    assert out is x
    np.testing.assert_array_equal(x.numpy(), [0.0, 2.0])


def test_cross_entropy_target_shape_mismatch_raises_shape_error_naming_shapes():
    with pytest.raises(ember.ShapeError, match=r"cross_entropy.*\(3,\).*\(4, 5\)"):
        F.cross_entropy(ember.randn(4, 5), ember.tensor([0, 1, 2]))
    with pytest.raises(ember.ShapeError, match=r"cross_entropy.*probability target"):
        F.cross_entropy(ember.randn(4, 5), ember.randn(4, 4))
    with pytest.raises(ember.ShapeError, match=r"cross_entropy: weight"):
        F.cross_entropy(ember.randn(4, 5), ember.tensor([0, 1, 2, 3]), weight=ember.ones(4))


def test_loss_dtype_errors_name_the_function_and_dtypes():
    with pytest.raises(ember.DTypeError, match=r"cross_entropy.*int64"):
        F.cross_entropy(ember.tensor([[1, 2]]), ember.tensor([0]))
    with pytest.raises(ember.DTypeError, match=r"cross_entropy.*bool"):
        F.cross_entropy(ember.randn(2, 3), ember.tensor([True, False]))
    with pytest.raises(ember.DTypeError, match=r"nll_loss.*float32"):
        F.nll_loss(ember.randn(2, 3), ember.randn(2))
    with pytest.raises(ember.ShapeError, match=r"binary_cross_entropy_with_logits.*\(3,\).*\(4,\)"):
        F.binary_cross_entropy_with_logits(ember.randn(4), ember.rand(3))
    with pytest.raises(ValueError, match="reduction"):
        F.mse_loss(ember.randn(3), ember.randn(3), reduction="avg")


def test_replacing_a_layer_or_a_parameter_keeps_its_place():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    model[0] = nn.Linear(3, 4)
    assert [type(m).__name__ for m in model] == ["Linear", "ReLU", "Linear"]
    assert list(model._modules) == ["0", "1", "2"]
    lin = model[0]
    names = [n for n, _ in lin.named_parameters()]
    lin.weight = nn.Parameter(ember.zeros(4, 3))
    lin.register_parameter("weight", nn.Parameter(ember.ones(4, 3)))
    assert [n for n, _ in lin.named_parameters()] == names
    np.testing.assert_array_equal(model(ember.ones(5, 3)).shape, (5, 2))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_deep_copied_module_keeps_the_values_it_was_copied_with_while_the_original_trains(device, request):
    import copy

    if device == "cuda":
        request.getfixturevalue("cuda_backend")
    ember.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)
    x = ember.tensor(rng(1).standard_normal((16, 4)).astype(np.float32), device=device)
    model(x).sum().backward()  # realized weights and gradients
    before = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    twin = copy.deepcopy(model)
    assert all(a is not b for a, b in zip(twin.parameters(), model.parameters()))
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in twin.parameters())
    np.testing.assert_array_equal(twin[0].weight.grad.numpy(), model[0].weight.grad.numpy())
    opt = SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    for k, v in twin.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), before[k])
    assert not np.array_equal(model[0].weight.numpy(), before["0.weight"])
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy(model(x))
