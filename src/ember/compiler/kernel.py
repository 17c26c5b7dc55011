"""The kernel IR: a planned kernel as data, between the fusion planner and a target's renderer.

`compiler/lower.py` turns each FusedKernel into a `KernelIR`: functions made of statements over
expression trees. An expression knows the tile axes it varies along (`axes`), so whether a value is
one scalar or a tile, and along which axes of a GEMM tile a load varies, is read off the tree. Index
arithmetic (views, broadcasts, pads, gathers folded into positions) and values are both expressions;
a primitive's computation is a `Prim` that each target renders with the primitive's own lowering
(`RULES[op].lowerings`). Nothing here is the syntax of any target: `compiler/targets/triton.py` renders
it as Triton source.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property

from ember.dtypes import DType
from ember.ir import Node, Op

NO_AXES: frozenset[str] = frozenset()


class Expr:
    """A value inside a kernel. Subclasses are frozen dataclasses, so equal trees hash alike."""

    @property
    def axes(self) -> frozenset[str]:
        """The tile axes this value varies along; none: one scalar for the whole program."""
        return frozenset().union(*(child.axes for child in self.children()))

    def children(self) -> tuple[Expr, ...]:
        return ()

    @property
    def is_tile(self) -> bool:
        return bool(self.axes)


@dataclass(frozen=True)
class Var(Expr):
    """A named value: defined by an Assign, a kernel parameter, or a loop variable."""

    name: str
    varies: frozenset[str] = NO_AXES

    @property
    def axes(self) -> frozenset[str]:
        return self.varies


@dataclass(frozen=True)
class Lit(Expr):
    """A literal: an index (int), or a constant of `dtype` (None: the target's default for the Python type)."""

    value: object
    dtype: DType | None = None


@dataclass(frozen=True)
class Block(Expr):
    """A tile edge: a compile-time block size named `name` (or an expression of one, bracketed: half a GEMM tile's
    columns), laid along tile axis `axis`."""

    name: str
    axis: str


@dataclass(frozen=True)
class Range(Expr):
    """0, 1, ..., block - 1 along position `position` of a tile of `rank` dimensions."""

    block: Block
    position: int = 0
    rank: int = 1

    @property
    def axes(self) -> frozenset[str]:
        return frozenset([self.block.axis])


@dataclass(frozen=True)
class Bin(Expr):
    """a `op` b, with op one of + - * / // % < <= > >= == != & |."""

    op: str
    a: Expr
    b: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.a, self.b)

    @cached_property
    def axes(self) -> frozenset[str]:  # cached: index trees are walked often
        return self.a.axes | self.b.axes


@dataclass(frozen=True)
class Call(Expr):
    """A target-neutral function of the kernel IR (see FUNCTIONS)."""

    fn: str
    args: tuple[Expr, ...] = ()
    shape: tuple[Block | int, ...] | None = None  # "full"/"zeros": the tile shape made
    dtype: DType | None = None  # "full"/"zeros": the element type
    options: tuple[tuple[str, object], ...] = ()  # keyword options (mask=..., axis=..., combine=...)

    def children(self) -> tuple[Expr, ...]:
        return self.args + tuple(v for _, v in self.options if isinstance(v, Expr))

    @cached_property
    def axes(self) -> frozenset[str]:
        if self.fn in ("full", "zeros"):
            made = frozenset(d.axis for d in self.shape if isinstance(d, Block))
            return made | Expr.axes.fget(self)
        if self.fn == "reduce":
            return Expr.axes.fget(self) - {dict(self.options)["drop"]}
        if self.fn == "load":  # a load varies where its address does
            return self.args[0].axes
        return Expr.axes.fget(self)


# The functions a kernel calls, each a target must render. Reductions name a combine ("sum", "prod", "max",
# "min", "argmax", "argmin") and the axis (position and name) they drop.
FUNCTIONS = {
    "program_id": "the program's index along grid axis `axis`",
    "load": "load(address; mask, other): the elements at a pointer plus offsets",
    "store": "store(address, value; mask)",
    "atomic": "atomic(address, value; mask, combine): read-modify-write with sum, max or min, returning the\
 old value",
    "record_index": "record_index(flag, index, out_of_range): where out_of_range holds, mark an index check's\
 flag and keep the index there",
    "where": "where(condition, a, b)",
    "minimum": "the smaller of two indices", "maximum": "the larger of two indices",
    "cdiv": "ceil(a / b) of two sizes",
    "full": "a tile of `shape` filled with a value, of `dtype`", "zeros": "a tile of zeros",
    "cast": "a value converted to `dtype`",
    "exp2": "2 to the power of a float32 value", "log2": "the base-2 logarithm of a float32 value",
    "relu_cast": "a value converted to `dtype` (float16) and clamped from below at 0, NaN kept: max(cast(x), 0)",
    "rand": "Philox uniform floats at (seed, offset)", "randn": "Philox normal floats at (seed, offset)",
    "reduce": "a tile reduced along one axis by a combine (keeping it as size 1)",
    "reduce2": "two tiles (value, position) reduced together along one axis by an arg combine",
    "combine": "two partial results merged by a combine (max, min; argmax, argmin take four values)",
    "dot": "acc + a @ b on the matrix units (option `precision`)",
    "trans": "a 2-d tile transposed",
    "halves": "a 2-d tile's left and right halves of its columns (`shape`: its rows, 2, half its columns)",
}


