"""RNN (tanh and relu), LSTM (with projections too), GRU and their cells against torch: outputs, final states and
the gradients of the input, the initial state and every parameter; torch's state_dict layout and initialisation;
dropout between layers; the import of a torch model holding an LSTM, and a training step of it; argument errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

import ember
from ember import nn
from ember.errors import DTypeError, ShapeError

torch = pytest.importorskip("torch")
tnn = torch.nn

# torch computes an LSTM with projections without oneDNN, and says so
pytestmark = pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")

RTOL, ATOL = 1e-5, 1e-5  # float32 values through a few dozen steps of tanh and sigmoid
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-5


def twins(kind: str, *args, seed: int = 0, **kwargs):
    """The torch layer `kind` with torch's random parameters, and the ember one holding the same values."""
    torch.manual_seed(seed)
    t_layer = getattr(tnn, kind)(*args, **kwargs)
    e_layer = getattr(nn, kind)(*args, **kwargs)
    assert [(k, tuple(v.shape)) for k, v in e_layer.state_dict().items()] == \
        [(k, tuple(v.shape)) for k, v in t_layer.state_dict().items()]
    e_layer.load_state_dict({k: ember.tensor(v.numpy()) for k, v in t_layer.state_dict().items()})
    return t_layer, e_layer


def flat(value) -> list:
    """A layer's result as a list of tensors: (output, h_n), (output, (h_n, c_n)), (h, c) or h."""
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in flat(v)]
    return [value]


def compare(t_layer, e_layer, x: np.ndarray, hx: list[np.ndarray] | None, seed: int = 0) -> None:
    """Run both layers on `x` (and the initial state `hx`, a list of arrays, or the default): the results and the
    gradients of x, hx and every parameter for random cotangents must match."""
    pack = (lambda s: tuple(s) if len(s) > 1 else s[0])
    t_x = torch.tensor(x, requires_grad=True)
    e_x = ember.tensor(x, requires_grad=True)
    t_hx = [torch.tensor(h, requires_grad=True) for h in hx or []]
    e_hx = [ember.tensor(h, requires_grad=True) for h in hx or []]
    t_out = flat(t_layer(t_x, pack(t_hx) if hx else None))
    e_out = flat(e_layer(e_x, pack(e_hx) if hx else None))
    assert len(e_out) == len(t_out)
    for i, (e, t) in enumerate(zip(e_out, t_out)):
        assert tuple(e.shape) == tuple(t.shape), f"result {i}: shape {e.shape} != torch's {tuple(t.shape)}"
        np.testing.assert_allclose(e.numpy(), t.detach().numpy(), rtol=RTOL, atol=ATOL, err_msg=f"result {i}")
    rng = np.random.default_rng(seed)
    cotangents = [rng.uniform(-1, 1, t.shape).astype(np.float32) for t in t_out]
    names = [name for name, _ in t_layer.named_parameters()]
    t_wrt = [t_x, *t_hx, *(p for _, p in t_layer.named_parameters())]
    e_params = dict(e_layer.named_parameters())
    e_wrt = [e_x, *e_hx, *(e_params[name] for name in names)]
    t_grads = torch.autograd.grad(t_out, t_wrt, [torch.tensor(c) for c in cotangents])
    e_grads = ember.grad(e_out, e_wrt, [ember.tensor(c) for c in cotangents])
    for what, e, t in zip(["input", *(f"hx[{i}]" for i in range(len(t_hx))), *names], e_grads, t_grads):
        np.testing.assert_allclose(e.numpy(), t.numpy(), rtol=GRAD_RTOL, atol=GRAD_ATOL, err_msg=f"gradient of {what}")


def inputs(seed: int, shape, hidden_shapes) -> tuple[np.ndarray, list[np.ndarray] | None]:
    rng = np.random.default_rng(seed)
    x = rng.uniform(-2, 2, shape).astype(np.float32)
    return x, [rng.uniform(-1, 1, s).astype(np.float32) for s in hidden_shapes] or None


