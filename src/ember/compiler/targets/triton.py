"""The Triton target's renderer: a KernelIR (compiler/kernel.py) becomes one readable source file.

Each function of the kernel IR becomes a `@triton.jit` function; each statement one line with a
named variable; a primitive's computation is its own Triton lowering, declared with the primitive
(`RULES[op].lowerings["triton"]`, ember/ops/pointwise_rules.py). The file starts with a header comment
naming the graph nodes the kernel covers, and is named after a digest of its text, so equal kernels
share one compiled file.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

from ember import dtypes
from ember.compiler.context import CompileContext
from ember.compiler.fused import FusedKernel
from ember.compiler.kernel import (
    Assign,
    Bin,
    Block,
    Branch,
    Call,
    Effect,
    Expr,
    Function,
    KernelIR,
    LaunchConfig,
    Lit,
    Loop,
    Param,
    Prim,
    Range,
    Var,
)
from ember.compiler.lower import lower
from ember.dtypes import DType, compute_dtype
from ember.errors import CompileError
from ember.ir import Node
from ember.ir.ops import RULES

TL = {
    dtypes.bool_: "tl.int1", dtypes.uint8: "tl.uint8", dtypes.int8: "tl.int8", dtypes.int16: "tl.int16",
    dtypes.int32: "tl.int32", dtypes.int64: "tl.int64", dtypes.float16: "tl.float16",
    dtypes.bfloat16: "tl.bfloat16", dtypes.float32: "tl.float32", dtypes.float64: "tl.float64",
}
# Python's binding strength of each operator of the kernel IR: a comparison binds more loosely than & and |
PRECEDENCE = {"<": 1, "<=": 1, ">": 1, ">=": 1, "==": 1, "!=": 1, "|": 2, "&": 4, "+": 6, "-": 6,
              "*": 7, "/": 7, "//": 7, "%": 7}
ATOM = 10
ATOMIC = {"sum": "tl.atomic_add", "max": "tl.atomic_max", "min": "tl.atomic_min"}


@dataclass
class Launch:
    """One generated kernel function and how to launch it."""

    function: str
    args: list[Param]
    constexprs: dict[str, int]
    grid: int
    num_warps: int = 4
    gemm: tuple[int, int, int, int] | None = None  # (batch, M, N, K): the grid and block sizes come from a tuned config
    layout: str = ""  # a GEMM's operand layouts, as autotune.Problem names them
    precision: str = "ieee"  # a GEMM's dot: "ieee", or "tf32" for float32 tiles on TF32 tensor cores
    splits: int = 1  # a GEMM's programs per output tile, each walking a share of K (grid axis 1)
    num_stages: int | None = None  # Triton's software pipelining depth of its loops (None: Triton's default)
    # configurations the source serves, this launch's own first: timed on the first run where `work` is worth it
    alternatives: tuple[LaunchConfig, ...] = ()
    work: int = 0  # multiply-adds of the launch's dots

    def options(self) -> dict:
        """What Triton's launch is given besides the arguments: the constexprs, warps and (where set) stages."""
        stages = {"num_stages": self.num_stages} if self.num_stages is not None else {}
        return dict(self.constexprs, num_warps=self.num_warps, **stages)


@dataclass
class KernelSource:
    text: str
    name: str
    launches: list[Launch] = field(default_factory=list)

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]


@dataclass
class Operands:
    """What a primitive's Triton lowering is given: its operands' expressions (`x`, `y`, `z`), the dtype
    they are computed in (half types in float32), the node, and a way to name a typed constant."""

    names: list[str]
    dtype: DType
    node: Node
    renderer: Renderer

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
        return name if name.isidentifier() else self.renderer.define(f"tl.full([], {name}, {TL[self.dtype]})")


def literal(value, dtype: DType | None) -> str:
    if dtype is dtypes.bool_:
        return "True" if value else "False"  # Triton types these int1, not int32 as it does 1 and 0
    if (dtype is not None and dtype.is_integer) or type(value) is int:
        return str(int(value))
    if math.isnan(value):
        return 'float("nan")'
    if math.isinf(value):
        return 'float("inf")' if value > 0 else 'float("-inf")'
    if value == 0 and math.copysign(1.0, value) < 0:  # Triton makes every zero literal +0.0: negate a tensor zero
        return f"(-tl.full([], 0.0, {TL[dtype or dtypes.float32]}))"
    return repr(float(value))


