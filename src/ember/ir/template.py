"""Templates: the nodes a function built, recorded once, to build again from other inputs without running
the function's Python.

An optimizer builds the same subgraph for every parameter of a shape, step after step: an Adam update is
about 35 nodes, each through operator dispatch, type promotion, broadcasting and the shape rules. Recorded
once as a template (valid for inputs of the same shapes, dtypes and devices, and for whatever Python values
the caller keys it by), the update is built again by making its nodes directly, with their recorded shapes
and dtypes: the graph the Python would build, node for node, so it finds the same compiled plan.

A function can be recorded when every node its outputs depend on is one of its inputs or a node it made,
pending (not realized while it ran), and not random (a random node draws a new offset each time it is made).
"""

from __future__ import annotations

import operator
import threading

from ember.ir import node as _graph
from ember.ir.node import Node, static_key
from ember.ir.ops import Op


class Template:
    __slots__ = ("steps", "outputs")

    def __init__(self, steps: list[tuple], outputs: list[int]):
        # (op, a function of the made nodes giving the node's inputs, attrs, shape, dtype, device, static key)
        self.steps = steps
        self.outputs = outputs  # indices into inputs + built nodes

    def build(self, inputs: list[Node]) -> list[Node]:
        """The recorded nodes made again on `inputs` (of the recorded shapes, dtypes and devices)."""
        made = list(inputs)
        append = made.append
        for op, pick, attrs, shape, dtype, device, static in self.steps:
            append(Node(op, pick(made), attrs, shape, dtype, device, None, static))
        return [made[i] for i in self.outputs]

    def __len__(self) -> int:
        return len(self.steps)


_recordings = threading.Lock()


class recording:
    """`with recording() as made:` lists, in order, the nodes made in the block (by `Node.make`) by this thread."""

    def __enter__(self) -> list[Node]:
        thread, made = threading.get_ident(), []
        with _recordings:  # a new dict each time: `Node.make` reads it without the lock
            recordings = dict(_graph.made or {})
            self.outer, recordings[thread] = recordings.get(thread), made
            _graph.made = recordings
        return made

    def __exit__(self, *exc) -> None:
        thread = threading.get_ident()
        with _recordings:
            recordings = dict(_graph.made)
            made = recordings.pop(thread)
            if self.outer is not None:
                recordings[thread] = self.outer
            _graph.made = recordings or None
        if self.outer is not None:
            self.outer.extend(made)


def template(inputs: list[Node], outputs: list[Node], made: list[Node]) -> Template | None:
    """The template of a recorded call that took `inputs`, made `made` and produced `outputs`; None when
    the outputs depend on anything else, or on a node that was realized or draws random numbers."""
    index = {id(n): i for i, n in enumerate(inputs)}
    if len(index) != len(inputs):  # one node passed as two inputs: a template would wire every use to one
        return None
    made_ids = {id(n) for n in made}
    needed: set[int] = set()
    stack = [o for o in outputs if id(o) not in index]
    while stack:
        n = stack.pop()
        if id(n) in needed or id(n) in index:
            continue
        if id(n) not in made_ids or n.realized or n.op is Op.RAND:
            return None
        needed.add(id(n))
        stack.extend(n.inputs)
    steps = []
    for n in made:  # in the order they were made: inputs before users
        if id(n) in needed:
            index[id(n)] = len(inputs) + len(steps)
            steps.append((n.op, _picker(tuple(index[id(i)] for i in n.inputs)), n.attrs, n.shape, n.dtype,
                          n.device, static_key(n)))
    return Template(steps, [index[id(o)] for o in outputs])


def _picker(refs: tuple[int, ...]):
    """A function of the nodes made so far that gives the inputs at `refs`, as a tuple (itemgetter: C speed)."""
    if len(refs) >= 2:
        return operator.itemgetter(*refs)
    if len(refs) == 1:
        (only,) = refs
        return lambda made: (made[only],)
    return lambda made: ()
