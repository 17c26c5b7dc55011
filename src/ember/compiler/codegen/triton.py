"""Triton code generation: one readable `@triton.jit` kernel per FusedKernel.

The generator walks the graph from each output of a kernel and turns every node
into a line of Triton code, evaluated at an *index*: the position, within the
node's own shape, that the element being computed reads. Movement ops never
produce a value of their own; they rewrite the index (a permute swaps names, an
expand pins a dimension to 0, a slice scales and shifts, a pad adds a bound check,
a reshape goes through the linear position). Only stored nodes are loaded.

Sizes are kernel arguments, not literals, so a new batch size reuses the compiled
kernel; float constants that change between steps (a learning rate) and random
seeds are arguments too.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field

from ember import dtypes
from ember.compiler.context import CompileContext
from ember.compiler.fusion import (
    FULL,
    OTHER,
    ROW,
    FusedKernel,
    KernelKind,
    input_level,
    operand_sums,
    summed_operand,
    summed_output,
)
from ember.dtypes import DType
from ember.errors import CompileError
from ember.ir import Kind, Node, Op
from ember.ir.ops import RULES

TL = {
    dtypes.bool_: "tl.int1", dtypes.uint8: "tl.uint8", dtypes.int8: "tl.int8", dtypes.int16: "tl.int16",
    dtypes.int32: "tl.int32", dtypes.int64: "tl.int64", dtypes.float16: "tl.float16",
    dtypes.bfloat16: "tl.bfloat16", dtypes.float32: "tl.float32", dtypes.float64: "tl.float64",
}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
POINTWISE_BLOCK = 1024
ROW_TILE = 4096  # elements of a row kernel's tile; rows longer than this are reduced in a loop
LOOP_CHUNK = 1024  # columns per step of that loop
INT32_LIMIT = 2**31 - 1
GEMM_BLOCK = {"rm": "BLOCK_M", "rn": "BLOCK_N", "ka": "BLOCK_K", "kb": "BLOCK_K"}  # a GEMM tile's axes


def compute_dtype(d: DType) -> DType:
    return dtypes.float32 if d in (dtypes.float16, dtypes.bfloat16) else d


@dataclass
class Operands:
    """What a primitive's Triton lowering is given: its operands' expressions (`x`, `y`, `z`), the dtype
    they are computed in (half types in float32), the node, and a way to name a typed constant."""

    names: list[str]
    dtype: DType
    node: Node
    emitter: Emitter

    @property
    def x(self) -> str:
        return self.names[0]

    @property
    def y(self) -> str:
        return self.names[1]

    @property
    def z(self) -> str:
        return self.names[2]

    @property
    def floating(self) -> bool:
        return self.dtype.is_floating_point

    @staticmethod
    def tl(dtype: DType) -> str:
        """Triton's name of a dtype."""
        return TL[dtype]

    @staticmethod
    def computed(dtype: DType) -> DType:
        """The dtype a value of `dtype` is computed in."""
        return compute_dtype(dtype)

    def typed(self, name: str) -> str:
        """An operand as a value of its dtype: a bare literal is float32 or int32 in Triton, and a library
        function computes in its arguments' dtype (libdevice takes only equal ones)."""
        return name if name.isidentifier() else self.emitter.define(f"tl.full([], {name}, {TL[self.dtype]})")


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass
class Arg:
    """One argument of a generated kernel, as the launcher must supply it."""

    kind: str  # "read", "write", "size", "scalar", "seed", "offset", "bound"
    value: object  # a Node for read/write, an int for size/bound, an index for scalar/seed/offset
    name: str
    annotation: str = ""  # the Triton type of a scalar; without one a Python float reaches the GPU as float32


@dataclass
class Launch:
    """One generated kernel function and how to launch it."""

    function: str
    args: list[Arg]
    constexprs: dict[str, int]
    grid: int
    num_warps: int = 4
    gemm: tuple[int, int, int, int] | None = None  # (batch, M, N, K): the grid and block sizes come from a tuned config
    layout: str = ""  # a GEMM's operand layouts, as autotune.Problem names them
    precision: str = "ieee"  # a GEMM's dot: "ieee", or "tf32" for float32 tiles on TF32 tensor cores


@dataclass
class KernelSource:
    text: str
    name: str
    launches: list[Launch] = field(default_factory=list)

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Index:
    """Where an element sits in a node's shape: per-dimension names and/or the linear position."""

    dims: tuple[str, ...] | None
    linear: str | None
    mask: str | None
    level: str

    def key(self) -> tuple:
        return (self.dims, self.linear if self.dims is None else None, self.mask, self.level)


class Context:
    """State shared by all functions of one source file: arguments and the size table."""

    def __init__(self, stored: set[int], settings: CompileContext):
        self.stored = stored
        self.settings = settings
        self.args: list[Arg] = []
        self.names: dict[tuple, str] = {}

    def arg(self, kind: str, value, prefix: str, annotation: str = "") -> str:
        key = (kind, id(value) if isinstance(value, Node) else value)
        if key not in self.names:
            self.names[key] = f"{prefix}{sum(1 for a in self.args if a.kind == kind)}"
            self.args.append(Arg(kind, value, self.names[key], annotation))
        return self.names[key]

    def size(self, value: int) -> str:
        if value == 1:
            return "1"
        return self.arg("size", value, "n")


