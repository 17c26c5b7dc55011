"""`ember.jit`: a step function recorded once and replayed without running its Python again.

    @ember.jit
    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

Calls run the function as written (warm-up: kernels compile, optimizer state appears)
until two in a row ran the same plans; the next one also records every plan it
executes, and later calls with arguments of the same shapes, dtypes and devices skip
the Python: they replay its plans on the arguments where they are — on a GPU as one
CUDA graph, so a step costs one launch of host work, and no argument is copied.

What may change between replays, and how it is handled:
- argument shapes, dtypes, devices and aliasing, and non-Tensor argument values: each
  combination is recorded on its own, as a new step;
- the learning rate: the optimizer reads it from a 0-d tensor that each replay brings up
  to date (a scheduler stepped every iteration, outside the function, costs nothing);
- other hyper-parameters, train/eval mode, the parameters and submodules of the modules it
  calls (one replaced or removed) and which parameters require gradients: re-read before each
  replay, and a change records the step again (a mode the step sets itself is set by its
  replays too);
- values set from outside (`load_state_dict`, a parameter updated by an optimizer outside
  the step): the replay follows them, or records again when it cannot;
- copies of a parameter kept from before a replay keep their value.
What may not: Python values the function computes from anything else (a global, a
counter, the time) are fixed at the recording, as in `jax.jit` (pass changing values as
Tensor arguments), and values created from host data inside the function are constants.
Random numbers drawn inside the step are fresh at every replay, CUDA graph or not: random
kernels read their (seed, offset) pairs from device memory, which a replay writes first.
Gradients the step leaves in `.grad` are rewritten in place by each replay. Returned
Tensors are new each call and keep their values: a replay writes its results into buffers
no returned Tensor still shows (two sets of them alternate, so `h = step(h)` or a loss kept
until the next call costs no copy), and a result shared outside ember (DLPack) gets a
buffer of its own first. A step that reads a value on
the host (`.item()`), computes on the cpu, takes unhashable arguments (NumPy arrays), steps
a scheduler inside itself, optimizes gradients of a backward pass run outside it, or adds
to the `.grad` of the call before cannot be replayed: it keeps running as written, and
`why_not_replayed` says why.

How: while a call records, a `Recorder` (ember/recording.py) is the runtime's `executor.this_thread.recorder`
(what other threads run meanwhile is not recorded), noting every plan the cuda backend executes with its input and
output buffers, and the facts needed to turn that into a `_Program`: which Tensors were rebound
(parameters, optimizer state), which host values were uploaded, which random offsets were drawn, and
which Python values the step read (guards). A program re-runs the same plans on fixed buffers (and
arenas of its own):

- an argument is read from its buffer: a replay binds the buffers of its call; a CUDA graph is
  captured per binding (the usual loop over a few staging buffers, parameters and optimizer
  state replays graphs it has), up to `GRAPHS_KEPT` of them, beyond which arguments are
  copied into buffers of the program's own;
- a state Tensor (a parameter, a moment estimate) lives in one buffer that the replay
  reads and overwrites in place — directly from the kernel that computes the new value
  when that is safe (`Plan.writes_in_place`), else through a copy at the end of the plan;
- everything else the step reads is a constant; gradients land in the same buffers each
  time, returned values in one of two sets of buffers (the one no returned Tensor shows).
"""

from __future__ import annotations

import functools
import operator
import sys
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from ember import nested
from ember.compiler import Signature
from ember.ir import Node
from ember.nn import module as nn_module
from ember.ops.random import take_offsets
from ember.recording import NotCapturable, RecordedPlan, Recorder, record
from ember.runtime.executor import deferred_interrupt, from_host, transient
from ember.tensor import Tensor, realize


def jit(fn: Callable | None = None, *, cuda_graph: bool = True, warmup: int = 1):
    """Record `fn` (a training or inference step with fixed shapes) and replay it; see the module doc."""
    if fn is None:
        return lambda f: JitFunction(f, cuda_graph, warmup)
    return JitFunction(fn, cuda_graph, warmup)


