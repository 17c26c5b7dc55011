"""ember.nn.utils.rnn against torch.nn.utils.rnn: packing and unpacking variable-length sequences (values, the step
counts and sort orders, gradients), pad_sequence and its inverses; RNN, LSTM and GRU over a PackedSequence (packed
outputs, each sequence's final state, the gradients of the input, the initial state and every parameter); a torch
model that packs its input imported with from_torch; and the misuses torch refuses."""

from __future__ import annotations

import numpy as np
import pytest

import ember
from ember import nn
from ember.errors import ShapeError
from ember.nn.utils import rnn

torch = pytest.importorskip("torch")
trnn = torch.nn.utils.rnn

pytestmark = pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")


def leaves(x: np.ndarray):
    return torch.tensor(x, requires_grad=True), ember.tensor(x, requires_grad=True)


def same(e, t, rtol: float = 1e-5, atol: float = 1e-6, what: str = "") -> None:
    assert tuple(e.shape) == tuple(t.shape), f"{what}: shape {e.shape} != torch's {tuple(t.shape)}"
    np.testing.assert_allclose(e.numpy().astype(np.float64), t.detach().numpy().astype(np.float64), rtol=rtol,
                               atol=atol, err_msg=what)


def same_packing(e: rnn.PackedSequence, t) -> None:
    """The same data, step counts and sort orders."""
    same(e.data, t.data, what="data")
    assert e.batch_sizes.tolist() == t.batch_sizes.tolist()
    for name in ("sorted_indices", "unsorted_indices"):
        mine, theirs = getattr(e, name), getattr(t, name)
        assert (mine is None) == (theirs is None), name
        assert mine is None or mine.tolist() == theirs.tolist(), name


def backward_both(t_out: list, e_out: list, seed: int = 0) -> None:
    """Backpropagate the same random cotangents of matching outputs through torch and ember."""
    rng = np.random.default_rng(seed)
    cotangents = [rng.standard_normal(tuple(t.shape)).astype(np.float32) for t in t_out]
    sum((t * torch.tensor(c).to(t.dtype)).sum() for c, t in zip(cotangents, t_out)).backward()
    sum((e * ember.tensor(c).to(e.dtype)).sum() for c, e in zip(cotangents, e_out)).backward()


# -- packing and unpacking -------------------------------------------------------------------------------

PACKINGS = {  # id: (padded shape, lengths, batch_first, enforce_sorted)
    "sorted": ((4, 3, 2), [4, 2, 1], False, True),
    "unsorted-ties-batch-first": ((5, 6, 2), [2, 5, 2, 1, 5], True, False),
    "trailing-dims-longer-than-lengths": ((6, 2, 2, 3), [3, 4], False, False),
    "one-sequence-of-one-step": ((1, 1, 3), [1], True, True),
    "equal-lengths": ((3, 2, 1), [3, 3], False, False),
}


@pytest.mark.parametrize("shape, lengths, batch_first, enforce_sorted", PACKINGS.values(), ids=PACKINGS)
def test_packing_and_unpacking_match_torch_with_gradients(shape, lengths, batch_first, enforce_sorted):
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    tx, ex = leaves(x)
    t_packed = trnn.pack_padded_sequence(tx, torch.tensor(lengths), batch_first, enforce_sorted)
    e_packed = rnn.pack_padded_sequence(ex, lengths, batch_first, enforce_sorted)
    same_packing(e_packed, t_packed)
    total = shape[1 if batch_first else 0] + 1
    t_padded, t_lengths = trnn.pad_packed_sequence(t_packed, batch_first, padding_value=-2.0, total_length=total)
    e_padded, e_lengths = rnn.pad_packed_sequence(e_packed, batch_first, padding_value=-2.0, total_length=total)
    same(e_padded, t_padded, what="padded")
    assert e_lengths.tolist() == t_lengths.tolist() == lengths
    assert e_lengths.dtype is ember.int64 and e_packed.batch_sizes.dtype is ember.int64
    backward_both([t_padded, t_packed.data], [e_padded, e_packed.data])
    same(ex.grad, tx.grad, what="gradient of the input")


def test_packing_float16_keeps_the_values_and_dtype():
    x = np.random.default_rng(2).standard_normal((3, 3, 2)).astype(np.float16)
    t_packed = trnn.pack_padded_sequence(torch.tensor(x), [1, 3, 2], enforce_sorted=False)
    e_packed = rnn.pack_padded_sequence(ember.tensor(x), [1, 3, 2], enforce_sorted=False)
    assert e_packed.data.dtype is ember.float16
    same_packing(e_packed, t_packed)
    same(rnn.pad_packed_sequence(e_packed)[0], trnn.pad_packed_sequence(t_packed)[0], what="padded")


