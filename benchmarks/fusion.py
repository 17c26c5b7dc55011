"""Fusion benchmark: ember against PyTorch eager, torch.compile and the measured copy bandwidth.

One row per workload of the fusion issue. A time is the median wall time of one step, from the
call until the GPU is done, after warm-up (CUDA events; the GPU is idle when a step starts). For
ember that is what a user pays: building the lazy graph, the plan-cache lookup, the launches and
the kernels; eager and torch.compile pay their own launch overhead likewise. Effective bandwidth
counts the fewest bytes a step must move (each input read once, each output written once; the
formula is written in each row) and is compared with a large device-to-device copy measured
first. Every ember result is checked against torch one precision higher (bf16 -> float32,
float32 -> float64), so a fast wrong answer shows in the table.

    python benchmarks/fusion.py                           # full sizes, appended to benchmarks/RESULTS.md
    python benchmarks/fusion.py --quick --rows 1,3        # small sizes, some rows; nothing appended
    EMBER_INTERPRET=1 python benchmarks/fusion.py --quick --cpu-smoke   # no GPU: tiny sizes, every code path
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as TF
from common import (
    cell,
    chain_of_reductions,
    environment,
    for_each_case,
    graph_gpu_ms,
    guarded,
    markdown_table,
    median_ms,
    parse_options,
    publish,
    to_ember,
    to_torch,
)

import ember
import ember.nn.functional as EF
from ember.explain import plan

# (full, --quick, --cpu-smoke) size of each workload
SIZES = {
    "pointwise": (2**28, 2**24, 2**12),
    "gelu": ((8192, 8192), (2048, 2048), (64, 128)),
    "rows": ((32768, 4096), (4096, 4096), (64, 256)),
    "cross_entropy": ((65536, 32000), (4096, 32000), (64, 1000)),
    "adam": (1024, 256, 16),  # width of the 100-tensor model: 49.3M parameters at 1024
    "chain": (64, 64, 16),
    "copy": (2**30, 2**28, 2**22),  # bytes per copy buffer
}


@dataclass
class Case:
    row: str
    name: str
    shape: str
    nbytes: int | None  # fewest bytes one step must move; None: a latency row
    ember: Callable[[], object]  # one step: build the lazy graph and realize it
    eager: Callable[[], object]
    compiled: Callable[[], Callable[[], object]]  # makes the torch.compile'd step (it may raise)
    check: Callable[[], list]  # [(ember value, reference value)] as torch tensors
    tol: float  # bound on ||ember - reference|| / ||reference||
    build: Callable[[], tuple] | None = None  # the lazy outputs of a step, for ember.explain.plan
    extra: dict[str, Callable[[], Callable[[], object]]] = field(default_factory=dict)  # more torch variants


def widen(t: torch.Tensor) -> torch.Tensor:
    """The reference precision: bf16/fp16 -> float32, float32 -> float64, integers unchanged."""
    wider = {torch.bfloat16: torch.float32, torch.float16: torch.float32, torch.float32: torch.float64}
    return t.detach().to(wider.get(t.dtype, t.dtype))


def forward_backward(fwd, grad, inputs, wrt, upstream) -> tuple:
    out = fwd(*inputs)
    return (out, *grad(out, [inputs[i] for i in wrt], upstream)) if wrt else (out,)


def workload(row, name, shape, fwd, inputs, nbytes, tol, wrt=(), upstream=None) -> Case:
    """A Case from `fwd(F, *inputs)`, written once for torch.nn.functional and ember.nn.functional;
    with `wrt`, a step also returns the gradients of those inputs for the upstream gradient."""
    for i in wrt:
        inputs[i].requires_grad_()
    ember_inputs = [to_ember(t, i in wrt) for i, t in enumerate(inputs)]
    ember_upstream = None if upstream is None else to_ember(upstream)

    def build():
        return forward_backward(lambda *a: fwd(EF, *a), ember.grad, ember_inputs, wrt, ember_upstream)

    def ember_step():
        outputs = build()
        ember.realize(*outputs)
        return outputs

    def torch_step(f):
        return lambda: forward_backward(f, torch.autograd.grad, inputs, wrt, upstream)

    def check():
        wide = [widen(t).requires_grad_(i in wrt) for i, t in enumerate(inputs)]
        reference = forward_backward(lambda *a: fwd(TF, *a), torch.autograd.grad, wide, wrt,
                                     None if upstream is None else widen(upstream))
        return [(to_torch(e), r) for e, r in zip(ember_step(), reference)]

    return Case(row, name, shape, nbytes, ember_step, torch_step(lambda *a: fwd(TF, *a)),
                lambda: torch_step(torch.compile(lambda *a: fwd(TF, *a))), check, tol, build)


def adam(size: int, dev: str) -> Case:
    shapes = [(size, 3 * size // 2), (3 * size // 2,), (3 * size // 4, size // 2), (4 * size,)] * 25
    init = [torch.randn(s, device=dev) for s in shapes]
    grads = [torch.randn(s, device=dev) for s in shapes]
    count = sum(p.numel() for p in init)

    def torch_adam(**options):
        params = [p.clone().requires_grad_() for p in init]
        for p, g in zip(params, grads):
            p.grad = g
        return params, torch.optim.Adam(params, lr=1e-3, **options)

    ember_params = [to_ember(p.clone(), requires_grad=True) for p in init]
    for p, g in zip(ember_params, grads):
        p.grad = to_ember(g)
    ember_opt = ember.optim.Adam(ember_params, lr=1e-3)
    eager_params, eager_opt = torch_adam(foreach=True)

    def check():  # the first step of each, as the change it makes to every parameter
        ember_opt.step()
        eager_opt.step()
        return [(to_torch(e) - p0, t.detach() - p0) for e, t, p0 in zip(ember_params, eager_params, init)]

    return Case("6", "adam step (torch: foreach)", f"100 tensors, {count / 1e6:.1f}M f32",
                7 * count * 4,  # read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq
                ember_opt.step, eager_opt.step, lambda: torch.compile(torch_adam(foreach=True)[1].step),
                check, 1e-3, extra={"torch fused=True": lambda: torch_adam(fused=True)[1].step})


def cases(which: int, dev: str) -> list[tuple[str, Callable[[], Case]]]:
    """Each row's number and a maker of its Case (rows are made one at a time, to bound memory)."""
    s = {k: v[which] for k, v in SIZES.items()}
    bf16 = dict(device=dev, dtype=torch.bfloat16)
    n = s["pointwise"]
    m, k = s["gelu"]
    r, c = s["rows"]
    b, v = s["cross_entropy"]
    w = s["chain"]
    chain8 = lambda F, x, y: ((x * 1.5 + 0.5).tanh() * y - x).sigmoid() * y + x  # noqa: E731 - 8 ops
    softmax = lambda F, x: F.softmax(x, -1)  # noqa: E731
    layer_norm = lambda F, x, wt, bias: F.layer_norm(x, (c,), wt, bias)  # noqa: E731
    return [
        ("1", lambda: workload(  # read x, y; write out
            "1", "pointwise chain, 8 ops", f"2^{n.bit_length() - 1} f32", chain8,
            [torch.randn(n, device=dev), torch.randn(n, device=dev)], 3 * n * 4, 1e-5)),
        ("2", lambda: workload(  # read x, bias; write out
            "2", "bias + gelu (erf)", f"{m}x{k} bf16", lambda F, x, bias: F.gelu(x + bias),
            [torch.randn(m, k, **bf16), torch.randn(k, **bf16)], 2 * m * k * 2 + k * 2, 1e-2)),
        ("3", lambda: workload(  # read x; write y
            "3a", "softmax fwd", f"{r}x{c} bf16", softmax, [torch.randn(r, c, **bf16)], 2 * r * c * 2, 1e-2)),
        ("3", lambda: workload(  # read x, dy; write y, dx
            "3b", "softmax fwd+bwd", f"{r}x{c} bf16", softmax, [torch.randn(r, c, **bf16)], 4 * r * c * 2, 1e-2,
            wrt=(0,), upstream=torch.randn(r, c, **bf16))),
        ("4", lambda: workload(  # read x, weight, bias; write y
            "4a", "layer norm fwd", f"{r}x{c} bf16", layer_norm,
            [torch.randn(r, c, **bf16), torch.randn(c, **bf16), torch.randn(c, **bf16)],
            2 * r * c * 2 + 2 * c * 2, 1e-2)),
        ("4", lambda: workload(  # read x, dy, weight, bias; write y, dx, dweight, dbias
            "4b", "layer norm fwd+bwd", f"{r}x{c} bf16", layer_norm,
            [torch.randn(r, c, **bf16), torch.randn(c, **bf16), torch.randn(c, **bf16)],
            4 * r * c * 2 + 4 * c * 2, 1e-2, wrt=(0, 1, 2), upstream=torch.randn(r, c, **bf16))),
        ("5", lambda: workload(  # read logits, targets; write dlogits, loss
            "5", "cross entropy fwd+bwd", f"{b}x{v} bf16", lambda F, x, t: F.cross_entropy(x, t),
            [torch.randn(b, v, **bf16), torch.randint(0, v, (b,), device=dev)], 2 * b * v * 2 + b * 8 + 2,
            1e-2, wrt=(0,))),
        ("6", lambda: adam(s["adam"], dev)),
        ("7", lambda: workload(  # a latency row: bytes do not matter
            "7", "plan-cache hit, 50 kernels", f"{w}x{w} f32", chain_of_reductions,
            [torch.randn(w, w, device=dev)], None, 1e-4)),
    ]


