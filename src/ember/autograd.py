"""Reverse-mode autodiff over primitives.

Each primitive application that needs gradients records a `Function`: the op, its
attributes, its input and output nodes, and where each input's gradient goes next
(another Function, a leaf Tensor, or nowhere). `backward` walks these records and
applies each primitive's vector-Jacobian product from the rules table (`ir.ops.RULES`: the
pointwise primitives declare theirs in ember/ops/pointwise.py, the others in `VJP` below). The rules build
ordinary lazy Tensor expressions, so forward, backward and the optimizer update of
a training step form one graph that is compiled together.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from ember.ir import Node, Op
from ember.ir.ops import NOT_DIFFERENTIABLE, RULES, vjp_rule

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
    from ember.runtime.executor import realize_with_next

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
    from ember.ops.creation import ones_like
    from ember.ops.pointwise import as_tensor

    if gradient is None:
        if tensor.numel() != 1:
            raise RuntimeError(f"backward(): a gradient can be created implicitly only for a single-element "
                               f"output, not shape {tensor.shape}; pass `gradient=`")
        return ones_like(tensor).detach()
    gradient = as_tensor(gradient, like=tensor)
    if gradient.shape != tensor.shape:
        from ember.errors import ShapeError

        raise ShapeError(f"backward(): gradient shape {gradient.shape} does not match output shape {tensor.shape}")
    return gradient.detach().to(tensor.dtype)


def _run(roots, retain_graph: bool, targets: dict[int, int] | None) -> dict[int, object]:
    from ember.tensor import Tensor

    found: dict[int, object] = {}

    def deliver(dest, g) -> None:
        if targets is not None:
            slot = targets.get(id(dest))
            if slot is not None:
                found[slot] = g if slot not in found else found[slot] + g
            if isinstance(dest, Tensor):
                return
        if isinstance(dest, Tensor):
            dest.grad = g if dest.grad is None else dest.grad + g

    # count, for every Function reachable from the roots, how many gradients it waits for
    waiting: dict[int, int] = {}
    functions: dict[int, Function] = {}
    stack = [t._grad_fn for t, _ in roots if t._grad_fn is not None]
    for fn in stack:
        functions[id(fn)] = fn
    while stack:
        fn = stack.pop()
        if fn.inputs is None:
            raise RuntimeError("backward() through a graph a second time: its saved values were freed; "
                               "pass retain_graph=True to the first backward()")
        for nxt in fn.next:
            if isinstance(nxt, Function):
                waiting[id(nxt)] = waiting.get(id(nxt), 0) + 1
                if id(nxt) not in functions:
                    functions[id(nxt)] = nxt
                    stack.append(nxt)

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
            if g is not None and targets is not None and id(fn) in targets:
                deliver(fn, g)
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
    return found


def differentiable(op: Op) -> bool:
    """Whether the primitive's output carries gradients (its VJP rule is a function)."""
    return callable(RULES[op].vjp)


def _vjp(fn: Function, g):
    from ember.tensor import Tensor

    rule = RULES[fn.op].vjp
    if rule == NOT_DIFFERENTIABLE:
        return (None,) * len(fn.inputs)
    xs = [Tensor(n) for n in fn.inputs]
    return rule(g, xs, Tensor(fn.output), fn.attrs)


# -- vector-Jacobian products, one per differentiable primitive ------------------------------
# Each rule gets the output gradient g, the inputs xs, the output and the attributes, and
# returns one gradient (or None for "zero") per input.

def _apply(op: Op, *args, **attrs):
    from ember.tensor import apply

    return apply(op, *args, **attrs)


def _zero_grad(g, xs, out, a):
    return (None,) * len(xs)


def _reduce_extremum(g, xs, out, a):
    (x,) = xs
    hit = (x == out.expand(x.shape)).to(g.dtype)
    count = _apply(Op.SUM, hit, axes=a["axes"])
    return ((g / count).expand(x.shape) * hit,)


def _prod(g, xs, out, a):
    (x,) = xs
    from ember.ops.pointwise import where

    axes = a["axes"]
    nonzero = x != 0
    prod_nonzero = _apply(Op.PROD, where(nonzero, x, 1.0), axes=axes).expand(x.shape)
    zeros = _apply(Op.SUM, (~nonzero).to(g.dtype), axes=axes).expand(x.shape)
    others = where(zeros == 0, prod_nonzero / where(nonzero, x, 1.0),
                   where((zeros == 1) & ~nonzero, prod_nonzero, 0.0))
    return (g.expand(x.shape) * others,)


def _expand(g, xs, out, a):
    (x,) = xs
    axes = tuple(i for i, (s, n) in enumerate(zip(x.shape, out.shape)) if s == 1 and n != 1)
    return (_apply(Op.SUM, g, axes=axes) if axes else g,)


def _unslice(g, xs, out, a):
    (x,) = xs
    for axis, ((start, _, step), n) in enumerate(zip(a["slices"], x.shape)):
        length = g.shape[axis]
        if length == 0:
            from ember.ops.creation import zeros

            return (zeros(x.shape, dtype=g.dtype, device=g.device),)
        if step > 1:  # put step-1 zeros after every element
            spread = list(g.shape)
            spread[axis] = length * step
            g = _apply(Op.PAD, g.unsqueeze(axis + 1),
                       pads=tuple((0, step - 1) if d == axis + 1 else (0, 0) for d in range(g.ndim + 1)), value=0)
            g = g.reshape(spread)
            g = _slice_axis(g, axis, 0, (length - 1) * step + 1)
        covered = g.shape[axis]
        g = _pad_axis(g, axis, start, n - start - covered)
    return (g,)


def _slice_axis(t, axis: int, start: int, stop: int):
    slices = tuple((start, stop, 1) if d == axis else (0, s, 1) for d, s in enumerate(t.shape))
    return _apply(Op.SLICE, t, slices=slices)


