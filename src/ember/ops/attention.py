"""Attention as one op, softmax(q @ kᵀ · scale, masked) @ v, however it was written, and its primitives' rules.

`attention` builds an ATTENTION node from queries (..., L, D), keys (..., S, D), values (..., S, E) and an optional
mask (..., L, S): boolean (True: the query attends to the key) or added to the scores; `causal`: query i attends to
keys 0..i. The compiler generates one kernel for it (compiler/patterns/attention.py): key and value tiles streamed
through on-chip memory with an online softmax, the L x S scores never stored, only each row's log-sum-exp kept
for the backward, whose kernels compute the scores again per tile (ATTENTION_GRAD).

`recognised` finds the same computation written by hand, when `matmul(weights, value)` is called on weights that are
a softmax over the last axis of scores `q @ kᵀ`, scaled by a constant and masked (`masked_fill`, `where` or an
added mask) in either order, through casts (autocast runs the softmax in float32), clones and reshapes of the batch
dims (an imported ATen graph's `bmm` of operands whose heads are flattened into one batch dim). A mask made of index
arithmetic alone (`tril`, `triu`, comparisons of `arange`s) is evaluated once per structure, and a causal one becomes
the kernel's `causal` flag, whose tiles above the diagonal are skipped. Dropout on the weights (`dropout()`'s form,
where(draw >= p, w / (1 - p), 0) of a uniform draw) is the kernel's: the draws are a RAND leaf that the kernels
compute at each position, forward and backward, never stored. A mask that needs a gradient, or a scale that is not a
constant, leaves the graph as written.
"""

from __future__ import annotations

import math

import numpy as np

from ember import autograd, dtypes
from ember.ir import Kind, Node, Op
from ember.ir.node import toposort
from ember.ir.ops import check_shape, define
from ember.ops import random
from ember.tensor import Tensor, apply

MAX_HEAD_DIM = 256  # the widest rows of queries, keys or values a kernel holds on chip
FLOATS = (dtypes.float16, dtypes.bfloat16, dtypes.float32)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, causal: bool, safe: bool,
              dropout: float = 0.0, draws: Tensor | None = None) -> Tensor:
    """The ATTENTION node (see the module's doc). `safe`: a query row no key is left to gets zeros (PyTorch's
    scaled_dot_product_attention) rather than NaN (a softmax over -inf alone, as written by hand). `dropout`: the
    probability of zeroing a weight (the rest scaled by 1 / (1 - dropout)), decided as `dropout()` decides, by
    uniform `draws` of the scores' shape (drawn here where not given): a RAND leaf, which the kernels compute at
    each position from the counter-based generator, forward and backward, and never store."""
    kind = None if mask is None else "keep" if mask.dtype is dtypes.bool_ else "add"
    inputs = [q, k, v] + ([mask] if mask is not None else [])
    if dropout > 0:
        inputs.append(draws if draws is not None else
                      random.rand(q.shape[:-1] + (k.shape[-2],), device=q.device))
    return apply(Op.ATTENTION, *inputs, scale=float(scale), causal=bool(causal), mask=kind, safe=bool(safe),
                 dropout=float(dropout), result="out")


