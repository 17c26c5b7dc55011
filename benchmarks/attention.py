"""Attention benchmark: attention alone, forward and forward + backward, in TFLOP/s and peak memory, ember against
torch's SDPA backends, torch.compile and FlexAttention, every variant's result checked against torch.

Rows are (T, head dim, causal or not), bfloat16 inputs (B, H, T, D) of B * T = 16k tokens and H * D = 1024 (16
heads of 64, 8 of 128), named like "4k.d64.causal". Variants:

 torch SDPA flash / efficient / cudnn   F.scaled_dot_product_attention under torch.nn.attention.sdpa_kernel with
                                        that one backend (skipped where it has no kernel for the inputs)
 torch.compile manual                   torch.compile of the attention written out (manual below)
 FlexAttention                          torch.compile(flex_attention), with a causal BlockMask for causal rows
 ember SDPA lazy / ember SDPA jit       ember.nn.functional.scaled_dot_product_attention as written, and under
                                        ember.jit (replayed)
 ember manual jit                       the attention written out, under ember.jit

manual: softmax((q @ kᵀ) * scale, masked_fill(not causal, -inf)) @ v, the T x T scores in memory.

FLOPs: forward 4 * B * H * T * T * D (two GEMMs), half of it for causal rows; forward + backward 3.5 times the
forward (the backward's five GEMMs, 2.5 times the forward's). A time is the median of steps timed one at a time
from the call until the GPU is done; "fwd" runs without autograd, "fwd+bwd" computes the output and the gradients
of q, k and v for a fixed upstream gradient. Peak memory is torch.cuda.max_memory_allocated during one step, less
what was allocated before the variant was made (ember allocates through torch; an ember.jit step's recorded buffers
count). Every variant's output and gradients are checked against torch's SDPA in float32 on the same bfloat16
inputs (relative error in the Frobenius norm, the largest of the four).

torch.compile and FlexAttention are compiled once per run with dynamic=True (sizes as runtime values), as a program
that meets many sizes would, so that a run compiles each once per causal flag and autograd mode rather than per row.
The variants not yet run when --budget seconds (330) have passed are left out, and the table says so.

    python benchmarks/attention.py                           # full size on a CUDA GPU, appended to RESULTS.md
    python benchmarks/attention.py --quick --skip FlexAttention
    python benchmarks/attention.py --rows 16k.d128,16k.d128.causal
    EMBER_INTERPRET=1 python benchmarks/attention.py --cpu-smoke   # no GPU: tiny sizes, every code path
"""

from __future__ import annotations