class Emitter:
    """Emits the body of one kernel (or one segment of a segmented launch)."""

    def __init__(self, ctx: Context, kernel: FusedKernel, lines: list[str], indent: str, tag: str = ""):
        self.ctx = ctx
        self.kernel = kernel
        self.lines = lines
        self.indent = indent
        self.tag = tag
        self.memo: dict[tuple, tuple[str, DType]] = {}
        self.unravelled: dict[tuple, tuple[str, ...]] = {}
        self.reduced: dict[int, str] = {}
        self.tiles: set[str] = {"rows", "cols", "mask", "rmask", f"offs{tag}", f"mask{tag}"}
        self.loop_at: int | None = None  # where the current column loop starts in `lines`
        self.hoisting = False
        self.hoisted: set[tuple] = set()  # memo keys of values computed before a loop
        self.count = 0
        self.accumulator: str | None = None  # a GEMM epilogue's name for the core's value
        # A GEMM's tiles are 2-d: a mask split by axis lets a load that varies along one axis only (a
        # bias, a per-feature scale) load a row or a column instead of the whole tile.
        self.axes_of: dict[str, frozenset[str]] = {}  # name -> the tile axes ("rm", "ka", ...) it varies along
        self.mask_parts: dict[str, dict[str, str]] = {}  # a 2-d mask -> {axis: that axis's own mask}
        self.big = max([n.numel for n in kernel.covers + kernel.reads + kernel.outputs] + [1]) > INT32_LIMIT

    # -- small helpers -------------------------------------------------------------------
    def line(self, text: str) -> None:
        if self.hoisting:  # a row-level value inside a column loop: compute it once, before the loop
            self.lines.insert(self.loop_at, "    " + text)
            self.loop_at += 1
        else:
            self.lines.append(self.indent + text)

    def fresh(self, stem: str) -> str:
        self.count += 1
        return f"{stem}{self.tag}_{self.count}"

    def define(self, expr: str, stem: str = "v") -> str:
        name = self.fresh(stem)
        self.line(f"{name} = {expr}")
        if self.is_tile(expr):
            self.tiles.add(name)
        if self.axes_of:
            self.axes_of[name] = self.varies_along(expr)
        return name

    def varies_along(self, expr: str) -> frozenset[str]:
        return frozenset().union(*(self.axes_of.get(token, ()) for token in _IDENTIFIER.findall(expr)))

    def load_mask(self, mask: str | None, offset: str) -> str | None:
        """The mask a load at `offset` needs: the parts of a split mask along the axes the offset varies."""
        parts = self.mask_parts.get(mask or "")
        if not parts:
            return mask
        used = [part for axis, part in parts.items() if axis in self.varies_along(offset)]
        return mask if len(used) == len(parts) else " & ".join(used) or None

    def is_tile(self, expr: str) -> bool:
        """Whether an expression varies across the lanes of the block (else it is one scalar)."""
        return any(token in self.tiles for token in _IDENTIFIER.findall(expr))

    def unravel(self, linear: str, shape: tuple[int, ...]) -> tuple[str, ...]:
        key = (linear, shape)
        if key not in self.unravelled:
            dims: list[str] = []
            rest = linear if linear.isidentifier() else f"({linear})"
            for d in range(len(shape) - 1, -1, -1):
                s = shape[d]
                if s == 1:
                    dims.append("0")
                    continue
                if all(x == 1 for x in shape[:d]):
                    dims.append(rest)
                    break
                size = self.ctx.size(s)
                dims.append(self.define(f"{rest} % {size}", "i"))
                rest = self.define(f"{rest} // {size}", "q")
            dims += ["0"] * (len(shape) - len(dims))
            self.unravelled[key] = tuple(reversed(dims))
        return self.unravelled[key]

    def dims(self, idx: Index, shape: tuple[int, ...]) -> tuple[str, ...]:
        return idx.dims if idx.dims is not None else self.unravel(idx.linear, shape)

    def linear(self, idx: Index, shape: tuple[int, ...]) -> str:
        if idx.linear is not None:
            return idx.linear
        terms, stride = [], 1
        for d in range(len(shape) - 1, -1, -1):
            if shape[d] != 1 and idx.dims[d] != "0":
                terms.append(idx.dims[d] if stride == 1 else f"{idx.dims[d]} * {self.ctx.size(stride)}")
            stride *= shape[d]
        if len(terms) > 1:
            return "(" + " + ".join(reversed(terms)) + ")"
        return terms[0] if terms else "0"

    def reshape_dims(self, dims: tuple[str, ...], shape: tuple[int, ...], source: tuple[int, ...]) -> tuple[str, ...]:
        """Per-dimension positions in `source` for positions `dims` in `shape`, group by group.

        A reshape splits or merges runs of dimensions; matching the runs by their products, a
        merge becomes multiply-adds and only a split needs a division (by a run's inner sizes).
        """
        out: list[str] = []
        i = j = 0
        while i < len(shape) or j < len(source):
            a, b = i + 1, j + 1
            left = shape[i] if i < len(shape) else 1
            right = source[j] if j < len(source) else 1
            while left != right:
                if left < right:
                    left *= shape[a]
                    a += 1
                else:
                    right *= source[b]
                    b += 1
            group_dims, group_shape = dims[i:a], shape[i:a]
            target = source[j:b]
            if len(target) == 1:
                out.append(self.linear(Index(group_dims, None, None, OTHER), group_shape))
            elif len(group_dims) == 1:
                out.extend(self.unravel(group_dims[0], target))
            else:
                out.extend(self.unravel(self.linear(Index(group_dims, None, None, OTHER), group_shape), target))
            i, j = a, b
        return tuple(out[:len(source)]) if len(out) >= len(source) else tuple(out) + ("0",) * (len(source) - len(out))

    # -- values ----------------------------------------------------------------------------
    def value(self, node: Node, idx: Index) -> tuple[str, DType]:
        """The name (or literal) of node's value at idx, and the dtype it is computed in."""
        key = (id(node), idx.key())
        if key in self.memo:
            return self.memo[key]
        if idx.level == ROW and self.loop_at is not None and not self.hoisting:
            # nothing below a row-level value depends on the column: hoist it out of the loop
            self.hoisting = True
            try:
                result = self._value(node, idx)
            finally:
                self.hoisting = False
            self.hoisted.add(key)
        else:
            result = self._value(node, idx)
        self.memo[key] = result
        return result

    def _value(self, node: Node, idx: Index) -> tuple[str, DType]:
        kernel = self.kernel
        if node is kernel.core:  # the planner lets an epilogue read it only at the element computed
            if self.accumulator is None:
                raise CompileError(f"kernel {kernel.index}: the matmul's result is read before it is computed")
            return self.accumulator, dtypes.float32
        if node in kernel.reductions:
            if id(node) not in self.reduced:
                raise CompileError(f"kernel {kernel.index}: reduction {node} is read before it is computed")
            return self.reduced[id(node)], compute_dtype(node.dtype)
        if node.op is Op.BUFFER or (id(node) in self.ctx.stored and node not in kernel.outputs):
            return self.load(node, idx)
        op, kind = node.op, node.op.kind
        if kind is Kind.LEAF:
            return self.leaf(node, idx)
        if op is Op.PAD:
            return self.pad(node, idx)
        if kind is Kind.MOVEMENT:
            return self.value(node.inputs[0], self.move(node, idx))
        if op is Op.GATHER:
            return self.gather(node, idx)
        if kind in (Kind.UNARY, Kind.BINARY, Kind.TERNARY):
            args = [self.value(i, Index(idx.dims, idx.linear, idx.mask,
                                        input_level(node, idx.level, kernel.space, kernel.axes, p)))
                    for p, i in enumerate(node.inputs)]
            return self.pointwise(node, args)
        raise CompileError(f"kernel {kernel.index}: {node.op.label} cannot be computed inside a fused kernel")

    def load(self, node: Node, idx: Index) -> tuple[str, DType]:
        """A stored node's value, computed in float32 if it is a half type."""
        pointer = self.ctx.arg("read", node, "in")
        offset = self.linear(idx, node.shape)
        # an offset every lane shares is a scalar load, in bounds by construction
        needed = self.load_mask(idx.mask, offset)
        mask = f", mask={needed}, other=0" if needed and self.is_tile(offset) else ""
        text = f"tl.load({pointer} + {offset}{mask})"
        out = compute_dtype(node.dtype)
        if out is not node.dtype:
            text += f".to({TL[out]})"
        return self.define(text), out

    def operand(self, node: Node, idx: Index, dtype: DType) -> tuple[str, str]:
        """A GEMM operand tile in `dtype` and its layout. A view of a stored value is loaded as it is (so
        the tile goes to the tensor cores unconverted): layout "n" when the tile's column index runs
        along rows in memory, else "t". A prologue ("p") is computed, zeroed outside the mask and cast."""
        rows, cols = idx.dims[-2:]
        view = node
        while view.op in (Op.RESHAPE, Op.PERMUTE, Op.EXPAND, Op.SLICE, Op.FLIP) and id(view) not in self.ctx.stored:
            idx = self.move(view, idx)
            view = view.inputs[0]
        if view.op is Op.BUFFER or id(view) in self.ctx.stored:
            offset = self.linear(idx, view.shape)
            if self.varies_along(offset) != {rows, cols}:  # a size-1 axis: tl.load still needs a tile of pointers
                offset = f"{offset} + tl.zeros([{GEMM_BLOCK[rows]}, {GEMM_BLOCK[cols]}], tl.int32)"
            value = self.define(f"tl.load({self.ctx.arg('read', view, 'in')} + {offset}, mask={idx.mask}, other=0)")
            layout = "t" if idx.dims and idx.dims[-1] not in (cols, "0") else "n"
            return (value if view.dtype is dtype else self.define(f"{value}.to({TL[dtype]})", "x")), layout
        value, _ = self.value(view, idx)
        return self.define(f"tl.where({idx.mask}, {value}, 0).to({TL[dtype]})", "x"), "p"

    def leaf(self, node: Node, idx: Index) -> tuple[str, DType]:
        if node.op is Op.CONST:
            out = compute_dtype(node.dtype)
            if "arg" in node.attrs:
                # typed, so a float64 constant stays float64; tl.full makes a typed scalar of it under the
                # interpreter too, where the argument is a plain Python float
                scalar = self.ctx.arg("scalar", node.attrs["arg"], "c", TL[out])
                return self.define(f"tl.full([], {scalar}, {TL[out]})"), out
            return _literal(node.attrs["value"], node.dtype), out
        if node.op is Op.IOTA:
            position = idx.linear if idx.dims is None else idx.dims[0]
            if _int(position) is not None:  # a fixed position: a literal has no .to()
                return self.define(f"tl.full([], {position}, tl.int64)"), dtypes.int64
            return self.define(f"({position}).to(tl.int64)"), dtypes.int64
        if node.op is Op.RAND:
            k = node.attrs["seed_arg"]
            seed, start = self.ctx.arg("seed", k, "seed"), self.ctx.arg("offset", k, "offset")
            fn = "tl.rand" if node.attrs["distribution"] == "uniform" else "tl.randn"
            return self.define(f"{fn}({seed}, {start} + {self.linear(idx, node.shape)})"), dtypes.float32
        raise CompileError(f"no code for leaf {node.op.label}")

    def move(self, node: Node, idx: Index) -> Index:
        """The index into node's input that node's index reads."""
        op, a = node.op, node.attrs
        source = node.inputs[0].shape
        level = input_level(node, idx.level, self.kernel.space, self.kernel.axes, 0)
        if op is Op.RESHAPE:
            loaded = node.inputs[0].op is Op.BUFFER or id(node.inputs[0]) in self.ctx.stored
            if idx.dims is None or 0 in source or loaded and self.kernel.core is not None:
                # the linear position is the same on both sides of a reshape (empty: no runs to match); a
                # GEMM loading a reshaped buffer uses it rather than regrouping its tile's indices
                return Index(None, self.linear(idx, node.shape), idx.mask, level)
            return Index(self.reshape_dims(idx.dims, node.shape, source), None, idx.mask, level)
        dims = self.dims(idx, node.shape)
        if op is Op.PERMUTE:
            new = [""] * len(dims)
            for i, o in enumerate(a["order"]):
                new[o] = dims[i]
            return Index(tuple(new), None, idx.mask, level)
        if op is Op.EXPAND:
            new = tuple("0" if s == 1 and n != 1 else d for d, s, n in zip(dims, source, node.shape))
            if level == ROW:
                return Index(None, "rows", "rmask", ROW)
            return Index(new, None, idx.mask, level)
        if op is Op.SLICE:
            new = []
            for d, (start, _, step) in zip(dims, a["slices"]):
                term = d if step == 1 else f"{d} * {step}"
                new.append(term if start == 0 else f"({start} + {term})")
            return Index(tuple(new), None, idx.mask, level)
        if op is Op.FLIP:
            new = tuple(f"({self.ctx.size(source[i])} - 1 - {d})" if i in a["axes"] else d
                        for i, d in enumerate(dims))
            return Index(new, None, idx.mask, level)
        raise CompileError(f"no index rule for {op.label}")

    def clamp(self, position: str, size: int) -> str:
        """A position forced into [0, size): the load stays in bounds and a where() picks the real value."""
        return self.define(f"tl.minimum(tl.maximum({position}, 0), {self.ctx.size(size)} - 1)", "c")

    def pad(self, node: Node, idx: Index) -> tuple[str, DType]:
        dims = self.dims(idx, node.shape)
        source = node.inputs[0].shape
        fill = _literal(node.attrs["value"], node.dtype)
        if 0 in source:  # all padding, and no position to clamp a load to
            return fill, compute_dtype(node.dtype)
        inner, checks = [], []
        for d, (lo, hi), s in zip(dims, node.attrs["pads"], source):
            if lo == 0 and hi == 0:
                inner.append(d)
                continue
            if _int(d) is not None:  # a fixed position: decide now whether it falls in the padding
                if not 0 <= _int(d) - lo < s:
                    return fill, compute_dtype(node.dtype)
                inner.append(str(_int(d) - lo))
                continue
            shifted = self.define(f"{d} - {lo}" if lo else d, "p")
            inner.append(self.clamp(shifted, s))
            checks.append(f"({shifted} >= 0) & ({shifted} < {self.ctx.size(s)})")
        level = input_level(node, idx.level, self.kernel.space, self.kernel.axes, 0)
        value, dt = self.value(node.inputs[0], Index(tuple(inner), None, idx.mask, level))
        if not checks:
            return value, dt
        valid = self.define(" & ".join(checks), "ok")
        return self.define(f"tl.where({valid}, {value}, {fill})"), dt

    def gather(self, node: Node, idx: Index) -> tuple[str, DType]:
        source, index = node.inputs
        axis = node.attrs["axis"]
        if source.numel == 0:  # every index is out of range, and no position to clamp a load to
            return "0", compute_dtype(node.dtype)
        level = input_level(node, idx.level, self.kernel.space, self.kernel.axes, 1)
        picked, _ = self.value(index, Index(idx.dims, idx.linear, idx.mask, level))
        size = source.shape[axis]
        valid = self.define(f"({picked} >= 0) & ({picked} < {self.ctx.size(size)})", "ok")
        dims = list(self.dims(idx, node.shape))
        dims[axis] = self.clamp(picked, size)
        source_level = input_level(node, idx.level, self.kernel.space, self.kernel.axes, 0)
        value, dt = self.value(source, Index(tuple(dims), None, idx.mask, source_level))
        return self.define(f"tl.where({valid}, {value}, 0)"), dt

    def pointwise(self, node: Node, args: list[tuple[str, DType]]) -> tuple[str, DType]:
        """A pointwise primitive, by its Triton lowering (declared with the primitive, ember/ops/pointwise.py)."""
        lowering = RULES[node.op].lowerings.get("triton")
        if lowering is None:
            raise CompileError(f"no Triton lowering for {node.op.label}")
        text = lowering(Operands([a for a, _ in args], args[0][1], node, self))
        return self.define(text), compute_dtype(node.dtype)

    # -- stores ------------------------------------------------------------------------------
    def store(self, node: Node, idx: Index, tile: str) -> None:
        value, dt = self.value(node, idx)
        pointer = self.ctx.arg("write", node, "out")
        if not self.is_tile(value):  # a literal or a scalar: give it the tile's shape
            value = f"{value} + tl.zeros({tile}, {TL[dt]})"
        if dt is not node.dtype:
            value = f"({value}).to({TL[node.dtype]})"
        mask = f", mask={idx.mask}" if idx.mask else ""
        offset = self.linear(idx, node.shape)
        # tl.store needs a tile of pointers: an offset that is one scalar (every axis of size 1), or a GEMM's
        # that misses an axis of size 1, is broadcast to the tile
        if not self.is_tile(offset) or (
                self.kernel.core is not None and not {"rm", "rn"} <= set(_IDENTIFIER.findall(offset))):
            offset = f"{offset} + tl.zeros({tile}, tl.int32)"
        self.line(f"tl.store({pointer} + {offset}, {value}{mask})")


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _literal(value, dtype: DType) -> str:
    if dtype is dtypes.bool_:
        return "True" if value else "False"  # Triton types these int1, not int32 as it does 1 and 0
    if dtype.is_integer:
        return str(int(value))
    if math.isnan(value):
        return 'float("nan")'
    if math.isinf(value):
        return 'float("inf")' if value > 0 else 'float("-inf")'
    return repr(float(value))


