"""GEMM benchmark: ember's fused GEMMs against cuBLAS alone, PyTorch eager and torch.compile.

One row per workload of the GEMM-fusion issue, all bfloat16: bare GEMMs (4096^3, 8192^3), a GEMM with
an epilogue (bias + GELU, a residual add), a GEMM with a prologue in its mainloop (relu(x * scale +
shift) @ W, scale and shift per K), a linear layer forward + backward (y, dX, dW, db) and an MLP block
Linear-GELU-Linear forward + backward. A time is the median wall time of one step, from the call until
the GPU is done, after warm-up (CUDA events; the GPU is idle when a step starts).

"ember ms" is the step under ember.jit, as a steady-state user runs it: the inputs passed as Tensor
arguments, warmed up until the calls replay the recorded kernels as one CUDA graph (a replay copies the
arguments into the recorded buffers and the returned values out; both copies are in the time). Rows 6
and 7 clear the leaves' .grad inside the step, run forward and backward and return y; the gradients are
read from .grad, which each replay rewrites. "ember lazy ms" is the same step run as written: building
the lazy graph (and the backward graph), the plan-cache lookup, the launches and the kernels, about 0.1
ms of host work per step. ember runs each row with ember.runtime.cuda.gemm_backend = "auto" (it times
its generated Triton GEMM against cuBLAS plus separate epilogue kernels and keeps the faster; "path"
says which it kept, per GEMM) and, rows 1 to 5, "triton" (always the generated fused kernel; jit too).
"cuBLAS bare" is torch.matmul of the same operands alone, no prologue or epilogue: the ceiling of every
row (rows 6 and 7: the sum over their 3 and 6 GEMMs). torch eager and torch.compile run without CUDA
graphs; torch.compile(mode="reduce-overhead") is not timed. TFLOP/s counts 2 * M * N * K per GEMM. Every
ember result (lazy, and a jit replay's) is checked against torch in float32 (relative error in the
Frobenius norm, max over a row's outputs).

    python benchmarks/gemm.py                           # full sizes, appended to benchmarks/RESULTS.md
    python benchmarks/gemm.py --quick --rows 1,3        # small sizes, some rows; nothing appended
    EMBER_INTERPRET=1 python benchmarks/gemm.py --cpu-smoke   # no GPU: tiny sizes, every code path
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as TF
from common import (
    cell,
    environment,
    for_each_case,
    guarded,
    markdown_table,
    median_ms,
    parse_options,
    publish,
    rel_error,
    to_ember,
    to_torch,
)

import ember
import ember.nn.functional as EF
from ember.explain import plan
from ember.jit import JitFunction

# (full, --quick, --cpu-smoke) size of each workload
SIZES = {
    "gemm": (4096, 1024, 64),  # M = N = K of rows 1, 3, 4
    "large": (8192, 2048, 128),  # M = N = K of row 2
    "mainloop": ((8192, 4096, 4096), (2048, 1024, 1024), (128, 64, 64)),  # (M, K, N) of row 5
    "linear": ((8192, 4096, 4096), (2048, 1024, 1024), (128, 64, 64)),  # (batch, in, out) of row 6
    "mlp": ((8192, 4096, 4096), (2048, 1024, 1024), (64, 64, 64)),  # (batch, width, hidden) of row 7
    "ceiling": (8192, 4096, 128),  # square bf16 torch.matmul measuring the hardware's rate
}
TOL = 2e-2  # bound on ||ember - reference|| / ||reference||, bf16 against float32
TARGETS = {"bare": 0.90, "epilogue_cublas": 0.90, "epilogue_compile": 1.1, "mainloop": 1.2}


@dataclass
class Case:
    row: str
    name: str
    shape: str
    flops: int  # 2 * M * N * K summed over the step's GEMMs
    gemms: list[tuple[torch.Tensor, torch.Tensor]]  # (A, B) of each GEMM, timed as torch.matmul(A, B) alone
    ember: Callable[[], tuple]  # one lazy step: build the lazy graph (and its backward), realize it, its outputs
    jitted: Callable[[bool], Jitted]  # a fresh ember.jit of the step, inputs passed (True) or in its closure
    build: Callable[[], tuple]  # the lazy outputs of a step, for ember.explain.plan
    eager: Callable[[], object]
    compiled: Callable[[dict], Callable[[], object]]  # torch.compile options -> the compiled step (it may raise)
    reference: Callable[[], list[torch.Tensor]]  # the step's outputs from torch in float32
    triton: bool = True  # also time ember with gemm_backend = "triton"
    extra: dict[str, Callable[[], Jitted]] = field(default_factory=dict)  # more ember steps, in the notes


@dataclass
class Jitted:
    """An ember.jit function and a call of it on the case's inputs that returns the step's outputs."""

    fn: JitFunction
    call: Callable[[], tuple]  # its outputs: what the step returns first, then the gradients read from .grad
    args: list[ember.Tensor]  # the Tensors passed to it (none: the step reads its inputs from its closure)


def mib(tensors) -> float:
    return sum(to_torch(t).numel() * to_torch(t).element_size() for t in tensors) / 2**20


def jit(fn: Callable, inputs: list[ember.Tensor], passed: bool = True,
        outputs: Callable[[object], tuple] = lambda out: (out,)) -> Jitted:
    """A fresh ember.jit of `fn(*inputs)`, the inputs passed as arguments or captured by its closure;
    `outputs` makes the step's outputs from what it returns."""
    if passed:
        step = ember.jit(fn)
        return Jitted(step, lambda: outputs(step(*inputs)), inputs)
    step = ember.jit(lambda: fn(*inputs))
    return Jitted(step, lambda: outputs(step()), [])


