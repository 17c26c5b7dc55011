"""Per-kernel CUDA time of one ember step, with each generated kernel's block shape, registers and
spills: the first place to look when a row of benchmarks/fusion.py is slow.

    python benchmarks/profile_kernels.py cross_entropy 16384 32000
    python benchmarks/profile_kernels.py softmax 16384 32000
    python benchmarks/profile_kernels.py layer_norm_backward 32768 4096
"""

import sys

import torch
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


def main() -> None:
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
