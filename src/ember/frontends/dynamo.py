"""`torch.compile(model, backend="ember")`: torch's training and inference code, run on ember's kernels.

Registered under torch's backend entry point (`torch_dynamo_backends`), so `backend="ember"` works once ember is
installed. TorchDynamo captures the Python; AOTAutograd splits each captured graph into a forward and a backward
graph of core ATen operators (torch's decompositions applied to the rest) and functionalizes them; each graph is
run by `ember.frontends.aten_graph.AtenGraph` on ember tensors that share the memory of torch's (no copies),
built from its template after the first call and realized as one ember plan per call: its operators fused
by ember's compiler, its plans cached, and on a GPU each graph's calls replayed as CUDA graphs (ember.jit; the
results torch keeps get buffers of their own). What dynamo cannot capture runs in torch between the graphs (graph
breaks), as with any backend; an optimizer step dynamo captures is one more graph.

Options (`torch.compile(..., backend="ember", options={...})`):
- "device": "cuda" runs the graphs on ember's cuda device whatever torch's device is: under the interpreter
  (EMBER_INTERPRET=1), torch's cpu tensors are the interpreted cuda device's memory, so the path a GPU runs
  (generated kernels, ember.jit replays) is tested without one.

What a call costs besides its plans is the boundary: a ResNet-50 step passes some 1,100 torch tensors into its
graphs and takes some 1,000 back. Each is wrapped as an ember node on its memory (no DLPack capsule, no
per-tensor checks), results that live in buffers a later replay writes are copied out in one batched copy, and the
inputs a graph updates (parameters, momenta, running statistics) are written by the kernels computing their new
values, straight into torch's tensors, where the kernel is the last to read the old value and reads it element for
element where it writes (ember.jit's `write_into_arguments`; an optimizer step's updates); the others at the graph's
end in one multi-tensor copy per device and dtype. Tensors torch lays out densely in another order than their
dimensions' (an attention's output kept transposed, channels-last activations) cross without copies: ember computes
such an output in torch's memory order and reads such an input as it lies; an input that is a strided slice of a
wider tensor is read as the box of memory around it (frontends.layouts). Outputs that are views of another output
are made again on that output's tensor, so they share memory exactly as torch's would, and ember computes no buffer
for them. `replay_report()` says, per compiled graph, whether its calls replay and whether as CUDA graphs.
"""

from __future__ import annotations

import bisect
import collections
import functools
import itertools
import operator
import weakref
from typing import NamedTuple

from ember.device import Device, as_device, channels_last, get_conv_memory_format
from ember.frontends.aten import _NotComputed
from ember.frontends.aten_graph import AtenGraph
from ember.frontends.layouts import (
    as_numbers,
    box_inputs,
    boxable,
    in_memory_order,
    memory_order,
    restride_placeholders,
    save_channels_last,
)
from ember.jit import GRAPHS_KEPT, jit
from ember.runtime import executor
from ember.runtime.dlpack import copy_tensors
from ember.tensor import Tensor, realize

_OPTIONS = ("device",)
_UNKEYED = object()  # a call whose inputs make no key for replaying on torch's tensors directly
_replayed: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # graph number -> its ember.jit function
_numbers = itertools.count()


def backend(gm, example_inputs, options: dict | None = None):
    """The TorchDynamo backend: AOTAutograd with ember running the forward, backward and inference graphs."""
    from torch._decomp import core_aten_decompositions
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    options = dict(options or {})
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown or options.get("device", "cuda") != "cuda":
        raise ValueError(f'torch.compile(backend="ember"): options {options} not understood; known: "device": "cuda"')
    on_cuda = options.get("device") == "cuda"
    # the thread that last ran the forward: its backward, which autograd may run on a thread of its own, shows
    # its realizations to that thread's observers too (an ember.explain.capture around the training step)
    caller: dict = {}
    forward = functools.partial(_compile, on_cuda=on_cuda, caller=caller, role="forward")
    backward = functools.partial(_compile, on_cuda=on_cuda, caller=caller, role="backward")
    inference = functools.partial(_compile, on_cuda=on_cuda)
    # inputs a graph updates (parameters and momenta in an optimizer step, a batch norm's running statistics) stay
    # writes in the graph, made by ember (in place, or at its end in one batched copy), not one torch copy_ per
    # tensor after it.
    # The forward saves for the backward a minimal cut of what it computes: the pointwise chains between (an
    # activation's tanh, powers and products) are recomputed inside the backward's fused kernels rather than
    # written by the forward and read back; what the backward must materialize anyway (a GEMM's or a
    # convolution's operand) stays saved
    return aot_autograd(fw_compiler=forward, bw_compiler=backward, inference_compiler=inference,
                        partition_fn=min_cut_rematerialization_partition,
                        decompositions=core_aten_decompositions(), keep_inference_input_mutations=True)(
        gm, example_inputs)


