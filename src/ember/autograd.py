"""Reverse-mode autodiff over primitives.

Each primitive application that needs gradients records a `Function`: the op, its
attributes, its input and output nodes, and where each input's gradient goes next
(another Function, a leaf Tensor, or nowhere). `backward` walks these records and
applies each primitive's vector-Jacobian product from the rules table (`ir.ops.RULES`; each
primitive declares its VJP beside its user-facing ops, in ember/ops/ or ember/placement.py). A VJP
gets the output gradient g, the inputs xs, the output and the attributes, and returns one gradient
(or None for "zero") per input. The rules build ordinary lazy Tensor expressions, so forward, backward and
the optimizer update of a training step form one graph that is compiled together.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence

from ember.errors import ShapeError
from ember.ir import Node, Op
from ember.ir.ops import NOT_DIFFERENTIABLE, RULES
from ember.ir.template import Template, recording, template
from ember.runtime.executor import realize_with_next

_state = threading.local()


def is_grad_enabled() -> bool:
    return getattr(_state, "enabled", True)


class set_grad_enabled:
    """Context manager (and decorator) that turns gradient recording on or off."""

    def __init__(self, mode: bool):
        self.mode = mode
        self.previous = is_grad_enabled()
        _state.enabled = mode

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc) -> None:
        _state.enabled = self.previous

    def __call__(self, fn: Callable) -> Callable:
        mode = self.mode
        _state.enabled = self.previous

        def wrapped(*args, **kwargs):
            with set_grad_enabled(mode):
                return fn(*args, **kwargs)

        wrapped.__wrapped__ = fn
        wrapped.__name__ = getattr(fn, "__name__", "wrapped")
        return wrapped


class _grad_mode(set_grad_enabled):
    """A guard that switches when entered (not when made), so one object can be entered again."""

    def __init__(self, mode: bool):
        self.mode = mode
        self.previous = is_grad_enabled()

    def __enter__(self) -> None:
        self.previous = is_grad_enabled()
        _state.enabled = self.mode


class no_grad(_grad_mode):
    """`with ember.no_grad():` builds graph without recording it for autograd."""

    def __init__(self):
        super().__init__(False)


class enable_grad(_grad_mode):
    def __init__(self):
        super().__init__(True)


inference_mode = no_grad


class Function:
    """The record of one primitive application, for the backward pass."""

    __slots__ = ("op", "attrs", "inputs", "output", "next")

    def __init__(self, op: Op, attrs: dict, inputs: Sequence, output: Node):
        self.op = op
        self.attrs = attrs
        self.inputs: tuple[Node, ...] | None = tuple(t._node for t in inputs)
        self.output: Node | None = output
        self.next = tuple(
            None if not t.requires_grad else (t._grad_fn if t._grad_fn is not None else t) for t in inputs
        )

    def release(self) -> None:
        self.inputs = self.output = None

    def __repr__(self) -> str:
        return f"<{self.op.label} backward>"


# -- the engine ---------------------------------------------------------------------------

def backward(tensor, gradient=None, retain_graph: bool = False) -> None:
    """Accumulate d(tensor)/d(leaf) into `.grad` of every leaf that requires gradients."""
    if not tensor.requires_grad:
        raise RuntimeError("backward(): the tensor does not require grad and has no grad_fn "
                           "(did you compute it under no_grad, or from tensors without requires_grad=True?)")
    _run([(tensor, _root_gradient(tensor, gradient))], retain_graph, targets=None)
    realize_with_next(tensor._node)


def grad(outputs, inputs, grad_outputs=None, retain_graph: bool = False, allow_unused: bool = False):
    """Gradients of `outputs` with respect to `inputs` (leaf or not), without touching `.grad`."""
    outputs = [outputs] if not isinstance(outputs, (list, tuple)) else list(outputs)
    single = not isinstance(inputs, (list, tuple))
    inputs = [inputs] if single else list(inputs)
    if grad_outputs is None:
        grad_outputs = [None] * len(outputs)
    elif not isinstance(grad_outputs, (list, tuple)):
        grad_outputs = [grad_outputs]
    for t in inputs:
        if not t.requires_grad:
            raise RuntimeError(f"grad(): an input of shape {t.shape} does not require grad")
    roots = [(o, _root_gradient(o, g)) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
    targets = {id(t._grad_fn if t._grad_fn is not None else t): i for i, t in enumerate(inputs)}
    found = _run(roots, retain_graph, targets)
    result = []
    for i, t in enumerate(inputs):
        if i not in found:
            if not allow_unused:
                raise RuntimeError(f"grad(): input {i} (shape {t.shape}) was not used to compute the outputs; "
                                   "pass allow_unused=True to get None for it")
            result.append(None)
        else:
            result.append(found[i])
    return result[0] if single else tuple(result)


def _root_gradient(tensor, gradient):
    # the op modules import ember.tensor, which imports this module: they load only after it
    from ember.ops.creation import ones_like
    from ember.ops.pointwise import as_tensor

    if gradient is None:
        if tensor.numel() != 1:
            raise RuntimeError(f"backward(): a gradient can be created implicitly only for a single-element "
                               f"output, not shape {tensor.shape}; pass `gradient=`")
        return ones_like(tensor).detach()
    gradient = as_tensor(gradient, like=tensor)
    if gradient.shape != tensor.shape:
        raise ShapeError(f"backward(): gradient shape {gradient.shape} does not match output shape {tensor.shape}")
    return gradient.detach().to(tensor.dtype)


# hooks called with a leaf once backward() has accumulated its gradient (Tensor.register_post_accumulate_grad_hook),
# by leaf; and, per thread, callbacks run once when its next backward() has delivered every leaf's gradient, by key
# (one each: DistributedDataParallel's end of a step's reductions)
_accumulate_hooks: dict[int, list] = {}  # by id (a Tensor's == is elementwise), dropped with the Tensor


class _Callbacks(threading.local):
    def __init__(self) -> None:
        self.after_backward: dict = {}


_callbacks = _Callbacks()


class HookHandle:
    """What registering a hook returns: `remove()` takes it away."""

    def __init__(self, hooks: list, hook):
        self.hooks, self.hook = hooks, hook

    def remove(self) -> None:
        if self.hook in self.hooks:
            self.hooks.remove(self.hook)


def register_post_accumulate_grad_hook(tensor, hook) -> HookHandle:
    """Call `hook(tensor)` each time backward() has accumulated a gradient into the leaf `tensor`'s `.grad`."""
    if tensor._grad_fn is not None:
        raise RuntimeError("register_post_accumulate_grad_hook: only a leaf tensor accumulates a gradient")
    if not tensor.requires_grad:
        raise RuntimeError("register_post_accumulate_grad_hook: the tensor does not require grad")
    if id(tensor) not in _accumulate_hooks:
        weakref.finalize(tensor, _accumulate_hooks.pop, id(tensor), None)
    hooks = _accumulate_hooks.setdefault(id(tensor), [])
    hooks.append(hook)
    return HookHandle(hooks, hook)