import gc
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as TF
from common import (
    environment,
    markdown_table,
    median_ms,
    parse_options,
    publish,
    rel_error,
    release_memory,
    to_ember,
    to_torch,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

import ember
import ember.nn.functional as EF

# (sequence lengths, head dims, tokens per step B * T, model width H * D) at (full, --quick, --cpu-smoke)
SIZES = (((1024, 4096, 8192, 16384), (64, 128), 16384, 1024),
         ((1024, 4096), (64,), 8192, 1024),
         ((16, 32), (16,), 64, 32))
VARIANTS = ("torch SDPA flash", "torch SDPA efficient", "torch SDPA cudnn", "torch.compile manual", "FlexAttention",
            "ember SDPA lazy", "ember SDPA jit", "ember manual jit")
BACKENDS = {"torch SDPA flash": SDPBackend.FLASH_ATTENTION, "torch SDPA efficient": SDPBackend.EFFICIENT_ATTENTION,
            "torch SDPA cudnn": SDPBackend.CUDNN_ATTENTION}
TOL = 2e-2  # bound on ||variant - torch float32|| / ||torch float32||, bfloat16 inputs
MAX_CALLS_TO_REPLAY = 10  # calls a fresh ember.jit function gets to start replaying (it needs 3)


@dataclass
class Case:
    row: str
    name: str
    shape: str
    causal: bool
    flops: float  # of the forward; the forward + backward does 3.5 times as many
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    upstream: torch.Tensor  # the gradient of the output, for every variant's backward
    reference: list[torch.Tensor] = field(default_factory=list)  # torch float32: out, dq, dk, dv


@dataclass
class Variant:
    """A variant's two steps on a case's inputs; each returns torch tensors: the output, and for `train` the
    gradients of q, k and v after it."""

    forward: Callable[[], torch.Tensor]
    train: Callable[[], tuple[torch.Tensor, ...]]


@dataclass
class Line:
    row: str
    variant: str
    fwd_ms: float | None = None
    train_ms: float | None = None
    fwd_peak: float | None = None  # GiB
    train_peak: float | None = None
    err: float | None = None
    missing: dict[str, str] = field(default_factory=dict)  # a measurement left out: why

    def why_missing(self) -> str:
        reasons = set(self.missing.values())
        if len(reasons) == 1 and len(self.missing) > 1:  # the same reason for all: once
            return reasons.pop()
        return "; ".join(f"{what}: {why}" if what else why for what, why in self.missing.items()) or "-"


def manual(lib, q, k, v, causal: bool):
    """Attention written out, for torch and ember alike: the T x T scores in memory."""
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        t = q.shape[-2]
        scores = scores.masked_fill(~lib.tril(lib.ones(t, t, dtype=lib.bool, device=q.device)), float("-inf"))
    return lib.nn.functional.softmax(scores, dim=-1) @ v


def cases(which: int, dev: str) -> list[tuple[str, Callable[[], Case]]]:
    lengths, dims, tokens, width = SIZES[which]

    def make(t: int, d: int, causal: bool, row: str) -> Case:
        b, h = max(tokens // t, 1), width // d
        q, k, v, upstream = (torch.randn(b, h, t, d, device=dev, dtype=torch.bfloat16) for _ in range(4))
        flops = 4 * b * h * t * t * d / (2 if causal else 1)
        name = "causal" if causal else "full"
        return Case(row, name, f"B {b} H {h} T {t} D {d}", causal, flops, q, k, v, upstream)

    made = []
    for t in lengths:
        for d in dims:
            for causal in (False, True):
                row = f"{t // 1024}k" if t >= 1024 else str(t)
                row += f".d{d}" + (".causal" if causal else "")
                made.append((row, lambda t=t, d=d, causal=causal, row=row: make(t, d, causal, row)))
    return made


def torch_variant(case: Case, attend: Callable) -> Variant:
    """A variant of `attend(q, k, v)` on torch tensors: forward without autograd, gradients by autograd.grad."""
    leaves = [t.detach().requires_grad_() for t in (case.q, case.k, case.v)]

    def forward():
        with torch.no_grad():
            return attend(case.q, case.k, case.v)

    def train():
        out = attend(*leaves)
        return (out, *torch.autograd.grad(out, leaves, case.upstream))

    return Variant(forward, train)


def sdpa_backend(case: Case, backend: SDPBackend) -> Variant:
    def attend(q, k, v):
        with sdpa_kernel(backend):
            return TF.scaled_dot_product_attention(q, k, v, is_causal=case.causal)
    return torch_variant(case, attend)


def compile_options(cpu: bool) -> dict:
    """torch.compile's options: sizes as runtime values (dynamic=True), so that a run compiles each function once
    per causal flag and autograd mode, not once per row; under --cpu-smoke, tracing only (backend="eager")."""
    return {"backend": "eager"} if cpu else {"dynamic": True}


def compiled_manual(case: Case, compiled: dict, cpu: bool) -> Variant:
    """torch.compile of the written-out attention, one compiled function per run (`compiled` holds it)."""
    if "manual" not in compiled:
        compiled["manual"] = torch.compile(lambda q, k, v, causal: manual(torch, q, k, v, causal),
                                           **compile_options(cpu))
    fn = compiled["manual"]
    return torch_variant(case, lambda q, k, v: fn(q, k, v, case.causal))


def flex(case: Case, compiled: dict, cpu: bool) -> Variant:
    """FlexAttention, compiled once per run, with a causal BlockMask for causal rows (none otherwise)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "flex" not in compiled:
        compiled["flex"] = torch.compile(flex_attention, **compile_options(cpu))
    fn, t = compiled["flex"], case.q.shape[-2]
    mask = None
    if case.causal:
        block = min(128, t)  # the default block; a tiny --cpu-smoke row is one block
        mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, t, t, device=case.q.device.type,
                                 BLOCK_SIZE=block)
    return torch_variant(case, lambda q, k, v: fn(q, k, v, block_mask=mask))


def ember_variant(case: Case, attend: Callable, jit: bool) -> Variant:
    """`attend(q, k, v)` on ember tensors that share the case's buffers: as written (lazy) or under ember.jit (each
    step a fresh jit function, called until it replays). A training step clears the leaves' .grad, runs forward and
    backward and returns the output; the gradients are read from .grad, which a replay rewrites in place."""
    inputs = [to_ember(t) for t in (case.q, case.k, case.v)]
    leaves = [to_ember(t, requires_grad=True) for t in (case.q, case.k, case.v)]
    upstream = to_ember(case.upstream)

    def forward_step(q, k, v):
        with ember.no_grad():
            return attend(q, k, v)

    def train_step(q, k, v, grad):
        for leaf in (q, k, v):
            leaf.grad = None
        out = attend(q, k, v)
        out.backward(grad)
        return out

    if jit:
        forward_step, train_step = replaying(ember.jit(forward_step), inputs), replaying(ember.jit(train_step),
                                                                                         [*leaves, upstream])

    def forward():
        out = forward_step(*inputs)
        return to_torch(out.realize())

    def train():
        out = train_step(*leaves, upstream)
        grads = [leaf.grad for leaf in leaves]
        ember.realize(out, *grads)
        return tuple(to_torch(t) for t in (out, *grads))

    return Variant(forward, train)


def replaying(step, args: list[ember.Tensor]) -> Callable:
    """An ember.jit function, called on `args` until it replays its recording (its first calls run as written and
    record), so that the timed calls are replays; raises where it does not replay."""
    for _ in range(MAX_CALLS_TO_REPLAY):
        if step.stats["replays"]:
            return step
        ember.realize(step(*args))
    why = "; ".join(getattr(step, "why_not_replayed", None) or []) or "no reason given"
    raise RuntimeError(f"ember.jit does not replay after {step.stats['calls']} calls ({why})")


def makers(case: Case, compiled: dict, cpu: bool) -> dict[str, Callable[[], Variant]]:
    causal = case.causal
    sdpa = lambda q, k, v: EF.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    written = lambda q, k, v: manual(ember, q, k, v, causal)  # noqa: E731
    return {**{name: lambda backend=backend: sdpa_backend(case, backend) for name, backend in BACKENDS.items()},
            "torch.compile manual": lambda: compiled_manual(case, compiled, cpu),
            "FlexAttention": lambda: flex(case, compiled, cpu),
            "ember SDPA lazy": lambda: ember_variant(case, sdpa, jit=False),
            "ember SDPA jit": lambda: ember_variant(case, sdpa, jit=True),
            "ember manual jit": lambda: ember_variant(case, written, jit=True)}


def reference(case: Case) -> list[torch.Tensor]:
    """torch's SDPA in float32 on the case's bfloat16 inputs: output and gradients."""
    wide = [t.detach().float().requires_grad_() for t in (case.q, case.k, case.v)]
    out = TF.scaled_dot_product_attention(*wide, is_causal=case.causal)
    return [out.detach(), *torch.autograd.grad(out, wide, case.upstream.float())]


def why_skipped(error: Exception) -> str:
    """A short reason for a table cell; the whole message goes to stderr."""
    print(f"    {type(error).__name__}: {str(error)[:500]}", file=sys.stderr)
    text = str(error)
    if isinstance(error, (torch.OutOfMemoryError, ember.OutOfMemoryError)) or "out of memory" in text.lower():
        return "out of memory"
    if "No available kernel" in text or "No viable backend" in text:
        return "no kernel for these inputs"
    if "does not support backward" in text:
        return "no backward on this device"
    return f"{type(error).__name__}: {text.splitlines()[0][:60] if text else ''}"


def attempt(line: Line, what: str, fn: Callable):
    """Run `fn`; on failure note why in the line and return None (and free what the failure left)."""
    try:
        return fn()
    except Exception as e:  # a variant that cannot run must not stop the others
        line.missing[what] = why_skipped(e)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None


def peak_gib(step: Callable[[], object], before: int, cpu: bool) -> float | None:
    """torch.cuda.max_memory_allocated during one call of `step`, less `before` (None without a GPU)."""
    if cpu:
        step()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def measure(case: Case, name: str, make: Callable[[], Variant], args) -> Line:
    cpu, line = args.cpu_smoke, Line(case.row, name)
    print(f"  {name}", flush=True)
    before = 0 if cpu else torch.cuda.memory_allocated()
    variant = attempt(line, "setup", make)
    if variant is None:
        return line
    outputs = attempt(line, "fwd+bwd", variant.train)  # the first call: compiles, and is checked
    if outputs is not None:
        line.err = max(rel_error(out, ref) for out, ref in zip(outputs, case.reference))
        del outputs
        line.train_ms = attempt(line, "fwd+bwd", lambda: median_ms(variant.train, args.warmup, args.reps, cpu))
        if line.train_ms is not None:
            line.train_peak = attempt(line, "fwd+bwd peak", lambda: peak_gib(variant.train, before, cpu))
    if attempt(line, "fwd", variant.forward) is not None:
        line.fwd_ms = attempt(line, "fwd", lambda: median_ms(variant.forward, args.warmup, args.reps, cpu))
        if line.fwd_ms is not None:
            line.fwd_peak = attempt(line, "fwd peak", lambda: peak_gib(variant.forward, before, cpu))
    return line


def tflops(flops: float, ms: float | None) -> str:
    return "-" if ms is None else f"{flops / ms / 1e9:.1f}"


def cells(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def check(line: Line) -> str:
    return "-" if line.err is None else f"{line.err:.1e}" + ("" if line.err <= TOL else " FAIL")


def table(lines: list[Line], flops: dict[str, float]) -> str:
    head = ["row", "variant", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd TFLOP/s", "peak GiB fwd",
            "peak GiB fwd+bwd", "rel err", "why missing"]
    body = [[line.row, line.variant, cells(line.fwd_ms, "{:.4g}"), tflops(flops[line.row], line.fwd_ms),
             cells(line.train_ms, "{:.4g}"), tflops(3.5 * flops[line.row], line.train_ms),
             cells(line.fwd_peak, "{:.3g}"), cells(line.train_peak, "{:.3g}"), check(line), line.why_missing()]
            for line in lines]
    return markdown_table(head, body)


def pivot(lines: list[Line], rows: list[str], value: Callable[[Line], str], corner: str) -> str:
    """One line per variant, one column per row: `value` of each measurement."""
    by = {(line.variant, line.row): line for line in lines}
    variants = list(dict.fromkeys(line.variant for line in lines))
    body = [[variant, *[value(by[variant, row]) if (variant, row) in by else "-" for row in rows]]
            for variant in variants]
    return markdown_table([corner, *rows], body)


def main(argv: list[str] | None = None) -> None:
    def options(parser):
        parser.add_argument("--skip", default="", help=f"variants to leave out, comma-separated, of {VARIANTS}")
        parser.add_argument("--budget", type=float, default=330.0,
                            help="seconds after which the variants not yet run are left out (default 330)")

    opts = parse_options(argv, "attention.py", __doc__, cases, rows_example="1k.d64,16k.d128.causal",
                         warmup_help="warm-up steps per variant (default 3)", add_options=options)
    args = opts.args
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if skip - set(VARIANTS):
        raise SystemExit(f"--skip: no variant {sorted(skip - set(VARIANTS))}; variants are {VARIANTS}")
    if not args.cpu_smoke:
        args.reps = min(args.reps, 10)  # a step is milliseconds long: 10 timed steps are enough, and fit the budget
    ember.manual_seed(0)
    compiled: dict = {}  # torch.compile's functions, kept across rows as a program keeps them
    lines: list[Line] = []
    flops: dict[str, float] = {}
    shapes: dict[str, str] = {}
    start, over = time.perf_counter(), []
    for row, make in opts.cases:
        if row not in opts.selected:
            continue
        case = make()
        print(f"row {row}: {case.shape}, {case.name} ({time.perf_counter() - start:.0f} s into the run)", flush=True)
        flops[row], shapes[row] = case.flops, case.shape
        case.reference = reference(case)
        for name, variant in makers(case, compiled, args.cpu_smoke).items():
            if name in skip:
                continue
            if time.perf_counter() - start > args.budget:
                over.append(f"{row} {name}")
                lines.append(Line(row, name, missing={"": f"over the run's {args.budget:.0f} s budget"}))
                continue
            lines.append(measure(case, name, variant, args))
            gc.collect()
        del case
        gc.collect()
        if not args.cpu_smoke:
            torch.cuda.empty_cache()
    release_memory(args.cpu_smoke)
    rows = list(flops)
    summary = pivot(lines, rows, lambda line: tflops(3.5 * flops[line.row], line.train_ms), "fwd+bwd TFLOP/s")
    memory = pivot(lines, rows, lambda line: cells(line.train_peak, "{:.3g}"), "fwd+bwd peak GiB")
    notes = ["rows: " + "; ".join(f"{row} {shape}" for row, shape in shapes.items()) + "; bfloat16",
             "FLOPs: fwd 4*B*H*T*T*D (causal: half), fwd+bwd 3.5x fwd; ms: median of steps timed one at a time, "
             "call to GPU done; fwd without autograd, fwd+bwd the output and dq, dk, dv for a fixed upstream gradient",
             "peak: torch.cuda.max_memory_allocated during one step less what was allocated before the variant was "
             "made (an ember.jit step's recorded buffers count)",
             f"rel err: ||variant - torch SDPA float32|| / ||torch SDPA float32||, the largest of out, dq, dk, dv "
             f"(first call); FAIL above {TOL}",
             "torch.compile and FlexAttention (torch.compile(flex_attention), a causal BlockMask on causal rows) are "
             "compiled once per run with dynamic=True (sizes as runtime values), as a program with many sizes would",
             "ember SDPA is ember.nn.functional.scaled_dot_product_attention as it stands; ember manual: "
             "softmax(q@kT*scale masked_fill) @ v; jit variants are timed as replays"]
    notes.append(f"the run took {time.perf_counter() - start:.0f} s" + (
        f"; over its --budget of {args.budget:.0f} s, {len(over)} variants were left out" if over else ""))
    if skip:
        notes.append(f"variants left out of this run: {', '.join(sorted(skip))}")
    if args.cpu_smoke:
        notes.append("--cpu-smoke: times mean nothing (torch on the CPU, ember's kernels through Triton's "
                     "interpreter, tiny sizes); torch.compile variants ran with backend='eager'")
    title = f"Attention (`benchmarks/attention.py`): {environment(args.cpu_smoke)}" + (
        " (--quick sizes)" if args.quick else "")
    publish(title, table(lines, flops) + "\n\n" + summary + "\n\n" + memory, notes, opts.results_file)


if __name__ == "__main__":
    main()
