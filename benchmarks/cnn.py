"""CNN training benchmark: a ResNet-18 training step (forward, cross entropy, backward, SGD with momentum) in
ember (lazy, ember.jit; "ember.jit NCHW" with its convolutions' activations on (N, C, H, W) memory instead of
ember's default channels-last) against PyTorch eager (NCHW and channels-last), torch.compile (default and
max-autotune), with images/s, the GPU time of each variant's kernels, peak memory and the first step's time.

"ember.jit from_torch" trains torch's own model (the variants' torch.nn ResNet-18) imported with
`ember.from_torch`, which traces it with torch.fx and shares its parameters.

Rows:
 1  ResNet-18 for 32x32 inputs (3x3 stem, no max-pool), batch 256, bfloat16 parameters and inputs
 2  the same network and batch, float32 parameters under autocast(bfloat16)
 3  ResNet-18 for 224x224 inputs (7x7 stride-2 stem, max-pool), batch 128, bfloat16 parameters and inputs
 4  the same as row 3 under autocast(bfloat16) with float32 parameters

Steps are timed back to back (the host may run ahead of the GPU), from the first call until the GPU is
done, divided by the steps. "first step" is the first call of a variant in this process, until its loss is
known: compilation included (ember's kernel caches are those of the environment: point EMBER_CACHE_DIR and
TRITON_CACHE_DIR at empty directories to measure a cold start). Every variant's first losses are checked
against torch eager's (same initial weights, same batch).

    python benchmarks/cnn.py                          # full sizes on a CUDA GPU, appended to RESULTS.md
    python benchmarks/cnn.py --rows 1 --skip max-autotune
    EMBER_INTERPRET=1 python benchmarks/cnn.py --cpu-smoke   # no GPU: tiny sizes, every code path
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as TF
from common import (
    breakdown_lines,
    cell,
    device_ms,
    environment,
    guarded,
    loop_ms,
    markdown_table,
    parse_options,
    publish,
    release_memory,
    step_breakdown,
    to_ember,
    training_step,
)

import ember
import ember.nn.functional as EF

# row: (image size, batch, autocast) at (full, --quick, --cpu-smoke); --cpu-smoke also narrows the network
ROWS = {
    "1": ((32, 256, False), (32, 64, False), (16, 8, False)),
    "2": ((32, 256, True), (32, 64, True), (16, 8, True)),
    "3": ((224, 128, False), (224, 32, False), (32, 4, False)),
    "4": ((224, 128, True), (224, 32, True), (32, 4, True)),
}
WIDTHS = ((64, 128, 256, 512), (64, 128, 256, 512), (4, 4, 8, 8))
CLASSES = 10
CHECK_STEPS = 3
LOSS_TOL = 5e-2  # relative, bfloat16 convolutions
VARIANTS = ("torch eager", "torch eager channels-last", "torch.compile", "torch.compile max-autotune",
            "ember lazy", "ember.jit", "ember.jit NCHW", "ember.jit from_torch")


def resnet18(nn, image_size: int, widths: tuple[int, ...], device: str, dtype):
    """torchvision's ResNet-18 layout, written once for torch.nn and ember.nn: for inputs of 32x32 or smaller a
    3x3 stem without max-pool (as CIFAR ResNets), otherwise the 7x7 stride-2 stem and a 3x3 max-pool."""
    kw = dict(device=device, dtype=dtype)

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False, **kw)
            self.bn1 = nn.BatchNorm2d(cout, **kw)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False, **kw)
            self.bn2 = nn.BatchNorm2d(cout, **kw)
            self.relu = nn.ReLU()
            self.shortcut = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False, **kw), nn.BatchNorm2d(cout, **kw))

        def forward(self, x):
            h = self.relu(self.bn1(self.conv1(x)))
            return self.relu(self.bn2(self.conv2(h)) + self.shortcut(x))

    small = image_size <= 32
    stem = [nn.Conv2d(3, widths[0], 3, 1, 1, bias=False, **kw) if small else
            nn.Conv2d(3, widths[0], 7, 2, 3, bias=False, **kw), nn.BatchNorm2d(widths[0], **kw), nn.ReLU()]
    if not small:
        stem.append(nn.MaxPool2d(3, 2, 1))
    blocks, cin = [], widths[0]
    for i, cout in enumerate(widths):
        blocks += [Block(cin, cout, 1 if i == 0 else 2), Block(cout, cout, 1)]
        cin = cout
    return nn.Sequential(*stem, *blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, CLASSES, **kw))


@dataclass
class Line:
    row: str
    workload: str
    variant: str
    ms: float | None
    images: int
    first_s: float | None = None
    gpu_ms: float | None = None
    peak_gib: float | None = None
    check: str = "-"
    breakdown: list[str] | None = None  # --breakdown: where the step's time goes (common.breakdown_lines)


class Workload:
    """One initial state and batch, from which each variant builds its own model and optimizer."""

    def __init__(self, image_size: int, batch: int, amp: bool, widths: tuple[int, ...], dev: str):
        self.image_size, self.batch, self.amp, self.widths, self.dev = image_size, batch, amp, widths, dev
        self.torch_dtype = torch.float32 if amp else torch.bfloat16
        self.init = [t.detach().clone() for t in self.torch_model(False).state_dict().values()]
        self.x = torch.randn(batch, 3, image_size, image_size, device=dev, dtype=self.torch_dtype)
        self.y = torch.randint(0, CLASSES, (batch,), device=dev)

    def torch_model(self, channels_last: bool):
        model = resnet18(torch.nn, self.image_size, self.widths, self.dev, self.torch_dtype)
        if hasattr(self, "init"):
            with torch.no_grad():
                for t, value in zip(model.state_dict().values(), self.init):
                    t.copy_(value)
        return model.to(memory_format=torch.channels_last) if channels_last else model

    def torch_step(self, mode: str | None, channels_last: bool, cpu: bool) -> Callable[[], object]:
        model = self.torch_model(channels_last)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        autocast = (lambda: torch.autocast(self.dev, dtype=torch.bfloat16)) if self.amp else None
        step = training_step(TF, model, optimizer, autocast)
        if mode == "max-autotune":
            # without its CUDA graphs: a graph replay overwrites the momentum buffers the next step's optimizer
            # reads (torch raises "accessing tensor output of CUDAGraphs that has been overwritten")
            mode = "max-autotune-no-cudagraphs"
        if mode is not None:
            step = torch.compile(step, backend="eager") if cpu else torch.compile(step, mode=mode)
        x = self.x.contiguous(memory_format=torch.channels_last) if channels_last else self.x
        return lambda: step(x, self.y)

    def ember_step(self, jit: bool, imported: bool = False, memory_format: str | None = None) -> Callable[[], object]:
        """ember's ResNet, or (`imported`) torch's model through ember.from_torch (traced with torch.fx, its
        parameters shared); its convolutions' activations in `memory_format` (None: ember's default)."""
        if memory_format is not None:
            step = self.ember_step(jit, imported)

            def in_format():
                with ember.conv_memory_format(memory_format):
                    return step()
            return in_format
        dtype = ember.float32 if self.amp else ember.bfloat16
        if imported:
            model = ember.from_torch(self.torch_model(False)).to("cuda")
        else:
            model = resnet18(ember.nn, self.image_size, self.widths, "cuda", dtype)
            for name, value in zip(model.state_dict(), self.init):
                _assign(model, name, to_ember(value.clone()))
        optimizer = ember.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        autocast = (lambda: ember.autocast("cuda", dtype=ember.bfloat16)) if self.amp else None
        step = training_step(EF, model, optimizer, autocast)
        step = ember.jit(step) if jit else step
        x, y = to_ember(self.x), to_ember(self.y)
        return lambda: step(x, y)


def _assign(model, name: str, value: ember.Tensor) -> None:
    """Set a parameter's or buffer's value by its state_dict name."""
    *path, leaf = name.split(".")
    owner = model
    for part in path:
        owner = getattr(owner, part)
    target = getattr(owner, leaf)
    if target.shape != value.shape:
        raise ValueError(f"{name}: ember's {target.shape} against torch's {value.shape}")
    target.data = value


def run_row(row: str, args) -> list[Line]:
    cpu = args.cpu_smoke
    image_size, batch, amp = ROWS[row][args.which]
    work = Workload(image_size, batch, amp, WIDTHS[args.which], args.dev)
    workload = (f"resnet18 {image_size}x{image_size} x {batch}, "
                + ("f32 params, autocast bf16" if amp else "bf16"))
    makers = {
        "torch eager": lambda: work.torch_step(None, False, cpu),
        "torch eager channels-last": lambda: work.torch_step(None, True, cpu),
        "torch.compile": lambda: work.torch_step("default", False, cpu),
        "torch.compile max-autotune": lambda: work.torch_step("max-autotune", False, cpu),
        "ember lazy": lambda: work.ember_step(jit=False),
        "ember.jit": lambda: work.ember_step(jit=True),
        "ember.jit NCHW": lambda: work.ember_step(jit=True, memory_format="contiguous"),
        "ember.jit from_torch": lambda: work.ember_step(jit=True, imported=True),
    }
    return run_variants(row, workload, makers, VARIANTS, batch, args)


def run_variants(row: str, workload: str, makers: dict[str, Callable[[], Callable[[], object]]],
                 variants: tuple[str, ...], count: int, args) -> list[Line]:
    """Measure each variant's step (made by `makers[variant]`, one at a time; `count` items per step) and check
    its first losses against torch eager's."""
    lines, losses = [], {}
    for name in variants:
        if name in args.skip:
            continue
        print(f"  {name}", flush=True)
        line = Line(row, workload, name, None, count)
        if not args.cpu_smoke:
            torch.cuda.reset_peak_memory_stats()
        step = guarded(f"{row} {name} (setup)", makers[name])
        if step is not None:
            losses[name] = measure(line, step, args)
        lines.append(line)
        del step
        release_memory(args.cpu_smoke)
    reference = losses.get("torch eager")
    for line in lines:
        mine = losses.get(line.variant)
        if line.variant == "torch eager":
            line.check = "reference"
        elif mine and reference:
            err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(mine, reference))
            line.check = f"{err:.1e}" + ("" if err <= LOSS_TOL else " FAIL")
        else:
            line.check = "error"
    return lines