def after_backward(key, callback) -> None:
    """Run `callback()` once, when the next backward() has accumulated every leaf's gradient (the latest callback
    given under `key` replaces an earlier one)."""
    _callbacks.after_backward[key] = callback


def _run(roots, retain_graph: bool, targets: dict[int, int] | None) -> dict[int, object]:
    """Backpropagate from the roots: into `.grad` of the leaves when `targets` is None, else into the slots
    `targets` gives for leaf Tensors and Functions (by id), returned by slot."""
    functions = _reachable(roots)
    if targets is None:
        if all(t._grad_fn is not None for t, _ in roots):
            leaves = _backward_by_structure(roots, functions, retain_graph)
        else:
            leaves, _ = _walk(roots, functions, retain_graph, False)
        for t, g in leaves.values():
            t.grad = g if t.grad is None else t.grad + g
            for hook in list(_accumulate_hooks.get(id(t), ())):
                hook(t)
        callbacks = list(_callbacks.after_backward.values())
        _callbacks.after_backward.clear()
        for callback in callbacks:
            callback()
        return {}
    leaves, reached = _walk(roots, functions, retain_graph, True)
    found: dict[int, object] = {}
    for key, g in [*((key, g) for key, (_, g) in leaves.items()), *reached.items()]:
        slot = targets.get(key)
        if slot is not None:
            found[slot] = g if slot not in found else found[slot] + g
    return found


def _reachable(roots) -> dict[int, Function]:
    """Every Function the roots' gradients pass through, by id, in the order a walk from the roots finds them."""
    stack = [t._grad_fn for t, _ in roots if t._grad_fn is not None]
    functions = {id(fn): fn for fn in stack}
    while stack:
        fn = stack.pop()
        if fn.inputs is None:
            raise RuntimeError("backward() through a graph a second time: its saved values were freed; "
                               "pass retain_graph=True to the first backward()")
        for nxt in fn.next:
            if isinstance(nxt, Function) and id(nxt) not in functions:
                functions[id(nxt)] = nxt
                stack.append(nxt)
    return functions


