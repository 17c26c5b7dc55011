"""Data-parallel training benchmark: ember's DistributedDataParallel (a plain lazy loop, and ember.jit) against
torch's DistributedDataParallel (eager, and under torch.compile) at equal per-GPU batch, on 1, 2 and 4 GPUs, with
throughput, scaling efficiency, the communication left exposed and the first step's time.

Rows (the batch is per GPU):
 resnet50  torchvision's ResNet-50 (through ember.from_torch for ember), 224x224 x 64, bfloat16, SGD momentum
 gpt       the GPT of benchmarks/gpt.py row 1 (6 layers, width 512, 8 heads, T 512, vocabulary 8192) x 16,
           bfloat16, attention through scaled_dot_product_attention(is_causal=True), AdamW

This script starts itself under torchrun once per world size (`--gpus`, default every one of 1, 2, 4 this machine
has), one process per GPU; each process trains on its own batch. For each variant and world size:

- ms per step: steps run back to back (median of 3 bursts), first call until the GPU is done, the slowest rank's;
- per-GPU throughput, and scaling efficiency: per-GPU throughput against the same variant on one GPU;
- exposed communication: the step time on N GPUs less the same variant's on one (where the all-reduce of a world
  of one moves nothing), as a share of the step; the all-reduce floor: the time NCCL takes to average every
  gradient alone, in buckets of 25 MiB, with nothing else running;
- loss check: rank 0's first three losses against torch DDP eager's (same initial weights, same batches).

    python benchmarks/distributed.py                          # appended to RESULTS.md
    python benchmarks/distributed.py --gpus 1,2 --rows gpt --skip "torch DDP compiled"
    python benchmarks/distributed.py --cpu-smoke              # no GPU: 2 processes over gloo, tiny models
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.nn.functional as TF

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

VARIANTS = ("torch DDP eager", "torch DDP compiled", "ember lazy", "ember.jit")
# row: (batch per GPU, size) at (full, --cpu-smoke); size: image side, or (layers, width, heads, T, vocabulary)
ROWS = {"resnet50": ((64, 224), (2, 32)), "gpt": ((16, (6, 512, 8, 512, 8192)), (2, (1, 32, 4, 16, 64)))}
CHECK_STEPS = 3
LOSS_TOL = 5e-2  # relative, bfloat16
BUCKET_MB = 25


# -- one process of a world -----------------------------------------------------------------------------------

class Row:
    """One row's initial weights and this rank's batch, from which each variant builds its model."""

    def __init__(self, name: str, smoke: bool, dev: str, rank: int) -> None:
        self.name, self.dev, self.smoke = name, dev, smoke
        self.batch, self.size = ROWS[name][1 if smoke else 0]
        torch.manual_seed(0)
        self.init = [t.detach().clone() for t in self.torch_model().state_dict().values()]
        generator = torch.Generator().manual_seed(1000 + rank)
        if name == "resnet50":
            self.x = torch.randn(self.batch, 3, self.size, self.size, generator=generator).to(dev, self.dtype)
            self.y = torch.randint(0, 1000, (self.batch,), generator=generator).to(dev)
            self.items = self.batch
        else:
            layers, width, heads, context, vocab = self.size
            self.x = torch.randint(0, vocab, (self.batch, context), generator=generator).to(dev)
            self.y = torch.randint(0, vocab, (self.batch * context,), generator=generator).to(dev)
            self.items = self.batch * context

    @property
    def dtype(self):
        return torch.float32 if self.smoke else torch.bfloat16

    def torch_model(self, lib=torch):
        if self.name == "resnet50":
            import torchvision

            made = torchvision.models.resnet50(width_per_group=8 if self.smoke else 64)
        else:
            import gpt

            layers, width, heads, context, vocab = self.size
            made = gpt.model(lib, vocab, width, heads, layers, context, "sdpa")
        if lib is torch:
            made = made.to(self.dev, self.dtype)
            if hasattr(self, "init"):
                with torch.no_grad():
                    for t, value in zip(made.state_dict().values(), self.init):
                        t.copy_(value)
        return made

    def optimizer(self, lib, params):
        if self.name == "resnet50":
            return lib.optim.SGD(params, lr=0.05, momentum=0.9)
        return lib.optim.AdamW(params, lr=3e-4)

    def torch_step(self, compiled: bool):
        from common import training_step
        from torch.nn.parallel import DistributedDataParallel

        made = self.torch_model()
        if self.name == "resnet50" and not self.smoke:
            made = made.to(memory_format=torch.channels_last)
        ddp = DistributedDataParallel(made, device_ids=None if self.smoke else [torch.cuda.current_device()],
                                      bucket_cap_mb=BUCKET_MB)
        model = (torch.compile(ddp, backend="eager") if self.smoke else torch.compile(ddp)) if compiled else ddp
        step = training_step(TF, model, self.optimizer(torch, made.parameters()))
        x = self.x.contiguous(memory_format=torch.channels_last) if self.x.dim() == 4 and not self.smoke else self.x
        return lambda: step(x, self.y), made

    def ember_step(self, jit: bool):
        from cnn import _assign
        from common import to_ember, training_step

        import ember
        import ember.nn.functional as EF

        if self.name == "resnet50":
            made = ember.from_torch(self.torch_model()).to("cuda")
        else:
            made = self.torch_model(ember).to("cuda").to(ember.float32 if self.smoke else ember.bfloat16)
            for name, value in zip(made.state_dict(), self.init):
                _assign(made, name, to_ember(value.clone()))
        ddp = ember.nn.parallel.DistributedDataParallel(made, bucket_cap_mb=BUCKET_MB)
        step = training_step(EF, ddp, self.optimizer(ember, made.parameters()))
        step = ember.jit(step) if jit else step
        x, y = to_ember(self.x), to_ember(self.y)
        return (lambda: step(x, y)), made


def allreduce_floor(params: list[torch.Tensor], smoke: bool) -> float:
    """ms to average gradients of these parameters' sizes in buckets of BUCKET_MB, nothing else running."""
    total = sum(p.numel() * p.element_size() for p in params)
    dtype = params[0].dtype
    bucket = max(1, BUCKET_MB * 2**20 // params[0].element_size())
    left, buffers = total // params[0].element_size(), []
    while left > 0:
        buffers.append(torch.ones(min(bucket, left), dtype=dtype, device=params[0].device))
        left -= bucket
    average = tdist.ReduceOp.SUM if smoke else tdist.ReduceOp.AVG

    def once():
        for b in buffers:
            tdist.all_reduce(b, average)
    return _loop_ms(once, smoke)


def _sync(smoke: bool) -> None:
    if not smoke:
        torch.cuda.synchronize()


def _loop_ms(step, smoke: bool, warmup: int = 3, reps: int = 10, bursts: int = 3) -> float:
    """ms per step of `reps` steps back to back (median of `bursts`), the slowest rank's."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(bursts):
        _sync(smoke)
        tdist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            step()
        _sync(smoke)
        times.append((time.perf_counter() - start) * 1e3 / reps)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
    if not smoke:
        slowest = slowest.cuda()
    tdist.all_reduce(slowest, tdist.ReduceOp.MAX)
    return float(slowest.item())


def worker(args) -> None:
    import ember
    import ember.distributed as dist

    smoke = args.cpu_smoke
    dev = "cpu" if smoke else "cuda"
    with ember.device("cuda"):
        dist.init_process_group(timeout=600)
    rank, world = dist.get_rank(), dist.get_world_size()
    if not smoke:
        torch.backends.cudnn.benchmark = True
    results = []
    for name in args.rows.split(","):
        row = Row(name, smoke, dev, rank)
        for variant in VARIANTS:
            if variant in args.skip:
                continue
            if rank == 0:
                print(f"{world} GPU(s) {name} {variant}", flush=True)
            line = {"row": name, "variant": variant, "world": world, "items": row.items}
            try:
                start = time.perf_counter()
                step, model = row.torch_step("compiled" in variant) if variant.startswith("torch") else \
                    row.ember_step(variant == "ember.jit")
                losses = [float(step().item())]
                line["first_s"] = time.perf_counter() - start
                losses += [float(step().item()) for _ in range(CHECK_STEPS - 1)]
                line["losses"] = losses
                line["ms"] = _loop_ms(step, smoke, reps=args.reps)
                if variant == "torch DDP eager":
                    line["floor_ms"] = allreduce_floor([p for p in model.parameters()], smoke)
                if not smoke:
                    line["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            except Exception as error:  # a variant that fails is reported, the others still run
                line["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                print(f"rank {rank}: {variant} failed: {line['error']}", flush=True)
            results.append(line)
            if rank == 0:  # after each variant: a world stopped by --timeout still reports what it measured
                Path(args.worker).write_text(json.dumps(results))
            step = model = None
            torch._dynamo.reset()
            if not smoke:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            tdist.barrier()
    tdist.barrier()
    # Tearing NCCL down while CUDA graphs that hold its collectives are alive hung on an H200 pair (torch 2.11):
    # the results are written, so the process ends without it.
    sys.stdout.flush()
    os._exit(0)


# -- the launcher and the report ------------------------------------------------------------------------------

def launch(world: int, args, out: Path) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               __file__, "--worker", str(out), "--rows", args.rows, "--skip", ",".join(args.skip),
               "--reps", str(args.reps), *(["--cpu-smoke"] if args.cpu_smoke else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    if args.cpu_smoke:
        env.update(EMBER_INTERPRET="1", OMP_NUM_THREADS="1")
    try:
        done = subprocess.run(command, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"{world} GPU(s): stopped after {args.timeout} s", flush=True)
        return json.loads(out.read_text()) if out.exists() else []
    if done.returncode != 0 or not out.exists():
        print(f"{world} GPU(s): torchrun exited with {done.returncode}", flush=True)
        return []
    return json.loads(out.read_text())


def table(lines: list[dict]) -> str:
    from common import cell as shown
    from common import markdown_table

    def cell(value, fmt: str = "{:.4g}") -> str:
        return "-" if value is None else shown(value, fmt)

    one = {(r["row"], r["variant"]): r.get("ms") for r in lines if r["world"] == 1}
    eager = {(r["row"], r["world"]): r.get("losses") for r in lines if r["variant"] == "torch DDP eager"}
    floor = {(r["row"], r["world"]): r.get("floor_ms") for r in lines if r["variant"] == "torch DDP eager"}
    best_torch = {}
    for r in lines:
        if r["variant"].startswith("torch") and r.get("ms"):
            key = (r["row"], r["world"])
            best_torch[key] = min(best_torch.get(key, float("inf")), r["ms"])
    head = ["row", "GPUs", "variant", "ms per step", "items/s per GPU", "items/s", "scaling", "exposed comm",
            "all-reduce alone ms", "vs torch DDP best", "first step s", "peak GiB", "loss check"]
    body = []
    for r in lines:
        ms, key = r.get("ms"), (r["row"], r["world"])
        base = one.get((r["row"], r["variant"]))
        per_gpu = r["items"] / ms * 1e3 if ms else None
        scaling = base / ms if ms and base else None
        exposed = (ms - base) / ms if ms and base and r["world"] > 1 else None
        reference, mine = eager.get(key), r.get("losses")
        if r["variant"] == "torch DDP eager":
            check = "reference"
        elif mine and reference:
            err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(mine, reference))
            check = f"{err:.1e}" + ("" if err <= LOSS_TOL else " FAIL")
        else:
            check = r.get("error", "error")[:60]
        body.append([r["row"], r["world"], r["variant"], cell(ms), cell(per_gpu, "{:.0f}"),
                     cell(per_gpu * r["world"] if per_gpu else None, "{:.0f}"), cell(scaling, "{:.3f}"),
                     cell(exposed, "{:.1%}"), cell(floor.get(key), "{:.2f}"),
                     cell(best_torch[key] / ms if ms and key in best_torch else None, "{:.2f}x"),
                     cell(r.get("first_s"), "{:.3g}"), cell(r.get("peak_gib"), "{:.2f}"), check])
    return markdown_table(head, body)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", default=None, help="world sizes, e.g. 1,2 (default: each of 1, 2, 4 available)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"rows, of {list(ROWS)}")
    parser.add_argument("--skip", default="", help=f"variants to leave out, comma-separated, of {VARIANTS}")
    parser.add_argument("--reps", type=int, default=10, help="steps per timed burst (default 10)")
    parser.add_argument("--cpu-smoke", action="store_true", help="no GPU: 2 processes over gloo, tiny models, "
                        "ember through Triton's interpreter, torch.compile with backend='eager'")
    parser.add_argument("--results", type=Path, default=None, help="markdown file to append to (default "
                        "RESULTS.md for GPU runs)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a world size may take (default 1800)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.skip - set(VARIANTS):
        parser.error(f"--skip: no variant {sorted(args.skip - set(VARIANTS))}; variants are {VARIANTS}")
    if set(args.rows.split(",")) - set(ROWS):
        parser.error(f"--rows: rows are {list(ROWS)}")
    if args.worker is not None:
        return worker(args)
    available = 2 if args.cpu_smoke else torch.cuda.device_count()
    if not available:
        sys.exit("distributed.py times CUDA GPUs; without one, add --cpu-smoke")
    worlds = [int(w) for w in args.gpus.split(",")] if args.gpus else [w for w in (1, 2, 4) if w <= available]
    lines = []
    with tempfile.TemporaryDirectory() as where:
        for world in worlds:
            lines += launch(world, args, Path(where) / f"world{world}.json")
    from common import environment, publish

    notes = [f"batch per GPU: resnet50 {ROWS['resnet50'][args.cpu_smoke][0]}, gpt {ROWS['gpt'][args.cpu_smoke][0]}; "
             f"gradients averaged in buckets of {BUCKET_MB} MiB by every variant; torch DDP compiled: "
             "torch.compile(DistributedDataParallel(model)) (its DDPOptimizer splits the graph at buckets), the "
             "optimizer eager; torch's ResNet-50 runs channels-last, cudnn.benchmark on",
             "scaling: per-GPU throughput against the same variant on one GPU; exposed comm: (step on N GPUs - step "
             "on one) / step on N GPUs; all-reduce alone: every gradient averaged by NCCL with nothing else running"]
    if args.cpu_smoke:
        notes.append("--cpu-smoke: times mean nothing (gloo on the CPU, ember through Triton's interpreter)")
    results = args.results or (None if args.cpu_smoke else HERE / "RESULTS.md")
    publish(f"Distributed benchmark: {environment(args.cpu_smoke)}, worlds {worlds}", table(lines), notes, results)


if __name__ == "__main__":
    main()