IDENTITY = {Op.SUM: "0", Op.PROD: "1", Op.MAX: "-inf", Op.MIN: "inf", Op.ARGMAX: "-inf", Op.ARGMIN: "inf"}


def _identity(op: Op, dtype: DType) -> str:
    kind = IDENTITY[op]
    if kind in ("0", "1"):
        return kind
    if dtype.is_floating_point:
        return f'float("{kind}")'
    if dtype is dtypes.bool_:
        return "0" if kind == "-inf" else "1"
    import numpy as np

    info = np.iinfo(dtype.np)
    return str(info.min if kind == "-inf" else info.max)


# -- whole kernels ---------------------------------------------------------------------------

def generate(kernel: FusedKernel, stored: set[int], context: CompileContext) -> KernelSource:
    """The Triton source of a pointwise, reduce, segmented, scatter_add or GEMM kernel."""
    ctx = Context(stored, context)
    body: list[str] = []
    launches: list[Launch] = []
    if kernel.kind is KernelKind.POINTWISE:
        launches.append(_pointwise(ctx, kernel, body, "kernel"))
    elif kernel.kind is KernelKind.SEGMENTED:
        launches.append(_segmented(ctx, kernel, body))
    elif kernel.kind is KernelKind.REDUCE:
        launches.append(_rows(ctx, kernel, body))
    elif kernel.kind is KernelKind.SCATTER_ADD:
        launches.extend(_scatter_add(ctx, kernel, body))
    elif kernel.kind is KernelKind.MATMUL and kernel.core is not None:
        launches.append(_gemm(ctx, kernel, body))
    else:
        raise CompileError(f"no Triton generator for {kernel.kind} kernels")
    header = _header(kernel)
    text = "\n".join(header + ["import triton", "import triton.language as tl", "",
                               "import ember.compiler.codegen.triton_lib as lib", "", ""] + body) + "\n"
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    name = f"ember_{kernel.kind}_{digest}"
    text = text.replace("def kernel", f"def {name}")
    for launch in launches:
        launch.function = launch.function.replace("kernel", name, 1)
    return KernelSource(text, name, launches)