LAYER_CASES = {
    # id: (kind, constructor keywords, input shape, given initial state or the default)
    "rnn-tanh-hx-batch1": ("RNN", {}, (4, 1, 3), True),
    "rnn-relu-2layers-bidirectional-batch-first": ("RNN", dict(nonlinearity="relu", num_layers=2, bidirectional=True,
                                                              batch_first=True), (2, 4, 3), False),
    "rnn-unbatched-no-bias": ("RNN", dict(bias=False), (5, 3), True),
    "lstm-2layers-bidirectional": ("LSTM", dict(num_layers=2, bidirectional=True), (4, 2, 3), False),
    "lstm-batch-first-hx-length1": ("LSTM", dict(batch_first=True), (3, 1, 3), True),
    "lstm-unbatched-hx": ("LSTM", {}, (4, 3), True),
    "lstm-projection-2layers-bidirectional-hx": ("LSTM", dict(proj_size=2, num_layers=2, bidirectional=True),
                                                 (3, 2, 3), True),
    "gru-2layers-hx-no-bias": ("GRU", dict(num_layers=2, bias=False), (4, 2, 3), True),
    "gru-bidirectional-unbatched": ("GRU", dict(bidirectional=True), (3, 3), False),
    "gru-batch-first-length1-batch1": ("GRU", dict(batch_first=True), (1, 1, 3), True),
}


def hidden_shapes(kind: str, kwargs: dict, shape: tuple[int, ...], hidden: int) -> list[tuple[int, ...]]:
    stacked = kwargs.get("num_layers", 1) * (2 if kwargs.get("bidirectional") else 1)
    batch = () if len(shape) == 2 else (shape[0] if kwargs.get("batch_first") else shape[1],)
    h = (stacked, *batch, kwargs.get("proj_size") or hidden)
    return [h, (stacked, *batch, hidden)] if kind == "LSTM" else [h]


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_recurrent_layers_and_their_gradients_match_torch(case):
    kind, kwargs, shape, given = LAYER_CASES[case]
    t_layer, e_layer = twins(kind, 3, 4, **kwargs)
    x, hx = inputs(1, shape, hidden_shapes(kind, kwargs, shape, 4) if given else [])
    compare(t_layer, e_layer, x, hx)


CELL_CASES = {
    "rnn-cell-tanh-hx": ("RNNCell", {}, (2, 3), True),
    "rnn-cell-relu-unbatched": ("RNNCell", dict(nonlinearity="relu"), (3,), False),
    "lstm-cell-hx": ("LSTMCell", {}, (2, 3), True),
    "lstm-cell-unbatched-no-bias": ("LSTMCell", dict(bias=False), (3,), True),
    "gru-cell-default-hx": ("GRUCell", {}, (2, 3), False),
    "gru-cell-unbatched-hx": ("GRUCell", {}, (3,), True),
}


@pytest.mark.parametrize("case", list(CELL_CASES))
def test_recurrent_cells_and_their_gradients_match_torch(case):
    kind, kwargs, shape, given = CELL_CASES[case]
    t_cell, e_cell = twins(kind, 3, 4, **kwargs)
    state = (*shape[:-1], 4)
    x, hx = inputs(2, shape, ([state, state] if kind == "LSTMCell" else [state]) if given else [])
    compare(t_cell, e_cell, x, hx)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_an_lstm_on_each_device_matches_torch(device):
    if device == "cuda":
        from ember.runtime import cuda

        if not cuda.is_available():
            pytest.skip("the cuda backend needs a GPU or EMBER_INTERPRET=1")
    t_layer, e_layer = twins("LSTM", 3, 4, batch_first=True)
    with ember.device(device):
        e_layer.to(device)
        x, hx = inputs(3, (2, 3, 3), [(1, 2, 4), (1, 2, 4)])
        compare(t_layer, e_layer, x, hx)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["RNN", "LSTM", "GRU"])
def test_a_deeper_bidirectional_stack_over_a_longer_sequence_matches_torch(kind):
    t_layer, e_layer = twins(kind, 5, 6, num_layers=3, bidirectional=True, batch_first=True)
    x, hx = inputs(4, (3, 12, 5), hidden_shapes(kind, dict(num_layers=3, bidirectional=True, batch_first=True),
                                                (3, 12, 5), 6))
    compare(t_layer, e_layer, x, hx)


# -- parameters -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,kwargs", [
    ("RNN", dict(num_layers=2, bidirectional=True, bias=False)),
    ("LSTM", dict(num_layers=2, proj_size=3, bidirectional=True)),
    ("GRU", dict(num_layers=3)),
    ("LSTMCell", {}),
    ("GRUCell", dict(bias=False)),
])
def test_parameters_have_torchs_names_shapes_order_and_initial_distribution(kind, kwargs):
    ember.manual_seed(0)  # the statistical bounds below hold for any seed but one in millions; fixed, it never varies
    t_layer, e_layer = getattr(tnn, kind)(5, 8, **kwargs), getattr(nn, kind)(5, 8, **kwargs)
    assert [(n, tuple(p.shape)) for n, p in e_layer.named_parameters()] == \
        [(n, tuple(p.shape)) for n, p in t_layer.named_parameters()]
    values = np.concatenate([p.numpy().ravel() for p in e_layer.parameters()])
    bound = 1 / math.sqrt(8)
    assert np.all(np.abs(values) <= bound)
    assert values.min() < -0.8 * bound and values.max() > 0.8 * bound  # uniform over the whole interval
    standard_error = bound / math.sqrt(3 * values.size)  # of the mean of n uniform draws over [-bound, bound]
    assert abs(values.mean()) < 5 * standard_error