def replay_report() -> list[str]:
    """Per graph compiled for a cuda device in this process: its calls, how many replayed, and why it does not
    replay, or replays launch by launch (no CUDA graph)."""
    lines = []
    for number, step in sorted(_replayed.items()):
        stats = step.stats
        why = "; ".join(step.why_not_replayed) or ("replayed as CUDA graphs" if stats["replays"] else
                                                   "not replayed yet (recorded from its second call)")
        if any((beyond := step.beyond_graphs_kept).values()):
            why += f" (bindings past {GRAPHS_KEPT}: {beyond['launched']} run uncaptured, {beyond['copied']} copied in)"
        lines.append(f"graph {number}: {stats['calls']} calls, {stats['replays']} replayed: {why}")
    return lines


def _compile(gm, example_inputs, on_cuda: bool = False, caller: dict | None = None, role: str = ""):
    """A boxed callable running the ATen graph `gm` on ember (AOTAutograd passes the inputs as one list); a
    forward's (`role`) notes its calling thread's observers in `caller`, which its backward reports to."""
    import torch

    torch_device = next((t.device for t in example_inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
    device = _ember_device(torch_device, on_cuda)
    restride_placeholders(gm.graph, example_inputs)
    if device is not None and get_conv_memory_format() == channels_last:
        save_channels_last(gm.graph)
    handed = _fresh_outputs(gm.graph)
    writes = _written_inputs(gm.graph)
    ordered = in_memory_order(gm.graph, handed)
    found = boxable(gm.graph, example_inputs, ordered)
    unboxed = _copy(gm.graph) if found else None  # (the graph before box_inputs, for calls some boxes do not fit)
    boxed = box_inputs(gm.graph, found, handed)
    to_ember = functools.partial(_to_ember, device=device)
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    names = list(dict.fromkeys(n.target for n in gm.graph.nodes if n.op == "get_attr"))
    with unset_fake_temporarily():  # AOTAutograd compiles under fake tensors; the graph's constants are real ones
        attributes = [getattr(gm, n) for n in names]
        constants = dict(zip(names, to_ember(attributes)))
    # memory no output may be handed on: the constants' (a tensor made in the function is new at each call)
    fixed = [a for a in attributes if isinstance(a, torch.Tensor)]
    placed = device if torch_device.type != "cuda" else None  # the graph's cpu tensors, where torch's are on cpu
    static = _static(gm.graph)
    # by the boxed inputs a call's layout does not fit (a backward's input traced as a view of a projection that the
    # forward hands as a buffer of its own, say): the graph reading the others as boxes, compiled at the first such
    # call
    variants = {frozenset(): _Variant(gm.graph, handed, boxed, constants, placed, device)}

    def run(args: list) -> list:
        if role == "forward":
            caller["observers"] = executor.this_thread.observers
        elif role == "backward" and (observers := caller.get("observers")) and \
                observers is not executor.this_thread.observers:
            with executor.reporting_to(observers):
                return call(args)
        return call(args)

    def call(args: list) -> list:
        misfits = frozenset(p for p, box in boxed.items() if not box.fits(args[p]))
        variant = variants.get(misfits)
        if variant is None:
            graph, plan = _copy(unboxed), handed._replace(sliced={})
            boxes = box_inputs(graph, boxable(graph, example_inputs, {**ordered, **dict.fromkeys(misfits)}), plan)
            variant = variants[misfits] = _Variant(graph, plan, boxes, constants, placed, device)
        step, replays, plan = variant.step, variant.replays, variant.handed
        written = [args[p] for p in writes]
        numbers = {p: args[p] for p in plan.arguments}
        inputs = _Memory(fixed, args, exact=device is not None)
        key = None if static else tuple([a.shape if isinstance(a, torch.Tensor) else a for a in args])
        try:
            entry = replays.get(key)
        except TypeError:  # an input that is no hashable value: this call goes through ember.jit's own checks
            key = entry = _UNKEYED
        for p, order in ordered.items():  # torch's memory of these inputs, read as it lies
            args[p] = args[p].permute(order)
        for p, box in variant.boxed.items():
            args[p] = box.of(args[p])
        if entry is not _UNKEYED and entry is not None and entry.program is not None and entry.program.still_valid():
            known = variant.taught.get(entry.program)
            if known is None:  # its updates of the inputs, written into their memory where safe
                known = variant.taught[entry.program] = _teach(entry.program, args, writes, ordered, plan)
            outputs = _replay(step, entry.program, args, known)
            if outputs is not None:
                return _finish(outputs, plan, inputs, written, numbers, known)
        values = to_ember(args)
        args.clear()  # AOTAutograd's boxed convention: the inputs can be freed as soon as they are read
        outputs = list(step(*values))
        if device is not None and key is not _UNKEYED:
            replays[key] = step.last_entry
        return _finish(_to_torch(outputs, torch_device), plan, inputs, written, numbers)

    run._boxed_call = True
    return run


def _copy(graph):
    """A copy of fx graph `graph` (its nodes' metadata copied, not shared)."""
    import torch

    copied = torch.fx.Graph()
    copied.output(copied.graph_copy(graph, {}))
    return copied


class _Variant:
    """One ATen graph run on ember: its step (on cuda, an ember.jit function, recorded and replayed as CUDA graphs,
    one per binding of its inputs' buffers: a plan whose inputs are torch's tensors is no steady chain of the lazy
    path, which would run it launch by launch), how its outputs are handed to torch, and the inputs it reads as
    boxes."""

    def __init__(self, graph, handed: _Outputs, boxed: dict, constants: dict, placed, device):
        aten = AtenGraph(graph, "graph torch.compile captured")
        self.handed, self.boxed = handed, boxed

        def step(*inputs):
            return aten(*inputs, attributes=constants.__getitem__, device=placed)

        self.step = step
        if device is not None:
            self.step = jit(step)
            _replayed[next(_numbers)] = self.step
        self.replays: dict = {}  # the shapes of a call's arguments (None: the graph's are static) -> ember.jit entry
        # the programs told which inputs their replays write in place, with what that leaves _finish to check
        self.taught: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Memory:
    """The memory of a call's inputs and the graph's constants (torch tensors), which no new output may lie on,
    gathered at the first question (most replays ask none). On cuda, ember hands an input's memory back only as the
    whole input (an argument returned as it is), so an output lies on an input's memory exactly where it starts at
    an input's address; the cpu's reference backend may hand any part of it (a NumPy view), so there an output's
    elements are looked up in the ranges of the inputs' storages."""

    def __init__(self, fixed: list, args: list, exact: bool):
        import torch

        self.tensors = fixed + [a for a in args if isinstance(a, torch.Tensor)]
        self.exact = exact
        self.starts: list | set | None = None

    def holds(self, t) -> bool:
        """Whether torch tensor `t` has an element in this memory."""
        if self.exact:
            if self.starts is None:
                self.starts = {a.data_ptr() for a in self.tensors}
            base = t._base
            return t.data_ptr() in self.starts or (base is not None and base.data_ptr() in self.starts)
        if self.starts is None:
            storages = [a.untyped_storage() for a in self.tensors]
            spans = sorted((u.data_ptr(), u.data_ptr() + u.nbytes()) for u in storages if u.nbytes())
            merged: list = []
            for start, end in spans:
                if merged and start <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], end)
                else:
                    merged.append([start, end])
            self.starts, self.ends = [m[0] for m in merged], [m[1] for m in merged]
        if t.numel() == 0:
            return False
        first = t.data_ptr()
        last = first + t.element_size() * sum((n - 1) * abs(d) for n, d in zip(t.shape, t.stride()))
        k = bisect.bisect_right(self.starts, last) - 1  # the last range starting at or before `last`
        return k >= 0 and self.ends[k] > first