class JitFunction:
    def __init__(self, fn: Callable, cuda_graph: bool, warmup: int):
        functools.update_wrapper(self, fn)
        self.fn, self.cuda_graph, self.warmup = fn, cuda_graph, warmup
        self._entries: dict[tuple, _Entry] = {}
        self.last_entry: _Entry | None = None  # the entry of the latest call (frontends.dynamo replays it directly)
        self.stats = {"calls": 0, "captures": 0, "replays": 0, "eager": 0}

    def __call__(self, *args, **kwargs):
        self.stats["calls"] += 1
        if not kwargs and all(type(x) is Tensor for x in args):  # the usual call: Tensors only, no nesting
            tensors, leaves = list(args), args
            described = tuple([_describe(t) for t in tensors])
            structure = len(args)
        else:
            leaves = nested.leaves((args, kwargs))
            tensors = [x for x in leaves if isinstance(x, Tensor)]
            described = tuple(_describe(x) for x in leaves)
            structure = nested.structure((args, kwargs))
        first = {}  # the same Tensor passed twice is a different step from two Tensors
        aliases = tuple([first.setdefault(id(t._node), i) for i, t in enumerate(tensors)])
        key = described, aliases, structure
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
            if any(d is None for d in described):
                entry.failure = (f"{self.__name__} is not replayed: an argument is neither a Tensor nor hashable "
                                 "(a NumPy array?); pass such values as ember Tensors")
                warnings.warn(f"ember.jit: {entry.failure}", stacklevel=2)
        self.last_entry = entry
        if entry.program is not None:
            if entry.program.still_valid():
                self.stats["replays"] += 1
                return entry.program.replay(tensors)
            entry.program = None
        if entry.failure is not None:
            self.stats["eager"] += 1
            return self.fn(*args, **kwargs)
        return self._record(entry, args, kwargs, tensors)

    @property
    def beyond_graphs_kept(self) -> dict[str, int]:
        """Replays of bindings beyond GRAPHS_KEPT graphs (all shapes'): "launched" launch by launch (they write
        their arguments in place), "copied" on copies of their arguments."""
        programs = [e.program for e in self._entries.values() if e.program is not None]
        return {kind: sum(p.beyond[kind] for p in programs) for kind in ("launched", "copied")}

    @property
    def why_not_replayed(self) -> list[str]:
        """Why a recorded shape runs as written, or replays without a CUDA graph."""
        reasons = [e.failure for e in self._entries.values() if e.failure]
        return reasons + [e.program.why_no_graph for e in self._entries.values()
                          if e.program is not None and e.program.why_no_graph]

    def _record(self, entry: _Entry, args, kwargs, tensors: list[Tensor]):
        """Run the step as written while recording it; once it ran the same plans twice in a row (a
        first step creates optimizer state, a second one reads it), the recording becomes the replay."""
        realize(*tensors)
        nodes_before = [t._node for t in tensors]
        with record() as rec:
            rec.arguments = {id(n) for n in nodes_before}
            result = self.fn(*args, **kwargs)
            out_leaves = nested.leaves(result)
            # what the step returns or leaves behind (gradients, updated Tensors) is computed in it
            left = [t.grad for ref, _, _ in rec.grads.values() if (t := ref()) is not None and t.grad is not None]
            left += [t for ref, _ in rec.rebound.values() if (t := ref()) is not None]
            realize(*[t for t in out_leaves if isinstance(t, Tensor)], *left)
        keys = [r.sig.key for r in rec.plans]
        settled, entry.keys = keys == entry.keys, keys
        entry.calls += 1
        if not settled or entry.calls <= self.warmup:
            self.stats["eager"] += 1
            entry.earlier.update((id(r.plan), r.device) for r in rec.plans)
            return result
        self.stats["captures"] += 1
        try:
            if rec.failure:
                raise NotCapturable(rec.failure)
            if any(t._node is not n for t, n in zip(tensors, nodes_before)):
                raise NotCapturable("it changes an argument in place")
            entry.program = _Program(rec, tensors, result, out_leaves, self.cuda_graph)
            # the arenas this thread keeps for plans only the calls before ran (a first step's, which creates
            # optimizer state) are not needed again: the replays run in the program's own
            from ember.runtime import cuda  # torch: only once a program exists

            cuda.release_arenas(entry.earlier - {(id(r.plan), r.device) for r in rec.plans})
            entry.earlier.clear()
        except NotCapturable as error:
            entry.failure = f"{self.__name__} is not replayed: {error}"
            warnings.warn(f"ember.jit: {entry.failure}", stacklevel=3)
        return result


