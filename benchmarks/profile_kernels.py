"""Per-kernel CUDA time of one ember step, with each generated kernel's block shape, registers and
spills: the first place to look when a row of benchmarks/fusion.py is slow.

    python benchmarks/profile_kernels.py cross_entropy 16384 32000
    python benchmarks/profile_kernels.py softmax 16384 32000
    python benchmarks/profile_kernels.py layer_norm_backward 32768 4096

`resnet18 SIZE BATCH` profiles a whole training step instead (benchmarks/cnn.py's ResNet-18 at SIZE x SIZE,
bfloat16, SGD momentum, a plain lazy loop): per fused kernel of the step's plan, its GPU time, the bytes it reads
and writes and their rate against the GPU's copy rate, heaviest first, then each kind's totals.

    python benchmarks/profile_kernels.py resnet18 224 128
"""

import sys

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import ember
import ember.nn.functional as F
from ember.ir import toposort
from ember.runtime import disk, launcher, plan_cache

sys.path.insert(0, "benchmarks")
from fusion import to_ember  # noqa: E402


def workload(name: str, rows: int, cols: int):
    x = to_ember(torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16), True)
    if name == "cross_entropy":
        target = to_ember(torch.randint(0, cols, (rows,), device="cuda"))
        loss = F.cross_entropy(x, target)
        return (loss, *ember.grad(loss, [x]))
    if name == "softmax":
        return (x.softmax(-1),)
    if name == "layer_norm_backward":
        w = to_ember(torch.randn(cols, device="cuda", dtype=torch.bfloat16), True)
        out = F.layer_norm(x, (cols,), w, w)
        upstream = to_ember(torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16))
        return (out, *ember.grad(out, [x, w], upstream))
    raise SystemExit(f"unknown workload {name}")


def step_kernels(size: int, batch: int, reps: int = 5) -> None:
    """Each fused kernel of a ResNet-18 training step: GPU time, bytes moved, rate against the copy rate."""
    from cnn import WIDTHS, resnet18
    from common import training_step
    from fusion import copy_gbs

    model = resnet18(ember.nn, size, WIDTHS[0], "cuda", ember.bfloat16)
    step = training_step(F, model, ember.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    x = ember.randn(batch, 3, size, size, device="cuda").bfloat16()
    y = ember.randint(0, 10, (batch,), device="cuda")
    step(x, y).item()
    with ember.explain.capture() as plans:  # the steady step's plan (the first step's starts the momenta)
        step(x, y).item()
    for _ in range(3):
        step(x, y).item()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step(x, y)
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            times[event.name] = times.get(event.name, 0.0) + event.self_device_time_total / 1e3 / reps
    copy_rate = copy_gbs(1 << 30, "cuda", 3, 10, False)
    rows, total = [], 0.0
    for plan in plans:
        for k in plan.kernels:
            source = plan.sources.get(id(k))
            if source is None:
                continue
            ms = sum(times.pop(launch.function, 0.0) for launch in source.launches)
            moved = sum(n.numel * n.dtype.itemsize for n in (*k.reads, *k.outputs))
            block = ", ".join(f"{launch.function} {launch.constexprs}" for launch in source.launches)
            rows.append((ms, moved, k, block))
            total += ms
    print(f"copy rate {copy_rate:.0f} GB/s; {len(rows)} generated kernels take {total:.3f} ms a step")
    kinds: dict[str, list] = {}
    for ms, moved, k, block in sorted(rows, key=lambda row: -row[0]):
        rate = moved / ms / 1e6 if ms else 0.0
        entry = kinds.setdefault(k.kind.value, [0.0, 0, 0])
        entry[0], entry[1], entry[2] = entry[0] + ms, entry[1] + moved, entry[2] + 1
        print(f"{ms:7.3f} ms {moved / 2**20:8.1f} MiB {rate:6.0f} GB/s {100 * rate / copy_rate:4.0f}%  "
              f"kernel {k.index} {k.kind.value} {list(k.space)} covers {len(k.covers)}: {block}")
    for kind, (ms, moved, count) in kinds.items():
        print(f"{kind}: {count} kernels, {ms:.3f} ms, {moved / 2**30:.2f} GiB, "
              f"{100 * moved / ms / 1e6 / copy_rate if ms else 0:.0f}% of the copy rate")
    rest = sorted(times.items(), key=lambda item: -item[1])[:12]
    print("other kernels: " + "; ".join(f"{name[:80]} {ms:.3f} ms" for name, ms in rest))


def main() -> None:
    if sys.argv[1] == "resnet18":
        return step_kernels(int(sys.argv[2]), int(sys.argv[3]))
    name, rows, cols = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    outputs = workload(name, rows, cols)
    nodes = [o._node for o in outputs]
    order = toposort(nodes)
    plan, sig = plan_cache.plan_for(order, {id(n) for n in nodes})
    device = nodes[0].device
    inputs = [leaf.buffer for leaf in sig.inputs]
    for _ in range(2):
        launcher.execute(plan, sig, device, inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        launcher.execute(plan, sig, device, inputs)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10))
    for ck in plan.kernels:
        if ck.source is None:
            print(f"kernel {ck.kernel.index}: {ck.kernel.kind} (vendor)")
            continue
        for launch in ck.source.launches:
            fn = getattr(disk.load_source(ck.source, interpret=False), launch.function)
            compiled = [k for cache in getattr(fn, "device_caches", {}).values() for k in cache[0].values()]
            info = ", ".join(f"regs {getattr(k, 'n_regs', '?')} spills {getattr(k, 'n_spills', '?')}"
                             for k in compiled[:2])
            print(f"kernel {ck.kernel.index}: {ck.kernel.kind} {list(ck.kernel.space)} axes {list(ck.kernel.axes)} "
                  f"{launch.function} grid {launch.grid} {launch.constexprs} warps {launch.num_warps}: {info}")
    print(ember.explain.plan(*outputs))


if __name__ == "__main__":
    main()