@dataclass(frozen=True)
class Prim(Expr):
    """A pointwise primitive applied to its operands (each a Var or a Lit), computed in `dtype`."""

    op: Op
    node: Node
    args: tuple[Expr, ...]
    dtype: DType

    def children(self) -> tuple[Expr, ...]:
        return self.args


def call(fn: str, *args: Expr, **options) -> Call:
    assert fn in FUNCTIONS, fn
    shape = options.pop("shape", None)
    dtype = options.pop("dtype", None)
    return Call(fn, args, shape, dtype, tuple(sorted(options.items())))


def lit(value) -> Lit:
    return value if isinstance(value, Expr) else Lit(value)


def add(a: Expr, b: Expr) -> Expr:
    if b == Lit(0):
        return a
    if a == Lit(0):
        return b
    return Bin("+", a, b)


def mul(a: Expr, b: Expr) -> Expr:
    if b == Lit(1):
        return a
    if a == Lit(1):
        return b
    return Bin("*", a, b)


def literal_int(e: Expr) -> int | None:
    """The value of an integer literal index, else None."""
    return e.value if isinstance(e, Lit) and type(e.value) is int else None


# -- statements ------------------------------------------------------------------------------------

@dataclass
class Assign:
    targets: tuple[Var, ...]
    value: Expr


@dataclass
class Effect:
    """A call for its effect (a store, an atomic update)."""

    value: Call


@dataclass
class Loop:
    """for var in range(start, stop, step): body. `prelude` holds values computed once before the loop
    (row-level values a column loop reads), in the order they were needed."""

    var: Var
    start: Expr
    stop: Expr
    step: Expr
    body: list = field(default_factory=list)
    prelude: list = field(default_factory=list)
    stages: int | None = None  # loads kept in flight across iterations (None: the target's default pipelining)


@dataclass
class Branch:
    """if condition: body, else: orelse (a segmented launch's ranges of programs)."""

    condition: Expr
    body: list = field(default_factory=list)
    orelse: list = field(default_factory=list)
    comment: str = ""


class ParamKind(enum.Enum):
    """What a kernel argument is, so the launcher knows what to pass; a function's parameters come in this order."""

    READ = "read"  # a stored node's buffer, read
    WRITE = "write"  # a result's buffer, written
    SCRATCH = "scratch"  # a float32 buffer the runtime keeps with the kernel's launches (one writes, one reads)
    FLAG = "flag"  # the two int64 words of the plan's flags for a CHECK_INDEX node (set, the index)
    DRAWS = "draws"  # the plan's (seed, offset) pairs, int64 in device memory, one pair per random draw
    SIZE = "size"  # a size of the kernel's space (an int)
    SCALAR = "scalar"  # a runtime float constant (its index among the signature's scalars)
    BOUND = "bound"  # a segment's first program (an int)


@dataclass
class Param:
    """One argument of a kernel function, as the launcher must supply it."""

    kind: ParamKind
    value: object  # a Node for READ/WRITE, an int for SIZE/BOUND, an index for SCALAR, "draws" for DRAWS;
    # SCRATCH: (what, elements, ...); FLAG: a CHECK_INDEX node
    name: str
    dtype: DType | None = None  # a scalar's type; without one a Python float reaches the GPU as float32


@dataclass(frozen=True)
class LaunchConfig:
    """One configuration a function's source can be launched with: its compile-time block sizes, its programs,
    warps and pipeline stages (None: the target's default)."""

    constexprs: dict[str, int]
    grid: int
    num_warps: int = 4
    num_stages: int | None = None

    def __str__(self) -> str:
        blocks = " ".join(f"{name}={value}" for name, value in self.constexprs.items())
        stages = f", {self.num_stages} stages" if self.num_stages is not None else ""
        return f"{blocks}, {self.num_warps} warps{stages}"


@dataclass
class Function:
    """One kernel function: parameters, compile-time block sizes, its statements, and its launch."""

    name: str  # what follows the kernel's name: "" for its one function, "_init" and "_scatter" for a scatter's two
    params: list[Param]
    constexprs: dict[str, int]
    body: list
    grid: int
    num_warps: int = 4
    gemm: tuple[int, int, int, int] | None = None  # (batch, M, N, K): grid and blocks come from a tuned config
    layout: str = ""  # a GEMM's operand layouts, as autotune.Problem names them
    precision: str = "ieee"  # a GEMM's dot: "ieee", or "tf32" for float32 tiles on TF32 tensor cores
    splits: int = 1  # a GEMM's programs per output tile, each walking a share of K (grid axis 1)
    num_stages: int | None = None  # loads its loops keep in flight (None: the target's default)
    # configurations the same source serves, the function's own (constexprs, grid, warps, stages) first; with more
    # than one the runtime times them on the function's first run, where `work` (multiply-adds) makes it worth it
    alternatives: tuple[LaunchConfig, ...] = ()
    work: int = 0


@dataclass
class KernelIR:
    """A planned kernel lowered: its functions in launch order, and the header describing what it covers."""

    kind: str
    header: list[str]
    functions: list[Function]