@dataclass
class _Entry:
    calls: int = 0
    keys: list | None = None  # the plans the last recorded call ran
    earlier: set = field(default_factory=set)  # (id(plan), device) of the plans run by the calls before the recording
    program: _Program | None = None
    failure: str | None = None


GRAPHS_KEPT = 8  # CUDA graphs a program captures (argument buffers x result set), before it copies arguments

# references to a state's node held by a program and by the check itself (its `state_nodes` entry, the
# check's variable or list, getrefcount's argument); more means something outside refers to the node
_OWN_REFERENCES = 3


def _describe(x):
    """What a replay depends on in an argument; None for a value it cannot tell apart from another."""
    if isinstance(x, Tensor):
        return "tensor", x.shape, x.dtype, x.device, x.requires_grad
    try:
        hash(x)
    except TypeError:
        return None
    return "value", type(x), x


# -- replay ------------------------------------------------------------------------------------

@dataclass
class _Slots:
    """Where each buffer a recorded plan reads comes from, found by the buffer's identity."""

    produced: dict[int, object] = field(default_factory=dict)  # outputs of earlier plans
    state_in: dict[int, object] = field(default_factory=dict)  # old value's buffer -> the state's buffer
    written: set[int] = field(default_factory=set)  # state buffers already updated by an earlier plan


class _Modes:
    """What a replay depends on in the modules a step calls, read back as flat lists: each module's
    train/eval mode, children, parameters and its submodules' (the same objects) and which of them train."""

    def __init__(self, recorded: list[tuple], generation: int):
        self.modules = [m for m, _, _, _, _ in recorded]
        self.training = [training for _, training, _, _, _ in recorded]
        self.children = [c for _, _, _, _, children in recorded for c in children]
        trains = {id(p): t for _, _, params, flags, _ in reversed(recorded) for p, t in zip(params, flags)}
        self.parameters = _unique(p for _, _, params, _, _ in recorded for p in params)  # a child's: once
        self.trains = [trains[id(p)] for p in self.parameters]
        self.generation = generation  # as the recording started: a step replacing a parameter is compared

    def unchanged(self) -> bool:
        if self.generation != nn_module.generation:  # some module's registries changed: are these the same?
            params = _unique(p for m in self.modules for p in m.parameters())
            children = [c for m in self.modules for c in m._modules.values()]
            if not (_same(params, self.parameters) and _same(children, self.children)):
                return False
            self.generation = nn_module.generation
        return ([m.training for m in self.modules] == self.training
                and [p.requires_grad for p in self.parameters] == self.trains)