class Renderer:
    """Renders the statements of one function, line by line."""

    def __init__(self):
        self.lines: list[str] = []
        self.indent = "    "
        self.count = 0

    def line(self, text: str) -> None:
        self.lines.append(self.indent + text)

    def define(self, text: str) -> str:
        """A value a primitive's lowering needs named (a typed constant)."""
        self.count += 1
        name = f"k_{self.count}"
        self.line(f"{name} = {text}")
        return name

    # -- expressions -------------------------------------------------------------------------
    def expr(self, e: Expr) -> str:
        return self._expr(e)[0]

    def _expr(self, e: Expr) -> tuple[str, int]:
        """The text of an expression and how strongly it binds."""
        if isinstance(e, Var):
            return e.name, ATOM
        if isinstance(e, Lit):
            return literal(e.value, e.dtype), ATOM
        if isinstance(e, Block):
            return e.name, ATOM
        if isinstance(e, Range):
            picked = "" if e.rank == 1 else "[:, None]" if e.position == 0 else "[None, :]"
            return f"tl.arange(0, {e.block.name}){picked}", ATOM
        if isinstance(e, Bin):
            strength = PRECEDENCE[e.op]
            left, left_strength = self._expr(e.a)
            right, right_strength = self._expr(e.b)
            # a comparison is never chained, and a // or % on the left is bracketed to read as computed
            unclear = isinstance(e.a, Bin) and e.a.op in ("//", "%", "<", "<=", ">", ">=", "==", "!=")
            if left_strength < strength or (left_strength == strength and unclear):
                left = f"({left})"
            if right_strength <= strength:
                right = f"({right})"
            return f"{left} {e.op} {right}", strength
        if isinstance(e, Call):
            return self.call(e), ATOM
        raise CompileError(f"the Triton renderer cannot inline {type(e).__name__}")

    def call(self, c: Call) -> str:
        fn, args = c.fn, [self.expr(a) for a in c.args]
        options = dict(c.options)
        if fn == "program_id":
            return f"tl.program_id({options['axis']})"
        if fn == "cast":
            text, strength = self._expr(c.args[0])
            return f"{text if strength == ATOM else f'({text})'}.to({TL[c.dtype]})"
        if fn == "relu_cast":
            if c.dtype is not dtypes.float16:
                raise CompileError(f"the Triton renderer has relu_cast to float16 only, not {c.dtype.name}")
            return f"lib.relu_to_f16({args[0]})"
        if fn in ("full", "zeros"):
            shape = ", ".join(d.name if isinstance(d, Block) else str(d) for d in c.shape)
            value = f"{args[0]}, " if fn == "full" else ""
            return f"tl.{fn}([{shape}], {value}{TL[c.dtype]})"
        if fn in ("load", "store", "atomic"):
            masked = ""
            if "mask" in options:
                masked = f", mask={self.expr(options['mask'])}"
                if "other" in options:
                    masked += f", other={self.expr(options['other'])}"
            if "cache" in options:
                masked += f", cache_modifier=\"{options['cache']}\""
            name = ATOMIC[options["combine"]] if fn == "atomic" else f"tl.{fn}"
            return f"{name}({', '.join(args)}{masked})"
        if fn in ("rand", "randn", "record_index"):
            return f"lib.{fn}({', '.join(args)})"
        if fn in ("where", "minimum", "maximum", "cdiv", "exp2", "log2"):
            return f"tl.{fn}({', '.join(args)})"
        if fn == "reduce":
            combine, axis = options["combine"], options["axis"]
            if combine == "sum":
                return f"tl.sum({args[0]}, axis={axis}, keep_dims=True)"
            if combine == "prod" or options.get("nan") == "propagate":
                return f"tl.reduce({args[0]}, {axis}, lib.{combine}_combine, keep_dims=True)"
            return f"tl.{combine}({args[0]}, axis={axis}, keep_dims=True)"
        if fn == "reduce2":
            return f"tl.reduce(({args[0]}, {args[1]}), {options['axis']}, lib.{options['combine']}_combine, " \
                   "keep_dims=True)"
        if fn == "combine":
            return f"lib.{options['combine']}_combine({', '.join(args)})"
        if fn == "trans":
            return f"tl.trans({args[0]})"
        if fn == "halves":  # [rows, 2, half] with the halves last, split there
            shape = ", ".join(d.name if isinstance(d, Block) else str(d) for d in c.shape)
            return f"tl.split(tl.permute(tl.reshape({args[0]}, [{shape}]), (0, 2, 1)))"
        if fn == "dot":
            precision = f", input_precision=\"{options['precision']}\"" if "precision" in options else ""
            return f"tl.dot({', '.join(args)}{precision})"
        raise CompileError(f"the Triton renderer has no form for {fn}")

    def prim(self, p: Prim) -> str:
        """A primitive, by its Triton lowering (declared with the primitive, ember/ops/pointwise_rules.py)."""
        lowering = RULES[p.op].lowerings.get("triton")
        if lowering is None:
            raise CompileError(f"no Triton lowering for {p.op.label}")
        return lowering(Operands([self.expr(a) for a in p.args], p.dtype, p.node, self))

    # -- statements --------------------------------------------------------------------------
    def statements(self, block: list) -> None:
        for s in block:
            self.statement(s)

    def statement(self, s) -> None:
        if isinstance(s, Assign):
            value = self.prim(s.value) if isinstance(s.value, Prim) else self.expr(s.value)
            self.line(f"{', '.join(t.name for t in s.targets)} = {value}")
        elif isinstance(s, Effect):
            self.line(self.call(s.value))
        elif isinstance(s, Loop):
            self.statements(s.prelude)
            bounds = f"{self.expr(s.start)}, {self.expr(s.stop)}, {self.expr(s.step)}"
            if s.stages is None:
                self.line(f"for {s.var.name} in range({bounds}):")
            else:
                self.line(f"for {s.var.name} in tl.range({bounds}, num_stages={s.stages}):")
            self.nested(s.body)
        elif isinstance(s, Branch):
            self.branch(s, "if")
        else:
            raise CompileError(f"the Triton renderer has no form for {type(s).__name__}")

    def branch(self, b: Branch, keyword: str) -> None:
        self.line(f"{keyword} {self.expr(b.condition)}:")
        self.nested(b.body, b.comment)
        if len(b.orelse) == 1 and isinstance(b.orelse[0], Branch):
            self.branch(b.orelse[0], "elif")
        elif b.orelse:
            self.line("else:")
            self.nested(b.orelse)

    def nested(self, block: list, comment: str = "") -> None:
        outer = self.indent
        self.indent += "    "
        if comment:
            self.line(f"# {comment}")
        self.statements(block)
        if not block:
            self.line("pass")
        self.indent = outer


