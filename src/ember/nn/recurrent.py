"""Recurrent layers with torch.nn's semantics: RNN (tanh or relu), LSTM (with an optional projection) and GRU, and
their one-step cells.

A layer is written as the graph a user would write: per layer and direction, the input projections of all time
steps are one matmul, then a Python loop over time applies the recurrence (one small matmul and the gates per
step) and joins the outputs. A padded batch and a PackedSequence (ember.nn.utils.rnn) run the same loop over the
packed layout: at each step only the sequences still running (a prefix of the batch, longest first) are
stepped, the others keep their state. Autograd differentiates that graph like any other. Parameter names, shapes, order
and initialisation (uniform in ±1/sqrt(hidden_size)) are PyTorch's, so `load_state_dict(torch_model.state_dict())`
fits and `from_torch` shares them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import numpy as np

from ember import dtypes
from ember.errors import DTypeError, ShapeError, operands
from ember.nn import functional as F
from ember.nn import init
from ember.nn.module import Module, Parameter
from ember.nn.utils.rnn import PackedSequence, batch_sizes_of, step_starts
from ember.ops import index_select, linear, sigmoid, tanh
from ember.ops.activations import relu
from ember.ops.creation import empty, zeros
from ember.ops.movement import cat, stack
from ember.tensor import Tensor, expect_tensors

State = tuple[Tensor, ...]  # (h,) for RNN and GRU, (h, c) for LSTM

# the gate blocks stacked in a weight's rows: LSTM (i, f, g, o), GRU (r, z, n)
GATES = {"RNN_TANH": 1, "RNN_RELU": 1, "LSTM": 4, "GRU": 3}


# -- one time step: `gi` is the input's projection x W_ihᵀ + b_ih, computed for all steps at once -------------

def _simple_step(activation: Callable[[Tensor], Tensor]):
    def step(gi: Tensor, state: State, w_hh: Tensor, b_hh: Tensor | None, w_hr: Tensor | None) -> State:
        return (activation(gi + linear(state[0], w_hh, b_hh)),)
    return step


def _lstm_step(gi: Tensor, state: State, w_hh: Tensor, b_hh: Tensor | None, w_hr: Tensor | None) -> State:
    h, c = state
    i, f, g, o = (gi + linear(h, w_hh, b_hh)).chunk(4, -1)
    c = sigmoid(f) * c + sigmoid(i) * tanh(g)
    h = sigmoid(o) * tanh(c)
    return (linear(h, w_hr) if w_hr is not None else h), c


def _gru_step(gi: Tensor, state: State, w_hh: Tensor, b_hh: Tensor | None, w_hr: Tensor | None) -> State:
    (h,) = state
    i_r, i_z, i_n = gi.chunk(3, -1)
    h_r, h_z, h_n = linear(h, w_hh, b_hh).chunk(3, -1)
    r, z = sigmoid(i_r + h_r), sigmoid(i_z + h_z)
    n = tanh(i_n + r * h_n)
    return ((1 - z) * n + z * h,)


STEPS = {"RNN_TANH": _simple_step(tanh), "RNN_RELU": _simple_step(relu), "LSTM": _lstm_step, "GRU": _gru_step}


def _factory(device, dtype) -> dict:
    return {"device": device, "dtype": dtypes.as_dtype(dtype) if dtype is not None else dtypes.default_float}


def _mode(layer: str, nonlinearity: str) -> str:
    if nonlinearity not in ("tanh", "relu"):
        raise ValueError(f"{layer}: unknown nonlinearity {nonlinearity!r}; expected 'tanh' or 'relu'")
    return "RNN_TANH" if nonlinearity == "tanh" else "RNN_RELU"


def _check_sizes(layer: str, input_size: int, hidden_size: int) -> None:
    for name, value in (("input_size", input_size), ("hidden_size", hidden_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{layer}: {name} must be a positive integer, got {value!r}")


def _check_input(layer: str, input: Tensor, input_size: int, weight: Tensor, accepted: tuple[int, int],
                 dims: str) -> None:
    """`input` has one of the `accepted` numbers of dims (unbatched, batched; `dims` describes them), `input_size`
    features last, and the dtype of the parameters (`weight`)."""
    expect_tensors(layer, input=input)
    if input.ndim not in accepted:
        raise ShapeError(f"{layer}: expected input of {dims}, got {operands(input)}")
    if input.shape[-1] != input_size:
        raise ShapeError(f"{layer}: expected input whose last dim is input_size={input_size}, got {operands(input)}")
    _check_dtype(layer, input, weight)


def _reset_uniform(module: Module, hidden_size: int) -> None:
    """torch's initialisation of every recurrent parameter: uniform in ±1/sqrt(hidden_size)."""
    bound = 1.0 / math.sqrt(hidden_size)
    for weight in module.parameters():
        init.uniform_(weight, -bound, bound)