class _Replayed(NamedTuple):
    """What a program's replays hand `_finish` as it is: the outputs that may lie on an input's memory or on
    another output's (`fresh`, `_Outputs.fresh`'s entries for them; every other output is a result buffer of its
    own), the inputs written whose new values it wrote into their memory (`in_place`, by index among the inputs
    written) and the others (`copied`)."""

    fresh: list[tuple[int, int]]
    in_place: list[int]
    copied: list[int]
    recorded: list[int]  # the returned values ember.jit's program returns as it recorded them
    # among `fresh`, the outputs on the program's own memory (a result buffer returned twice, a kept copy), which can
    # lie on another such output's but on no input's
    apart: frozenset[int]


def _teach(program, args: list, writes: list[int], ordered: dict, handed: _Outputs) -> _Replayed:
    """Tell a program which of its returned values update inputs it may write into their memory (ember.jit's
    `write_into_arguments`); what its replays leave `_finish` to check."""
    import torch

    count = len(program.out_slots)
    kept = count - len(writes)
    # ember.jit numbers a call's tensor arguments only (a graph of dynamic shapes takes its sizes too)
    tensors = {p: k for k, p in enumerate(p for p, a in enumerate(args) if isinstance(a, torch.Tensor))}
    taken = program.write_into_arguments({kept + k: tensors[p] for k, p in enumerate(writes)
                                          if p not in ordered and p in tensors})
    slots = collections.Counter(what for kind, what, _ in program.out_slots if kind == "result")
    own = {i for i, (kind, what, _) in enumerate(program.out_slots[:kept])
           if kind == "result" and slots[what] == 1 and what not in program.into}
    return _Replayed([(i, root) for i, root in handed.fresh if i not in own],
                     [k for k in range(len(writes)) if kept + k in taken],
                     [k for k in range(len(writes)) if kept + k not in taken],
                     [i for i, (kind, _, _) in enumerate(program.out_slots)
                      if kind not in ("result", "computed", "argument")],  # (those handed as buffers)
                     frozenset(i for i, (kind, what, _) in enumerate(program.out_slots[:kept])
                               if kind == "computed" or kind == "result" and what not in program.into))