@pytest.mark.parametrize("batch_first, padding_value, padding_side", [
    (False, 0.0, "right"), (True, 1.5, "right"), (True, 0.0, "left"), (False, -1.0, "left")])
def test_pad_sequence_and_its_inverses_match_torch(batch_first, padding_value, padding_side):
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal((n, 2)).astype(np.float32) for n in (2, 4, 1)]
    t_seqs, e_seqs = zip(*(leaves(a) for a in arrays))
    t_padded = trnn.pad_sequence(t_seqs, batch_first, padding_value, padding_side)
    e_padded = rnn.pad_sequence(e_seqs, batch_first, padding_value, padding_side)
    same(e_padded, t_padded, what="padded")
    backward_both([t_padded], [e_padded])
    for e, t in zip(e_seqs, t_seqs):
        same(e.grad, t.grad, what="gradient of a sequence")
    if padding_side == "right":
        for e, t in zip(rnn.unpad_sequence(e_padded, [2, 4, 1], batch_first),
                        trnn.unpad_sequence(t_padded, torch.tensor([2, 4, 1]), batch_first)):
            same(e, t, what="unpadded")


def test_pack_sequence_and_unpack_sequence_match_torch():
    rng = np.random.default_rng(4)
    arrays = [rng.standard_normal((n, 3)).astype(np.float32) for n in (2, 3, 1)]
    t_packed = trnn.pack_sequence([torch.tensor(a) for a in arrays], enforce_sorted=False)
    e_packed = rnn.pack_sequence([ember.tensor(a) for a in arrays], enforce_sorted=False)
    same_packing(e_packed, t_packed)
    for e, t in zip(rnn.unpack_sequence(e_packed), trnn.unpack_sequence(t_packed)):
        same(e, t, what="unpacked")
    rebuilt = rnn.PackedSequence(e_packed.data, e_packed.batch_sizes, e_packed.sorted_indices)
    assert rebuilt.unsorted_indices.tolist() == t_packed.unsorted_indices.tolist()  # computed, as torch does
    moved = e_packed.to(ember.float64)
    assert moved.data.dtype is ember.float64 and moved.batch_sizes is e_packed.batch_sizes
    assert not moved.is_cuda


# -- the recurrent layers over packed sequences ------------------------------------------------------------

LAYERS = {  # id: (kind, constructor keywords, lengths, given initial state)
    "lstm-2layers-bidirectional-projection-unsorted-hx": ("LSTM", dict(num_layers=2, bidirectional=True, proj_size=2),
                                                          [2, 4, 1, 4], True),
    "gru-batch-first-sorted": ("GRU", dict(batch_first=True), [3, 2, 2], False),
    "rnn-relu-bidirectional-unsorted-hx": ("RNN", dict(nonlinearity="relu", bidirectional=True), [1, 3], True),
    "lstm-one-sequence-of-one-step": ("LSTM", {}, [1], True),
    "gru-2layers-no-bias-unsorted": ("GRU", dict(num_layers=2, bias=False), [2, 3, 1], False),
}


def _twins(kind: str, kwargs: dict):
    torch.manual_seed(0)
    t_layer, e_layer = getattr(torch.nn, kind)(3, 4, **kwargs), getattr(nn, kind)(3, 4, **kwargs)
    e_layer.load_state_dict({k: ember.tensor(v.numpy()) for k, v in t_layer.state_dict().items()})
    return t_layer, e_layer


def _states(value) -> list:
    return list(value) if isinstance(value, tuple) else [value]


@pytest.mark.parametrize("case", list(LAYERS))
def test_recurrent_layers_over_packed_sequences_match_torch_with_gradients(case):
    kind, kwargs, lengths, given = LAYERS[case]
    t_layer, e_layer = _twins(kind, kwargs)
    batch_first = kwargs.get("batch_first", False)
    steps, batch = max(lengths), len(lengths)
    rng = np.random.default_rng(5)
    tx, ex = leaves(rng.uniform(-2, 2, (batch, steps, 3) if batch_first else (steps, batch, 3)).astype(np.float32))
    stacked = kwargs.get("num_layers", 1) * (2 if kwargs.get("bidirectional") else 1)
    shapes = [(stacked, batch, kwargs.get("proj_size") or 4)] + ([(stacked, batch, 4)] if kind == "LSTM" else [])
    t_hx, e_hx = zip(*(leaves(rng.uniform(-1, 1, s).astype(np.float32)) for s in shapes)) if given else ((), ())
    pack = (lambda hx: None if not hx else tuple(hx) if kind == "LSTM" else hx[0])
    t_out, t_last = t_layer(trnn.pack_padded_sequence(tx, lengths, batch_first, enforce_sorted=False), pack(t_hx))
    e_out, e_last = e_layer(rnn.pack_padded_sequence(ex, lengths, batch_first, enforce_sorted=False), pack(e_hx))
    assert isinstance(e_out, rnn.PackedSequence)
    same_packing(e_out, t_out)
    for i, (e, t) in enumerate(zip(_states(e_last), _states(t_last))):
        same(e, t, what=f"final state {i}")
    backward_both([t_out.data, *_states(t_last)], [e_out.data, *_states(e_last)])
    same(ex.grad, tx.grad, 1e-4, 1e-5, "gradient of the input")
    for i, (e, t) in enumerate(zip(e_hx, t_hx)):
        same(e.grad, t.grad, 1e-4, 1e-5, f"gradient of hx[{i}]")
    mine = dict(e_layer.named_parameters())
    for name, p in t_layer.named_parameters():
        same(mine[name].grad, p.grad, 1e-4, 1e-5, f"gradient of {name}")


