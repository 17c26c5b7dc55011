"""Reductions benchmark: column sums against row sums of the same bytes, and a ResNet stem's max-pool gradient.

A column sum reduces the rows of a row-major (R, C) matrix (the kept axis is the contiguous one: batch-norm
statistics and bias gradients in channels-last, (N*H*W, C)); a row sum reduces the contiguous axis of the same
bytes laid out (C, R). Both should read at close to the copy bandwidth. One row per (C, dtype) with R*C about
2^25 elements, against torch eager (x.sum(0)), torch.compile and a large device-to-device copy measured first;
then max_pool2d (kernel 3, stride 2, padding 1) forward and backward on a ResNet stem's activation, (64, 64,
112, 112) bf16 in both memory layouts, against torch, and against ember's earlier composition (one gradient term
per kernel offset, nine, where the stride-phase gradient reads at most four windows per input element).

A time is the median of one step, from the call until the GPU is done (CUDA events, the GPU idle when it
starts); ember's includes building the lazy graph and the plan-cache lookup, and 'kernels ms' replays its cached
plan alone. '% copy' is the fewest bytes a step must move (each input read once, each output written once) over
that time, as a share of the copy bandwidth. Every result is checked against torch one precision higher.

    python benchmarks/reductions.py                       # full sizes, appended to benchmarks/RESULTS.md
    python benchmarks/reductions.py --quick --rows c64    # small sizes, some rows; nothing appended
    python benchmarks/reductions.py --cpu-smoke           # no GPU: tiny sizes, every code path
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import common
import torch
from fusion import copy_gbs, error, replay, widen

import ember
import ember.nn.functional as EF
from ember.ops.pooling import _pool_windows, first_maximum

# (full, --quick, --cpu-smoke) sizes
ELEMENTS = (2**25, 2**22, 2**12)  # R * C of a reduction's input, about
STEM = ((64, 64, 112), (16, 64, 112), (2, 3, 12))  # max_pool2d's input: batch, channels, height = width
COPY_BYTES = (2**30, 2**28, 2**22)
WIDTHS = (3, 64, 256, 1024, 4096)  # C, the kept (column sums) or reduced (row sums) length
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


@dataclass
class Case:
    row: str
    name: str
    shape: str
    nbytes: int  # the fewest bytes one step moves
    ember: Callable[[], tuple]  # one step's lazy outputs (built, not realized)
    torch: Callable[[], object]  # one eager step
    compiled: Callable[[], Callable[[], object]]  # makes the torch.compile'd step
    reference: Callable[[], list]  # the results one precision higher, as torch tensors
    tol: float
    extra: dict[str, Callable[[], tuple]] = field(default_factory=dict)  # more ember variants: lazy outputs


def reduction_case(kind: str, width: int, dtype: str, elements: int, dev: str) -> Case:
    """A column sum of (R, width) or a row sum of (width, R): the same bytes, reduced along either axis."""
    rows = max(elements // width, 1)
    shape = (rows, width) if kind == "column" else (width, rows)
    axis = 0 if kind == "column" else 1
    x = torch.randn(shape, device=dev, dtype=DTYPES[dtype])
    ex = common.to_ember(x)
    itemsize = x.element_size()

    def reduce(t):
        return t.sum(axis)

    return Case(f"{kind[0]}{width}-{dtype}", f"{kind} sum", f"{shape[0]}x{shape[1]} {dtype}",
                x.numel() * itemsize + width * itemsize, lambda: (reduce(ex),), lambda: reduce(x),
                lambda: torch.compile(lambda: reduce(x)), lambda: [reduce(widen(x))],
                # a float32 sum of 2^25 values (~6000 of them per column) in another order: ~1e-6 apart
                1e-2 if dtype == "bf16" else 1e-5)


def stem_case(batch: int, channels: int, size: int, channels_last: bool, dev: str) -> Case:
    """max_pool2d(3, 2, 1) of a ResNet stem's activation, forward and backward for an upstream gradient."""
    bf16 = dict(device=dev, dtype=torch.bfloat16)
    x = torch.randn(batch, channels, size, size, **bf16)
    out = (size - 1) // 2 + 1
    upstream = torch.randn(batch, channels, out, out, **bf16)
    if channels_last:
        x, upstream = (t.contiguous(memory_format=torch.channels_last) for t in (x, upstream))
        # ember sees channels-last memory as a permute of an (N, H, W, C) buffer, and differentiates that buffer
        leaf = common.to_ember(x.permute(0, 2, 3, 1), requires_grad=True)
        eg = common.to_ember(upstream.permute(0, 2, 3, 1))
        as_nchw = lambda t: t.permute(0, 3, 1, 2)  # noqa: E731
    else:
        leaf, eg = common.to_ember(x, requires_grad=True), common.to_ember(upstream)
        as_nchw = lambda t: t  # noqa: E731
    x.requires_grad_()

    def ember_step(pool) -> tuple:
        y = pool(as_nchw(leaf))
        return (y, *ember.grad(y, [leaf], as_nchw(eg)))

    def reference() -> list:
        y, dx = torch_step(widen(x).requires_grad_(), widen(upstream))
        return [y, dx.permute(0, 2, 3, 1) if channels_last else dx]

    def nine_terms(t):  # the composition before: one gradient term per kernel offset
        attrs = {"kernel": (3, 3), "stride": (2, 2), "padding": (1, 1), "ceil_mode": False}
        return first_maximum(_pool_windows(t, attrs), True)

    def torch_step(t, g):
        y = torch.nn.functional.max_pool2d(t, 3, 2, 1)
        return (y, *torch.autograd.grad(y, [t], g))

    layout = "channels-last" if channels_last else "contiguous"
    pixels = batch * channels * (size * size + out * out)
    return Case(f"pool-{'nhwc' if channels_last else 'nchw'}", f"max_pool2d(3, 2, 1) fwd+bwd, {layout}",
                f"{batch}x{channels}x{size}x{size} bf16", 2 * pixels * 2,  # read x, g; write y, dx
                lambda: ember_step(lambda t: EF.max_pool2d(t, 3, 2, 1)), lambda: torch_step(x, upstream),
                lambda: (lambda f: lambda: f(x, upstream))(torch.compile(torch_step)),
                reference, 1e-2,
                extra={"ember, nine window terms (before)": lambda: ember_step(nine_terms)})