def _check_dtype(layer: str, input: Tensor, weight: Tensor, *hx: Tensor) -> None:
    for t in (input, *hx):
        if t.dtype is not weight.dtype:
            raise DTypeError(f"{layer}: input and hidden state must have the parameters' dtype {weight.dtype.name}, "
                             f"got {operands(input, *hx)}")


class RNNBase(Module):
    """What RNN, LSTM and GRU share: the parameters of every layer and direction, the checks of the input and the
    hidden state, and the loop over layers, directions and time."""

    def __init__(self, mode: str, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False, proj_size: int = 0,
                 device=None, dtype=None) -> None:
        super().__init__()
        layer = type(self).__name__
        _check_sizes(layer, input_size, hidden_size)
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers <= 0:
            raise ValueError(f"{layer}: num_layers must be a positive integer, got {num_layers!r}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout <= 1:
            raise ValueError(f"{layer}: dropout must be a number in [0, 1] (the probability of an element being "
                             f"zeroed between layers), got {dropout!r}")
        if dropout > 0 and num_layers == 1:
            warnings.warn(f"{layer}: dropout={dropout} is applied between layers only, so it does nothing with "
                          "num_layers=1", stacklevel=2)
        if proj_size < 0:
            raise ValueError(f"{layer}: proj_size must be a non-negative integer, got {proj_size}")
        if proj_size and mode != "LSTM":
            raise ValueError(f"{layer}: proj_size is only supported by LSTM, not RNN or GRU")
        if proj_size >= hidden_size:
            raise ValueError(f"{layer}: proj_size ({proj_size}) must be smaller than hidden_size ({hidden_size})")
        self.mode, self.input_size, self.hidden_size, self.num_layers = mode, input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.dropout = bias, batch_first, float(dropout)
        self.bidirectional, self.proj_size = bidirectional, proj_size
        directions = 2 if bidirectional else 1
        gate_size = GATES[mode] * hidden_size
        out_size = proj_size or hidden_size
        factory = _factory(device, dtype)
        self._flat_weights_names: list[str] = []
        for k in range(num_layers):
            layer_input = input_size if k == 0 else out_size * directions
            for direction in range(directions):
                suffix = f"l{k}" + ("_reverse" if direction else "")
                shapes = {f"weight_ih_{suffix}": (gate_size, layer_input), f"weight_hh_{suffix}": (gate_size, out_size)}
                if bias:
                    shapes |= {f"bias_ih_{suffix}": (gate_size,), f"bias_hh_{suffix}": (gate_size,)}
                if proj_size:
                    shapes[f"weight_hr_{suffix}"] = (proj_size, hidden_size)
                for name, shape in shapes.items():
                    self.register_parameter(name, Parameter(empty(shape, **factory)))
                self._flat_weights_names.extend(shapes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_uniform(self, self.hidden_size)

    @property
    def _directions(self) -> int:
        return 2 if self.bidirectional else 1

    def _weights(self, k: int, direction: int) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
        """(weight_ih, weight_hh, bias_ih, bias_hh, weight_hr) of layer `k` in `direction`, None where absent."""
        suffix = f"l{k}" + ("_reverse" if direction else "")
        return tuple(getattr(self, f"{kind}_{suffix}", None)
                     for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr"))

    def _state_shapes(self, batch: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """The shapes of h_0 (and c_0 for LSTM) for a batch of `batch` (empty when unbatched)."""
        stacked = self.num_layers * self._directions
        h = (stacked, *batch, self.proj_size or self.hidden_size)
        return (h, (stacked, *batch, self.hidden_size)) if self.mode == "LSTM" else (h,)

    def _initial_state(self, layer: str, hx, batch: tuple[int, ...], input: Tensor, input_kind: str) -> State:
        """h_0 (and c_0 for LSTM) as (layers * directions, N, size): `hx` checked against a batch of `batch`
        (empty when unbatched: given without N, returned with N = 1) and the `input` (named as `input_kind`), or
        zeros of its dtype."""
        shapes = self._state_shapes(batch)
        if hx is None:
            state = tuple(zeros(shape, dtype=input.dtype, device=input.device) for shape in shapes)
            return state if batch else tuple(t.unsqueeze(1) for t in state)
        if self.mode == "LSTM" and (not isinstance(hx, (tuple, list)) or len(hx) != 2):
            raise TypeError(f"{layer}: hx must be a tuple (h_0, c_0), got {type(hx).__name__}")
        given = tuple(hx) if self.mode == "LSTM" else (hx,)
        expect_tensors(layer, **{name: t for name, t in zip(("h_0", "c_0"), given)})
        expected = " and ".join(str(shape) for shape in shapes)
        if any(t.ndim != len(shapes[0]) for t in given):
            raise ShapeError(f"{layer}: for {input_kind}, the hidden state must have {len(shapes[0])} dims "
                             f"too: expected {expected}, got {operands(*given)}")
        if any(t.shape != shape for t, shape in zip(given, shapes)):
            raise ShapeError(f"{layer}: expected hidden state of shape {expected} for {input_kind} of shape "
                             f"{input.shape}, got {operands(*given)}")
        _check_dtype(layer, input, self.weight_ih_l0, *given)
        return given if batch else tuple(t.unsqueeze(1) for t in given)

    def forward(self, input: Tensor | PackedSequence, hx=None):
        """(output, h_n), or (output, (h_n, c_n)) for LSTM: the last layer's outputs at every step, both directions
        side by side, and each layer's and direction's final state. For a PackedSequence the output is packed as
        the input, and each sequence's final state is the one at its own last step (at step 0 in reverse)."""
        layer = type(self).__name__
        if isinstance(input, PackedSequence):
            return self._forward_packed(layer, input, hx)
        _check_input(layer, input, self.input_size, self.weight_ih_l0, (2, 3),
                     f"2 dims (L, input_size) or 3 dims ({'N, L' if self.batch_first else 'L, N'}, input_size)")
        batched = input.ndim == 3
        if not batched:
            x = input.unsqueeze(1)  # (L, N, features) throughout, N = 1 here
        else:
            x = input.transpose(0, 1) if self.batch_first else input
        steps, batch = x.shape[:2]
        if steps == 0:
            raise ShapeError(f"{layer}: expected a sequence of at least one step, got {operands(input)}")
        state = self._initial_state(layer, hx, (batch,) if batched else (), input,
                                    f"{'batched 3-d' if batched else 'unbatched 2-d'} input")
        data, last = self._run(x.reshape(steps * batch, x.shape[2]), state, [batch] * steps)
        x = data.reshape(steps, batch, data.shape[-1])
        if not batched:
            output, last = x.squeeze(1), tuple(t.squeeze(1) for t in last)
        else:
            output = x.transpose(0, 1) if self.batch_first else x
        return output, (last if self.mode == "LSTM" else last[0])

    def _forward_packed(self, layer: str, packed: PackedSequence, hx):
        """forward over a PackedSequence: h_0 given in the batch's own order, as torch takes it, and h_n so too."""
        counts = batch_sizes_of(packed)
        data = packed.data
        _check_input(layer, data, self.input_size, self.weight_ih_l0, (2,),
                     "a PackedSequence whose data has 2 dims (sum of the lengths, input_size)")
        state = self._initial_state(layer, hx, (int(counts[0]),), data, "PackedSequence data")
        if packed.sorted_indices is not None:
            state = tuple(index_select(t, 1, packed.sorted_indices.to(t.device)) for t in state)
        out, last = self._run(data, state, counts.tolist())
        if packed.unsorted_indices is not None:
            last = tuple(index_select(t, 1, packed.unsorted_indices.to(t.device)) for t in last)
        output = PackedSequence(out, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices)
        return output, (last if self.mode == "LSTM" else last[0])

    def _run(self, x: Tensor, state: State, batch_sizes: list[int]) -> tuple[Tensor, State]:
        """Every layer and direction over a sequence laid out as a PackedSequence's data: x holds each step's rows
        in turn, `batch_sizes[t]` of them, the first that many of the batch (a padded batch: all of them at every
        step). Returns the last layer's outputs in x's layout and the final states stacked as `state`."""
        step = STEPS[self.mode]
        starts = step_starts(np.array(batch_sizes)).tolist()
        finals: list[State] = []
        for k in range(self.num_layers):
            outputs = []
            for direction in range(self._directions):
                w_ih, w_hh, b_ih, b_hh, w_hr = self._weights(k, direction)
                index = k * self._directions + direction
                s = tuple(t[index] for t in state)
                gi = linear(x, w_ih, b_ih)  # every step's input projection in one matmul
                ys: list[Tensor] = [None] * len(batch_sizes)
                for t in (reversed(range(len(batch_sizes))) if direction else range(len(batch_sizes))):
                    n = batch_sizes[t]
                    if n == s[0].shape[0]:
                        s = step(gi[starts[t]:starts[t] + n], s, w_hh, b_hh, w_hr)
                    else:  # the sequences past their end keep their state
                        running = step(gi[starts[t]:starts[t] + n], tuple(h[:n] for h in s), w_hh, b_hh, w_hr)
                        s = tuple(cat([new, h[n:]]) for new, h in zip(running, s))
                    ys[t] = s[0][:n]
                outputs.append(cat(ys) if len(ys) > 1 else ys[0])
                finals.append(s)
            x = cat(outputs, -1) if len(outputs) > 1 else outputs[0]
            if self.dropout and self.training and k < self.num_layers - 1:
                x = F.dropout(x, self.dropout, True)
        return x, tuple(stack([s[i] for s in finals]) for i in range(len(state)))

    def extra_repr(self) -> str:
        text = f"{self.input_size}, {self.hidden_size}"
        if self.proj_size:
            text += f", proj_size={self.proj_size}"
        if self.num_layers != 1:
            text += f", num_layers={self.num_layers}"
        if not self.bias:
            text += ", bias=False"
        if self.batch_first:
            text += ", batch_first=True"
        if self.dropout:
            text += f", dropout={self.dropout}"
        if self.bidirectional:
            text += ", bidirectional=True"
        return text


class RNN(RNNBase):
    """torch.nn.RNN: h_t = nonlinearity(x_t W_ihᵀ + b_ih + h_{t-1} W_hhᵀ + b_hh), tanh or relu, over (L, N, H_in)
    input ((N, L, H_in) with `batch_first`, or unbatched (L, H_in)); returns (output, h_n)."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, nonlinearity: str = "tanh",
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__(_mode("RNN", nonlinearity), input_size, hidden_size, num_layers, bias, batch_first,
                         dropout, bidirectional, device=device, dtype=dtype)
        self.nonlinearity = nonlinearity


class LSTM(RNNBase):
    """torch.nn.LSTM: input, forget, cell and output gates (stacked in that order in the weights' rows); with
    `proj_size` > 0 the hidden state is projected by weight_hr. forward(input, (h_0, c_0)) returns
    (output, (h_n, c_n))."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False, proj_size: int = 0,
                 device=None, dtype=None) -> None:
        super().__init__("LSTM", input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         proj_size, device, dtype)


class GRU(RNNBase):
    """torch.nn.GRU: reset, update and new gates (stacked in that order in the weights' rows), with the reset gate
    applied to the hidden projection after its bias, as PyTorch (and cuDNN) do. Returns (output, h_n)."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False, device=None,
                 dtype=None) -> None:
        super().__init__("GRU", input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         device=device, dtype=dtype)


# -- cells: one time step -----------------------------------------------------------------------------------

class RNNCellBase(Module):
    """What the cells share: weight_ih, weight_hh, bias_ih and bias_hh (torch's names and initialisation), and the
    checks of the input (N, input_size) or (input_size) and the hidden state."""

    def __init__(self, mode: str, input_size: int, hidden_size: int, bias: bool, device=None, dtype=None) -> None:
        super().__init__()
        layer = type(self).__name__
        _check_sizes(layer, input_size, hidden_size)
        self.mode, self.input_size, self.hidden_size, self.bias = mode, input_size, hidden_size, bias
        factory = _factory(device, dtype)
        gate_size = GATES[self.mode] * hidden_size
        self.weight_ih = Parameter(empty((gate_size, input_size), **factory))
        self.weight_hh = Parameter(empty((gate_size, hidden_size), **factory))
        if bias:
            self.bias_ih = Parameter(empty(gate_size, **factory))
            self.bias_hh = Parameter(empty(gate_size, **factory))
        else:
            self.register_parameter("bias_ih", None)
            self.register_parameter("bias_hh", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_uniform(self, self.hidden_size)

    def _step(self, input: Tensor, hx: State | None) -> State:
        """The new state for `input` from `hx` (zeros when None), each of the input's batched-ness."""
        layer = type(self).__name__
        _check_input(layer, input, self.input_size, self.weight_ih, (1, 2),
                     "1 dim (input_size) or 2 dims (N, input_size)")
        expected = (*input.shape[:-1], self.hidden_size)
        if hx is None:
            hx = tuple(zeros(expected, dtype=input.dtype, device=input.device) for _ in range(len(self._state_names)))
        expect_tensors(layer, **dict(zip(self._state_names, hx)))
        if any(t.shape != expected for t in hx):
            raise ShapeError(f"{layer}: expected hidden state of shape {expected} for input of shape {input.shape}, "
                             f"got {operands(*hx)}")
        _check_dtype(layer, input, self.weight_ih, *hx)
        gi = linear(input, self.weight_ih, self.bias_ih)
        return STEPS[self.mode](gi, hx, self.weight_hh, self.bias_hh, None)

    @property
    def _state_names(self) -> tuple[str, ...]:
        return ("h_0", "c_0") if self.mode == "LSTM" else ("hx",)

    def extra_repr(self) -> str:
        text = f"{self.input_size}, {self.hidden_size}"
        if not self.bias:
            text += ", bias=False"
        if getattr(self, "nonlinearity", "tanh") != "tanh":
            text += f", nonlinearity={self.nonlinearity}"
        return text


class RNNCell(RNNCellBase):
    """torch.nn.RNNCell: h' = nonlinearity(x W_ihᵀ + b_ih + h W_hhᵀ + b_hh), tanh or relu."""

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, nonlinearity: str = "tanh",
                 device=None, dtype=None) -> None:
        super().__init__(_mode("RNNCell", nonlinearity), input_size, hidden_size, bias, device, dtype)
        self.nonlinearity = nonlinearity

    def forward(self, input: Tensor, hx: Tensor | None = None) -> Tensor:
        return self._step(input, None if hx is None else (hx,))[0]


class LSTMCell(RNNCellBase):
    """torch.nn.LSTMCell: forward(input, (h, c)) returns (h', c')."""

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__("LSTM", input_size, hidden_size, bias, device, dtype)

    def forward(self, input: Tensor, hx: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        if hx is not None and (not isinstance(hx, (tuple, list)) or len(hx) != 2):
            raise TypeError(f"LSTMCell: hx must be a tuple (h_0, c_0), got {type(hx).__name__}")
        return self._step(input, None if hx is None else tuple(hx))


class GRUCell(RNNCellBase):
    """torch.nn.GRUCell: one GRU step, h' = (1 - z) * n + z * h."""

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__("GRU", input_size, hidden_size, bias, device, dtype)

    def forward(self, input: Tensor, hx: Tensor | None = None) -> Tensor:
        return self._step(input, None if hx is None else (hx,))[0]