def fusable(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> bool:
    """Whether one attention kernel computes this: float operands of one dtype, head dims it holds on chip, batch
    dims equal, a mask without gradient of the scores' shape."""
    if not (q.dtype is k.dtype is v.dtype and q.dtype in FLOATS) or min(q.ndim, k.ndim, v.ndim) < 2:
        return False
    if q.shape[:-2] != k.shape[:-2] or k.shape[:-2] != v.shape[:-2] or q.shape[-1] != k.shape[-1] \
            or k.shape[-2] != v.shape[-2] or max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        return False
    if mask is not None and (mask.requires_grad or mask.shape != q.shape[:-1] + (k.shape[-2],)
                             or not (mask.dtype is dtypes.bool_ or mask.dtype.is_floating_point)):
        return False
    return True


# -- the hand-written form ----------------------------------------------------------------------------------

def recognised(weights: Tensor, value: Tensor) -> Tensor | None:
    """`weights @ value` as one ATTENTION node, if `weights` is a masked, scaled softmax of `q @ kᵀ` (see the
    module's doc); None otherwise."""
    node = weights._node
    under = node
    for _ in range(8):  # every matmul asks: rejected on the nodes, before any Tensor is made
        if under.op not in _TRANSPARENT:
            break
        under = under.inputs[0]
    if under.op is not Op.SOFTMAX and under.op is not Op.WHERE:
        return None
    p = _through(weights)
    dropout, draws = 0.0, None
    if p is not None and p._node.op is Op.WHERE:  # dropout(weights): where(rand >= p, weights * 1/(1-p), 0)
        p, dropout, draws = _dropped(p)
        p = _through(p) if p is not None else None
    if p is None or p._node.op is not Op.SOFTMAX or p._node.attrs["axis"] != p.ndim - 1 or p.ndim < 2:
        return None
    scores = _through(_parents(p)[0])
    scale, mask, keep = 1.0, None, None
    while scores is not None and scores._node.op is not Op.MATMUL:
        n = scores._node
        a = _parents(scores)
        if n.op is Op.MUL and scale == 1.0 and _constant(a[1]) is not None:
            scores, scale = a[0], _constant(a[1])
        elif n.op is Op.MUL and scale == 1.0 and _constant(a[0]) is not None:
            scores, scale = a[1], _constant(a[0])
        elif n.op is Op.DIV and scale == 1.0 and _constant(a[1]) not in (None, 0.0):
            scores, scale = a[0], 1.0 / _constant(a[1])
        elif n.op is Op.WHERE and mask is None and _constant(a[1]) == -math.inf:
            scores, mask, keep = a[2], a[0], False  # masked_fill: True is masked
        elif n.op is Op.WHERE and mask is None and _constant(a[2]) == -math.inf:
            scores, mask, keep = a[1], a[0], True
        elif n.op is Op.ADD and mask is None and not a[1].requires_grad:
            scores, mask = a[0], a[1]
            mask = mask if scale == 1.0 else mask * (1.0 / scale)  # added before the scale: scaled with the scores
        elif n.op is Op.ADD and mask is None and not a[0].requires_grad:
            scores, mask = a[1], a[0]
            mask = mask if scale == 1.0 else mask * (1.0 / scale)
        else:
            return None
        scores = _through(scores) if scores is not None else None
    if scores is None or not math.isfinite(scale) or scale <= 0.0:
        return None
    # the operands in the softmax's batch dims: a batched matmul over flattened heads (an imported graph's bmm of
    # reshaped operands) is the same attention
    batch = p.shape[:-2]
    operands = [_through(t) for t in (*_parents(scores), value)]
    if any(t is None or math.prod(t.shape[:-2]) != math.prod(batch) for t in operands):
        return None
    q, kt, v = (t.reshape(batch + t.shape[-2:]) if t.shape[:-2] != batch else t for t in operands)
    k = kt.transpose(-2, -1)
    causal = False
    if keep is not None:
        static = _static_keep(mask._node, keep, q.shape[-2], k.shape[-2])
        if static == "causal":
            mask, causal = None, True
        elif not keep:
            mask = mask.logical_not()
    if not fusable(q, k, v, mask) or q.dtype is not v.dtype or v.dtype is not node.dtype:
        return None
    if draws is not None and draws.shape != q.shape[:-1] + (k.shape[-2],):
        return None
    out = attention(q, k, v, mask, scale, causal, safe=False, dropout=dropout, draws=draws)
    return out.reshape(weights.shape[:-1] + v.shape[-1:]) if weights.ndim != p.ndim else out


def _dropped(t: Tensor) -> tuple[Tensor | None, float, Tensor | None]:
    """For `dropout(x, p)` as ember.ops.random.dropout builds it: x, p and its uniform draws (a RAND leaf);
    (None, 0, None) for anything else."""
    keep, scaled, zero = _parents(t)
    if keep._node.op is not Op.LE or _constant(zero) != 0.0 or scaled._node.op is not Op.MUL:  # p <= draw
        return None, 0.0, None
    threshold, draws = _parents(keep)
    x, factor = _parents(scaled)
    p = _constant(threshold)
    if draws._node.op is not Op.RAND or draws._node.attrs["distribution"] != "uniform" or p is None \
            or not 0.0 < p < 1.0 or _constant(factor) is None or abs(_constant(factor) * (1 - p) - 1) > 1e-6:
        return None, 0.0, None
    return x, p, draws


def _parents(t: Tensor) -> list[Tensor]:
    """The Tensors `t` was computed from, with their gradient history."""
    fn = t._grad_fn
    if fn is None:
        return [Tensor(i) for i in t._node.inputs]
    return [Tensor(i) if nxt is None else Tensor(i, True, nxt) if isinstance(nxt, autograd.Function) else nxt
            for i, nxt in zip(fn.inputs, fn.next)]


_TRANSPARENT = (Op.CAST, Op.RESHAPE, Op.EXPAND, Op.ADD)


def _through(t: Tensor) -> Tensor | None:
    """`t` under what leaves its matrices' values as they are: casts between float types, reshapes of the leading
    (batch) dims alone, expands that change nothing, and `x + 0` (a clone that keeps the gradient's path); None
    under a cast to or from a type that is not float."""
    while True:
        n = t._node
        if n.op is Op.CAST:
            if not (t.dtype.is_floating_point and n.inputs[0].dtype.is_floating_point):
                return None
            t = _parents(t)[0]
        elif n.op is Op.RESHAPE and len(n.shape) >= 2 and len(n.inputs[0].shape) >= 2 \
                and n.shape[-2:] == n.inputs[0].shape[-2:] or n.op is Op.EXPAND and n.shape == n.inputs[0].shape:
            t = _parents(t)[0]
        elif n.op is Op.ADD and n.inputs[0].shape == n.shape and _constant(_parents(t)[1]) == 0.0:
            t = _parents(t)[0]
        else:
            return t


def _constant(t: Tensor) -> float | None:
    """The value of a float constant (of any shape, broadcast or not), else None."""
    n = t._node
    while n.op in (Op.EXPAND, Op.RESHAPE, Op.CAST):
        n = n.inputs[0]
    if n.op is not Op.CONST or not n.dtype.is_floating_point:
        return None
    return float(n.attrs["value"])


_static_masks: dict[tuple, str] = {}


def _static_keep(cond: Node, keep: bool, length: int, keys: int) -> str | None:
    """"causal" when the boolean `cond` (True: attend, if `keep`; else True: masked) is computed from indices
    alone and lets query i attend to keys 0..i exactly; None otherwise."""
    base = cond
    while base.op in (Op.EXPAND, Op.RESHAPE) and base.numel >= length * keys:
        base = base.inputs[0]
    if base.numel != length * keys or tuple(base.shape[-2:]) != (length, keys) or base.realized:
        return None
    order = toposort([base])
    if any(n.op.kind is Kind.LEAF and n.op not in (Op.IOTA, Op.CONST) for n in order):
        return None
    position = {id(n): i for i, n in enumerate(order)}
    if any(id(i) not in position for n in order for i in n.inputs):  # it reads data
        return None
    key = (keep, tuple((n.op, n.shape, tuple(sorted(n.attrs.items(), key=str)), tuple(position[id(i)] for i in
                        n.inputs)) for n in order))
    verdict = _static_masks.get(key)
    if verdict is None:
        from ember.compiler import CompileContext, compile
        value = compile(order, {id(base)}, "reference", CompileContext()).evaluate()[id(base)]
        allowed = np.asarray(value, dtype=bool).reshape(length, keys)
        allowed = allowed if keep else ~allowed
        verdict = _static_masks[key] = "causal" if np.array_equal(allowed, np.tri(length, keys, dtype=bool)) else ""
    return verdict or None


# -- the primitives' rules ----------------------------------------------------------------------------------

def _attention_rule(inputs, attrs) -> tuple:
    q, k, v = inputs[:3]
    check_shape(q.shape[:-2] == k.shape[:-2] == v.shape[:-2] and q.shape[-1] == k.shape[-1]
                and k.shape[-2] == v.shape[-2], Op.ATTENTION, f"q {q.shape}, k {k.shape} and v {v.shape} do not match")
    if attrs["result"] == "lse":
        return q.shape[:-1], dtypes.float32
    return q.shape[:-1] + (v.shape[-1],), q.dtype


def _attention_grad_rule(inputs, attrs) -> tuple:
    q, k, v = inputs[:3]
    of = {"dq": q, "dk": k, "dv": v}[attrs["result"]]
    return of.shape, of.dtype


def _scores(q, k, mask, scale, causal, **_) -> np.ndarray:
    """The masked, scaled scores in float32 (NumPy), -inf where a key is not attended to."""
    s = np.matmul(q.astype(np.float32), np.swapaxes(k, -1, -2).astype(np.float32)) * np.float32(scale)
    if mask is not None and mask.dtype == np.bool_:
        s = np.where(mask, s, -np.inf)
    elif mask is not None:
        s = s + mask.astype(np.float32)
    if causal:
        s = np.where(np.tri(s.shape[-2], s.shape[-1], dtype=bool), s, -np.inf)
    return s.astype(np.float32)


def _log_sum_exp(s: np.ndarray, safe: bool) -> np.ndarray:
    """Each row's log-sum-exp; a row with no key left: +inf where `safe` (its weights are then 0), else NaN."""
    m = s.max(axis=-1, keepdims=True) if s.shape[-1] else np.full(s.shape[:-1] + (1,), -np.inf, np.float32)
    empty = m == -np.inf
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(empty, np.inf if safe else np.nan,
                       np.where(empty, 0, m) + np.log(np.exp(s - np.where(empty, 0, m)).sum(-1, keepdims=True)))
    return lse[..., 0].astype(np.float32)


def _extra(extra: tuple, mask_kind, dropout: float) -> tuple:
    """The optional inputs after q, k, v (and dO, lse, delta): the mask, and the dropout's kept weights' factor
    (0, or 1 / (1 - p) where a draw keeps the weight)."""
    mask = extra[0] if mask_kind is not None else None
    kept = None
    if dropout > 0:
        kept = np.where(extra[-1] >= np.float32(dropout), np.float32(1 / (1 - dropout)), np.float32(0))
    return mask, kept


def _np_attention(q, k, v, *extra, scale, causal, mask_kind=None, safe, result, dropout=0.0, **_):
    mask, kept = _extra(extra, mask_kind, dropout)
    s = _scores(q, k, mask, scale, causal)
    lse = _log_sum_exp(s, safe)
    if result == "lse":
        return lse
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(s - lse[..., None])
    if s.shape[-1] == 0:
        return np.zeros(q.shape[:-1] + (v.shape[-1],), np.float32)
    return np.matmul(p if kept is None else p * kept, v.astype(np.float32))


def _np_attention_grad(q, k, v, do, lse, delta, *extra, scale, causal, mask_kind=None, result, dropout=0.0, **_):
    mask, kept = _extra(extra, mask_kind, dropout)
    s = _scores(q, k, mask, scale, causal)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(s - lse[..., None])
    do = do.astype(np.float32)
    if result == "dv":
        return np.matmul(np.swapaxes(p if kept is None else p * kept, -1, -2), do)
    dp = np.matmul(do, np.swapaxes(v, -1, -2).astype(np.float32))
    ds = p * ((dp if kept is None else dp * kept) - delta[..., None]) * np.float32(scale)
    if result == "dq":
        return np.matmul(ds, k.astype(np.float32))
    return np.matmul(np.swapaxes(ds, -1, -2), q.astype(np.float32))


def _reference(fn):
    """The reference rule: the node's attrs as keywords (its mask kind under another name than the input)."""
    def rule(*arrays, mask=None, **attrs):
        return fn(*arrays, mask_kind=mask, **attrs)
    return rule


def _attention_vjp(g, xs, out, a):
    """The backward of one ATTENTION node: the rows' log-sum-exp (computed again by the forward kernel, which
    writes it beside the output where both are pending), each row's sum of dO * O, and one ATTENTION_GRAD node per
    gradient, computing the scores again tile by tile."""
    if a["result"] != "out":
        raise NotImplementedError("attention: the log-sum-exp of attention rows has no gradient")
    q, k, v = xs[:3]
    extra = xs[3:]  # the mask and the dropout's draws: no gradient
    with autograd.no_grad():
        lse = apply(Op.ATTENTION, *xs, **{**a, "result": "lse"})
        delta = (g.float() * out.detach().float()).sum(-1)  # with dropout too: rowsum(dP * P) = rowsum(dO * O)
        grads = [apply(Op.ATTENTION_GRAD, q, k, v, g, lse, delta, *extra, **{**a, "result": r})
                 for r in ("dq", "dk", "dv")]  # those no input needs are never computed
    return (*grads, *(None for _ in extra))


def _attention_grad_vjp(g, xs, out, a):
    raise NotImplementedError("attention: a gradient of attention's gradient (double backward) is not supported")


define(Op.ATTENTION, shape=_attention_rule, vjp=_attention_vjp, reference=_reference(_np_attention))
define(Op.ATTENTION_GRAD, shape=_attention_grad_rule, vjp=_attention_grad_vjp,
       reference=_reference(_np_attention_grad))