def _same(a: list, b: list) -> bool:
    """Whether two lists hold the same objects, in order."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _unique(items) -> list:
    """`items` without repeats (by identity), in order."""
    return list({id(x): x for x in items}.values())


class _Program:
    """A recorded step bound to fixed buffers, with what must hold for a replay to be valid."""

    def __init__(self, rec: Recorder, args: list[Tensor], result, out_leaves: list, cuda_graph: bool):
        from ember.runtime import graphs  # torch is imported only once a step is replayed

        if not rec.plans:
            raise NotCapturable("it computes nothing on a cuda device (the cpu's reference backend runs "
                                "op by op and has nothing to replay)")
        self.result_structure = nested.structure(result)
        self.guards, self.refreshers = rec.guards, rec.refreshers
        self.modes = _Modes(list(rec.modules.values()), rec.generation)
        self.draw_counts = [count for _, _, count in rec.draws]
        self.constants: list[tuple] = []  # (tensor, its node, buffer read) for values the step only reads
        self.uploads: list[tuple[int, object, object]] = []  # (argument, device buffer, device) for host data
        produced_ids = {id(b) for r in rec.plans for b in r.outputs}
        slots = _Slots()
        finals = self._find_states(rec, produced_ids, slots)
        arg_nodes = {id(t._node): i for i, t in enumerate(args)}
        self.arguments = [i for i, t in enumerate(args) if t._node.buffer is not None and t.device.type == "cuda"]
        self.arg_slot = {id(args[i]._node.buffer): k for k, i in enumerate(self.arguments)}
        self.results: list[list] = [[]]  # sets of buffers the returned values are written into, by slot
        self.result_slot: dict[int, int] = {}  # id(recorded buffer of a returned value) -> its slot
        uploaded = {b: arg_nodes[id(src)] for b, src in rec.uploads.items() if id(src) in arg_nodes}
        returned = {id(t._node) for t in out_leaves if isinstance(t, Tensor)}
        draw_index = {(seed, offset): k for k, (seed, offset, _) in enumerate(rec.draws)}
        # a gradient the step also returns keeps showing the buffer replays write, as .grad does
        gradients = {id(p.grad._node) for ref, _, _ in rec.grads.values() if (p := ref()) is not None
                     and p.grad is not None}
        self._kept_results: dict[int, object] = {}  # id(recorded buffer of a returned value) -> this call's copy
        steps = [self._bind(r, slots, finals, uploaded, returned - gradients, draw_index) for r in rec.plans]
        del self._kept_results
        self.out_slots = self._returns(rec, out_leaves, arg_nodes)
        self.grads = self._gradients(rec, produced_ids)
        self.none_before = [ref for ref, _, needs_none in self.grads if needs_none]
        self.constant_refs = [ref for ref, _, _ in self.constants]
        self.constant_buffers = [buffer for _, _, buffer in self.constants]
        self.plans = graphs.Replay(steps)
        self.handed_at = [0]  # per set of result buffers: the replay that last returned them
        self.lends = True  # results handed to torch share the set's memory (runtime.dlpack.torch_buffers)
        self.calls = 0
        self.graphs: dict[tuple, object] = {}  # (argument buffers' addresses, result set, into) -> CUDA graph
        self.own_arguments: list | None = None  # where arguments are copied once GRAPHS_KEPT graphs exist
        self.uses: dict[int, object] = {}  # result set -> graphs.StorageUses of its buffers (_free_results)
        # replays of a binding beyond GRAPHS_KEPT: run launch by launch, or on copies of the arguments
        self.beyond = {"launched": 0, "copied": 0}
        # result slot -> argument slot: a returned value replay_buffers writes into that argument's buffer
        self.into: dict[int, int] = {}
        self.why_no_graph = self._capture_graph([args[i]._node.buffer for i in self.arguments]) if cuda_graph \
            else "cuda_graph=False"
        self.graphed = not self.why_no_graph
        self.plans.bind([None] * len(self.arguments), [None] * len(self.results[0]))  # nothing held between calls

    def _capture_graph(self, arguments: list) -> str:
        """Capture the replay, bound to the recorded call's buffers, as a CUDA graph where it can be; why
        not, or "" once captured."""
        from ember.runtime import cuda  # torch is imported only once a step is replayed

        if cuda.TARGET.interpret:
            return "no GPU: the interpreter replays launch by launch"
        try:
            self.plans.bind(arguments, self.results[0])
            self.graphs[_addresses(arguments), 0, False] = self.plans.capture()
        except Exception as error:  # e.g. a kernel that synchronises; replays stay correct without the graph
            return f"capture failed: {error}"
        return ""

    def _find_states(self, rec: Recorder, produced_ids: set[int], slots: _Slots) -> set[int]:
        """Tensors rebound during the step from a value that existed before it to one it computed; the
        ids of their final nodes. Replays read and update the state's new buffer; the old value's
        buffer is never written, so a Tensor still showing it (a detached copy) keeps it."""
        finals = set()
        self.state_refs: list[weakref.ref] = []  # the state Tensors
        self.state_nodes: list[Node] = []  # ... and the node each must still show
        for ref, old in rec.rebound.values():
            t = ref()
            if t is None or t._node is old or old.buffer is None or id(old.buffer) in produced_ids:
                continue
            final = t._node
            if final.buffer is None or id(final.buffer) not in produced_ids:
                continue  # set to a value from outside the step's plans: a value it reads, followed as such
            slots.state_in[id(old.buffer)] = final.buffer
            finals.add(id(final))
            self.state_refs.append(ref)
            self.state_nodes.append(final)
        return finals

    def _bind(self, r: RecordedPlan, slots: _Slots, finals: set[int], uploaded: dict, returned: set[int],
              draw_index: dict):
        """One recorded plan on fixed buffers: where each input comes from, where each output goes."""
        from ember.runtime import graphs  # torch is imported only once a step is replayed

        inputs, reads_state = [], {}
        arguments, results_in, results_out = [], [], []
        kept = self._kept_results
        for i, (leaf, buffer) in enumerate(zip(r.sig.inputs, r.inputs)):
            key = id(buffer)
            if key in self.result_slot:
                results_in.append((i, self.result_slot[key]))
            elif key in slots.produced:
                buffer = slots.produced[key]
            elif key in slots.state_in:
                if id(slots.state_in[key]) in slots.written:
                    raise NotCapturable("it reads a value's old version after updating it")
                buffer = slots.state_in[key]
                reads_state[id(buffer)] = i
            elif key in self.arg_slot:
                arguments.append((i, self.arg_slot[key]))
                buffer = None  # bound before each replay
            elif key in uploaded:
                if all(b is not buffer for _, b, _ in self.uploads):
                    self.uploads.append((uploaded[key], buffer, r.device))
            else:
                holders = [ref for ref in leaf.handles if ref() is not None]
                self.constants += [(ref, weakref.ref(leaf), buffer) for ref in holders]
            inputs.append(buffer)
        outputs, copies = [], []
        for j, (node, buffer) in enumerate(zip(r.kept, r.outputs)):
            passthrough = any(buffer is b for b in r.inputs)  # an output that is an input (x * 1): not written
            if id(node) in finals:
                source = reads_state.get(id(buffer))
                in_place = True if source is None else r.plan.writes_in_place(source, j)
                if in_place is False:  # through a buffer of its own, copied over the state after the plan
                    copies.append((buffer, graphs.torch.empty_like(buffer)))
                    buffer = copies[-1][1]
                slots.written.add(id(node.buffer))
            elif id(node) in returned and not passthrough:
                # this call's result stays (a copy); replays write the slot. Returned nodes the plan stores in
                # one buffer (one value returned twice) share its slot: a slot of each would leave one unwritten
                if id(buffer) not in self.result_slot:
                    self.result_slot[id(buffer)] = len(self.results[0])
                    self.results[0].append(buffer)
                    kept[id(buffer)] = buffer.clone()
                node.set_buffer(kept[id(buffer)])
                results_out.append((j, self.result_slot[id(buffer)]))
            if passthrough:
                outputs.append(None)
                continue
            slots.produced[id(buffer)] = buffer
            outputs.append(buffer)
        seed_draws = [draw_index.get(s, -1) for s in r.sig.seeds]
        sig = Signature(r.sig.key, [], r.sig.scalars, r.sig.seeds)  # not the old values' nodes
        draws = graphs.launcher.upload_draws(r.sig.seeds, graphs.cuda.torch_device(r.device)) if r.sig.seeds else None
        return graphs.ReplayStep(r.plan, sig, r.device, inputs, outputs, copies, seed_draws, draws, arguments,
                                 results_in, results_out)

    def _returns(self, rec: Recorder, out_leaves: list, arg_nodes: dict) -> list[tuple]:
        """How to make each returned leaf: ("result", slot, (dtype, device)) for a value written into the
        result buffers, ("computed", buffer, (dtype, device)) for one the step keeps (a gradient, a state),
        ("argument", index, None) or ("value", value, None) for a constant or a Python value."""
        computed = {id(node): out for r in rec.plans for node, out in zip(r.kept, r.outputs)}
        slots = []
        for t in out_leaves:
            placed = (t.dtype, t.device) if isinstance(t, Tensor) else None
            buffer = computed.get(id(t._node)) if isinstance(t, Tensor) else None
            if id(buffer) in self.result_slot:
                slots.append(("result", self.result_slot[id(buffer)], placed))
            elif buffer is not None and id(buffer) in self.arg_slot:  # an argument passed through (x * 1)
                slots.append(("argument", self.arguments[self.arg_slot[id(buffer)]], None))
            elif isinstance(t, Tensor) and id(t._node) in computed:
                slots.append(("computed", computed[id(t._node)], placed))
            elif isinstance(t, Tensor) and id(t._node) in arg_nodes:
                slots.append(("argument", arg_nodes[id(t._node)], None))
            else:
                slots.append(("value", t, None))
        return slots

    @staticmethod
    def _gradients(rec: Recorder, produced_ids: set[int]) -> list[tuple]:
        """(parameter, gradient Tensor the replay writes, whether .grad must be None before a replay) for
        every `.grad` the step set; None in the last place when the step sets .grad before reading it."""
        read = {id(b) for r in rec.plans for b in r.inputs}
        grads = []
        for ref, before, first in rec.grads.values():
            p = ref()
            if p is None:
                continue
            if p.grad is None:  # the step clears it
                grads.append((ref, None, False))
                continue
            if p.grad._node.buffer is None or id(p.grad._node.buffer) not in produced_ids:
                raise NotCapturable("a .grad is set to a value the step did not compute")
            if before is not None and id(before._node.buffer) in read:
                raise NotCapturable("it adds to the .grad left by the call before (gradient "
                                    "accumulation): clear gradients inside the step, or accumulate "
                                    "without ember.jit")
            # a step that sets .grad from nothing (backward into a None .grad) depends on it being None
            grads.append((ref, p.grad, before is None and first is not None))
        return grads

    def still_valid(self) -> bool:
        """Whether a replay computes what the Python would; on the way, make the state Tensors show the
        buffers the replay updates."""
        for update in self.refreshers:  # first: what the step itself sets (a mode) is then as it will be
            update()
        if not self.modes.unchanged() or (self.guards and not all(read() == value for read, value in self.guards)):
            return False
        if self.constants and not self._constants_shown() and not all(map(self._follow, self.constants)):
            return False
        if self.none_before and not all((p := ref()) is None or p.grad is None for ref in self.none_before):
            return False  # the step would add to a gradient left from before: a different step
        return not self.state_refs or self._states_shown() or self._show_states()

    def _constants_shown(self) -> bool:
        """The usual case, checked at once: every value the step only reads is still shown by its Tensor."""
        try:
            shown = [ref()._node.buffer for ref in self.constant_refs]
        except AttributeError:  # a Tensor gone (nothing to follow): the case by case check
            return False
        return all(map(operator.is_, shown, self.constant_buffers))

    def _states_shown(self) -> bool:
        """The usual case, checked at once: every state Tensor shows its node, and nothing else refers to
        the node (the list here, `shown`, the Tensor, getrefcount's argument), so the replay may update it."""
        try:
            shown = [ref()._node for ref in self.state_refs]
        except AttributeError:
            return False
        # a Node compares by identity, so the lists' == is an identity check, in C
        return shown == self.state_nodes and max(map(sys.getrefcount, shown), default=0) <= _OWN_REFERENCES + 1

    def _show_states(self) -> bool:
        """Each state Tensor shows a node of its own that the replay updates: a value set from outside is
        taken, a node something else refers to is left to it; False where a state is gone or changed shape."""
        for k, ref in enumerate(self.state_refs):
            t, node = ref(), self.state_nodes[k]
            if t is None:  # replaced wholesale (an optimizer's load_state_dict): record again
                return False
            if t._node is node:
                if sys.getrefcount(node) <= _OWN_REFERENCES + 1:  # + 1: the Tensor showing it
                    continue
                self.state_nodes[k] = self._detach_state(t, node)
                continue
            current = t._node  # set from outside, e.g. by another shape's replay: take its value
            if current.buffer is None or (current.shape, current.dtype, current.device) != (
                    node.shape, node.dtype, node.device):
                return False
            fresh = self._detach_state(t, node)  # first, so whatever else shows `node` keeps its value
            fresh.buffer.copy_(current.buffer)
            del current
            self.state_nodes[k] = fresh
        return True

    @staticmethod
    def _detach_state(t: Tensor, node: Node) -> Node:
        """Show the state through a node of its own: whatever else still refers to `node` (a detached
        copy, a pending graph) keeps the value it had, as it would if the Python ran."""
        fresh = Node.from_buffer(node.buffer, node.dtype, node.device)
        if sys.getrefcount(node) > _OWN_REFERENCES + 1 + (t._node is node):  # + 1: the argument
            node.buffer = node.buffer.clone()
        t.data = Tensor(fresh)
        return fresh

    @staticmethod
    def _follow(constant: list) -> bool:
        """Keep a value the step reads up to date with the Tensor that shows it (a parameter updated
        outside the step, or by another recorded step): copy its value into the buffer the replay
        reads, once the node that held that buffer is gone (nothing can see the old value any more);
        else record the step again."""
        ref, node, buffer = constant
        t = ref()
        if t is None or t._node.buffer is buffer:
            return True
        current = t._node.buffer
        if node() is not None or current is None or current.shape != buffer.shape or current.dtype != buffer.dtype:
            return False
        buffer.copy_(current)
        return True

    def _rebind_gradients(self) -> None:
        """Give each parameter the gradient Tensor the replay wrote, as running the step would."""
        for ref, grad, _ in self.grads:
            if (p := ref()) is not None:
                p._grad = grad

    def replay(self, args: list[Tensor]):
        realize(*args)
        for i, buffer, device in self.uploads:
            buffer.copy_(from_host(args[i]._node.buffer, device))
        s = self._replay_on([args[i]._node.buffer for i in self.arguments])
        leaves = iter([self._returned(value, args, s) for value in self.out_slots])
        return nested.rebuild(self.result_structure, leaves)

    def write_into_arguments(self, pairs: dict[int, int]) -> set[int]:
        """Let `replay_buffers` write returned leaves straight into arguments' buffers (`pairs`: leaf index ->
        argument index), for a caller that puts each such value in that argument's place after the call (a
        torch.compile graph's update of its inputs: parameters, momenta, running statistics): each replay then
        writes no buffer of its own for it, and the caller has nothing to copy. Taken for a leaf only where that
        is safe: the value is a result of its own, computed by the last plan that reads the argument, by the
        kernel that reads it last and element for element where it writes (`Plan.writes_in_place`), and the step
        does not also return the argument itself (its old value, which the caller copies). The leaves taken."""
        taken: set[int] = set()
        slots = [what for kind, what, _ in self.out_slots if kind == "result"]
        returned = {what for kind, what, _ in self.out_slots if kind == "argument"}  # (its old value, handed on)
        for leaf, argument in pairs.items():
            kind, slot, _ = self.out_slots[leaf]
            if kind != "result" or slots.count(slot) != 1 or argument not in self.arguments or argument in returned:
                continue
            a = self.arguments.index(argument)
            writers = [(k, j) for k, step in enumerate(self.plans.steps) for j, s in step.results_out if s == slot]
            if len(writers) != 1:
                continue
            (k, j), steps = writers[0], self.plans.steps
            read = [i for i, b in steps[k].arguments if b == a]
            later = any(b == a for step in steps[k + 1:] for _, b in step.arguments)
            if len(read) == 1 and not later and steps[k].plan.writes_in_place(read[0], j):
                self.into[slot] = a
                taken.add(leaf)
        return taken

    def replay_buffers(self, buffers: list) -> list | None:
        """A replay on its Tensor arguments' buffers as they are, in order (a torch.compile graph's inputs that are
        tensors: frontends.dynamo), with the returned leaves as buffers too: a result as a tensor of its own on the
        result set's memory (a copy where the program no longer lends), or as the argument's buffer it was
        written into (`write_into_arguments`), an argument as its buffer, a value the step keeps as a copy,
        anything else as recorded (a Python value, a constant Tensor). None where it takes host data (a cpu
        argument)."""
        if self.uploads:
            return None
        arguments = [buffers[i] for i in self.arguments]
        s = self._replay_on(arguments, into=True)
        results = self.results[s]
        self.handed_at[s] = self.calls
        leaves = []
        for kind, what, _ in self.out_slots:
            if kind == "result" and what in self.into:
                leaves.append(arguments[self.into[what]])
            elif kind == "result":
                leaves.append(results[what].detach() if self.lends else results[what].clone())
            elif kind == "computed":
                leaves.append(_kept_copy(what))
            else:
                leaves.append(buffers[what] if kind == "argument" else what)
        return leaves

    def _replay_on(self, arguments: list, into: bool = False) -> int:
        """Run the plans on the arguments' buffers into a free set of result buffers (and, `into`, the values
        `write_into_arguments` took into the arguments' buffers); that set."""
        self.calls += 1
        s = self._free_results()
        draws = [take_offsets(n) for n in self.draw_counts] if self.draw_counts else None
        with deferred_interrupt():
            self._run(arguments, s, draws, into and bool(self.into))
            self._rebind_gradients()
        return s

    def _run(self, arguments: list, s: int, draws: list | None, into: bool = False) -> None:
        """Run the plans on `arguments`, writing the returned values into result set `s` (`into`: those taken by
        `write_into_arguments` into the arguments' buffers): a CUDA graph captured for these buffers, or one
        captured now (after running the plans once, which compiles whatever a new binding needs), or launch by
        launch."""
        results = self.results[s]
        if into:
            results = [arguments[self.into[k]] if k in self.into else r for k, r in enumerate(results)]
        capture = self.graphed
        if self.graphed:
            key = (_addresses(arguments), s, into)
            if key not in self.graphs and len(self.graphs) >= GRAPHS_KEPT and into:
                capture = False  # the arguments it writes cannot be copies of the program's own: launch by launch
                self.beyond["launched"] += 1
            elif key not in self.graphs and len(self.graphs) >= GRAPHS_KEPT:
                self.beyond["copied"] += 1
                if self.own_arguments is None:
                    self.own_arguments = [b.clone() for b in arguments]
                else:
                    from ember.runtime.dlpack import copy_tensors  # torch: only for the cuda device

                    copy_tensors(self.own_arguments, arguments)
                arguments = self.own_arguments
                key = (_addresses(arguments), s, into)
            graph = self.graphs.get(key)
            if graph is not None:
                self.plans.draw(draws)  # the graph's random kernels read their offsets from device memory
                graph.replay()
                self.plans.replayed(results)
                return
        self.plans.bind(arguments, results)
        self.plans.run(draws)
        if capture:
            try:
                self.graphs[key] = self.plans.capture()
            except Exception as error:  # replays stay correct launch by launch
                self.graphed, self.why_no_graph = False, f"capture failed: {error}"
        self.plans.bind([None] * len(arguments), [None] * len(results))  # so a buffer's references say who shows it

    def _free_results(self) -> int:
        """A set of result buffers nothing outside the program refers to (no returned Tensor, nothing derived
        from one without a copy, no argument of this call, no tensor torch was handed on their memory): the first
        such; else a second set; else the oldest set is left to what shows it and replaced by new buffers (its
        graphs go with it), and from then on results handed to torch are copies (`lends`: torch keeps them longer
        than a call)."""
        from ember.runtime import graphs  # torch is imported only once a step is replayed

        for s, buffers in enumerate(self.results):
            if max(map(sys.getrefcount, buffers), default=0) > _RESULT_REFERENCES:
                continue
            uses = self.uses.get(s)
            if uses is None or not uses.of(buffers):
                uses = self.uses[s] = graphs.StorageUses(buffers)
            if not uses.shared():
                return s
        fresh = [graphs.torch.empty_like(b) for b in self.results[0]]
        if len(self.results) < 2:
            self.results.append(fresh)
            self.handed_at.append(0)
            return 1
        self.lends = False
        s = min(range(len(self.results)), key=self.handed_at.__getitem__)
        self.results[s] = fresh
        self.uses.pop(s, None)  # (its storages are the old set's, which only what shows them keeps now)
        self.graphs = {key: g for key, g in self.graphs.items() if key[1] != s}
        return s

    def _returned(self, value: tuple, args: list[Tensor], s: int):
        """One returned leaf: a Tensor showing result set `s`, a fresh Tensor of a value the step keeps, an
        argument, or a value as recorded."""
        kind, what, placed = value
        if kind == "result":
            node = Node.from_buffer(self.results[s][what], *placed)
            self.handed_at[s] = self.calls
            transient[node] = self
            return Tensor(node)
        if kind == "computed":
            return Tensor(Node.from_buffer(_kept_copy(what), *placed))
        return args[what] if kind == "argument" else what


def _kept_copy(buffer):
    """A copy of a buffer the step keeps (a state, a gradient), carrying its index checks."""
    from ember.runtime import index_checks  # torch is imported only once a step is replayed

    copy = buffer.clone()
    index_checks.depend_on(getattr(buffer, index_checks.CARRIED, frozenset()), [copy])
    return copy


def _addresses(buffers: list) -> tuple[int, ...]:
    return tuple(b.data_ptr() for b in buffers)


# references to a result buffer held by the program (its set's list) and by the check (getrefcount's argument);
# more means something else shows the buffer
_RESULT_REFERENCES = 2
