"""A pending graph's signature: its structural key (ops, shapes, dtypes, attributes and wiring, not data), by which
a plan is cached, and what a run of the plan reads (realized inputs, runtime scalars, random seeds). Computed on
every realization, plan-cache hits included. Two graphs with one key share one compiled plan, so step 2 of a training
loop costs a key and the launches."""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.ir import Node, Op
from ember.ir.node import static_key


@dataclass
class Signature:
    """What a pending graph is (key) and what it is run with (inputs, scalars, seeds)."""

    key: tuple
    inputs: list[Node] = field(default_factory=list)  # realized leaves, in order of first use
    scalars: list[float] = field(default_factory=list)  # runtime float constants, in order
    seeds: list[tuple[int, int]] = field(default_factory=list)  # (seed, offset) per RAND node


def signature(order: list[Node], keep: set[int]) -> Signature:
    # This runs on every realization, plan-cache hits included, so it is written for speed: a node's own
    # part of the key (static_key) is computed once and kept on it (a template's nodes share theirs), and
    # attribute values are already hashable tuples, numbers, dtypes and devices.
    sig = Signature(key=())
    inputs, scalars, seeds = sig.inputs, sig.scalars, sig.seeds
    position: dict[Node, int] = {}  # keyed by the node itself: identity hashing, no id() call per input
    get = position.get
    parts = []
    append = parts.append
    rand, const = Op.RAND, Op.CONST
    last_inputs = None
    for node in order:
        # a template's results share one tuple of inputs (often hundreds): it is read, and put in the key, once;
        # the nodes after the first that read it say so by None
        if node.inputs is last_inputs:
            refs = None
        else:
            last_inputs, refs = node.inputs, []
            for i in last_inputs:
                at = get(i)
                if at is None:  # a realized leaf (pending inputs come first in `order`)
                    at = position[i] = -1 - len(inputs)
                    inputs.append(i)
                    append((i.shape, i.dtype))
                refs.append(at)
            refs = tuple(refs)
        static = node.static
        if static is None:
            static = node.static = static_key(node)
        op = static[0]
        if op is rand:
            seeds.append((node.attrs["seed"], node.attrs["offset"]))
        elif op is const and static[3] is None:
            scalars.append(node.attrs["value"])
        position[node] = len(parts)
        append((static, refs, id(node) in keep))
    sig.key = tuple(parts)
    return sig