def test_repr_names_the_arguments_as_torchs():
    assert repr(nn.LSTM(3, 4, num_layers=2, batch_first=True, proj_size=2)) == \
        repr(tnn.LSTM(3, 4, num_layers=2, batch_first=True, proj_size=2))
    assert repr(nn.RNN(3, 4, nonlinearity="relu", bias=False)) == repr(tnn.RNN(3, 4, nonlinearity="relu", bias=False))
    assert repr(nn.RNNCell(3, 4, nonlinearity="relu")) == repr(tnn.RNNCell(3, 4, nonlinearity="relu"))
    assert repr(nn.GRUCell(3, 4)) == repr(tnn.GRUCell(3, 4))


# -- dropout between layers ----------------------------------------------------------------------------------

def test_dropout_acts_between_layers_in_training_only():
    t_layer, e_layer = twins("GRU", 3, 4, num_layers=2, dropout=0.5)
    x, _ = inputs(5, (4, 2, 3), [])
    e_layer.eval()
    t_layer.eval()
    np.testing.assert_allclose(e_layer(ember.tensor(x))[0].numpy(), t_layer(torch.tensor(x))[0].detach().numpy(),
                               rtol=RTOL, atol=ATOL)
    evaluated = e_layer(ember.tensor(x))[1].numpy()
    e_layer.train()
    ember.manual_seed(0)
    trained = e_layer(ember.tensor(x))[1].numpy()
    np.testing.assert_allclose(trained[0], evaluated[0], rtol=RTOL, atol=ATOL)  # the first layer sees no dropout
    assert not np.allclose(trained[1], evaluated[1])
    with pytest.warns(UserWarning, match="num_layers=1"):
        nn.LSTM(3, 4, dropout=0.2)


# -- from_torch ----------------------------------------------------------------------------------------------