def _static(graph) -> bool:
    """Whether every input of `graph` is a tensor of fixed shape (dynamo guards its shapes, dtypes and devices, so
    each call of a static graph is the same ember.jit entry)."""
    import torch

    values = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    return all(isinstance(v, torch.Tensor) and all(isinstance(d, int) for d in v.shape) for v in values)


def _replay(step, program, args: list, replayed: _Replayed) -> list | None:
    """A replay of `program` (`step`'s, valid for these arguments) on torch's tensors as they are: no ember
    Tensor is made for a graph's hundreds of inputs and outputs. The outputs as torch tensors (the graph's own
    outputs, then the new values of the inputs it writes); None where the program cannot replay so."""
    import torch

    buffers = [_as_buffer(a) for a in args if isinstance(a, torch.Tensor)]
    leaves = program.replay_buffers(buffers)  # as ember.jit's
    if leaves is None:
        return None
    args.clear()
    step.stats["calls"] += 1
    step.stats["replays"] += 1
    device = buffers[0].device if buffers else None
    for i in replayed.recorded:
        leaf = leaves[i]
        if isinstance(leaf, Tensor):  # a constant the graph returns
            from ember.runtime import dlpack  # torch: only for the cuda device

            realize(leaf)
            leaves[i] = dlpack.torch_buffers([leaf._node])[0]
        elif isinstance(leaf, _NotComputed):
            leaves[i] = torch.empty(leaf.shape, device=device)
    return leaves


def _as_buffer(t):
    """A graph input's tensor as a buffer plans read: contiguous, and out of autograd's sight."""
    t = t if t.is_contiguous() else t.contiguous()
    return t.detach() if t.requires_grad else t


class _Outputs(NamedTuple):
    """How a graph's outputs are handed to torch (`_fresh_outputs`)."""

    fresh: list[tuple[int, int]]  # (position, the node whose view it is, or itself) of each new tensor
    views: list[tuple[int, int, list]]  # (position, the viewed value's position, the view operators from it)
    count: int  # the graph's own outputs (values viewed that it does not return follow them)
    # the viewed values whose views need torch's layout of them (position -> (shape, strides)): ember computes
    # values on contiguous memory, where a view such as `transpose(1, 2).view(...)` of a value torch lays out
    # transposed is no view
    layouts: dict[int, tuple[tuple, tuple]]
    # the outputs ember computes in torch's memory order of them (`layouts.in_memory_order`): position -> the
    # permutation of the computed value's dimensions back to the output's
    permuted: dict[int, list[int]]
    sliced: dict  # the inputs returned as they are that ember reads as a box: position -> its `layouts.Box`
    arguments: tuple[int, ...]  # the inputs the views take sizes from (dynamic shapes)


