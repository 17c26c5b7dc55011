"""aten.as_strided (and its _copy and _scatter forms) in ATen graphs, on ember values, which have no memory layout.

as_strided addresses its input's storage: element i of the result is the storage element at offset + Σ i_d stride_d,
whatever the input's own strides. The graph records each tensor's layout (its node's meta value: sizes, strides,
storage offset), so at translation every address the operator reads is looked up among the elements of its input,
or of a tensor the input is a view of (up the chain of view operators, all on one storage), and the operator becomes
a gather of those elements, its gradient the gather's (as torch's, reaching only the input's own elements).
as_strided_scatter writes src at the addresses, which must be elements of its input. An address no such tensor holds
(storage torch reaches around a view), a symbolic size or stride, or a graph without layouts, is refused with the
operator, the shapes and the strides named.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

import ember
from ember.frontends.aten import OPS

OPERATORS = ("aten.as_strided", "aten.as_strided_", "aten.as_strided_copy", "aten.as_strided_scatter")

# the operators whose result shares its input's storage: an address as_strided reads may be held up their chain
_VIEWS = frozenset({"aten.view", "aten._unsafe_view", "aten.alias", "aten.detach", "aten.t", "aten.transpose",
                    "aten.permute", "aten.slice", "aten.select", "aten.expand", "aten.unsqueeze", "aten.squeeze",
                    "aten.diagonal", "aten.narrow", "aten.unfold", *OPERATORS[:3]})

Layout = tuple[tuple[int, ...], tuple[int, ...], int]  # sizes, strides, storage offset


def _packet(node) -> str:
    return str(node.target).rsplit(".", 1)[0]


def _layout(node) -> Layout | None:
    """A graph node's recorded layout, None where it has none or a symbolic part."""
    import torch

    value = node.meta.get("val") if hasattr(node, "meta") else None
    if not isinstance(value, torch.Tensor):
        return None
    layout = (tuple(value.shape), tuple(value.stride()), value.storage_offset())
    return layout if all(isinstance(v, int) for v in (*layout[0], *layout[1], layout[2])) else None


def _addresses(size, stride, offset: int) -> np.ndarray:
    """The storage address of every element of a view (size, stride, offset), in the view's shape."""
    where = np.full(tuple(size), offset, dtype=np.int64)
    for d, (n, step) in enumerate(zip(size, stride)):
        where = where + (np.arange(n, dtype=np.int64) * step).reshape([n if i == d else 1 for i in range(len(size))])
    return where


def _positions(held: Layout, wanted: np.ndarray) -> np.ndarray | None:
    """For each wanted address, the flat position of an element of the tensor of layout `held` stored there, or
    None where some address is none of its elements'."""
    if not wanted.size:
        return wanted
    size, stride, offset = held
    if all(n == 1 or step == math.prod(size[d + 1:]) for d, (n, step) in enumerate(zip(size, stride))):
        positions = wanted - offset  # a contiguous tensor: its elements are the addresses from its offset on
        return positions if positions.min() >= 0 and positions.max() < math.prod(size) else None
    addresses = _addresses(*held).reshape(-1)
    if not addresses.size or wanted.min() < 0:
        return None
    table = np.full(max(int(addresses.max()), int(wanted.max())) + 1, -1, dtype=np.int64)
    table[addresses] = np.arange(addresses.size)  # an address held twice (an expanded view): either, same value
    positions = table[wanted]
    return None if (positions < 0).any() else positions


def _describe(layout: Layout) -> str:
    return f"shape {layout[0]}, strides {layout[1]}, storage offset {layout[2]}"


def translate(node) -> tuple[Callable | None, tuple | None, str]:
    """The ember function for an as_strided node, the node arguments it runs on (a tensor up the view chain may
    replace the input), and, where it cannot run (None), why."""
    scatter = _packet(node) == "aten.as_strided_scatter"
    args = dict(zip(("input", "src", "size", "stride", "storage_offset") if scatter
                    else ("input", "size", "stride", "storage_offset"), node.args)) | dict(node.kwargs)
    source = _layout(args["input"])
    size, stride, offset = args["size"], args["stride"], args.get("storage_offset")
    if source is None or not all(isinstance(v, int) for v in (*size, *stride, offset or 0)):
        return None, None, "the graph records no static layout for its input or its size and strides"
    size, stride = tuple(size), tuple(stride)
    offset = source[2] if offset is None else offset
    asked = f"size {size}, strides {stride}, storage offset {offset}"
    wanted = _addresses(size, stride, offset)
    if scatter:
        positions = _positions(source, wanted)
        if positions is None:
            return None, None, (f"it writes {asked} around its input's elements ({_describe(source)})")
        return _scatter_at(positions, size), (args["input"], args["src"]), ""
    if (offset, size) == (source[2], source[0]) and all(n == 1 or a == b for n, a, b in zip(size, stride, source[1])):
        return (lambda x: x), (args["input"],), ""  # the input's own layout: a no-op
    held = args["input"]
    while True:
        layout = _layout(held)
        positions = None if layout is None else _positions(layout, wanted)
        if positions is not None:
            own = np.isin(wanted, _addresses(*source))  # torch's gradient reaches the input's own elements only
            return _gather_at(positions, None if own.all() else own), (held,), ""
        if _packet(held) not in _VIEWS or not hasattr(held.args[0], "meta"):
            return None, None, (f"it reads {asked} from an input of {_describe(source)}: storage that neither the "
                                "input nor a tensor it is a view of holds as its elements")
        held = held.args[0]


def _gather_at(positions: np.ndarray, differentiable: np.ndarray | None) -> Callable:
    """The elements of x at flat `positions`; where `differentiable` is given, the others pass no gradient back."""
    def gather(x):
        index = ember.tensor(positions, device=x.device)
        picked = x.reshape(-1)[index]
        if differentiable is None:
            return picked
        return ember.where(ember.tensor(differentiable, device=x.device), picked, x.detach().reshape(-1)[index])
    return gather


def _scatter_at(positions: np.ndarray, size: tuple[int, ...]) -> Callable:
    def scatter(x, src):
        flat = OPS["aten.scatter.src"](x.reshape(-1), 0, ember.tensor(positions.reshape(-1), device=x.device),
                                       ember.broadcast_to(src, size).reshape(-1))
        return flat.reshape(x.shape)
    return scatter