def _header(kernel: FusedKernel) -> list[str]:
    numbering = {id(n): i for i, n in enumerate(kernel.reads + kernel.covers)}
    lines = [f"# ember fused kernel: {kernel.kind} over {list(kernel.space)}"
             + (f" reducing axes {list(kernel.axes)}" if kernel.axes else "")]
    for n in kernel.reads:
        lines.append(f"#   %{numbering[id(n)]} = load {list(n.shape)} {n.dtype.name}")
    for n in kernel.covers:
        args = ", ".join(f"%{numbering[id(i)]}" for i in n.inputs if id(i) in numbering)
        stored = "  -> stored" if n in kernel.outputs else ""
        lines.append(f"#   %{numbering[id(n)]} = {n.op.label}({args}) {list(n.shape)} {n.dtype.name}{stored}")
    return lines


def _signature(ctx: Context, extra: list[str]) -> str:
    order = ("read", "write", "size", "scalar", "seed", "offset", "bound")
    ctx.args.sort(key=lambda a: order.index(a.kind))
    return ", ".join([f"{a.name}: {a.annotation}" if a.annotation else a.name for a in ctx.args] + extra)


def _finish(ctx: Context, body: list[str], name: str, inner: list[str], constexprs: dict[str, int], grid: int,
            num_warps: int) -> Launch:
    params = _signature(ctx, [f"{k}: tl.constexpr" for k in constexprs])
    body += ["@triton.jit", f"def {name}({params}):"] + inner + ["", ""]
    return Launch(name, list(ctx.args), constexprs, grid, num_warps)