def _fresh_outputs(graph) -> _Outputs:
    """The outputs of `graph` that are new tensors in torch's semantics, not an input nor a view of one (those
    AOTAutograd rebuilds as views of the input itself), with the node each views, so that outputs that view one
    value are known to share memory; and the views of a value the graph computes, which torch makes again on the
    value's tensor, so that views of one value share its memory as the graph says (a value no output is is made
    one more output of the graph, after its own). A view's sizes may be the graph's inputs (dynamic shapes).

    A view that only torch's layout of its value allows (a reshape of a transposed value torch keeps transposed)
    is made on the value in that layout (`layouts.in_memory_order`, else a copy) where its sharing memory can be
    seen (the value is an output too, or has other views); else the output is ember's own value, which no other
    output shares."""
    def chain(node) -> tuple[object, list]:
        ops = []
        while _is_view(node) or node.target is operator.getitem and _is_view(node.args[0]):  # (a split's piece)
            ops.append(node)
            node = node.args[0]
        return node, ops[::-1]

    output = next(n for n in graph.nodes if n.op == "output")
    inputs = {n: i for i, n in enumerate(n for n in graph.nodes if n.op == "placeholder")}
    nodes = list(output.args[0])
    count = len(nodes)
    position = {id(o): i for i, o in reversed(list(enumerate(nodes))) if hasattr(o, "op")}
    fresh, chains = [], []
    for i, o in enumerate(nodes[:count]):
        if not hasattr(o, "op"):
            continue
        root, ops = chain(o)
        if root.op == "placeholder":
            continue
        fresh.append((i, id(root)))
        bound = [(op.target, _bound(op.args[1:], inputs), _bound(op.kwargs, inputs)) for op in ops]
        if ops and not any(args is _UNBOUND or kwargs is _UNBOUND for _, args, kwargs in bound):
            chains.append((i, root, bound))
    viewers = collections.Counter(id(root) for _, root, _ in chains)
    views, layouts, arguments = [], {}, set()
    for i, root, ops in chains:
        layout = _layout_needed(root, ops)
        if layout is not None:
            shared = id(root) in position or viewers[id(root)] > 1
            if not shared or (layout is _UNBOUND and memory_order(root.meta.get("val")) is None):
                continue  # ember's own value of this output serves (it shares no memory torch's would)
        if id(root) not in position:
            position[id(root)] = len(nodes)
            fresh.append((len(nodes), id(root)))  # new memory too, which its views share
            nodes.append(root)
        if layout is not None and layout is not _UNBOUND:
            layouts[position[id(root)]] = layout
        views.append((i, position[id(root)], ops))
        arguments.update(argument.position for argument in _inputs(ops))
    if len(nodes) > count:
        output.args = (type(output.args[0])(nodes),)
    return _Outputs(fresh, views, count, layouts, {}, {}, tuple(sorted(arguments)))


def _is_view(node) -> bool:
    """Whether fx node `node` is a view operator's (one of several views, for a split or an unbind)."""
    return getattr(node, "op", None) == "call_function" and bool(node.args) and getattr(node.target, "is_view", False)


class _Input(NamedTuple):
    """A view operator's argument that is an input of the graph (a symbolic size, under dynamic shapes)."""

    position: int
    example: object  # the value it was traced with (None where not known)


_UNBOUND = object()  # an argument computed in the graph; a layout only known symbolically


def _bound(value, inputs: dict):
    """A view operator's fx argument with the graph's inputs in it as `_Input`s; _UNBOUND where it holds a value
    the graph computes."""
    if isinstance(value, (list, tuple)):
        items = [_bound(v, inputs) for v in value]
        return _UNBOUND if any(item is _UNBOUND for item in items) else type(value)(items)
    if isinstance(value, dict):
        items = {k: _bound(v, inputs) for k, v in value.items()}
        return _UNBOUND if any(item is _UNBOUND for item in items.values()) else items
    if hasattr(value, "op"):
        if value not in inputs:
            return _UNBOUND
        example = as_numbers([value.meta.get("val")])
        return _Input(inputs[value], example[0] if example else None)
    return value