def render_function(function: Function, name: str) -> list[str]:
    params = [f"{p.name}: {TL[p.dtype]}" if p.dtype is not None else p.name for p in function.params]
    params += [f"{k}: tl.constexpr" for k in function.constexprs]
    renderer = Renderer()
    renderer.statements(function.body)
    return ["@triton.jit", f"def {name}{function.name}({', '.join(params)}):"] + renderer.lines + ["", ""]


def render(ir: KernelIR, name: str) -> str:
    lines = [f"# {line}" for line in ir.header]
    lines += ["import triton", "import triton.language as tl", "", "import ember.compiler.targets.triton_lib as lib",
              "", ""]
    for function in ir.functions:
        lines += render_function(function, name)
    return "\n".join(lines) + "\n"


def generate(kernel: FusedKernel, stored: set[int], context: CompileContext) -> KernelSource:
    """The Triton source of a planned kernel: lowered to the kernel IR, then rendered, named by its digest."""
    ir = lower(kernel, stored, context)
    digest = hashlib.sha256(render(ir, "kernel").encode()).hexdigest()[:10]
    name = f"ember_{ir.kind}_{digest}"
    launches = [Launch(name + f.name, f.params, f.constexprs, f.grid, f.num_warps, f.gemm, f.layout, f.precision,
                       f.splits, f.num_stages, f.alternatives, f.work)
                for f in ir.functions]
    return KernelSource(render(ir, name), name, launches)