def cases(which: int, dev: str) -> list[tuple[str, Callable[[], Case]]]:
    made = []
    for width in WIDTHS:
        for dtype in DTYPES:
            for kind in ("column", "row"):
                made.append((f"{kind[0]}{width}", lambda k=kind, w=width, d=dtype: reduction_case(
                    k, w, d, ELEMENTS[which], dev)))
    batch, channels, size = STEM[which]
    for channels_last in (False, True):
        made.append(("pool", lambda c=channels_last: stem_case(batch, channels, size, c, dev)))
    return made


def run(case: Case, args, bandwidth: float, notes: list[str]) -> dict:
    cpu, warmup, reps = args.cpu_smoke, args.warmup, args.reps
    result: dict = {"row": case.row, "name": case.name, "shape": case.shape, "nbytes": case.nbytes, "tol": case.tol}

    def realized(build):
        outputs = build()
        ember.realize(*outputs)
        return outputs

    def check():
        return max(error(common.to_torch(e), r)[1] for e, r in zip(realized(case.ember), case.reference()))

    timed = common.median_ms
    result["rel"] = common.guarded(f"{case.row} ember (check)", check)  # also ember's first step: compiles the plan
    step = lambda: realized(case.ember)  # noqa: E731
    result["ember"] = common.guarded(f"{case.row} ember", lambda: timed(step, warmup, reps, cpu))
    if not cpu:
        result["kernels"] = common.guarded(f"{case.row} ember kernels", lambda: timed(replay(case.ember), 1, reps, cpu))
    result["eager"] = common.guarded(f"{case.row} eager", lambda: timed(case.torch, warmup, reps, cpu))
    if not cpu:
        result["compile"] = common.guarded(f"{case.row} torch.compile",
                                           lambda: timed(case.compiled(), warmup, reps, cpu))
    for label, build in case.extra.items():
        ms = common.guarded(f"{case.row} {label}", lambda build=build: timed(
            replay(build) if not cpu else lambda: realized(build), warmup, reps, cpu))
        mine = result.get("kernels" if not cpu else "ember")
        faster = f" (the stride-phase gradient {ms / mine:.2f}x as fast)" if ms and mine else ""
        notes.append(f"{case.row}: {label}: {common.cell(ms)} ms{' kernels' if not cpu else ''}{faster}")
    return result


def table(results: list[dict], bandwidth: float, cpu: bool) -> str:
    head = ["row", "workload", "size", "MB moved", "ember ms", "kernels ms", "kernels % copy", "eager ms",
            "eager % copy", "compile ms", "compile % copy", "vs eager", "vs compile", "rel err"]

    def share(ms):
        return "-" if not ms else f"{100 * res['nbytes'] / ms / 1e6 / bandwidth:.0f}"

    lines = []
    for res in results:
        ember_ms, kernels, eager, compiled = (res.get(k) for k in ("ember", "kernels", "eager", "compile"))
        best = kernels or ember_ms
        rel = res.get("rel")
        lines.append([
            res["row"], res["name"], res["shape"], f"{res['nbytes'] / 1e6:.3g}", common.cell(ember_ms),
            common.cell(kernels) if "kernels" in res else "-", share(kernels), common.cell(eager), share(eager),
            "skipped" if cpu else common.cell(compiled), "-" if cpu else share(compiled),
            common.cell(eager / best if eager and best else None, "{:.2f}x"),
            "-" if cpu else common.cell(compiled / best if compiled and best else None, "{:.2f}x"),
            "error" if rel is None else f"{rel:.1e}{'' if rel <= res['tol'] else ' FAIL'}"])
    return common.markdown_table(head, lines)


def main(argv: list[str] | None = None) -> None:
    opts = common.parse_options(argv, "reductions.py", __doc__, cases, compile_smoke="no torch.compile",
                         rows_example="c64,r64,pool")
    args, which, dev = opts.args, opts.which, opts.dev
    bandwidth = copy_gbs(COPY_BYTES[which], dev, args.warmup, args.reps, args.cpu_smoke)
    print(f"copy bandwidth: {bandwidth:.0f} GB/s (read + write)", flush=True)
    notes = [f"copy bandwidth {bandwidth:.0f} GB/s (bytes read + written by a {COPY_BYTES[which] / 2**20:.0f} MiB "
             "torch copy_); 'vs' columns compare with ember's kernels alone (its cached plan replayed)"]
    results: list[dict] = []
    common.for_each_case(opts, lambda case: results.append(run(case, args, bandwidth, notes)))
    common.publish(f"reductions benchmark: {common.environment(args.cpu_smoke)}"
            + (" (--quick sizes)" if args.quick and not args.cpu_smoke else ""),
            table(results, bandwidth, args.cpu_smoke), notes, opts.results_file)


if __name__ == "__main__":
    main()
