"""The reference backend: a NumPy interpreter that evaluates the graph op by op.

It is the oracle every other backend is tested against, so it favours clarity over
speed. Each primitive's NumPy implementation is declared with its other rules (`ir.ops.RULES`);
this module runs them in order. Half-precision values are computed in float32 and rounded when
stored, as PyTorch's CPU backend does; integers wrap around as they do in PyTorch.
"""

from __future__ import annotations

import numpy as np

from ember import dtypes
from ember.ir import Kind, Node, toposort
from ember.ir.ops import RULES


def _widen(a: np.ndarray) -> np.ndarray:
    """Half types are computed in float32."""
    if a.dtype == dtypes.float16.np or a.dtype == dtypes.bfloat16.np:
        return a.astype(np.float32)
    return a


def evaluate(node: Node, args: list[np.ndarray]) -> np.ndarray:
    """The value of one node, given the values of its inputs: the primitive's reference rule (declared
    with its other rules, see `ir.ops.RULES`), computed in float32 for half types and rounded to the
    node's dtype. Movement and transfers compute nothing, so they see their input as stored."""
    if node.op.kind is Kind.COMPOSITE:
        return _expanded(node, args, {})
    rule = RULES[node.op].reference
    if node.op.kind in (Kind.MOVEMENT, Kind.DEVICE):
        return rule(*args, **node.attrs)
    return np.asarray(rule(*(_widen(a) for a in args), **node.attrs)).astype(node.dtype.np, copy=False)


def _expanded(node: Node, args: list[np.ndarray], shared: dict) -> np.ndarray:
    """A composite node's value: its expansion into primitives (see ember.ir.ops), evaluated on its inputs.
    The results of a composite with several are evaluated together, once per `shared` (one dict per graph)."""
    rules = RULES[node.op]
    if rules.result is not None:
        of, k = rules.result(node.attrs)
        key = (node.op, of, tuple(map(id, node.inputs)))
        if key not in shared:
            results = rules.expand(_leaves(node, args), node.attrs)
            pending = [r for r in results if not r.realized]
            computed = run(toposort(pending), {id(r) for r in pending})
            shared[key] = [r.buffer if r.realized else computed[id(r)] for r in results]
        return shared[key][k]
    out = rules.expand(_leaves(node, args), node.attrs)
    return out.buffer if out.realized else run(toposort([out]), {id(out)})[id(out)]


def _leaves(node: Node, args: list[np.ndarray]) -> tuple[Node, ...]:
    return tuple(Node.from_buffer(a, i.dtype, i.device) for a, i in zip(args, node.inputs))


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
    shared: dict = {}
    with np.errstate(all="ignore"):
        for node in order:
            args = [i.buffer if i.realized else values[id(i)] for i in node.inputs]
            value = _expanded(node, args, shared) if node.op.kind is Kind.COMPOSITE else evaluate(node, args)
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