def has_gemm_backend() -> bool:
    from ember.runtime import cuda

    return hasattr(cuda, "gemm_backend")


def raise_missing() -> bool:
    raise AttributeError("ember.runtime.cuda.gemm_backend does not exist")


@contextlib.contextmanager
def gemm_backend(value: str, required: bool = True):
    """Run with ember.runtime.cuda.gemm_backend = `value`, the previous value restored afterwards. Without the
    attribute, raise (`required`) or run as ember does by default."""
    from ember.runtime import cuda

    if not has_gemm_backend():
        if required:
            raise_missing()
        yield
        return
    previous, cuda.gemm_backend = cuda.gemm_backend, value
    try:
        yield
    finally:
        cuda.gemm_backend = previous


def forward_backward(fwd, grad, inputs, wrt, upstream) -> tuple:
    out = fwd(*inputs)
    return (out, *grad(out, [inputs[i] for i in wrt], upstream)) if wrt else (out,)


def workload(row, name, shape, fwd, inputs, flops, gemms, wrt=(), upstream=None, triton=True) -> Case:
    """A Case from `fwd(F, *inputs)`, written once for torch.nn.functional and ember.nn.functional; with
    `wrt`, a step also computes the gradients of those inputs for the upstream gradient (ember through
    .backward() and .grad, as a training step does; torch through torch.autograd.grad)."""
    for i in wrt:
        inputs[i].requires_grad_()
    ember_inputs = [to_ember(t, i in wrt) for i, t in enumerate(inputs)]
    ember_upstream = None if upstream is None else to_ember(upstream)

    def build():
        out = fwd(EF, *ember_inputs)
        if not wrt:
            return (out,)
        for i in wrt:
            ember_inputs[i].grad = None
        out.backward(ember_upstream)
        return (out, *[ember_inputs[i].grad for i in wrt])

    def ember_step():
        outputs = build()
        ember.realize(*outputs)
        return outputs

    def jit_step(*args):
        """The step for ember.jit: the inputs (and the upstream gradient) as arguments; it clears the leaves'
        .grad itself (a replay does not accumulate into the .grad of the call before) and returns y only:
        a replay rewrites the gradients in .grad in place, and a returned gradient stops the replay."""
        if not wrt:
            return fwd(EF, *args)
        for i in wrt:
            args[i].grad = None
        out = fwd(EF, *args[:-1])
        out.backward(args[-1])
        return out

    def jitted(passed: bool) -> Jitted:
        grads = lambda out: (out, *[ember_inputs[i].grad for i in wrt])  # noqa: E731
        return jit(jit_step, ember_inputs + ([] if upstream is None else [ember_upstream]), passed, grads)

    def torch_step(f):
        return lambda: forward_backward(f, torch.autograd.grad, inputs, wrt, upstream)

    def reference():
        wide = [t.detach().float().requires_grad_(i in wrt) for i, t in enumerate(inputs)]
        return [r.detach() for r in forward_backward(lambda *a: fwd(TF, *a), torch.autograd.grad, wide, wrt,
                                                     None if upstream is None else upstream.float())]

    return Case(row, name, shape, flops, gemms, ember_step, jitted, build, torch_step(lambda *a: fwd(TF, *a)),
                lambda options: torch_step(torch.compile(lambda *a: fwd(TF, *a), **options)), reference, triton)


