"""ONNX's control flow (If, Loop, Scan), sequences and optionals.

A branch's condition and a loop's trip count and condition are read as numbers when the node runs (they decide
which graph ember builds), so a Loop unrolls into the lazy graph; the values that flow through the iterations stay
lazy. Sequences are Python lists of tensors; an absent optional is None.
"""

from __future__ import annotations

import numpy as np

import ember
from ember.frontends.onnx.graph import NodeContext
from ember.frontends.onnx.tensors import slice_axis


def _subgraph(n: NodeContext, graph, values: list) -> list:
    """Runs a subgraph with its formal inputs bound to `values`, seeing the names of the scopes around it."""
    scope = n.scope.new_child({i.name: v for i, v in zip(graph.input, values)})
    return n.runner.run(graph, scope)


def _if(n: NodeContext, condition):
    branch = n.attr("then_branch") if bool(np.asarray(n.static(condition)).reshape(-1)[0]) else \
        n.attr("else_branch")
    return tuple(_subgraph(n, branch, []))


def _loop(n: NodeContext, trips=None, condition=None, *carried):
    body = n.attr("body")
    trips = None if trips is None else int(np.asarray(n.static(trips)).reshape(-1)[0])
    going = True if condition is None else bool(np.asarray(n.static(condition)).reshape(-1)[0])
    carried, scanned, i = list(carried), [], 0
    while going and (trips is None or i < trips):
        outputs = _subgraph(n, body, [n.const(np.int64(i)), n.const(np.bool_(going)), *carried])
        going = bool(np.asarray(n.static(outputs[0])).reshape(-1)[0])
        carried = outputs[1:1 + len(carried)]
        scanned.append(outputs[1 + len(carried):])
        i += 1
    count = len(body.output) - 1 - len(carried)
    stacked = [ember.stack([step[k] for step in scanned], 0) if scanned else
               ember.zeros((0,), device=n.device) for k in range(count)]
    return (*carried, *stacked)


def _scan(n: NodeContext, *inputs):
    body = n.attr("body")
    count = n.attr("num_scan_inputs")
    if n.opset < 9:  # Scan-8: a batch axis first, each batch item scanned on its own
        lengths, inputs = inputs[0], inputs[1:]
        states, sequences = list(inputs[:len(inputs) - count]), inputs[len(inputs) - count:]
        if lengths is not None and any(k != sequences[0].shape[1] for k in n.ints(lengths)):
            raise n.unsupported("sequence_lens shorter than the sequences")
        items = [_scan_steps(n, body, [s[b] for s in states], [x[b] for x in sequences], [0] * count,
                             n.attr("directions") or [0] * count, None, None)
                 for b in range(sequences[0].shape[0])]
        return tuple(ember.stack([item[k] for item in items], 0) for k in range(len(items[0])))
    states, sequences = list(inputs[:len(inputs) - count]), inputs[len(inputs) - count:]
    return _scan_steps(n, body, states, sequences, n.attr("scan_input_axes") or [0] * count,
                       n.attr("scan_input_directions") or [0] * count, n.attr("scan_output_axes"),
                       n.attr("scan_output_directions"))


def _scan_steps(n: NodeContext, body, states: list, sequences, in_axes, in_dirs, out_axes, out_dirs) -> tuple:
    """The body run along the scan inputs' axes (reversed where their direction is 1), the states carried through;
    the final states, then the per-step outputs stacked along their axes."""
    sequences = [s.flip((a % s.ndim,)) if d else s for s, a, d in zip(sequences, in_axes, in_dirs)]
    in_axes = [a % s.ndim for s, a in zip(sequences, in_axes)]
    steps = sequences[0].shape[in_axes[0]]
    scanned = []
    for t in range(steps):
        slices = [slice_axis(s, a, t, t + 1, 1).squeeze(a) for s, a in zip(sequences, in_axes)]
        outputs = _subgraph(n, body, [*states, *slices])
        states = outputs[:len(states)]
        scanned.append(outputs[len(states):])
    out_count = len(body.output) - len(states)
    out_axes = out_axes or [0] * out_count
    out_dirs = out_dirs or [0] * out_count
    results = []
    for k in range(out_count):
        axis = out_axes[k] % (scanned[0][k].ndim + 1)
        stacked = ember.stack([step[k] for step in scanned], axis)
        results.append(stacked.flip((axis,)) if out_dirs[k] else stacked)
    return (*states, *results)


def _position(n: NodeContext, sequence: list, position) -> int:
    return len(sequence) - 1 if position is None else int(np.asarray(n.static(position)).reshape(-1)[0])


def _sequence_insert(n: NodeContext, sequence, value, position=None):
    out = list(sequence)
    out.insert(len(out) if position is None else _position(n, sequence, position) % (len(out) + 1), value)
    return out


def _sequence_erase(n: NodeContext, sequence, position=None):
    out = list(sequence)
    del out[_position(n, sequence, position)]
    return out


def _concat_from_sequence(n: NodeContext, sequence):
    axis = n.attr("axis")
    if n.attr("new_axis", 0):
        return ember.stack(sequence, axis % (sequence[0].ndim + 1))
    return ember.cat(sequence, axis % sequence[0].ndim)


def _split_to_sequence(n: NodeContext, x, split=None):
    axis = n.attr("axis", 0) % x.ndim
    if split is None:
        pieces = [slice_axis(x, axis, i, i + 1, 1) for i in range(x.shape[axis])]
        return [p.squeeze(axis) for p in pieces] if n.attr("keepdims", 1) == 0 else pieces
    sizes = n.ints(split)
    if len(sizes) == 1 and np.asarray(n.static(split)).ndim == 0:
        sizes = [sizes[0]] * (x.shape[axis] // sizes[0]) + ([x.shape[axis] % sizes[0]] if x.shape[axis] %
                                                              sizes[0] else [])
    starts = np.cumsum([0, *sizes[:-1]])
    return [slice_axis(x, axis, int(s), int(s) + k, 1) for s, k in zip(starts, sizes)]


def _sequence_map(n: NodeContext, sequence, *others):
    body = n.attr("body")
    results = []
    for i in range(len(sequence)):
        extra = [o[i] if isinstance(o, list) else o for o in others]
        results.append(_subgraph(n, body, [sequence[i], *extra]))
    return tuple([step[k] for step in results] for k in range(len(body.output)))


OPS = {
    "If": _if, "Loop": _loop, "Scan": _scan,
    "SequenceConstruct": lambda n, *xs: list(xs), "SequenceEmpty": lambda n: [],
    "SequenceAt": lambda n, sequence, position: sequence[_position(n, sequence, position)],
    "SequenceInsert": _sequence_insert, "SequenceErase": _sequence_erase,
    "SequenceLength": lambda n, sequence: n.const(np.int64(len(sequence))),
    "ConcatFromSequence": _concat_from_sequence, "SplitToSequence": _split_to_sequence,
    "SequenceMap": _sequence_map,
    "Optional": lambda n, x=None: x, "OptionalGetElement": lambda n, x: x,
    "OptionalHasElement": lambda n, x=None: n.const(np.bool_(x is not None)),
}
