"""Imported-model benchmark: models people already have, trained by torch eager, torch.compile (Inductor), torch.compile
with backend="ember", and ember.jit on the from_torch import, with step time and first-step time. The CNN rows also
run torch eager in channels-last memory, torch.compile's max-autotune mode (without CUDA graphs) and the ember
backend with its convolutions' activations on (N, C, H, W) memory (ember's default is channels-last:
ember.set_conv_memory_format); every row runs
torch.compile's reduce-overhead mode (Inductor's kernels replayed as CUDA graphs) too.

Rows:
 resnet50         torchvision's ResNet-50, 224x224 x 64, bfloat16, SGD momentum 0.9
 mobilenet_v3     torchvision's MobileNetV3-Large, the same (dropout 0: every variant's losses comparable)
 efficientnet_b0  torchvision's EfficientNet-B0, the same (dropout and stochastic depth 0)
 gpt2      transformers' GPT-2 124M shape (12 layers, width 768, 12 heads, T 1024) x 8, bfloat16, AdamW; attention
           as transformers' "sdpa"

Steps are timed back to back (median of 3 bursts), from the first call until the GPU is done; "first step" is a
variant's first call until its loss is on the host (point EMBER_CACHE_DIR and TRITON_CACHE_DIR at empty
directories for a cold start). Every variant's first losses are checked against torch eager's.

    python benchmarks/import.py                      # on a CUDA GPU, appended to RESULTS.md
    python benchmarks/import.py --rows gpt2 --skip "ember.jit from_torch"
    python benchmarks/import.py --cpu-smoke          # no GPU: tiny models, every code path, times mean nothing
    python benchmarks/import.py --rows resnet50 --skip "ember.jit from_torch" --breakdown
                                                     # and where each variant's step time goes (GPU only)

--breakdown adds, per variant, its host time per step (until the calls return) against its wall time, its GPU time
by kernel kind (ember's generated kernels by kind, cuDNN convolutions, cuBLAS matmuls, copies and fills, other
torch kernels) from torch.profiler, and for the ember backend whether each of its graphs replays as CUDA graphs;
--kernels FILE writes every kernel's time per step there (JSON); --explain FILE appends the plans of ember's variants'
first steps there.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as TF

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

VARIANTS = ("torch eager", "torch eager channels-last", "torch.compile", "torch.compile reduce-overhead",
            "torch.compile max-autotune", "torch.compile backend=ember", "torch.compile backend=ember NCHW",
            "ember.jit from_torch")
CNNS = ("resnet50", "mobilenet_v3", "efficientnet_b0")
ROWS = (*CNNS, "gpt2")
# the CNN rows' other variants ("backend=ember NCHW": ember.set_conv_memory_format("contiguous"))
CNN_ONLY = ("torch eager channels-last", "torch.compile max-autotune", "torch.compile backend=ember NCHW")
CHECK_STEPS = 3
LOSS_TOL = 5e-2  # relative, bfloat16


def make(row: str, smoke: bool, dev: str):
    """(model, batch inputs, targets, optimizer class and settings) of a row, on `dev` in bfloat16 (float64 smoke:
    the smoke's ResNet-50 batch-normalizes 2 values at 1x1 in its last stage, where float32 rounding alone moves the
    second step's loss by more than 10x between any two implementations)."""
    from model_libraries import library

    dtype = torch.float64 if smoke else torch.bfloat16
    torch.manual_seed(0)
    if row in CNNS:
        models = library("torchvision").models
        model = {"resnet50": lambda: models.resnet50(num_classes=1000),
                 "mobilenet_v3": lambda: models.mobilenet_v3_large(num_classes=1000, dropout=0.0),
                 "efficientnet_b0": lambda: models.efficientnet_b0(num_classes=1000, dropout=0.0,
                                                                    stochastic_depth_prob=0.0)}[row]()
        # the smoke's lightest size at which float64 rounding alone leaves the first steps' losses comparable
        # (EfficientNet at 2 x 32x32 normalizes 2 values a channel in its last stage: a layout change moved its third
        # loss by 26%)
        batch, size = ((2, 32) if row == "resnet50" else (4, 64)) if smoke else (64, 224)
        x = torch.randn(batch, 3, size, size)
        y = torch.randint(0, 1000, (batch,))
        optimizer = (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})
    else:
        transformers = library("transformers")
        layers, width, heads, context, batch = (2, 64, 2, 32, 2) if smoke else (12, 768, 12, 1024, 8)
        config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=context,
                                         vocab_size=50304, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         use_cache=False, attn_implementation="sdpa")
        model = transformers.GPT2LMHeadModel(config)
        x = torch.randint(0, 50304, (batch, context))
        y = torch.randint(0, 50304, (batch * context,))
        optimizer = (torch.optim.AdamW, {"lr": 3e-4})
    model = model.to(dev, dtype)
    return model, x.to(dev, dtype) if x.is_floating_point() else x.to(dev), y.to(dev), optimizer


def logits(out):
    return out.logits if hasattr(out, "logits") else out