def unfused_prologue(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, w: torch.Tensor) -> Jitted:
    """Row 5 with the prologue kept out of the GEMM: relu(x * scale + shift) realized on its own first
    (under ember.jit, as the fused step is timed)."""
    def step(x, scale, shift, w):
        h = EF.relu(x * scale + shift)
        ember.realize(h)
        return h @ w
    return jit(step, [to_ember(t) for t in (x, scale, shift, w)])


def cases(which: int, dev: str) -> list[tuple[str, Callable[[], Case]]]:
    """Each row's number and a maker of its Case (rows are made one at a time, to bound memory)."""
    s = {k: v[which] for k, v in SIZES.items()}
    bf16 = dict(device=dev, dtype=torch.bfloat16)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, **bf16) * scale

    def square(row, name, n, fwd, extra=()):
        a, b = randn(n, n), randn(n, n, scale=n**-0.5)
        return workload(row, name, f"{n}^3 bf16", fwd, [a, b, *[randn(*e) for e in extra]], 2 * n**3, [(a, b)])

    def mainloop():
        m, k, n = s["mainloop"]
        x, scale, shift, w = randn(m, k), randn(k), randn(k), randn(k, n, scale=k**-0.5)
        case = workload("5", "relu(x * scale + shift) @ W", f"{m}x{k} @ {k}x{n} bf16",
                        lambda F, x, scale, shift, w: F.relu(x * scale + shift) @ w,
                        [x, scale, shift, w], 2 * m * n * k, [(x, w)])
        case.extra["ember.jit, prologue realized on its own (unfused)"] = lambda: unfused_prologue(x, scale, shift, w)
        return case

    def linear():
        m, k, n = s["linear"]
        x, w, b, g = randn(m, k), randn(n, k, scale=k**-0.5), randn(n), randn(m, n)
        return workload("6", "linear fwd+bwd: y, dX, dW, db", f"x {m}x{k}, W {n}x{k} bf16",
                        lambda F, x, w, b: F.linear(x, w, b), [x, w, b], 3 * 2 * m * n * k,
                        [(x, w.t()), (g, w), (g.t(), x)],  # y = x @ W^T, dX = g @ W, dW = g^T @ x
                        wrt=(0, 1, 2), upstream=g, triton=False)

    def mlp():
        m, d, h = s["mlp"]
        x, g = randn(m, d), randn(m, d)
        w1, b1, w2, b2 = randn(h, d, scale=d**-0.5), randn(h), randn(d, h, scale=h**-0.5), randn(d)
        hidden, dhidden = randn(m, h), randn(m, h)  # stand-ins of the same shape for the GEMMs' intermediates
        return workload("7", "mlp block fwd+bwd: Linear-GELU-Linear", f"x {m}x{d}, hidden {h} bf16",
                        lambda F, x, w1, b1, w2, b2: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2),
                        [x, w1, b1, w2, b2], 6 * 2 * m * d * h,
                        [(x, w1.t()), (hidden, w2.t()),  # forward
                         (g, w2), (g.t(), hidden),  # backward of the second layer: dH, dW2
                         (dhidden, w1), (dhidden.t(), x)],  # backward of the first layer: dX, dW1
                        wrt=(0, 1, 2, 3, 4), upstream=g, triton=False)

    n, big = s["gemm"], s["large"]
    return [
        ("1", lambda: square("1", "bare gemm", n, lambda F, a, b: a @ b)),
        ("2", lambda: square("2", "bare gemm", big, lambda F, a, b: a @ b)),
        ("3", lambda: square("3", "gemm + bias + gelu (erf)", n, lambda F, a, b, bias: F.gelu(a @ b + bias),
                             extra=[(n,)])),
        ("4", lambda: square("4", "gemm + residual add", n, lambda F, a, b, r: a @ b + r, extra=[(n, n)])),
        ("5", mainloop),
        ("6", linear),
        ("7", mlp),
    ]