def measure(line: Line, step: Callable[[], object], args) -> list[float] | None:
    """Fill in a variant's line from its step; return its first losses (None if it failed)."""
    what = f"{line.row} {line.variant}"
    start = time.perf_counter()
    first = guarded(f"{what} (first step)", lambda: float(step().item()))
    if first is None:
        return None
    line.first_s = time.perf_counter() - start
    rest = guarded(f"{what} (check)", lambda: [float(step().item()) for _ in range(CHECK_STEPS - 1)])
    line.ms = guarded(what, lambda: loop_ms(step, args.warmup, args.reps, args.cpu_smoke))
    if not args.cpu_smoke and line.ms is not None:
        line.gpu_ms = guarded(f"{what} (profiler)", lambda: device_ms(step, 1, 5))
        line.peak_gib = torch.cuda.max_memory_allocated() / 2**30
        if args.breakdown:
            b = guarded(f"{what} (breakdown)", lambda: step_breakdown(step, args.reps))
            line.breakdown = breakdown_lines(what, b) if b else None
            print("\n".join(f"    {note}" for note in line.breakdown or ()), flush=True)
    return [first, *rest] if rest is not None else None


def table(lines: list[Line], cpu: bool, unit: str = "images") -> str:
    """The lines as a markdown table; `unit` names what a line's `images` counts (per second in the table)."""
    gpu_only = (lambda value, fmt="{:.4g}": "-") if cpu else cell
    eager = {line.row: line.ms for line in lines if line.variant == "torch eager"}
    head = ["row", "workload", "variant", "ms per step", "vs torch eager", f"{unit}/s", "kernels' GPU ms",
            "peak GiB", "first step s", "loss check"]
    body = []
    for line in lines:
        base = eager.get(line.row)
        body.append([line.row, line.workload, line.variant, cell(line.ms),
                     cell(base / line.ms if base and line.ms else None, "{:.2f}x"),
                     cell(line.images / line.ms * 1e3 if line.ms else None, "{:.0f}"), gpu_only(line.gpu_ms),
                     gpu_only(line.peak_gib, "{:.2f}"), cell(line.first_s, "{:.3g}"), line.check])
    return markdown_table(head, body)