class PackingTagger(torch.nn.Module):
    """Tags each step of a padded batch of sequences of different lengths: packs them (unsorted) for a
    bidirectional LSTM and unpacks its output."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(3, 4, batch_first=True, bidirectional=True)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x, lengths):
        packed = trnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, (h, c) = self.lstm(packed)
        padded, _ = trnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return self.head(padded).sum(-1) + h.sum(0).mean(-1, keepdim=True)


def test_a_torch_model_that_packs_its_input_imports_and_trains_one_step_as_torch():
    torch.manual_seed(1)
    model = PackingTagger()
    em = ember.from_torch(model, via="fx")
    x = np.random.default_rng(6).standard_normal((3, 5, 3)).astype(np.float32)
    lengths = np.array([2, 5, 3])
    e_out = em(ember.tensor(x), ember.tensor(lengths))
    same(e_out, model(torch.tensor(x), torch.tensor(lengths)), what="output")
    e_loss = e_out.square().mean()
    e_grads = ember.grad(e_loss, list(em.parameters()))
    t_loss = model(torch.tensor(x), torch.tensor(lengths)).square().mean()
    t_grads = torch.autograd.grad(t_loss, list(model.parameters()))
    np.testing.assert_allclose(e_loss.item(), t_loss.item(), rtol=1e-5)
    for (name, _), e, t in zip(model.named_parameters(), e_grads, t_grads):
        same(e, t, 1e-4, 1e-6, f"gradient of {name}")


# -- misuse ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, lengths, kwargs, error", [
    ((3, 2, 1), [1, 3], {}, ValueError),  # not decreasing, enforce_sorted
    ((3, 2, 1), [3, 0], {}, ValueError),  # an empty sequence
    ((3, 2, 1), [3, 2, 1], {}, ShapeError),  # a length per sequence
    ((3,), [3], {}, ShapeError),  # no batch axis
], ids=["unsorted", "zero-length", "count", "rank"])
def test_packing_refuses_what_torch_refuses(shape, lengths, kwargs, error):
    with pytest.raises((RuntimeError, ValueError, IndexError)):
        trnn.pack_padded_sequence(torch.ones(shape), torch.tensor(lengths), **kwargs)
    with pytest.raises(error, match="pack_padded_sequence"):
        rnn.pack_padded_sequence(ember.ones(shape), lengths, **kwargs)


def test_misused_packed_sequences_are_errors_naming_what_is_wrong():
    with pytest.raises(ShapeError, match=r"lengths \[4, 2\] run past the 3 steps"):  # torch reads past the end
        rnn.pack_padded_sequence(ember.ones((3, 2, 1)), [4, 2])
    packed = rnn.pack_padded_sequence(ember.ones((3, 2, 3)), [3, 2])
    with pytest.raises(ValueError, match="total_length 2 is shorter than the longest sequence"):
        rnn.pad_packed_sequence(packed, total_length=2)
    with pytest.raises(TypeError, match="expected a PackedSequence"):
        rnn.pad_packed_sequence(ember.ones((3, 2)))
    with pytest.raises(ShapeError, match="batch_sizes"):
        rnn.pad_packed_sequence(rnn.PackedSequence(packed.data, ember.tensor([2, 2])))
    with pytest.raises(ShapeError, match=r"LSTM: expected input whose last dim is input_size=4"):
        nn.LSTM(4, 2)(packed)
    with pytest.raises(ShapeError, match=r"GRU: expected hidden state of shape \(1, 2, 2\) for PackedSequence data"):
        nn.GRU(3, 2)(packed, ember.zeros((1, 3, 2)))
    with pytest.raises(ValueError, match="padding_side"):
        rnn.pad_sequence([ember.ones((2, 1))], padding_side="middle")
