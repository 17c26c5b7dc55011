"""Templates: the nodes a function built, recorded once, to build again from other inputs without running
the function's Python.

An optimizer builds the same subgraph for its parameters step after step: an Adam update is about 35 nodes
per parameter, each through operator dispatch, type promotion, broadcasting and the shape rules; a backward
pass, hundreds. Recorded once as a template (valid for inputs of the same shapes, dtypes and devices, and for
whatever Python values the caller keys it by), such a graph is built again in one of two ways:

- `apply`: one composite node per result (`Op.TEMPLATE`: a group's Adam update is 4 nodes per parameter, the
  new parameter, its two moments and its step count), all reading one tuple of inputs, which the compiler
  expands into the recorded nodes once per plan (the results of one application share one expansion). The
  step's graph is then a few nodes per parameter to build, key and look up; the plan's key and the walks
  over the graph read the shared inputs once. The float constants the function made (betas, epsilon) are part of the
  template, so they are fixed in the plan's code rather than passed to its kernels: the caller keys its
  templates by them.
- `build`: the recorded nodes made again directly, with their recorded shapes and dtypes: the graph the
  Python would build, node for node.

A function can be recorded when every node its outputs depend on is one of its inputs or a node it made, and
pending (not realized while it ran). A random node draws new offsets each time it is made: a template with random
nodes (`template(..., random=True)`) is built with `build` only, given the draw that gives them theirs.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable

from ember.ir import node as _graph
from ember.ir.node import Node, picker, static_key
from ember.ir.ops import NOT_DIFFERENTIABLE, Op, define_composite

# the applied templates by digest: a TEMPLATE node names its template by a string (hashed in C when a plan key
# is looked up, and the same in every process, so a plan stored on disk is found again); one per structure of
# update an optimizer of this process made
_by_digest: dict[str, Template] = {}
_registering = threading.Lock()


class Template:
    __slots__ = ("steps", "outputs", "digest", "_expansion", "_results")

    def __init__(self, steps: list[tuple], outputs: list[int], inputs: int, digest: str):
        # (op, a function of the made nodes giving the node's inputs, attrs, shape, dtype, device, static key)
        self.steps = steps
        self.outputs = outputs  # indices into inputs + built nodes
        self.digest = digest  # of the recorded structure (see `template`)
        # the steps as an expansion makes them: float constants fixed in the plan's code
        self._expansion = [(op, pick, {**attrs, "fixed": True} if op is Op.CONST and attrs["dtype"].is_floating_point
                            else attrs, shape, dtype, device) for op, pick, attrs, shape, dtype, device, _ in steps]
        # per output: the index of the input it is, or its TEMPLATE node's (attrs, shape, dtype, device, static key)
        self._results: list = []
        for k, i in enumerate(outputs):
            if i < inputs:
                self._results.append(i)
                continue
            _, _, _, shape, dtype, device, _ = steps[i - inputs]
            attrs = {"template": digest, "output": k}
            self._results.append((attrs, shape, dtype, device, (Op.TEMPLATE, shape, dtype, tuple(attrs.items()))))

    @property
    def random(self) -> bool:
        """Whether it draws random numbers: then it is built node for node (`build`), each time with new offsets."""
        return any(step[0] is Op.RAND for step in self.steps)

    def apply(self, inputs: list[Node]) -> list[Node]:
        """The outputs on `inputs` (of the recorded shapes, dtypes and devices) as TEMPLATE nodes, one per
        output (an output that is an input is that input). Not for a random template: its expansion, once per
        plan, would fix its offsets."""
        assert not self.random, "a template that draws random numbers is built node for node"
        if self.digest not in _by_digest:
            with _registering:
                _by_digest.setdefault(self.digest, self)
        ins = tuple(inputs)
        results = [ins[r] if type(r) is int else Node(Op.TEMPLATE, ins, r[0], r[1], r[2], r[3], None, r[4])
                   for r in self._results]
        _note_made([n for n, r in zip(results, self._results) if type(r) is not int])
        return results

    def build(self, inputs: list[Node], draw: Callable[[int], tuple[int, int]] | None = None) -> list[Node]:
        """The recorded nodes made again on `inputs` (of the recorded shapes, dtypes and devices); a recording
        of this thread (`recording`) lists them, as it lists the nodes `Node.make` makes. A random node takes
        the (seed, offset) that `draw` gives for its number of values."""
        made = list(inputs)
        append = made.append
        for op, pick, attrs, shape, dtype, device, static in self.steps:
            if op is Op.RAND:
                seed, offset = draw(math.prod(attrs["shape"]))
                attrs = {**attrs, "seed": seed, "offset": offset}
            append(Node(op, pick(made), attrs, shape, dtype, device, None, static))
        _note_made(made[len(inputs):])
        return [made[i] for i in self.outputs]

    def expand(self, inputs: tuple[Node, ...]) -> list[Node]:
        """Every output made of the recorded nodes on `inputs`, its float constants fixed: a TEMPLATE node's
        expansion."""
        made = list(inputs)
        append = made.append
        for op, pick, attrs, shape, dtype, device in self._expansion:
            append(Node(op, pick(made), attrs, shape, dtype, device))
        return [made[i] for i in self.outputs]

    def __len__(self) -> int:
        return len(self.steps)


def _note_made(nodes: list[Node]) -> None:
    """List nodes a template made in this thread's recording (`recording`), as `Node.make` lists its own."""
    recordings = _graph.made
    if recordings is not None and threading.get_ident() in recordings:
        recordings[threading.get_ident()].extend(nodes)


def _shape(inputs, attrs) -> tuple:
    result = _by_digest[attrs["template"]]._results[attrs["output"]]
    return (inputs[result].shape, inputs[result].dtype) if type(result) is int else (result[1], result[2])


define_composite(Op.TEMPLATE, shape=_shape, vjp=NOT_DIFFERENTIABLE,
                 expand=lambda inputs, attrs: _by_digest[attrs["template"]].expand(inputs),
                 result=lambda attrs: (attrs["template"], attrs["output"]))


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


def template(inputs: list[Node], outputs: list[Node], made: list[Node], random: bool = False) -> Template | None:
    """The template of a recorded call that took `inputs`, made `made` and produced `outputs`; None when
    the outputs depend on anything else, or on a node that was realized, or (unless `random`) that draws random
    numbers."""
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
        if id(n) not in made_ids or n.realized or n.op is Op.RAND and not random:
            return None
        needed.add(id(n))
        stack.extend(n.inputs)
    steps = []
    structure: list = [tuple((n.shape, n.dtype, n.device) for n in inputs)]
    for n in made:  # in the order they were made: inputs before users
        if id(n) in needed:
            index[id(n)] = len(inputs) + len(steps)
            refs = tuple(index[id(i)] for i in n.inputs)
            steps.append((n.op, picker(refs), n.attrs, n.shape, n.dtype, n.device, static_key(n)))
            structure.append((n.op.name, refs, tuple(n.attrs.items()), n.shape, n.dtype, n.device))
    results = [index[id(o)] for o in outputs]
    structure.append(tuple(results))
    return Template(steps, results, len(inputs), hashlib.sha256(repr(structure).encode()).hexdigest()[:32])