def _walk(roots, functions: dict[int, Function], retain_graph: bool, at_functions: bool) -> tuple[dict, dict]:
    """Apply the VJP rules from the roots down. Returns the gradients arriving at leaf Tensors, summed, as
    {id: (Tensor, gradient)}, and (if `at_functions`) those arriving at Functions, {id: gradient}."""
    leaves: dict[int, tuple] = {}
    reached: dict[int, object] = {}

    def deliver(t, g) -> None:
        leaves[id(t)] = (t, g) if id(t) not in leaves else (t, leaves[id(t)][1] + g)

    waiting: dict[int, int] = {}  # for every Function, how many gradients it waits for
    for fn in functions.values():
        for nxt in fn.next:
            if isinstance(nxt, Function):
                waiting[id(nxt)] = waiting.get(id(nxt), 0) + 1
    grads: dict[int, object] = {}
    ready: list[Function] = []
    with no_grad():
        for t, g in roots:
            if t._grad_fn is None:
                deliver(t, g)
                continue
            key = id(t._grad_fn)
            grads[key] = g if key not in grads else grads[key] + g
            if waiting.get(key, 0) == 0 and t._grad_fn not in ready:
                ready.append(t._grad_fn)
        while ready:
            fn = ready.pop()
            g = grads.pop(id(fn), None)
            if g is not None and at_functions:
                reached[id(fn)] = g
            input_grads = _vjp(fn, g) if g is not None else (None,) * len(fn.next)
            for nxt, gi, node in zip(fn.next, input_grads, fn.inputs):
                if nxt is None:
                    continue
                if gi is not None:
                    assert gi.shape == node.shape, f"{fn}: gradient shape {gi.shape} for input {node.shape}"
                    if gi.dtype is not node.dtype:
                        gi = gi.to(node.dtype)
                if isinstance(nxt, Function):
                    if gi is not None:
                        key = id(nxt)
                        grads[key] = gi if key not in grads else grads[key] + gi
                    waiting[id(nxt)] -= 1
                    if waiting[id(nxt)] == 0:
                        ready.append(nxt)
                elif gi is not None:
                    deliver(nxt, gi)
            if not retain_graph:
                fn.release()
    return leaves, reached


# A backward pass's structure (see _structure) -> its template and the positions of the leaves it gives
# gradients to; None where its graph cannot be a template. The oldest is dropped beyond TEMPLATES_KEPT.
_templates: dict[tuple, tuple[Template, list[int]] | None] = {}
_templates_lock = threading.Lock()
TEMPLATES_KEPT = 64


def _backward_by_structure(roots, functions: dict[int, Function], retain_graph: bool) -> dict[int, tuple]:
    """`_walk`'s gradients at the leaves, built from the template of the first backward pass of this structure
    where there is one: a training step's backward is the same graph step after step, and building it again
    as the template's results skips the VJP rules' Python (dispatch, promotion, shape rules) and the nodes
    themselves: a step's graph holds one node per gradient, which the compiler expands (ir.template)."""
    key, inputs, leaves = _structure(roots, functions)
    recorded = _templates.get(key, False) if key is not None else None
    if recorded is False:
        with recording() as made:
            arrived, _ = _walk(roots, functions, retain_graph, False)
        given = [p for p, t in enumerate(leaves) if id(t) in arrived]
        built = template(inputs, [arrived[id(leaves[p])][1]._node for p in given], made)
        with _templates_lock:  # threads record and drop templates at once
            while len(_templates) >= TEMPLATES_KEPT:
                del _templates[next(iter(_templates))]
            _templates[key] = (built, given) if built is not None else None
        if built is None:
            return arrived
        # the template's results from the first pass on (the recorded nodes are dropped), so the first step's
        # graph is every later one's: a training loop compiles one plan
        return _from_template(built, given, inputs, leaves)
    if recorded is None:
        return _walk(roots, functions, retain_graph, False)[0]
    built, given = recorded
    if not retain_graph:
        for fn in functions.values():
            fn.release()
    return _from_template(built, given, inputs, leaves)


def _from_template(built: Template, given: list[int], inputs: list[Node], leaves: list) -> dict[int, tuple]:
    """The gradients of a backward pass from its template: one TEMPLATE node per gradient (all sharing one tuple
    of inputs), which the compiler expands once per plan; node for node where the pass spans devices (a node's
    inputs are on its device)."""
    from ember.tensor import Tensor  # ember.tensor imports this module before it defines Tensor

    device = inputs[0].device if inputs else None
    made = built.apply(inputs) if all(n.device == device for n in inputs) else None
    if made is None or any(n.device != device for n in made):
        made = built.build(inputs)
    return {id(leaves[p]): (leaves[p], Tensor(node)) for p, node in zip(given, made)}