def max_error(outputs: tuple, reference: list[torch.Tensor] | None) -> float:
    """The largest relative error over a step's outputs (ember Tensors) against torch's."""
    if reference is None:
        raise RuntimeError("no reference (torch float32 failed)")
    return max(rel_error(to_torch(e), r) for e, r in zip(outputs, reference))


def gemm_choices(case: Case) -> list[dict] | None:
    """ember.explain.plan(...).gemm_choices of a step: one dict per GEMM (None: not available)."""
    return getattr(plan(*case.build()), "gemm_choices", None)


def path(choices: list[dict] | None) -> str:
    return "?" if choices is None else "+".join(str(c.get("chosen", "?")) for c in choices) or "no gemm"


def time_lazy(case: Case, reference, args, stats: dict, notes: list[str]) -> tuple[float | None, float | None]:
    """The lazy step's time and the error of its first run (which compiles its plans and autotunes)."""
    err = guarded(f"{case.row} ember lazy (check)", lambda: max_error(case.ember(), reference))
    if guarded(f"{case.row} ember lazy (warm-up)", lambda: [case.ember() for _ in range(args.warmup)]) is None:
        return None, err
    compiled = stats["plans_compiled"]
    ms = guarded(f"{case.row} ember lazy", lambda: median_ms(case.ember, 0, args.reps, args.cpu_smoke))
    if stats["plans_compiled"] != compiled:
        notes.append(f"{case.row}: ember lazy compiled a plan while timed (plan cache missed)")
    return ms, err


def checked(made: Jitted, reference) -> dict:
    """One more call's error, and the MiB a replay copies: "in" (the arguments), "out" (what it returns)."""
    outputs = made.call()
    return {"err": max_error(outputs, reference), "in": mib(made.args), "out": mib(outputs[:1])}


MAX_CALLS_TO_REPLAY = 10  # calls a fresh ember.jit function gets to start replaying (it needs 3)


def time_jit(row: str, what: str, make: Callable[[], Jitted], reference, args, stats: dict,
             notes: list[str]) -> dict:
    """A fresh ember.jit step, timed once it replays: called until it replays (it runs as written until two
    calls in a row ran the same plans and records the next), then `args.warmup` replays more, untimed.
    Returns its time "ms", the error "err" of one replay's outputs, and the MiB a replay copies: "in" (its
    arguments) and "out" (what it returns)."""
    made = guarded(f"{row} {what} (make)", make)
    if made is None:
        return {}
    step = made.fn

    def warm_up():
        for _ in range(MAX_CALLS_TO_REPLAY):
            if step.stats["replays"]:
                break
            made.call()
        for _ in range(args.warmup):
            made.call()
        return True

    if guarded(f"{row} {what} (warm-up)", warm_up) is None:
        return {}
    why = getattr(step, "why_not_replayed", None) or []
    if not step.stats["replays"]:
        notes.append(f"{row}: WARNING: {what} is not replaying after {step.stats['calls']} calls ({step.stats}): "
                     "its time is of the step run as written" + (f"; why_not_replayed: {'; '.join(why)}" if why
                                                                  else ""))
    elif why and not args.cpu_smoke:  # under --cpu-smoke: "no GPU: the interpreter replays launch by launch"
        notes.append(f"{row}: {what} replays, without a CUDA graph: {'; '.join(why)}")
    result = guarded(f"{row} {what} (check)", lambda: checked(made, reference)) or {}
    replays, compiled = step.stats["replays"], stats["plans_compiled"]
    result["ms"] = guarded(f"{row} {what}", lambda: median_ms(made.call, 0, args.reps, args.cpu_smoke))
    if replays and step.stats["replays"] - replays != max(args.reps, 1):
        notes.append(f"{row}: {what}: not every timed call replayed ({step.stats})")
    if stats["plans_compiled"] != compiled:
        notes.append(f"{row}: {what} compiled a plan while timed (plan cache missed)")
    return result


