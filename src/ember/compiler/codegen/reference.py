"""The reference backend: a NumPy interpreter that evaluates the graph op by op.

It is the oracle every other backend is tested against, so it favours clarity over
speed. Half-precision values are computed in float32 and rounded when stored, as
PyTorch's CPU backend does; integers wrap around as they do in PyTorch.
"""

from __future__ import annotations

import numpy as np

from ember import dtypes
from ember.ir import Node, Op
from ember.ir.ops import RULES
from ember.ir.philox import philox_normal, philox_uniform


def _widen(a: np.ndarray) -> np.ndarray:
    """Half types are computed in float32."""
    if a.dtype == dtypes.float16.np or a.dtype == dtypes.bfloat16.np:
        return a.astype(np.float32)
    return a


REDUCE = {Op.SUM: np.sum, Op.PROD: np.prod, Op.MAX: np.max, Op.MIN: np.min}


def _reduce(node: Node, x: np.ndarray) -> np.ndarray:
    axes = node.attrs["axes"]
    if node.op in (Op.ARGMAX, Op.ARGMIN):
        (axis,) = axes
        fn = np.argmax if node.op is Op.ARGMAX else np.argmin
        return fn(x, axis=axis, keepdims=True)
    if node.op in (Op.SUM, Op.PROD) and x.dtype.kind in "iub":
        return REDUCE[node.op](x, axis=axes, keepdims=True, dtype=node.dtype.np)
    return REDUCE[node.op](x, axis=axes, keepdims=True)


def _movement(node: Node, x: np.ndarray) -> np.ndarray:
    a = node.attrs
    op = node.op
    if op is Op.RESHAPE:
        return x.reshape(a["shape"])
    if op is Op.PERMUTE:
        return x.transpose(a["order"])
    if op is Op.EXPAND:
        return np.broadcast_to(x, a["shape"])
    if op is Op.SLICE:
        return x[tuple(slice(*s) for s in a["slices"])]
    if op is Op.FLIP:
        return np.flip(x, a["axes"])
    if op is Op.PAD:
        return np.pad(x, a["pads"], constant_values=np.asarray(a["value"]).astype(x.dtype))
    raise AssertionError(op)


def conv2d(x: np.ndarray, w: np.ndarray, stride, padding, dilation, groups: int) -> np.ndarray:
    """Direct 2-D convolution (cross-correlation, as in PyTorch) through an im2col view."""
    n, c, _, _ = x.shape
    o, cg, kh, kw = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    x = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    ho = (x.shape[2] - dh * (kh - 1) - 1) // sh + 1
    wo = (x.shape[3] - dw * (kw - 1) - 1) // sw + 1
    s = x.strides
    # windows[n, c, i, j, p, q] = x[n, c, i*sh + p*dh, j*sw + q*dw]
    windows = np.lib.stride_tricks.as_strided(
        x, (n, c, max(ho, 0), max(wo, 0), kh, kw), (s[0], s[1], s[2] * sh, s[3] * sw, s[2] * dh, s[3] * dw),
        writeable=False)
    windows = windows.reshape(n, groups, cg, ho, wo, kh, kw)
    wg = w.reshape(groups, o // groups, cg, kh, kw)
    out = np.einsum("ngchwpq,gocpq->ngohw", windows, wg, optimize=True)
    return out.reshape(n, o, ho, wo)


def _gather(x: np.ndarray, index: np.ndarray, axis: int) -> np.ndarray:
    # torch.gather lets the index be smaller than the input along the other axes
    x = x[tuple(slice(0, s) if d != axis else slice(None) for d, s in enumerate(index.shape))]
    _check_index(index, x.shape[axis], "gather")
    return np.take_along_axis(x, index, axis)


def _scatter_add(base: np.ndarray, index: np.ndarray, src: np.ndarray, axis: int) -> np.ndarray:
    _check_index(index, base.shape[axis], "scatter_add")
    out = base.copy()
    where = list(np.indices(index.shape, sparse=True))
    where[axis] = index
    src = src[tuple(slice(0, s) for s in index.shape)]
    np.add.at(out, tuple(where), src)
    return out


def _check_index(index: np.ndarray, size: int, op: str) -> None:
    if index.size and (index.min() < 0 or index.max() >= size):
        bad = index[(index < 0) | (index >= size)].flat[0]
        raise IndexError(f"{op}: index {bad} is out of bounds for a dimension of size {size}")


def evaluate(node: Node, args: list[np.ndarray]) -> np.ndarray:
    """The value of one node, given the values of its inputs."""
    op, kind = node.op, node.op.kind.value
    out_np = node.dtype.np
    if op is Op.CONST:
        return np.broadcast_to(np.asarray(node.attrs["value"], dtype=out_np), node.shape)
    if op is Op.IOTA:
        return np.arange(node.attrs["n"], dtype=np.int64)
    if op is Op.RAND:
        offsets = node.attrs["offset"] + np.arange(node.numel, dtype=np.int64)
        draw = philox_uniform if node.attrs["distribution"] == "uniform" else philox_normal
        return draw(node.attrs["seed"], offsets).reshape(node.shape)
    if kind in ("unary", "binary", "ternary"):  # each primitive's NumPy rule (ember/ops/pointwise.py)
        return np.asarray(RULES[op].reference(*(_widen(a) for a in args))).astype(out_np, copy=False)
    if kind == "reduce":
        return np.asarray(_reduce(node, _widen(args[0]))).astype(out_np, copy=False)
    if kind == "movement":
        return _movement(node, args[0])
    if op is Op.MATMUL:
        return np.matmul(_widen(args[0]), _widen(args[1])).astype(out_np, copy=False)
    if op is Op.CONV2D:
        a = node.attrs
        out = conv2d(_widen(args[0]), _widen(args[1]), a["stride"], a["padding"], a["dilation"], a["groups"])
        return out.astype(out_np, copy=False)
    if op is Op.GATHER:
        return _gather(args[0], args[1], node.attrs["axis"])
    if op is Op.SCATTER_ADD:
        out = _scatter_add(_widen(args[0]), args[1], _widen(args[2]), node.attrs["axis"])
        return out.astype(out_np, copy=False)
    if op is Op.COPY:
        return args[0]
    raise AssertionError(f"reference backend has no rule for {op}")


def run(order: list[Node], keep: set[int]) -> dict[int, np.ndarray]:
    """Evaluate `order` (inputs first); return the values of the nodes whose ids are in `keep`.

    A value is dropped as soon as its last user has run, so peak memory follows the
    live set, not the whole graph.
    """
    uses: dict[int, int] = {}
    for node in order:
        for i in node.inputs:
            uses[id(i)] = uses.get(id(i), 0) + 1
    values: dict[int, np.ndarray] = {}
    kept: dict[int, np.ndarray] = {}
    with np.errstate(all="ignore"):
        for node in order:
            args = [i.buffer if i.realized else values[id(i)] for i in node.inputs]
            value = evaluate(node, args)
            assert value.shape == node.shape, f"{node}: reference produced shape {value.shape}"
            values[id(node)] = value
            if id(node) in keep:
                kept[id(node)] = value
            for i in node.inputs:
                if not i.realized:
                    uses[id(i)] -= 1
                    if uses[id(i)] == 0:
                        del values[id(i)]
    return kept