def _pointwise_body(ctx: Context, kernel: FusedKernel, inner: list[str], indent: str, tag: str,
                    first_block: str) -> None:
    emitter = Emitter(ctx, kernel, inner, indent, tag)
    numel = math.prod(kernel.space)
    offs, mask = f"offs{tag}", f"mask{tag}"
    start = f"({first_block})" if first_block != "pid" else "pid"
    if emitter.big:
        emitter.line(f"{offs} = {start}.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)")
    else:
        emitter.line(f"{offs} = {start} * BLOCK + tl.arange(0, BLOCK)")
    emitter.line(f"{mask} = {offs} < {ctx.size(numel) if numel != 1 else 1}")
    for out in kernel.outputs:
        emitter.store(out, Index(None, offs, mask, FULL), "[BLOCK]")


def _pointwise(ctx: Context, kernel: FusedKernel, body: list[str], name: str) -> Launch:
    inner = ["    pid = tl.program_id(0)"]
    _pointwise_body(ctx, kernel, inner, "    ", "", "pid")
    grid = -(-math.prod(kernel.space) // POINTWISE_BLOCK)
    return _finish(ctx, body, name, inner, {"BLOCK": POINTWISE_BLOCK}, grid, 4)


def _segmented(ctx: Context, kernel: FusedKernel, body: list[str]) -> Launch:
    """Many independent pointwise kernels in one launch: program ids are split into ranges."""
    inner = ["    pid = tl.program_id(0)"]
    total = 0
    for k, part in enumerate(kernel.segments):
        blocks = -(-math.prod(part.space) // POINTWISE_BLOCK)
        begin = total
        total += blocks
        bound = ctx.arg("bound", total, "end")
        keyword = "if" if k == 0 else "elif"
        inner.append(f"    {keyword} pid < {bound}:")
        inner.append(f"        # segment {k}: {', '.join(o.op.label for o in part.outputs)} over {list(part.space)}")
        first = "pid" if begin == 0 else f"pid - {ctx.arg('bound', begin, 'end')}"
        _pointwise_body(ctx, part, inner, "        ", f"_{k}", first)
    return _finish(ctx, body, "kernel", inner, {"BLOCK": POINTWISE_BLOCK}, total, 4)


def _rows(ctx: Context, kernel: FusedKernel, body: list[str]) -> Launch:
    """A row kernel: each program holds BLOCK_M rows; reductions over the row run in registers."""
    space, axes = kernel.space, kernel.axes
    m, n = kernel.rows, kernel.cols
    kept = [i for i in range(len(space)) if i not in axes]
    trailing = tuple(axes) == tuple(range(len(space) - len(axes), len(space)))
    if trailing:  # rows are contiguous in memory: a program takes few, long rows
        block_n = min(next_pow2(n), ROW_TILE)
        if next_pow2(n) > ROW_TILE:  # a row that does not fit is walked in small chunks (registers)
            block_n = LOOP_CHUNK
        block_m = max(1, min(ROW_TILE // block_n, next_pow2(m), 64)) if block_n != LOOP_CHUNK else 1
    else:  # the kept axes are the contiguous ones: wide along them, so loads coalesce
        block_m = min(next_pow2(m), 128)
        block_n = max(1, min(next_pow2(n), ROW_TILE // block_m))
    persistent = next_pow2(n) <= block_n
    inner: list[str] = []
    emitter = Emitter(ctx, kernel, inner, "    ")
    big = emitter.big
    emitter.line("pid = tl.program_id(0)")
    emitter.line(f"rows = {'pid.to(tl.int64)' if big else 'pid'} * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]")
    emitter.line(f"rmask = rows < {ctx.size(m)}")
    emitter.unravel("rows", tuple(space[i] for i in kept))  # before any loop, so every phase can use it
    n_size = ctx.size(n)

    def full_index(cols: str) -> Index:
        row_dims = emitter.unravel("rows", tuple(space[i] for i in kept))
        col_dims = emitter.unravel(cols, tuple(space[i] for i in axes))
        dims = [""] * len(space)
        for i, d in zip(kept, row_dims):
            dims[i] = d
        for i, d in zip(axes, col_dims):
            dims[i] = d
        linear = f"rows * {n_size} + {cols}" if trailing else None
        return Index(tuple(dims), linear, "mask", FULL)

    def open_chunk(start: str) -> None:
        emitter.line(f"cols = {start} + tl.arange(0, BLOCK_N)[None, :]")
        emitter.line(f"mask = rmask & (cols < {n_size})")

    def open_loop() -> None:
        emitter.line(f"for start in range(0, {n_size}, BLOCK_N):")
        emitter.loop_at = len(inner) - 1
        emitter.indent = "        "
        open_chunk("start")

    def reset() -> None:
        emitter.loop_at = None
        kept_values = {k: v for k, v in emitter.memo.items() if k[0] in emitter.reduced or k in emitter.hoisted}
        emitter.memo = kept_values
        emitter.unravelled = {k: v for k, v in emitter.unravelled.items() if k[0] == "rows"}

    if persistent:
        open_chunk("0")
    for r in kernel.reductions:
        dt = compute_dtype(r.dtype) if r.op not in (Op.ARGMAX, Op.ARGMIN) else compute_dtype(r.inputs[0].dtype)
        acc_dt = dtypes.int32 if dt is dtypes.bool_ else dt
        identity = _identity(r.op, dt)
        acc = emitter.fresh("acc")
        arg = emitter.fresh("arg") if r.op in (Op.ARGMAX, Op.ARGMIN) else None
        emitter.line(f"{acc} = tl.full([BLOCK_M, 1], {identity}, {TL[acc_dt]})")
        emitter.tiles.add(acc)
        if arg:
            emitter.line(f"{arg} = tl.zeros([BLOCK_M, 1], tl.int64)")
            emitter.tiles.add(arg)
        if not persistent:
            open_loop()
        value, _ = emitter.value(r.inputs[0], full_index("cols"))
        tile = emitter.define(f"tl.where(mask, {value} + tl.zeros([BLOCK_M, BLOCK_N], {TL[acc_dt]}), {identity})",
                              "t")
        if r.op is Op.SUM:
            emitter.line(f"{acc} = {acc} + tl.sum({tile}, axis=1, keep_dims=True)")
        elif r.op is Op.PROD:
            emitter.line(f"{acc} = {acc} * tl.reduce({tile}, 1, lib.prod_combine, keep_dims=True)")
        elif r.op in (Op.MAX, Op.MIN):
            combine = "lib.max_combine" if r.op is Op.MAX else "lib.min_combine"
            emitter.line(f"{acc} = {combine}({acc}, tl.reduce({tile}, 1, {combine}, keep_dims=True))")
        else:  # the chunk's best (value, column), then the best of it and the rows' best so far
            combine = "lib.argmax_combine" if r.op is Op.ARGMAX else "lib.argmin_combine"
            columns = emitter.define("cols + tl.zeros([BLOCK_M, BLOCK_N], tl.int32)", "j")
            best, where = emitter.fresh("b"), emitter.fresh("w")
            emitter.line(f"{best}, {where} = tl.reduce(({tile}, {columns}), 1, {combine}, keep_dims=True)")
            emitter.line(f"{acc}, {arg} = {combine}({acc}, {arg}, {best}, {where}.to(tl.int64))")
        emitter.indent = "    "
        result = arg if arg else acc
        if acc_dt is not dt and not arg:  # a bool max or min, accumulated in int32
            result = emitter.define(f"{acc} != 0")
        emitter.reduced[id(r)] = result
        if not persistent:
            reset()
    full_outputs = [o for o in kernel.outputs if kernel.levels[id(o)] == FULL]
    row_outputs = [o for o in kernel.outputs if kernel.levels[id(o)] == ROW]
    if full_outputs:
        if not persistent:
            open_loop()
        for o in full_outputs:
            emitter.store(o, full_index("cols"), "[BLOCK_M, BLOCK_N]")
        emitter.indent = "    "
        if not persistent:
            reset()
    for o in row_outputs:
        emitter.store(o, Index(None, "rows", "rmask", ROW), "[BLOCK_M, 1]")
    grid = -(-m // block_m)
    warps = 4 if block_m * block_n <= 2048 else 8
    return _finish(ctx, body, "kernel", inner, {"BLOCK_M": block_m, "BLOCK_N": block_n}, grid, warps)


def _scatter_add(ctx: Context, kernel: FusedKernel, body: list[str]) -> list[Launch]:
    """Copy the base into the output, then add each source element at its index atomically."""
    node = kernel.outputs[0]
    base, index, src = node.inputs
    axis = node.attrs["axis"]
    init = FusedKernel(KernelKind.POINTWISE, node.shape, (), [node], {id(node): FULL}, covers=kernel.covers,
                       reads=kernel.reads)
    init_ctx = Context(ctx.stored, ctx.settings)
    # the first launch writes the base (its cone inlined) into the output
    copy_body: list[str] = ["    pid = tl.program_id(0)"]
    emitter = Emitter(init_ctx, init, copy_body, "    ", "")
    emitter.line("offs = pid * BLOCK + tl.arange(0, BLOCK)")
    emitter.line(f"mask = offs < {init_ctx.size(node.numel)}")
    value, dt = emitter.value(base, Index(None, "offs", "mask", OTHER))
    pointer = init_ctx.arg("write", node, "out")
    emitter.line(f"tl.store({pointer} + offs, ({value} + tl.zeros([BLOCK], {TL[dt]})).to({TL[node.dtype]}), "
                 "mask=mask)")
    first = _finish(init_ctx, body, "kernel_init", copy_body, {"BLOCK": POINTWISE_BLOCK},
                    -(-node.numel // POINTWISE_BLOCK), 4)
    inner: list[str] = ["    pid = tl.program_id(0)"]
    emitter = Emitter(ctx, init, inner, "    ", "")
    emitter.line("offs = pid * BLOCK + tl.arange(0, BLOCK)")
    emitter.line(f"mask = offs < {ctx.size(index.numel)}")
    at = Index(None, "offs", "mask", OTHER)
    picked, _ = emitter.value(index, at)
    addend, _ = emitter.value(src, at)
    dims = list(emitter.dims(at, index.shape))
    size = ctx.size(node.shape[axis])
    emitter.line(f"valid = ({picked} >= 0) & ({picked} < {size})")
    dims[axis] = emitter.clamp(picked, node.shape[axis])
    target = emitter.linear(Index(tuple(dims), None, "mask", OTHER), node.shape)
    pointer = ctx.arg("write", node, "out")
    # an index out of range adds nothing (at a clamped address, so the access stays in bounds)
    emitter.line(f"tl.atomic_add({pointer} + {target}, tl.where(valid, {addend}, 0).to({TL[node.dtype]}), "
                 "mask=mask)")
    second = _finish(ctx, body, "kernel_scatter", inner, {"BLOCK": POINTWISE_BLOCK},
                     -(-index.numel // POINTWISE_BLOCK), 4)
    return [first, second]



def _gemm(ctx: Context, kernel: FusedKernel, body: list[str]) -> Launch:
    """A tiled GEMM over the core's output: each program computes a BLOCK_M x BLOCK_N tile, walking K
    in BLOCK_K steps; operand tiles come through the mainloop (prologue), the accumulator through
    the epilogue. Tiles are visited in groups of GROUP_M rows, so neighbouring programs share the
    operand tiles they load while those are still in L2."""
    core = kernel.core
    a, b = core.inputs
    *batch, m, n = core.shape
    k = a.shape[-1]
    inner: list[str] = []
    mainloop = Emitter(ctx, kernel, inner, "    ")
    M, N, K = ctx.size(m), ctx.size(n), ctx.size(k)
    wide = ".to(tl.int64)" if mainloop.big else ""
    mainloop.line("pid = tl.program_id(0)")
    mainloop.line(f"tiles_m = tl.cdiv({M}, BLOCK_M)")
    mainloop.line(f"tiles_n = tl.cdiv({N}, BLOCK_N)")
    mainloop.line("group_size = GROUP_M * tiles_n")
    mainloop.line("first_m = (pid // group_size) * GROUP_M")
    mainloop.line("group_rows = tl.minimum(tiles_m - first_m, GROUP_M)")
    mainloop.line("pid_m = first_m + (pid % group_size) % group_rows")
    mainloop.line("pid_n = (pid % group_size) // group_rows")
    mainloop.line(f"rm = pid_m{wide} * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]")
    mainloop.line(f"rn = pid_n{wide} * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]")
    batch_dims: tuple[str, ...] = ()
    if batch:
        mainloop.line(f"batch = tl.program_id(1){wide}")
        batch_dims = mainloop.unravel("batch", tuple(batch))
    tiles = {"rm", "rn", "ka", "kb", "mask_a", "mask_b", "mask", "acc", "mask_m", "mask_n", "mask_ka", "mask_kb"}
    mainloop.tiles |= tiles
    axes = {name: frozenset([name]) for name in ("rm", "rn", "ka", "kb")}
    masks = {"mask_a": {"rm": "mask_m", "ka": "mask_ka"}, "mask_b": {"kb": "mask_kb", "rn": "mask_n"},
             "mask": {"rm": "mask_m", "rn": "mask_n"}}
    mainloop.axes_of.update(axes)
    mainloop.axes_of.update({name: frozenset(parts) for name, parts in masks.items()})
    mainloop.mask_parts = masks
    mainloop.line(f"mask_m = rm < {M}")
    mainloop.line(f"mask_n = rn < {N}")
    mainloop.line("acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)")
    summed = {id(r): summed_operand(core, r) for r in operand_sums(kernel)}  # operands summed along K on the way
    sums = {key: mainloop.define(f"tl.zeros([{'BLOCK_M, 1' if position == 0 else '1, BLOCK_N'}], tl.float32)", "sum")
            for key, position in summed.items()}
    before_loop = dict(mainloop.unravelled)  # names defined inside the loop are out of scope after it
    mainloop.line(f"for start in range(0, {K}, BLOCK_K):")
    mainloop.indent = "        "
    mainloop.line("ka = start + tl.arange(0, BLOCK_K)[None, :]")
    mainloop.line("kb = start + tl.arange(0, BLOCK_K)[:, None]")
    mainloop.line(f"mask_ka = ka < {K}")
    mainloop.line(f"mask_kb = kb < {K}")
    mainloop.line("mask_a = mask_m & mask_ka")
    mainloop.line("mask_b = mask_kb & mask_n")
    tile_a, layout_a = mainloop.operand(a, Index((*batch_dims, "rm", "ka"), None, "mask_a", OTHER), core.dtype)
    tile_b, layout_b = mainloop.operand(b, Index((*batch_dims, "kb", "rn"), None, "mask_b", OTHER), core.dtype)
    dot = ctx.settings.dot_precision(core.dtype)
    precision = f", input_precision=\"{dot}\"" if core.dtype is dtypes.float32 else ""
    mainloop.line(f"acc = tl.dot({tile_a}, {tile_b}, acc{precision})")
    for key, position in summed.items():
        axis, tile = (1, tile_a) if position == 0 else (0, tile_b)
        mainloop.line(f"{sums[key]} += tl.sum({tile}.to(tl.float32), axis={axis}, keep_dims=True)")
    epilogue = Emitter(ctx, kernel, inner, "    ")
    epilogue.tiles |= tiles | set(sums.values()) | set(mainloop.tiles)
    epilogue.count = mainloop.count
    epilogue.unravelled = before_loop
    epilogue.accumulator = "acc"
    epilogue.axes_of = dict(mainloop.axes_of)
    epilogue.mask_parts = masks
    for o in kernel.outputs:  # one row of programs stores what every row of them summed
        r = summed_output(kernel, o)
        if r is None or id(r) not in summed:
            continue
        first = "pid_n == 0" if summed[id(r)] == 0 else "pid_m == 0"
        position, bound = ("rm", M) if summed[id(r)] == 0 else ("rn", N)
        pointer = ctx.arg("write", o, "out")  # a reshape of the sum: the same positions
        epilogue.line(f"tl.store({pointer} + {position}, {sums[id(r)]}.to({TL[o.dtype]}), "
                      f"mask=({position} < {bound}) & ({first}))")
    epilogue.line("mask = mask_m & mask_n")
    for o in kernel.outputs:
        if summed_output(kernel, o) is None:
            epilogue.store(o, _epilogue_index(epilogue, core, o.shape, batch_dims), "[BLOCK_M, BLOCK_N]")
    _epilogue_reductions(ctx, kernel, epilogue, batch_dims, [r for r in kernel.reductions if id(r) not in summed])
    launch = _finish(ctx, body, "kernel", inner, {"BLOCK_M": 0, "BLOCK_N": 0, "BLOCK_K": 0, "GROUP_M": 0}, 0, 4)
    launch.gemm = (math.prod(batch), m, n, k)
    launch.layout = layout_a + layout_b
    launch.precision = dot
    return launch


def _epilogue_index(emitter: Emitter, core: Node, shape: tuple[int, ...], batch_dims: tuple[str, ...]) -> Index:
    """Where the tile's elements sit in an output of the epilogue: the core's shape, or a reshape of it
    (the planner checked that element i of one is element i of the other)."""
    *batch, m, n = core.shape
    if shape == core.shape:
        return Index((*batch_dims, "rm", "rn"), None, "mask", FULL)
    if not batch and shape and shape[-1] == n:  # rows regrouped: one division per row, not per element
        return Index((*emitter.unravel("rm", shape[:-1]), "rn"), None, "mask", FULL)
    linear = emitter.linear(Index((*batch_dims, "rm", "rn"), None, "mask", FULL), core.shape)
    return Index(None, linear, "mask", FULL)


ATOMIC = {Op.SUM: "tl.atomic_add", Op.MAX: "tl.atomic_max", Op.MIN: "tl.atomic_min"}


def _epilogue_reductions(ctx: Context, kernel: FusedKernel, epilogue: Emitter, batch_dims: tuple[str, ...],
                         reductions: list[Node]) -> None:
    """Rows or columns of an epilogue value reduced across tiles: each program reduces its tile and
    combines the result atomically into the output, which the runtime fills with the identity first."""
    at = Index((*batch_dims, "rm", "rn"), None, "mask", FULL)
    for r in reductions:
        (axis,) = r.attrs["axes"]
        value, dt = epilogue.value(r.inputs[0], at)
        identity = _identity(r.op, dt)
        tile = epilogue.define(f"tl.where(mask, {value} + tl.zeros([BLOCK_M, BLOCK_N], {TL[dt]}), {identity})", "t")
        combine = "tl.sum" if r.op is Op.SUM else "tl.max" if r.op is Op.MAX else "tl.min"
        part = epilogue.define(f"{combine}({tile}, axis={axis}, keep_dims=True)", "part")
        position, keep = ("rm", "mask_m") if axis == 1 else ("rn", "mask_n")
        for o in kernel.outputs:
            if summed_output(kernel, o) is r:
                pointer = ctx.arg("write", o, "out")
                epilogue.line(f"{ATOMIC[r.op]}({pointer} + {position}, {part}, mask={keep})")


def epilogue_reduction_outputs(kernel: FusedKernel) -> list[tuple[Node, Op]]:
    """The outputs a GEMM kernel reduces into atomically, with their reductions: the runtime fills them
    with the reduction's identity before each launch."""
    sums = operand_sums(kernel)
    return [(o, r.op) for o in kernel.outputs if (r := summed_output(kernel, o)) is not None and r not in sums]
