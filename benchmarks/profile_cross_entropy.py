"""Where cross entropy's time goes: per-kernel CUDA time, and the row kernel's registers, spills and
speed under other block shapes (the generated source, launched by hand)."""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import ember
import ember.nn.functional as F
from ember.ir import toposort
from ember.runtime import cuda

sys.path.insert(0, "benchmarks")
from fusion import to_ember  # noqa: E402

rows, classes = (int(a) for a in (sys.argv[1:3] if len(sys.argv) > 2 else (16384, 32000)))
x = torch.randn(rows, classes, device="cuda", dtype=torch.bfloat16)
t = torch.randint(0, classes, (rows,), device="cuda")
ex, et = to_ember(x, True), to_ember(t)


def graph():
    loss = F.cross_entropy(ex, et)
    (g,) = ember.grad(loss, [ex])
    return loss, g


for _ in range(2):
    ember.realize(*graph())
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    ember.realize(*graph())
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6))

outs = graph()
nodes = [o._node for o in outs]
order = toposort(nodes)
plan, sig = cuda.plan_for(order, {id(n) for n in nodes})
buffers = cuda.execute(plan, sig, nodes[0].device)
big = max((ck for ck in plan.kernels if ck.source), key=lambda ck: ck.kernel.rows * ck.kernel.cols)
launch = big.source.launches[-1]
fn = getattr(big.module, launch.function)
args = [buffers[id(a.value)] if a.kind in ("read", "write") else a.value for a in launch.args]
print("row kernel", launch.constexprs, "warps", launch.num_warps)
for block_n, warps in ((4096, 8), (2048, 8), (1024, 4), (4096, 16)):
    def run(block_n=block_n, warps=warps):
        fn[(launch.grid,)](*args, BLOCK_M=1, BLOCK_N=block_n, num_warps=warps)
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        run()
    end.record()
    torch.cuda.synchronize()
    compiled = [k for k in fn.device_caches[0][0].values()] if hasattr(fn, "device_caches") else []
    info = compiled[-1] if compiled else None
    print(f"BLOCK_N {block_n} warps {warps}: {start.elapsed_time(end) / 3:.3f} ms",
          f"regs {getattr(info, 'n_regs', '?')} spills {getattr(info, 'n_spills', '?')}")