def main(argv: list[str] | None = None) -> None:
    notes = ["torch.backends.cudnn.benchmark = True for every variant; SGD lr 0.05 momentum 0.9; torch.compile "
             "compiles the whole step, optimizer.step() included"]
    torch.backends.cudnn.benchmark = True  # torch's variants pick their convolution algorithms as users do
    bench_main(argv, "cnn.py", __doc__, ROWS, VARIANTS, run_row, "CNN benchmark", "images", notes,
               "a network 16x narrower")


def bench_main(argv: list[str] | None, script: str, doc: str, rows: dict, variants: tuple[str, ...],
               run_row: Callable[[str, object], list[Line]], title: str, unit: str, notes: list[str],
               smoke_model: str) -> None:
    """A training benchmark's command line, rows and report (this script's and gpt.py's)."""
    def options(parser):
        parser.add_argument("--skip", default="", help=f"variants to leave out, comma-separated, of {variants}")
        parser.add_argument("--breakdown", action="store_true", help="also where each variant's step time goes: "
                            "host against GPU time, GPU time by kernel kind, the costliest kernels")

    opts = parse_options(argv, script, doc, lambda which, dev: ((row, None) for row in rows),
                         rows_example=",".join(list(rows)[:2]), add_options=options)
    args = opts.args
    args.which, args.dev = opts.which, opts.dev
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.skip - set(variants):
        raise SystemExit(f"--skip: no variant {sorted(args.skip - set(variants))}; variants are {variants}")
    ember.manual_seed(0)
    lines: list[Line] = []
    for row in opts.selected:
        print(f"row {row}", flush=True)
        lines += guarded(f"row {row}", lambda row=row: run_row(row, args)) or [Line(row, "", "setup", None, 0)]
        release_memory(args.cpu_smoke)
    notes = ["time per step of steps run back to back (median of 3 bursts), first call to GPU done; kernels' GPU "
             "ms: the profiler's sum of the step's kernel and copy durations; peak: torch.cuda.max_memory_allocated "
             "during the variant (ember allocates through torch); first step: the variant's first call until its "
             "loss is on the host, compilation included",
             f"loss check: the first {CHECK_STEPS} losses against torch eager's, relative tolerance {LOSS_TOL}", *notes]
    if args.skip:
        notes.append(f"variants left out of this run: {', '.join(sorted(args.skip))}")
    notes += [note for line in lines for note in line.breakdown or ()]
    if args.cpu_smoke:
        notes.append("--cpu-smoke: times mean nothing (torch on the CPU, ember's kernels through Triton's "
                     f"interpreter, {smoke_model}); torch.compile variants ran with backend='eager'")
    publish(f"{title}: {environment(args.cpu_smoke)}" + (" (--quick sizes)" if args.quick else ""),
            table(lines, args.cpu_smoke, unit), notes, opts.results_file)

if __name__ == "__main__":
    main()