def torch_step(model, optimizer, backend: str | None, mode: str | None = None, channels_last: bool = False):
    """torch's training step: eager (`backend` None) or compiled by `backend` (in `mode`); the model and its
    inputs in channels-last memory where asked."""
    if backend == "ember":
        import ember.frontends.dynamo  # noqa: F401  (registers the backend where ember is on the path, not installed)
    if channels_last:
        model.to(memory_format=torch.channels_last)
    opt = optimizer[0](model.parameters(), **optimizer[1])
    if mode == "reduce-overhead":
        state_before_graphs(opt)

    def step(x, y):
        out = logits(model(x))
        loss = TF.cross_entropy(out.reshape(-1, out.shape[-1]), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss
    if backend is not None:
        step = torch.compile(step, backend=backend, mode=mode)
    if not channels_last:
        return step
    return lambda x, y: step(x.contiguous(memory_format=torch.channels_last), y)


def state_before_graphs(opt) -> None:
    """The optimizer's state made before the step is compiled, holding the values its first step would make: under
    reduce-overhead, state made inside the step is output memory of a CUDA graph, which the next replay overwrites
    (torch refuses to read it). SGD's momentum starts at zero (its first step then leaves the gradient, as a clone
    of it would), Adam's and AdamW's moments at zero, their step counts on the device (capturable, as CUDA graphs
    need)."""
    for group in opt.param_groups:
        for p in group["params"]:
            if isinstance(opt, torch.optim.SGD) and group["momentum"]:
                opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
            elif isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
                group["capturable"] = True
                opt.state[p].update(step=torch.zeros((), dtype=torch.float32, device=p.device),
                                    exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))


def ember_step(model, optimizer, x, y, smoke: bool):
    """ember.jit of the step on the import (under --cpu-smoke on ember's cpu device: through the interpreter these
    models take many minutes)."""
    from common import to_ember

    import ember

    imported = ember.from_torch(model)
    if smoke:
        to_ember = ember.from_dlpack
    else:
        imported = imported.to("cuda")
    opt = getattr(ember.optim, optimizer[0].__name__)(imported.parameters(), **optimizer[1])

    def step(x, y):
        out = logits(imported(x))
        loss = ember.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss
    run, ex, ey = ember.jit(step), to_ember(x), to_ember(y)
    return lambda *_: run(ex, ey)


def sync(smoke: bool) -> None:
    if not smoke:
        torch.cuda.synchronize()


def measure(step, x, y, smoke: bool, reps: int, explained: list | None = None) -> dict:
    """The step's first-call time, first losses and median time per step; `explained`: a list to put the plans
    of the first call in (ember.explain.capture; they are then planned twice, and the first call takes longer)."""
    import contextlib

    import ember

    start = time.perf_counter()
    with ember.explain.capture() if explained is not None else contextlib.nullcontext([]) as plans:
        losses = [float(step(x, y).item())]
    first = time.perf_counter() - start
    if explained is not None:
        explained.extend(plans)
    losses += [float(step(x, y).item()) for _ in range(CHECK_STEPS - 1)]
    times = []
    for _ in range(3):
        sync(smoke)
        start = time.perf_counter()
        for _ in range(reps):
            step(x, y)
        sync(smoke)
        times.append((time.perf_counter() - start) * 1e3 / reps)
    return {"first_s": first, "losses": losses, "ms": statistics.median(times)}


def variant_line(row: str, variant: str, base, x, y, optimizer, args) -> dict:
    """One variant's step, measured (an error is reported and leaves its cells empty)."""
    from common import guarded

    model = copy.deepcopy(base)
    inductor = "eager" if args.cpu_smoke else "inductor"
    backend = "ember" if variant.startswith("torch.compile backend=ember") else {
        "torch eager": None, "torch eager channels-last": None, "torch.compile": inductor,
        "torch.compile reduce-overhead": inductor, "torch.compile max-autotune": inductor}.get(variant)
    # max-autotune without its CUDA graphs: a replay overwrites the momenta the next step's optimizer reads
    mode = {"torch.compile max-autotune": "max-autotune-no-cudagraphs",
            "torch.compile reduce-overhead": "reduce-overhead"}.get(variant) if not args.cpu_smoke else None
    from ember.frontends import dynamo

    earlier = {line.split(":")[0] for line in dynamo.replay_report()}  # the graphs of variants before this one
    import ember

    nchw = backend == "ember" and variant.endswith("NCHW")
    with ember.conv_memory_format("contiguous" if nchw else ember.get_conv_memory_format()):
        if variant.startswith("ember"):
            step = guarded(f"{row} {variant} (setup)", lambda: ember_step(model, optimizer, x, y, args.cpu_smoke))
        else:
            step = guarded(f"{row} {variant} (setup)", lambda: torch_step(
                model, optimizer, backend, mode, backend is None and variant.endswith("channels-last")))
        explained = [] if args.explain and (backend == "ember" or variant.startswith("ember")) else None
        result = guarded(f"{row} {variant}", lambda: measure(step, x, y, args.cpu_smoke, args.reps,
                                                             explained)) if step else None
        line = {"row": row, "variant": variant, **(result or {})}
        if explained:
            with args.explain.open("a") as out:
                out.write(f"# {row} {variant}: the first step's plans\n\n" + "\n\n".join(map(str, explained))
                          + "\n\n")
        if result and args.breakdown and not args.cpu_smoke:
            from common import step_breakdown

            line["breakdown"] = guarded(f"{row} {variant} (breakdown)", lambda: step_breakdown(lambda: step(x, y),
                                                                                                args.reps))
            if backend == "ember":
                line["replays"] = [r for r in dynamo.replay_report() if r.split(":")[0] not in earlier]
    return line