def verdict(err: float | None) -> str:
    return "" if err is not None and err <= TOL else " FAIL"


def run(case: Case, args, stats: dict, notes: list[str]) -> dict:
    cpu, warmup, reps = args.cpu_smoke, args.warmup, args.reps
    row = case.row
    result: dict = {k: getattr(case, k) for k in ("row", "name", "shape", "flops", "triton")}
    reference = guarded(f"{row} torch float32 reference", case.reference)
    with gemm_backend("auto", required=False):
        result["lazy"], result["lazy_rel"] = time_lazy(case, reference, args, stats, notes)
        jitted = time_jit(row, "ember.jit", lambda: case.jitted(True), reference, args, stats, notes)
        result["ember"], result["rel"] = jitted.get("ms"), jitted.get("err")
        closure = time_jit(row, "ember.jit, inputs in the closure", lambda: case.jitted(False), reference, args,
                           stats, notes)
        choices = guarded(f"{row} ember.explain.plan", lambda: gemm_choices(case))
        for label, make in case.extra.items():
            extra = time_jit(row, label, make, reference, args, stats, notes)
            result.setdefault("extra", {})[label] = extra.get("ms")
            notes.append(f"{row}: {label}: rel err {cell(extra.get('err'), '{:.1e}')}{verdict(extra.get('err'))}")
    if jitted.get("in") is not None:
        notes.append(f"{row}: an ember.jit replay copies its arguments ({jitted['in']:.3g} MiB) into the recorded "
                     f"buffers and what it returns ({jitted['out']:.3g} MiB) out, both in ember ms; with the "
                     f"inputs in the step's closure instead (nothing copied in): {cell(closure.get('ms'))} ms "
                     f"(ember ms / this = {cell(ratio(jitted.get('ms'), closure.get('ms')), '{:.2f}x')}), rel err "
                     f"{cell(closure.get('err'), '{:.1e}')}{verdict(closure.get('err'))}")
    result["path"] = path(choices)
    profiled = [c for c in choices or [] if c.get("triton_ms") is not None or c.get("cublas_ms") is not None]
    if profiled:
        ms = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
        notes.append(f"{row}: gemm_backend='auto' measured, per GEMM (kernel: triton ms / cublas + epilogue "
                     "ms -> chosen): " + ", ".join(f"{c.get('kernel', '?')}: {ms(c.get('triton_ms'))} / "
                                                    f"{ms(c.get('cublas_ms'))} -> {c.get('chosen', '?')}"
                                                    for c in profiled))
    if case.triton and guarded(f"{row} ember triton", lambda: has_gemm_backend() or raise_missing()):
        with gemm_backend("triton"):  # a jit function of its own: plans are keyed by the backend
            forced_jit = time_jit(row, "ember.jit triton", lambda: case.jitted(True), reference, args, stats, notes)
            result["triton_ms"], result["triton_rel"] = forced_jit.get("ms"), forced_jit.get("err")
            forced = guarded(f"{row} ember.explain.plan (triton)", lambda: gemm_choices(case))
        if forced is not None and any(c.get("chosen") != "triton" for c in forced):
            notes.append(f"{row}: gemm_backend='triton' still planned {path(forced)}")
    gemms = [(a.detach(), b.detach()) for a, b in case.gemms]  # no autograd bookkeeping in cuBLAS's time
    result["cublas"] = guarded(f"{case.row} cuBLAS bare", lambda: sum(
        median_ms(lambda a=a, b=b: torch.matmul(a, b), warmup, reps, cpu) for a, b in gemms))
    result["eager"] = guarded(f"{case.row} eager", lambda: median_ms(case.eager, warmup, reps, cpu))
    for key, options in (("compile", {}), ("autotune", {"mode": "max-autotune-no-cudagraphs"})):
        options = {"backend": "eager"} if cpu else options  # inductor's CPU compile is too slow for a smoke run
        result[key] = guarded(f"{case.row} torch.compile {options}",
                              lambda options=options: median_ms(case.compiled(options), warmup, reps, cpu))
        torch._dynamo.reset()  # the next variant compiles afresh; drops the tensors guards hold
    return result


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def target_notes(res: dict) -> list[str]:
    """The issue's targets for rows 1 to 5, met or missed, for ember (auto) and its generated kernel."""
    ok = lambda value, bound: "" if value is None else " met" if value >= bound else " missed"  # noqa: E731
    row, ember_ms, triton_ms, cublas = res["row"], res.get("ember"), res.get("triton_ms"), res.get("cublas")
    pct = lambda ms: cell(ratio(cublas, ms) and 100 * ratio(cublas, ms), "{:.0f}%")  # noqa: E731
    if row in ("1", "2"):
        bound = TARGETS["bare"]
        return [f"{row}: target bare >= {bound:.0%} of cuBLAS: ember {pct(ember_ms)}"
                f"{ok(ratio(cublas, ember_ms), bound)}, generated kernel {pct(triton_ms)}"
                f"{ok(ratio(cublas, triton_ms), bound)}"]
    if row in ("3", "4"):
        bound, speedup = TARGETS["epilogue_cublas"], TARGETS["epilogue_compile"]
        vs_compile = ratio(res.get("compile"), ember_ms)
        return [f"{row}: target gemm + epilogue >= {bound:.0%} of cuBLAS bare and >= {speedup}x torch.compile: "
                f"ember {pct(ember_ms)}{ok(ratio(cublas, ember_ms), bound)}, "
                f"{cell(vs_compile, '{:.2f}x')}{ok(vs_compile, speedup)} "
                f"(generated kernel {pct(triton_ms)}, {cell(ratio(res.get('compile'), triton_ms), '{:.2f}x')})"]
    if row == "5":
        bound = TARGETS["mainloop"]
        unfused = {"eager": res.get("eager"), **res.get("extra", {})}
        return [f"5: target mainloop >= {bound}x the unfused version: "
                + ", ".join(f"vs {label} ({cell(ms)} ms) {cell(ratio(ms, ember_ms), '{:.2f}x')}"
                            f"{ok(ratio(ms, ember_ms), bound)}" for label, ms in unfused.items())]
    return []