def copy_gbs(nbytes: int, dev: str, warmup: int, reps: int, cpu: bool) -> float:
    """Device-to-device copy bandwidth, counting the bytes read and the bytes written."""
    src = torch.randn(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_ms(lambda: dst.copy_(src), warmup, reps, cpu) / 1e6


def error(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Max abs error and ||out - ref|| / ||ref||, in chunks (a 4 GiB output needs no 16 GiB temporary);
    NaN propagates, so it never passes."""
    worst, diff2, ref2 = (torch.zeros((), dtype=torch.float64, device=ref.device) for _ in range(3))
    for o, r in zip(out.detach().flatten().split(1 << 26), ref.detach().flatten().split(1 << 26)):
        d = (o.to(r.dtype) - r).double()
        worst = torch.maximum(worst, d.abs().max())
        diff2 += d.square().sum()
        ref2 += r.double().square().sum()
    return worst.item(), (diff2.sqrt() / ref2.sqrt().clamp_min(1e-300)).item()


def run(case: Case, args, stats: dict, notes: list[str]) -> dict:
    cpu, warmup, reps = args.cpu_smoke, args.warmup, args.reps
    result: dict = {k: getattr(case, k) for k in ("row", "name", "shape", "nbytes", "tol")}
    pairs = guarded(f"{case.row} ember (check)", case.check)  # also ember's first step: compiles the plan
    if pairs is not None:
        errors = [error(e, r) for e, r in pairs]
        result["abs"], result["rel"] = max(a for a, _ in errors), max(r for _, r in errors)
        del pairs
    if guarded(f"{case.row} ember (warm-up)", lambda: [case.ember() for _ in range(warmup)]) is not None:
        before = dict(stats)
        result["ember"] = guarded(f"{case.row} ember", lambda: median_ms(case.ember, 0, reps, cpu))
        result["launches"] = (stats["launches"] - before["launches"]) / max(reps, 1)
        if stats["plans_compiled"] != before["plans_compiled"]:
            notes.append(f"{case.row}: ember compiled a plan while timed (plan cache missed)")
    if case.build is not None and not cpu:
        result["kernels"] = guarded(f"{case.row} ember kernels", lambda: median_ms(replay(case.build), 1, reps, cpu))
    result["eager"] = guarded(f"{case.row} eager", lambda: median_ms(case.eager, warmup, reps, cpu))
    if not cpu:
        result["compile"] = guarded(f"{case.row} torch.compile",
                                    lambda: median_ms(case.compiled(), warmup, reps, cpu))
    for label, make in case.extra.items():
        ms = guarded(f"{case.row} {label}", lambda make=make: median_ms(make(), warmup, reps, cpu))
        ember_ms = result.get("ember")
        speedup = f" (ember {ms / ember_ms:.2f}x as fast)" if ms and ember_ms else ""
        notes.append(f"{case.row}: {label}: {cell(ms)} ms{speedup}")
    if case.row == "7":  # the plan-cache row: how many kernels, and where a step's time goes
        p = plan(*case.build())
        e2e = result.get("ember")
        gpu = None if cpu else guarded("7 CUDA graph of ember's step", lambda: graph_gpu_ms(case.ember, reps))
        overhead = "not measured (--cpu-smoke)" if cpu else (
            f"{cell(gpu and gpu * 1e3, '{:.0f}')} us, so host overhead "
            f"{cell((e2e - gpu) * 1e3 if e2e and gpu else None, '{:.0f}')} us per step")
        notes.append(f"7: ember.explain.plan: {len(p.kernels)} kernels, {p.launches} launches; a warm-cache step: "
                     f"{cell(e2e and e2e * 1e3, '{:.0f}')} us end to end, GPU alone (CUDA graph replay) {overhead}")
    return result


def replay(build) -> Callable[[], object]:
    """Run the cached plan of one step again without building its graph: the GPU time of ember's kernels
    plus their launches, with no graph construction or plan lookup."""
    from ember.ir import toposort
    from ember.runtime import launcher, plan_cache

    nodes = [t._node for t in build()]
    order = toposort(nodes)
    keep = {id(n) for n in nodes} | {id(n) for n in order if n.is_held()}
    cached, signature = plan_cache.plan_for(order, keep)
    device = nodes[0].device
    inputs = [leaf.buffer for leaf in signature.inputs]
    return lambda: launcher.execute(cached, signature, device, inputs)


def table(results: list[dict], bandwidth: float, cpu: bool) -> str:
    head = ["row", "workload", "size", "MB moved", "ember ms", "GB/s", "% copy", "kernels ms", "kernels % copy",
            "eager ms", "compile ms", "vs eager", "vs compile", "launches", "max abs / rel err"]
    lines = []
    for res in results:
        ember_ms, eager, compiled = res.get("ember"), res.get("eager"), res.get("compile")
        gbs = res["nbytes"] / ember_ms / 1e6 if res["nbytes"] and ember_ms else None
        rel = res.get("rel")
        verdict = "" if rel is not None and rel <= res["tol"] else " FAIL"
        lines.append([
            res["row"], res["name"], res["shape"], "-" if res["nbytes"] is None else f"{res['nbytes'] / 1e6:.3g}"
            if res["nbytes"] < 1e7 else f"{res['nbytes'] / 1e6:.0f}",
            cell(ember_ms), "-" if gbs is None else f"{gbs:.0f}",
            "-" if gbs is None else f"{100 * gbs / bandwidth:.0f}",
            cell(res.get("kernels")) if "kernels" in res else "-",
            f"{100 * res['nbytes'] / res['kernels'] / 1e6 / bandwidth:.0f}" if res.get("kernels") and res["nbytes"]
            else "-",
            cell(eager), "skipped" if cpu else cell(compiled),
            cell(eager / ember_ms if eager and ember_ms else None, "{:.2f}x"),
            "-" if cpu else cell(compiled / ember_ms if compiled and ember_ms else None, "{:.2f}x"),
            cell(res.get("launches"), "{:.0f}"),
            "error" if rel is None else f"{res['abs']:.1e} / {rel:.1e}{verdict}"])
    return markdown_table(head, lines)


def main(argv: list[str] | None = None) -> None:
    opts = parse_options(argv, "fusion.py", __doc__, cases, compile_smoke="no torch.compile")
    args, which, dev = opts.args, opts.which, opts.dev
    from ember.runtime import cuda as ember_cuda

    copy_bytes = SIZES["copy"][which]
    bandwidth = copy_gbs(copy_bytes, dev, args.warmup, args.reps, args.cpu_smoke)
    print(f"copy bandwidth: {bandwidth:.0f} GB/s (read + write, {copy_bytes / 2**20:.0f} MiB buffers)", flush=True)

    notes = [f"copy bandwidth {bandwidth:.0f} GB/s (bytes read + written by a {copy_bytes / 2**20:.0f} MiB "
             "torch copy_); times are medians per step, call to GPU done; ember's include building the "
             "graph and the plan-cache lookup (end to end); 'kernels ms' replays ember's cached plan alone "
             "(launches and kernels, no graph building)"]
    results = []
    for_each_case(opts, lambda case: results.append(run(case, args, ember_cuda.stats, notes)))

    publish(f"fusion benchmark: {environment(args.cpu_smoke)}"
            + (" (--quick sizes)" if args.quick and not args.cpu_smoke else ""),
            table(results, bandwidth, args.cpu_smoke), notes, opts.results_file)


if __name__ == "__main__":
    main()
