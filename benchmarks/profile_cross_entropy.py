import torch, ember, ember.nn.functional as F
from torch.profiler import profile, ProfilerActivity
x = torch.randn(65536, 32000, device="cuda", dtype=torch.bfloat16)
t = torch.randint(0, 32000, (65536,), device="cuda")
import sys; sys.path.insert(0, "benchmarks")
from fusion import to_ember
ex, et = to_ember(x, True), to_ember(t)
def step():
    loss = F.cross_entropy(ex, et); g, = ember.grad(loss, [ex]); ember.realize(loss, g)
for _ in range(2): step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    step(); torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))