def table(results: list[dict]) -> str:
    head = ["row", "workload", "shape", "ember ms", "ember lazy ms", "ember triton ms", "cuBLAS bare ms", "eager ms",
            "compile ms", "max-autotune ms", "ember TFLOP/s", "% of cuBLAS", "vs compile", "vs eager", "path",
            "rel err (auto / triton / lazy)"]
    lines = []
    for res in results:
        ember_ms = res.get("ember")
        errors = [res.get("rel")] + ([res.get("triton_rel")] if res["triton"] else []) + [res.get("lazy_rel")]
        failed = "" if all(e is not None and e <= TOL for e in errors) else " FAIL"
        lines.append([
            res["row"], res["name"], res["shape"], cell(ember_ms), cell(res.get("lazy")),
            cell(res.get("triton_ms")) if res["triton"] else "-", cell(res.get("cublas")), cell(res.get("eager")),
            cell(res.get("compile")), cell(res.get("autotune")),
            cell(ember_ms and res["flops"] / ember_ms / 1e9, "{:.3g}"),
            cell(ratio(res.get("cublas"), ember_ms) and 100 * ratio(res.get("cublas"), ember_ms), "{:.0f}%"),
            cell(ratio(res.get("compile"), ember_ms), "{:.2f}x"), cell(ratio(res.get("eager"), ember_ms), "{:.2f}x"),
            res["path"], " / ".join([cell(res.get("rel"), "{:.1e}"),
                                     cell(res.get("triton_rel"), "{:.1e}") if res["triton"] else "-",
                                     cell(res.get("lazy_rel"), "{:.1e}")]) + failed])
    return markdown_table(head, lines)


def cublas_tflops(n: int, dev: str, warmup: int, reps: int, cpu: bool) -> float:
    a, b = torch.randn(n, n, device=dev, dtype=torch.bfloat16), torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    return 2 * n**3 / median_ms(lambda: torch.matmul(a, b), warmup, reps, cpu) / 1e9


