"""A quick look at fused-kernel speed on a GPU: ember vs torch eager vs torch.compile (CUDA events)."""

import sys

import torch

import ember
import ember.nn.functional as F


def bench(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main():
    rows = []
    x = torch.randn(1 << 28, device="cuda")
    y = torch.empty_like(x)
    copy = bench(lambda: y.copy_(x))
    bw = 2 * x.numel() * 4 / copy / 1e6
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    ex = ember.tensor(x.cpu(), device="cuda")

    def chain(a):
        return ((a * 1.5 + 0.5).tanh() * a - 0.25).sigmoid() * 2 + a
    ember_chain = lambda: chain(ex).realize()
    compiled = torch.compile(chain)
    rows.append(("chain8 2^28 f32", 2 * x.numel() * 4, bench(ember_chain), bench(lambda: chain(x)),
                 bench(lambda: compiled(x))))
    s = torch.randn(32768, 4096, device="cuda", dtype=torch.bfloat16)
    es = ember.tensor(s.cpu(), device="cuda")
    csm = torch.compile(lambda t: torch.softmax(t, -1))
    rows.append(("softmax 32768x4096 bf16", 2 * s.numel() * 2, bench(lambda: es.softmax(-1).realize()),
                 bench(lambda: torch.softmax(s, -1)), bench(lambda: csm(s))))
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    ew = ember.tensor(w.cpu(), device="cuda")
    cln = torch.compile(lambda t: torch.nn.functional.layer_norm(t, (4096,), w, w))
    rows.append(("layernorm 32768x4096 bf16", 2 * s.numel() * 2,
                 bench(lambda: F.layer_norm(es, (4096,), ew, ew).realize()),
                 bench(lambda: torch.nn.functional.layer_norm(s, (4096,), w, w)), bench(lambda: cln(s))))
    print(f"{'row':28} {'ember ms':>9} {'eager ms':>9} {'compile ms':>10} {'ember %bw':>9}")
    for name, nbytes, e, t, c in rows:
        print(f"{name:28} {e:9.3f} {t:9.3f} {c:10.3f} {nbytes / e / 1e6 / bw:9.0%}")
    print(ember.explain(es.softmax(-1)), file=sys.stderr)


if __name__ == "__main__":
    main()