def _resolved(value, numbers):
    """`value` with each `_Input` replaced by `numbers[position]` (a callable: by what it returns for it)."""
    if isinstance(value, _Input):
        return numbers(value) if callable(numbers) else numbers[value.position]
    if isinstance(value, (list, tuple)):
        return type(value)(_resolved(v, numbers) for v in value)
    if isinstance(value, dict):
        return {k: _resolved(v, numbers) for k, v in value.items()}
    return value


def _inputs(value) -> list[_Input]:
    """The `_Input`s in a view operator's arguments."""
    if isinstance(value, _Input):
        return [value]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _inputs(v)]
    if isinstance(value, dict):
        return _inputs(list(value.values()))
    return []


def _layout_needed(root, ops: list):
    """torch's (shape, strides) of the value `root` where the view operators `ops` do not apply to it on contiguous
    memory (_UNBOUND where that layout is symbolic); None where they do apply, or where that is not known."""
    import torch

    value = root.meta.get("val")
    shape, strides = ((as_numbers(value.shape), as_numbers(value.stride())) if isinstance(value, torch.Tensor)
                      else (None, None))
    if shape is None or strides is None:
        return None
    if any(argument.example is None for argument in _inputs(ops)):
        return _UNBOUND
    examples = _resolved(ops, lambda argument: argument.example)
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # (AOTAutograd compiles under fake tensors)
        view = torch.empty(shape, dtype=value.dtype, device="meta")
        try:
            for target, args, kwargs in examples:
                view = target(view, *args, **kwargs)
        except (RuntimeError, ValueError):
            concrete = all(isinstance(d, int) for d in (*value.shape, *value.stride()))
            return (shape, strides) if concrete else _UNBOUND
    return None


def _finish(outputs: list, plan: _Outputs, inputs: _Memory, written: list, numbers: dict,
            replayed: _Replayed | None = None) -> list:
    """The graph's outputs for torch (its own, then the new values of the inputs it writes, `written`): each new
    output on memory of its own (a view of another output, that output's view), then the inputs written.
    `replayed`: what a replay of ember.jit's program leaves to check, where the outputs come from one."""
    kept = len(outputs) - len(written)
    for p, back in plan.permuted.items():
        outputs[p] = outputs[p].permute(back)
    for p, box in plan.sliced.items():
        outputs[p] = box.within(outputs[p])
    fresh, apart = (plan.fresh, frozenset()) if replayed is None else (replayed.fresh, replayed.apart)
    results = _own_memory(outputs[:kept], fresh, inputs, apart)
    for base, (shape, strides) in plan.layouts.items():
        value = results[base]
        results[base] = value.new_empty_strided(shape, strides).copy_(value)
    for i, base, ops in plan.views:
        view = results[base]
        # (sizes from the graph's inputs only under dynamic shapes: else the recorded arguments are the numbers)
        for target, args, kwargs in _resolved(ops, numbers) if plan.arguments else ops:
            view = target(view, *args, **kwargs)
        results[i] = view
    del results[plan.count:]  # the values viewed that the graph does not return
    # an input's new value the replay wrote into the input's memory itself (ember.jit's write_into_arguments) is
    # in place already (AOTAutograd moves the version counters of the inputs a graph writes, either way)
    if replayed is None:
        pending = [(w, v) for w, v in zip(written, outputs[kept:]) if not _same_memory(w, v)]
    else:  # (an input not contiguous is written through a contiguous copy of it: _replay's _as_buffer)
        pending = [(written[k], outputs[kept + k]) for k in replayed.copied
                   if not _same_memory(written[k], outputs[kept + k])]
        pending += [(written[k], outputs[kept + k]) for k in replayed.in_place if not written[k].is_contiguous()]
    if pending:
        import torch

        # a new value on an input's memory (an input swapped with another, or kept while another is written) is
        # read before any input is written
        values = [v.clone() if inputs.holds(v) else v for _, v in pending]
        with torch.no_grad():  # into the inputs as they are (parameters among them), not detached views of each
            copy_tensors([w for w, _ in pending], values)
    return results