def main(argv: list[str] | None = None) -> None:
    opts = parse_options(argv, "gemm.py", __doc__, cases,
                         warmup_help="warm-up steps per variant, after ember's first (checked) step (default 3)")
    args, which, dev = opts.args, opts.which, opts.dev
    from ember.runtime import cuda as ember_cuda

    n = SIZES["ceiling"][which]
    rate = guarded("cuBLAS rate", lambda: cublas_tflops(n, dev, args.warmup, args.reps, args.cpu_smoke))
    print(f"cuBLAS bf16 {n}^3: {cell(rate, '{:.3g}')} TFLOP/s", flush=True)
    if not hasattr(ember_cuda, "gemm_backend"):
        print("ember.runtime.cuda.gemm_backend does not exist: 'ember' runs ember's default, "
              "'ember triton' is an error", flush=True)

    notes = [f"hardware ceiling: cuBLAS (torch.matmul) bf16 {n}^3 runs at {cell(rate, '{:.3g}')} TFLOP/s",
             "times are medians per step, call to GPU done; ember's first lazy step (its correctness check) "
             f"and {args.warmup} warm-up steps per variant, untimed, absorb plan compilation and GEMM autotuning "
             "(tens of seconds on first use)",
             "ember ms: the step under ember.jit (cuda_graph=True), its inputs passed as Tensor arguments, called "
             f"until it replays (it runs as written until two calls ran the same plans, records the third), then "
             f"{args.warmup} replays more, untimed: a timed call replays the recorded kernels as one CUDA graph, "
             "plus copying the arguments in and the returned values out (rows 6, 7: the step clears the leaves' "
             ".grad, runs forward and backward and returns y; the gradients are read from .grad, which each "
             "replay rewrites); ember lazy ms: the same step run as written, which adds building the graph (and "
             "the backward graph), the plan-cache lookup and the launches, about 0.1 ms of host work per step",
             "ember ms and ember lazy ms: ember.runtime.cuda.gemm_backend = 'auto' (the faster of the generated "
             "Triton GEMM and cuBLAS plus separate epilogue kernels, per GEMM; 'path' says which, from "
             "ember.explain.plan(...).gemm_choices, '?' where unavailable); ember triton ms (rows 1-5): "
             "gemm_backend = 'triton', the generated fused kernel always, under an ember.jit of its own",
             "cuBLAS bare: torch.matmul of the same operands alone, no prologue or epilogue, the ceiling of each "
             "row (rows 6, 7: the sum over their 3 and 6 GEMMs); % of cuBLAS = cuBLAS bare ms / ember ms; "
             "vs compile, vs eager = their ms / ember ms (ember ms: ember.jit); TFLOP/s counts 2*M*N*K per GEMM",
             "compile: torch.compile default; max-autotune: torch.compile(mode='max-autotune-no-cudagraphs'); "
             "rows 6, 7 compile the forward, torch.autograd.grad runs the compiled backward; torch eager and "
             "both torch.compile columns run without CUDA graphs, while ember ms replays one: "
             "torch.compile(mode='reduce-overhead') (CUDA graphs) is not timed",
             f"rel err: ||ember - torch float32|| / ||torch float32||, max over a row's outputs, for an ember.jit "
             f"replay with gemm_backend 'auto' / 'triton' and for ember lazy's first step; FAIL above {TOL:g}",
             f"targets (the issue): bare gemm >= {TARGETS['bare']:.0%} of cuBLAS; gemm + epilogue >= "
             f"{TARGETS['epilogue_cublas']:.0%} of cuBLAS bare and >= {TARGETS['epilogue_compile']}x "
             f"torch.compile default; mainloop (prologue) >= {TARGETS['mainloop']}x the unfused version "
             "(torch eager; ember.jit with the prologue realized on its own)"]
    if args.cpu_smoke:
        notes.append("--cpu-smoke: torch on the CPU, ember through Triton's interpreter, both torch.compile "
                     "columns with backend='eager'; the times mean nothing")
    results = []

    def run_row(case: Case) -> None:
        results.append(run(case, args, ember_cuda.stats, notes))
        notes.extend(target_notes(results[-1]))

    for_each_case(opts, run_row)

    publish(f"gemm benchmark: {environment(args.cpu_smoke)}"
            + (" (--quick sizes)" if args.quick and not args.cpu_smoke else ""),
            table(results), notes, opts.results_file)


if __name__ == "__main__":
    main()