class Tagger(tnn.Module):
    """An LSTM encoder and a linear head on its last step."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = tnn.LSTM(3, 5, num_layers=2, batch_first=True, bidirectional=True)
        self.head = tnn.Linear(10, 2)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        return self.head(out[:, -1]) + c.sum()


def test_a_torch_model_with_an_lstm_imports_and_trains_one_sgd_step_as_torch():
    torch.manual_seed(2)
    model = Tagger()
    em = ember.from_torch(model)
    assert isinstance(em.lstm, nn.LSTM)
    assert list(em.state_dict()) == list(model.state_dict())
    x, _ = inputs(6, (2, 4, 3), [])
    target = np.random.default_rng(7).uniform(-1, 1, (2, 2)).astype(np.float32)
    loss_e = ember.nn.functional.mse_loss(em(ember.tensor(x)), ember.tensor(target))
    opt_e = ember.optim.SGD(em.parameters(), lr=0.1)
    opt_e.zero_grad()
    loss_e.backward()
    opt_e.step()
    ember.realize(*em.parameters())  # before torch's step writes the shared memory
    loss_t = tnn.functional.mse_loss(model(torch.tensor(x)), torch.tensor(target))
    opt_t = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_t.zero_grad()
    loss_t.backward()
    np.testing.assert_allclose(loss_e.item(), loss_t.item(), rtol=1e-5)
    opt_t.step()
    trained = dict(model.named_parameters())
    for name, p in em.named_parameters():
        np.testing.assert_allclose(p.numpy(), trained[name].detach().numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("make", [
    lambda: tnn.RNN(3, 4, nonlinearity="relu", bidirectional=True),
    lambda: tnn.GRU(3, 4, batch_first=True, bias=False),
    lambda: tnn.LSTM(3, 4, proj_size=2),
    lambda: tnn.LSTMCell(3, 4),
    lambda: tnn.RNNCell(3, 4, nonlinearity="relu"),
    lambda: tnn.GRUCell(3, 4),
], ids=["rnn", "gru", "lstm-projection", "lstm-cell", "rnn-cell", "gru-cell"])
def test_recurrent_layers_and_cells_import_sharing_their_parameters(make):
    torch.manual_seed(3)
    model = make()
    em = ember.from_torch(model)
    assert type(em).__name__ == type(model).__name__
    assert list(em.state_dict()) == list(model.state_dict())
    x, _ = inputs(8, (2, 3) if "Cell" in type(model).__name__ else (4, 2, 3), [])
    for e, t in zip(flat(em(ember.tensor(x))), flat(model(torch.tensor(x)))):
        np.testing.assert_allclose(e.numpy(), t.detach().numpy(), rtol=RTOL, atol=ATOL)
    with torch.no_grad():  # the parameters are torch's memory
        next(iter(model.parameters())).add_(1.0)
    np.testing.assert_array_equal(next(iter(em.parameters())).numpy(), next(iter(model.parameters())).detach().numpy())


# -- errors ----------------------------------------------------------------------------------------------

def test_wrong_inputs_and_states_are_errors_naming_the_layer_and_the_shapes():
    lstm, gru = nn.LSTM(3, 4, num_layers=2), nn.GRU(3, 4, batch_first=True)
    with pytest.raises(ShapeError, match=r"LSTM: expected input whose last dim is input_size=3.*shape=\(5, 2, 7\)"):
        lstm(ember.ones((5, 2, 7)))
    with pytest.raises(ShapeError, match=r"GRU: expected input of 2 dims \(L, input_size\) or 3 dims \(N, L, "):
        gru(ember.ones((2, 5, 2, 3)))
    with pytest.raises(ShapeError, match=r"GRU: expected hidden state of shape \(1, 2, 4\) .*shape=\(1, 5, 4\)"):
        gru(ember.ones((2, 5, 3)), ember.zeros((1, 5, 4)))
    with pytest.raises(ShapeError, match=r"LSTM: for unbatched 2-d input, the hidden state must have 2 dims"):
        lstm(ember.ones((5, 3)), (ember.zeros((2, 1, 4)), ember.zeros((2, 1, 4))))
    with pytest.raises(ShapeError, match=r"LSTM: expected hidden state of shape \(2, 2, 4\) and \(2, 2, 4\)"):
        lstm(ember.ones((5, 2, 3)), (ember.zeros((2, 2, 4)), ember.zeros((2, 2, 5))))
    with pytest.raises(TypeError, match=r"LSTM: hx must be a tuple \(h_0, c_0\)"):
        lstm(ember.ones((5, 2, 3)), ember.zeros((2, 2, 4)))
    with pytest.raises(DTypeError, match="RNN: input and hidden state must have the parameters' dtype float32"):
        nn.RNN(3, 4)(ember.ones((5, 2, 3), dtype=ember.float64))
    with pytest.raises(ShapeError, match="RNN: expected a sequence of at least one step"):
        nn.RNN(3, 4)(ember.ones((0, 2, 3)))


def test_wrong_cell_inputs_and_states_are_errors_naming_the_cell():
    with pytest.raises(ShapeError, match=r"LSTMCell: expected input of 1 dim \(input_size\) or 2 dims"):
        nn.LSTMCell(3, 4)(ember.ones((2, 2, 3)))
    with pytest.raises(ShapeError, match=r"GRUCell: expected input whose last dim is input_size=3"):
        nn.GRUCell(3, 4)(ember.ones((2, 5)))
    with pytest.raises(ShapeError, match=r"RNNCell: expected hidden state of shape \(2, 4\) .*shape=\(3, 4\)"):
        nn.RNNCell(3, 4)(ember.ones((2, 3)), ember.zeros((3, 4)))
    with pytest.raises(TypeError, match=r"LSTMCell: hx must be a tuple \(h_0, c_0\)"):
        nn.LSTMCell(3, 4)(ember.ones((2, 3)), ember.zeros((2, 4)))


def test_bad_constructor_arguments_are_errors_naming_the_argument():
    with pytest.raises(ValueError, match="RNN: unknown nonlinearity 'gelu'"):
        nn.RNN(3, 4, nonlinearity="gelu")
    with pytest.raises(ValueError, match="LSTM: dropout must be a number in"):
        nn.LSTM(3, 4, num_layers=2, dropout=1.5)
    with pytest.raises(ValueError, match=r"LSTM: proj_size \(4\) must be smaller than hidden_size \(4\)"):
        nn.LSTM(3, 4, proj_size=4)
    with pytest.raises(ValueError, match="proj_size is only supported by LSTM"):
        nn.RNNBase("GRU", 3, 4, proj_size=2)
    with pytest.raises(ValueError, match="GRU: hidden_size must be a positive integer, got 0"):
        nn.GRU(3, 0)
    with pytest.raises(ValueError, match="RNN: num_layers must be a positive integer"):
        nn.RNN(3, 4, num_layers=0)