def breakdown_notes(lines: list[dict]) -> list[str]:
    """A note per variant measured with --breakdown: where its step time goes."""
    from common import breakdown_lines

    notes = []
    for line in lines:
        b = line.get("breakdown")
        if not b:
            continue
        notes += breakdown_lines(f"{line['row']} {line['variant']}", b)
        notes += [f"{line['row']} {line['variant']} {report}" for report in line.get("replays", [])]
    return notes


def progress(line: dict) -> str:
    """A variant's result as soon as it is measured, so that a run cut short still reports what it finished."""
    if "ms" not in line:
        return "error"
    losses = ", ".join(f"{loss:.4g}" for loss in line["losses"])
    text = f"{line['ms']:.2f} ms per step, first step {line['first_s']:.3g} s, losses {losses}"
    return "\n".join([text, *(f"    {note}" for note in breakdown_notes([line]))])


def run_row(row: str, args) -> list[dict]:
    from common import release_memory

    lines = []
    base, x, y, optimizer = make(row, args.cpu_smoke, args.dev)
    for variant in VARIANTS:
        if variant in args.skip or (variant in CNN_ONLY and row not in CNNS):
            continue
        print(f"  {row}: {variant}", flush=True)
        lines.append(variant_line(row, variant, base, x, y, optimizer, args))
        release_memory(args.cpu_smoke)
        print(f"  {row}: {variant}: {progress(lines[-1])}", flush=True)
    reference = next((line.get("losses") for line in lines if line["variant"] == "torch eager"), None)
    for line in lines:
        mine = line.get("losses")
        if line["variant"] == "torch eager":
            line["check"] = "reference"
        elif mine and reference:
            err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(mine, reference))
            line["check"] = f"{err:.1e}" + ("" if err <= LOSS_TOL else " FAIL")
        else:
            line["check"] = "error"
    return lines


def main(argv: list[str] | None = None) -> None:
    from common import cell, environment, markdown_table, parse_named_rows, publish

    def breakdown_option(parser) -> None:
        parser.add_argument("--breakdown", action="store_true", help="also where each variant's step time goes: "
                            "host against GPU time, GPU time by kernel kind, the ember backend's CUDA graph replays")
        parser.add_argument("--kernels", type=Path, default=None, help="with --breakdown: a JSON file to write every "
                            "kernel's GPU time per step to, per row and variant (name, ms, launches)")
        parser.add_argument("--explain", type=Path, default=None, help="a file to append the plans of ember's "
                            "variants' first steps to (ember.explain, GEMM choices and their times included; the "
                            "first step is then planned twice and takes longer)")

    args = parse_named_rows(argv, "import.py", __doc__, ",".join(ROWS), VARIANTS, 10,
                            "tiny models in float64, ember on its cpu device (the reference backend), torch.compile "
                            "with backend='eager'", add_options=breakdown_option)
    unknown = sorted(set(args.rows.split(",")) - set(ROWS))
    if unknown:
        raise SystemExit(f"--rows: no row {', '.join(unknown)}; rows are {', '.join(ROWS)}")
    lines = []
    for row in args.rows.split(","):
        lines += run_row(row, args)
    eager = {line["row"]: line.get("ms") for line in lines if line["variant"] == "torch eager"}
    inductor = {line["row"]: line.get("ms") for line in lines if line["variant"] == "torch.compile"}

    def against(base: dict, line: dict) -> str:
        """The line's speed against a variant's on its row; "not run" where --skip left that variant out."""
        if line["row"] not in base:
            return "not run"
        ms = base[line["row"]]
        return cell(ms / line["ms"] if line.get("ms") and ms else None, "{:.2f}x")

    body = [[line["row"], line["variant"], cell(line.get("ms")), against(eager, line), against(inductor, line),
             cell(line.get("first_s"), "{:.3g}"), line["check"]] for line in lines]
    table = markdown_table(["row", "variant", "ms per step", "vs torch eager", "vs torch.compile", "first step s",
                            "loss check"], body)
    notes = ["a training step: forward, cross entropy, backward, optimizer step; torch.compile variants compile the "
             "whole step", f"loss check: the first {CHECK_STEPS} losses against torch eager's, relative tolerance "
             f"{LOSS_TOL}", *breakdown_notes(lines)]
    if args.kernels:
        args.kernels.write_text(json.dumps({f"{line['row']} {line['variant']}": line["breakdown"]["kernels"]
                                            for line in lines if line.get("breakdown")}, indent=1))
    results = args.results or (None if args.cpu_smoke else HERE / "RESULTS.md")
    publish(f"Import benchmark: {environment(args.cpu_smoke)}", table, notes, results)


if __name__ == "__main__":
    main()