def _pad_axis(t, axis: int, lo: int, hi: int):
    """Pad (or, for negative amounts, crop) one axis with zeros."""
    if lo < 0 or hi < 0:
        t = _slice_axis(t, axis, max(-lo, 0), t.shape[axis] - max(-hi, 0))
        lo, hi = max(lo, 0), max(hi, 0)
    if lo or hi:
        t = _apply(Op.PAD, t, pads=tuple((lo, hi) if d == axis else (0, 0) for d in range(t.ndim)), value=0)
    return t


def _unpad(g, xs, out, a):
    slices = tuple((lo, lo + s, 1) for (lo, _), s in zip(a["pads"], xs[0].shape))
    return (_apply(Op.SLICE, g, slices=slices),)


def _matmul(g, xs, out, a):
    x, y = xs
    return _apply(Op.MATMUL, g, y.mT), _apply(Op.MATMUL, x.mT, g)


def _conv2d(g, xs, out, a):
    """Both gradients of a convolution are convolutions themselves."""
    x, w = xs
    (sh, sw), (ph, pw), (dh, dw), groups = a["stride"], a["padding"], a["dilation"], a["groups"]
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    og = o // groups
    # input gradient: spread g by the stride, pad, and correlate with the flipped, transposed weight
    gd = g
    for axis, s in ((2, sh), (3, sw)):
        if s > 1:
            length = gd.shape[axis]
            shape = list(gd.shape)
            shape[axis] = length * s
            gd = _apply(Op.PAD, gd.unsqueeze(axis + 1),
                        pads=tuple((0, s - 1) if d == axis + 1 else (0, 0) for d in range(5)), value=0)
            gd = _slice_axis(gd.reshape(shape), axis, 0, (length - 1) * s + 1)
    gd = _pad_axis(gd, 2, dh * (kh - 1) - ph, h - gd.shape[2] + ph)
    gd = _pad_axis(gd, 3, dw * (kw - 1) - pw, wd - gd.shape[3] + pw)
    wt = w.reshape(groups, og, cg, kh, kw).permute(0, 2, 1, 3, 4).reshape(groups * cg, og, kh, kw)
    wt = _apply(Op.FLIP, wt, axes=(2, 3))
    gx = _apply(Op.CONV2D, gd, wt, stride=(1, 1), padding=(0, 0), dilation=(dh, dw), groups=groups)
    # weight gradient: correlate the padded input with g, batch and channels swapped
    xp = _apply(Op.PAD, x, pads=((0, 0), (0, 0), (ph, ph), (pw, pw)), value=0)
    hp, wp = xp.shape[2:]
    xt = xp.reshape(n, groups, cg, hp, wp).permute(2, 1, 0, 3, 4).reshape(cg, groups * n, hp, wp)
    gt = g.reshape(n, groups, og, *g.shape[2:]).permute(1, 2, 0, 3, 4).reshape(o, n, *g.shape[2:])
    gw = _apply(Op.CONV2D, xt, gt, stride=(dh, dw), padding=(0, 0), dilation=(sh, sw), groups=groups)
    gw = _apply(Op.SLICE, gw, slices=((0, cg, 1), (0, o, 1), (0, kh, 1), (0, kw, 1))).permute(1, 0, 2, 3)
    return gx, gw


def _gather(g, xs, out, a):
    x, index = xs
    axis = a["axis"]
    from ember.ops.creation import arange, zeros
    from ember.ops.pointwise import where

    same_elsewhere = all(i == s for d, (i, s) in enumerate(zip(index.shape, x.shape)) if d != axis)
    if index.shape[axis] == 1 and same_elsewhere:
        # one pick per row (cross entropy, max with indices): a pointwise select, no scatter
        positions = arange(x.shape[axis], device=g.device).reshape(
            tuple(x.shape[axis] if d == axis else 1 for d in range(x.ndim)))
        return where(positions == index.expand(x.shape), g.expand(x.shape), 0), None
    base = zeros(x.shape, dtype=g.dtype, device=g.device)
    return _apply(Op.SCATTER_ADD, base, index, g, axis=axis), None


def _scatter_add(g, xs, out, a):
    _, index, _ = xs
    return g, None, _apply(Op.GATHER, g, index, axis=a["axis"])


def _inverse(order):
    inv = [0] * len(order)
    for i, o in enumerate(order):
        inv[o] = i
    return tuple(inv)


# The pointwise primitives declare theirs beside their ops (ember/ops/pointwise.py); these are still here.
VJP: dict[Op, Callable] = {
    Op.SUM: lambda g, xs, out, a: (g.expand(xs[0].shape),),
    Op.PROD: _prod,
    Op.MAX: _reduce_extremum,
    Op.MIN: _reduce_extremum,
    Op.RESHAPE: lambda g, xs, out, a: (g.reshape(xs[0].shape),),
    Op.PERMUTE: lambda g, xs, out, a: (g.permute(*_inverse(a["order"])),),
    Op.EXPAND: _expand,
    Op.SLICE: _unslice,
    Op.FLIP: lambda g, xs, out, a: (_apply(Op.FLIP, g, axes=a["axes"]),),
    Op.PAD: _unpad,
    Op.MATMUL: _matmul,
    Op.CONV2D: _conv2d,
    Op.GATHER: _gather,
    Op.SCATTER_ADD: _scatter_add,
    Op.COPY: lambda g, xs, out, a: (g.to(xs[0].device),),
}

for _op, _rule in VJP.items():
    vjp_rule(_op, _rule)
vjp_rule(Op.ARGMAX, NOT_DIFFERENTIABLE)
vjp_rule(Op.ARGMIN, NOT_DIFFERENTIABLE)