def _structure(roots, functions: dict[int, Function]) -> tuple[tuple | None, list[Node], list]:
    """What a backward pass's graph depends on, as a key: per Function its op, attributes, the positions of its
    input and output nodes among `inputs` and where its gradients go (a Function's position, or a leaf's);
    the roots; every node's op, shape, dtype and device (a constant's value too: a rule may read it), and the
    autocast mode the rules run in. Also the nodes (`inputs`, each once) and the leaf Tensors, in that order.
    The key is None when an attribute cannot be hashed."""
    from ember import amp  # ember.amp imports ember.tensor, which imports this module

    position = {key: k for k, key in enumerate(functions)}
    where: dict[int, int] = {}
    inputs: list[Node] = []
    leaves: list = []
    leaf_at: dict[int, int] = {}

    def ref(node: Node) -> int:
        k = where.get(id(node))
        if k is None:
            k = where[id(node)] = len(inputs)
            inputs.append(node)
        return k

    def goes(t) -> int | None:
        if t is None:
            return None
        if isinstance(t, Function):
            return position[id(t)]
        k = leaf_at.get(id(t))
        if k is None:
            k = leaf_at[id(t)] = len(leaves)
            leaves.append(t)
        return -1 - k

    parts: list = [amp._mode()]
    for fn in functions.values():
        parts.append((fn.op, tuple(fn.attrs.items()), tuple(ref(n) for n in fn.inputs), ref(fn.output),
                      tuple(goes(t) for t in fn.next)))
    parts.append(tuple((position[id(t._grad_fn)], ref(g._node)) for t, g in roots))
    parts.append(tuple((n.op, n.shape, n.dtype, n.device, tuple(n.attrs.items()) if n.op is Op.CONST else None)
                       for n in inputs))
    key = tuple(parts)
    try:
        hash(key)
    except TypeError:
        return None, inputs, leaves
    return key, inputs, leaves


def differentiable(op: Op) -> bool:
    """Whether the primitive's output carries gradients (its VJP rule is a function)."""
    return callable(RULES[op].vjp)


# per composite op (see composite_vjp): (attrs, the inputs' and the gradient's shapes, dtypes and devices) -> the
# template of its VJP and the positions of the inputs it gives gradients to; None where it cannot be a template
COMPOSITE_VJPS_KEPT = 256


def composite_vjp(derive: Callable) -> Callable:
    """A composite op's VJP from `derive(g, xs, out, attrs)`, the gradient of its decomposition (which builds the
    decomposition again and differentiates it by the primitives' rules: several times the nodes of the gradient
    itself), recorded once per kind of node as a template and built from it afterwards, as a backward pass of a
    known structure is."""
    recorded: dict[tuple, tuple[Template, list[int]] | None] = {}
    lock = threading.Lock()

    def vjp(g, xs: list, out, attrs: dict) -> tuple:
        from ember.tensor import Tensor  # ember.tensor imports this module before it defines Tensor

        key = (tuple(attrs.items()), g.shape, g.dtype, *((x.shape, x.dtype, x.device) for x in xs))
        try:
            known = recorded.get(key, False)
        except TypeError:  # an attribute that cannot be hashed
            return derive(g, xs, out, attrs)
        inputs = [g._node, *(x._node for x in xs)]
        if known is False:
            with recording() as made:
                grads = derive(g, xs, out, attrs)
            given = [k for k, d in enumerate(grads) if d is not None]
            built = template(inputs, [grads[k]._node for k in given], made)
            with lock:
                while len(recorded) >= COMPOSITE_VJPS_KEPT:
                    del recorded[next(iter(recorded))]
                recorded[key] = (built, given) if built is not None else None
            return grads
        if known is None:
            return derive(g, xs, out, attrs)
        built, given = known
        grads: list = [None] * len(xs)
        for k, node in zip(given, built.build(inputs)):
            grads[k] = Tensor(node)
        return tuple(grads)

    return vjp


def _vjp(fn: Function, g):
    from ember.tensor import Tensor  # ember.tensor imports this module before it defines Tensor

    rule = RULES[fn.op].vjp
    if rule == NOT_DIFFERENTIABLE:
        return (None,) * len(fn.inputs)
    xs = [Tensor(n) for n in fn.inputs]
    return rule(g, xs, Tensor(fn.output), fn.attrs)