def _same_memory(a, b) -> bool:
    """Whether torch tensors `a` and `b` are the same elements of the same memory."""
    return (hasattr(b, "data_ptr") and a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and a.stride() == b.stride() and a.dtype == b.dtype)


def _own_memory(results: list, fresh: list[tuple[int, int]], inputs: _Memory, apart: frozenset[int]) -> list:
    """`results` with each new output on memory of its own: ember computes values, not tensors, so a graph's
    `clone` of an input (an optimizer's first momentum, `clone(grad)`) is the input's own value, and two outputs of
    one value are one buffer; torch may write either in place (`zero_grad(set_to_none=False)`, `add_`), so such an
    output is copied, unless the graph itself makes the two views of one value. `apart`: the positions on memory of
    ember's own (`_Replayed.apart`), not tested against the inputs'."""
    seen: dict[int, int] = {}  # address -> the value whose view the output there is
    for i, root in fresh:
        t = results[i]
        if not hasattr(t, "data_ptr") or t.numel() == 0:
            continue
        address = t.data_ptr()
        if (i not in apart and inputs.holds(t)) or seen.get(address, root) != root:
            results[i] = t.clone()
        else:
            seen[address] = root
    return results


def _written_inputs(graph) -> list[int]:
    """The positions of the inputs `graph` writes (`aten.copy_` into a placeholder, where AOTAutograd keeps an
    input's update in the graph); each one's last value is made an output of the graph, after its own."""
    import torch

    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    last = {}
    for n in graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.copy_.default and n.args[0].op == "placeholder":
            last[n.args[0]] = n
    if last:
        output = next(n for n in graph.nodes if n.op == "output")
        output.args = ((*output.args[0], *last.values()),)
    return [placeholders.index(p) for p in last]


def _ember_device(torch_device, on_cuda: bool) -> Device | None:
    """ember's cuda device the graphs run on, or None for the cpu (the reference backend)."""
    if torch_device.type == "cuda":
        return as_device(f"cuda:{torch_device.index or 0}")
    if not on_cuda:
        return None
    from ember.runtime import cuda  # torch: only for the cuda device

    device = as_device("cuda")
    if cuda.torch_device(device).type != torch_device.type:
        raise ValueError(f'torch.compile(backend="ember", options={{"device": "cuda"}}): the inputs are on '
                         f"{torch_device}, and ember's cuda device runs on a GPU: move the model and inputs to "
                         "cuda (cpu tensors serve only where the cuda device runs through the interpreter)")
    return device


def _to_ember(values: list, device: Device | None) -> list:
    """torch's tensors among `values` as ember Tensors on their memory; other values as they are."""
    import torch

    if device is None:
        from ember.ops.creation import from_dlpack

        return [from_dlpack(v.detach()) if isinstance(v, torch.Tensor) else v for v in values]
    from ember.runtime import dlpack  # torch: only for the cuda device

    tensors = [v.detach() for v in values if isinstance(v, torch.Tensor)]
    nodes = iter(dlpack.nodes_on_torch(tensors, device))
    return [Tensor(next(nodes)) if isinstance(v, torch.Tensor) else v for v in values]


def _to_torch(outputs: list, device) -> list:
    """The graph's outputs as torch tensors."""
    import torch

    tensors = [o for o in outputs if isinstance(o, Tensor)]
    realize(*tensors)
    if any(t.device.type == "cuda" for t in tensors):
        from ember.runtime import dlpack  # torch: only for the cuda device

        shared = iter(dlpack.torch_buffers([t._node for t in tensors]))
    else:
        shared = iter([torch.from_dlpack(t) for t in tensors])
    result = []
    for o in outputs:
        if isinstance(o, Tensor):
            result.append(next(shared))
        elif isinstance(o, _NotComputed):  # read by no one but the backward ember derives for itself
            result.append(torch.empty(o.shape, device=device))
        else:
            result.append(o)
    return result


def _register() -> None:
    """`backend="ember"` without the installed entry point (ember on the path but not installed): registered when
    this module is imported."""
    try:
        from torch._dynamo import list_backends, register_backend
    except ImportError:
        return
    if "ember" not in list_backends(exclude_tags=()):
        register_backend(name="ember")(backend)


_register()
