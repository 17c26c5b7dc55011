"""ONNX's recurrent layers (RNN, GRU, LSTM) as ember ops: the time loop unrolled into the lazy graph, one step of
matmuls and gates per position and direction, the input projection of all steps done as one matmul first.

Gate orders are ONNX's (GRU: z, r, h; LSTM: i, o, f, c; peepholes i, o, f). `sequence_lens` masks the steps past
each sequence's end: the state stops there and the output is zero.
"""

from __future__ import annotations

import ember
from ember.frontends.onnx.graph import NodeContext


def _activation(n: NodeContext, name: str, alphas: list, betas: list):
    """An activation by its ONNX name, taking its alpha and beta (if it has them) from the front of the lists."""
    def take(values, default):
        return values.pop(0) if values else default
    if name == "Tanh":
        return ember.tanh
    if name == "Sigmoid":
        return ember.sigmoid
    if name == "Relu":
        return ember.relu
    if name == "LeakyRelu":
        a = take(alphas, 0.01)
        return lambda x: ember.where(x >= 0, x, x * a)
    if name == "ThresholdedRelu":
        a = take(alphas, 1.0)
        return lambda x: ember.where(x > a, x, ember.zeros_like(x))
    if name == "HardSigmoid":
        a, b = take(alphas, 0.2), take(betas, 0.5)
        return lambda x: ember.clamp(x * a + b, 0.0, 1.0)
    if name == "Affine":
        a, b = take(alphas, 1.0), take(betas, 0.0)
        return lambda x: x * a + b
    if name == "ScaledTanh":
        a, b = take(alphas, 1.0), take(betas, 1.0)
        return lambda x: ember.tanh(x * b) * a
    if name == "Elu":
        a = take(alphas, 1.0)
        return lambda x: ember.where(x > 0, x, ember.expm1(x) * a)
    if name == "Softsign":
        return lambda x: x / (1 + ember.abs(x))
    if name == "Softplus":
        return lambda x: ember.log1p(ember.exp(x))
    raise n.unsupported(f"the activation {name!r}")


def _activations(n: NodeContext, defaults: list[str], directions: int) -> list[list]:
    names = n.attr("activations") or defaults * directions
    alphas, betas = list(n.attr("activation_alpha") or []), list(n.attr("activation_beta") or [])
    fns = [_activation(n, name, alphas, betas) for name in names]
    per = len(fns) // directions
    return [fns[d * per:(d + 1) * per] for d in range(directions)]


def _recurrent(kind: str):
    gates, defaults = {"RNN": (1, ["Tanh"]), "GRU": (3, ["Sigmoid", "Tanh"]),
                       "LSTM": (4, ["Sigmoid", "Tanh", "Tanh"])}[kind]

    def layer(n: NodeContext, x, w, r, b=None, lengths=None, h0=None, c0=None, peepholes=None):
        batch_first = n.attr("layout", 0) == 1
        if batch_first:
            x = x.transpose(0, 1)
            h0 = None if h0 is None else h0.transpose(0, 1)
            c0 = None if c0 is None else c0.transpose(0, 1)
        steps, batch = x.shape[0], x.shape[1]
        hidden = n.attr("hidden_size") or r.shape[-1]
        direction = n.attr("direction", "forward")
        directions = 2 if direction == "bidirectional" else 1
        fns = _activations(n, defaults, directions)
        lens = None if lengths is None else lengths.to(ember.int64).reshape(batch, 1)
        ys, hs, cs = [], [], []
        for d in range(directions):
            reverse = direction == "reverse" or d == 1
            bias = None if b is None else b[d]
            state = ember.zeros((batch, hidden), dtype=x.dtype, device=x.device) if h0 is None else h0[d]
            cell = ember.zeros((batch, hidden), dtype=x.dtype, device=x.device) if c0 is None else c0[d]
            projected = x @ w[d].transpose(0, 1)  # [steps, batch, gates * hidden]
            if bias is not None:
                projected = projected + bias[:gates * hidden]
            outputs = [None] * steps
            for t in (reversed(range(steps)) if reverse else range(steps)):
                new_state, new_cell = _step(n, kind, projected[t], state, cell, r[d], bias, hidden, fns[d],
                                            None if peepholes is None else peepholes[d])
                if lens is not None:
                    live = lens > t
                    outputs[t] = ember.where(live, new_state, ember.zeros_like(new_state))
                    new_state = ember.where(live, new_state, state)
                    new_cell = ember.where(live, new_cell, cell)
                else:
                    outputs[t] = new_state
                state, cell = new_state, new_cell
            ys.append(ember.stack(outputs, 0))
            hs.append(state)
            cs.append(cell)
        y, y_h, y_c = ember.stack(ys, 1), ember.stack(hs, 0), ember.stack(cs, 0)  # Y: [steps, dirs, batch, hidden]
        if batch_first:
            y, y_h, y_c = y.permute(2, 0, 1, 3), y_h.transpose(0, 1), y_c.transpose(0, 1)
        return (y, y_h, y_c) if kind == "LSTM" else (y, y_h)
    return layer


def _step(n: NodeContext, kind: str, projected, state, cell, r, bias, hidden: int, fns: list, peepholes):
    """One time step of one direction: the new hidden state (and cell, for LSTM)."""
    clip = n.attr("clip")
    recurrent_bias = None if bias is None else bias[r.shape[0]:]

    def gate(pre):
        return ember.clamp(pre, -clip, clip) if clip is not None else pre

    def part(t, k):
        return t[..., k * hidden:(k + 1) * hidden]
    if kind == "RNN":
        pre = projected + state @ r.transpose(0, 1)
        return fns[0](gate(pre if recurrent_bias is None else pre + recurrent_bias)), cell
    if kind == "GRU":
        f, g = fns
        rz = state @ r[:2 * hidden].transpose(0, 1)
        if recurrent_bias is not None:
            rz = rz + recurrent_bias[:2 * hidden]
        z = f(gate(part(projected, 0) + part(rz, 0)))
        reset = f(gate(part(projected, 1) + part(rz, 1)))
        rh, rbh = r[2 * hidden:].transpose(0, 1), None if recurrent_bias is None else recurrent_bias[2 * hidden:]
        if n.attr("linear_before_reset", 0):
            recurrent = state @ rh if rbh is None else state @ rh + rbh
            candidate = g(gate(part(projected, 2) + reset * recurrent))
        else:
            recurrent = (reset * state) @ rh
            candidate = g(gate(part(projected, 2) + (recurrent if rbh is None else recurrent + rbh)))
        return (1 - z) * candidate + z * state, cell
    f, g, h = fns
    pre = projected + state @ r.transpose(0, 1)
    if recurrent_bias is not None:
        pre = pre + recurrent_bias
    p_i, p_o, p_f = (None, None, None) if peepholes is None else (part(peepholes, 0), part(peepholes, 1),
                                                                   part(peepholes, 2))
    i = f(gate(part(pre, 0) + (0 if p_i is None else p_i * cell)))
    forget = f(gate(part(pre, 2) + (0 if p_f is None else p_f * cell)))
    if n.attr("input_forget", 0):
        forget = 1 - i
    new_cell = forget * cell + i * g(gate(part(pre, 3)))
    o = f(gate(part(pre, 1) + (0 if p_o is None else p_o * new_cell)))
    return o * h(new_cell), new_cell


OPS = {"RNN": _recurrent("RNN"), "GRU": _recurrent("GRU"), "LSTM": _recurrent("LSTM")}
