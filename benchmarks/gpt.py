"""GPT training benchmark: a decoder-only transformer's training step (forward, cross entropy, backward, AdamW) in
ember (a plain lazy loop, and ember.jit) against PyTorch eager and torch.compile, with tokens/s, the GPU time of
each variant's kernels, peak memory and the first step's time.

The model is written once for torch.nn and ember.nn (`model`): token and position embeddings, pre-norm blocks
of causal self-attention and a GELU MLP, a final layer norm and an untied head. The attention is written out
(scores, mask, softmax, weighted sum: the T x T matrix is in memory in every variant but torch.compile's fusions)
in the plain variants, and is the library's `scaled_dot_product_attention(q, k, v, is_causal=True)` in the
"(SDPA)" variants (torch's picks its flash kernel on a GPU; ember's is its own composite).

Rows:
 1  6 layers, width 512, 8 heads, T 512, batch 16, vocabulary 8192, bfloat16 parameters and inputs
 2  GPT-2 124M's shape: 12 layers, width 768, 12 heads, T 1024, batch 8, vocabulary 50304, bfloat16

Steps are timed back to back, from the first call until the GPU is done, divided by the steps; "first step" is a
variant's first call in this process until its loss is on the host (point EMBER_CACHE_DIR and TRITON_CACHE_DIR at
empty directories for a cold start). Every variant's first losses are checked against torch eager's (same
initial weights, same batch).

    python benchmarks/gpt.py                             # full size on a CUDA GPU, appended to RESULTS.md
    python benchmarks/gpt.py --skip torch.compile
    python benchmarks/gpt.py --rows 2 --skip "torch.compile,torch.compile (SDPA)"
    EMBER_INTERPRET=1 python benchmarks/gpt.py --cpu-smoke   # no GPU: a tiny model, every code path
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as TF
from cnn import Line, _assign, bench_main, run_variants
from common import to_ember, training_step

import ember
import ember.nn.functional as EF

# row: (layers, width, heads, T, batch, vocabulary) at (full, --quick, --cpu-smoke)
ROWS = {"1": ((6, 512, 8, 512, 16, 8192), (2, 256, 4, 128, 4, 1024), (1, 32, 4, 16, 2, 64)),
        "2": ((12, 768, 12, 1024, 8, 50304), (4, 384, 6, 512, 4, 50304), (1, 32, 2, 16, 2, 96))}
LIBRARIES = ("torch eager", "torch.compile", "ember lazy", "ember.jit")
VARIANTS = (*LIBRARIES, *(f"{name} (SDPA)" for name in LIBRARIES))


def model(lib, vocab: int, width: int, heads: int, blocks: int, context: int, attention: str = "manual"):
    """A GPT in `lib` (torch or ember): the same modules and functions under both names. `attention`: "manual"
    (written out) or "sdpa" (the library's scaled_dot_product_attention, causal)."""
    F = lib.nn.functional
    if attention not in ("manual", "sdpa"):
        raise ValueError(f"attention must be 'manual' or 'sdpa', got {attention!r}")

    def attend(q, k, v):
        if attention == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        t = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) * (1.0 / q.shape[-1] ** 0.5)
        mask = lib.tril(lib.ones(t, t, dtype=lib.bool, device=q.device))
        return F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v

    class Block(lib.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = lib.nn.LayerNorm(width), lib.nn.LayerNorm(width)
            self.qkv, self.proj = lib.nn.Linear(width, 3 * width), lib.nn.Linear(width, width)
            self.fc1, self.fc2 = lib.nn.Linear(width, 4 * width), lib.nn.Linear(4 * width, width)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).reshape(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            x = x + self.proj(attend(q, k, v).transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class GPT(lib.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding, self.position = lib.nn.Embedding(vocab, width), lib.nn.Embedding(context, width)
            self.blocks = lib.nn.Sequential(*[Block() for _ in range(blocks)])
            self.ln, self.head = lib.nn.LayerNorm(width), lib.nn.Linear(width, vocab)

        def forward(self, idx):
            positions = lib.arange(idx.shape[1], device=idx.device)
            h = self.blocks(self.embedding(idx) + self.position(positions))
            return self.head(self.ln(h)).reshape(-1, vocab)

    return GPT()


class Workload:
    """One initial state and batch, from which each variant builds its own model and optimizer."""

    def __init__(self, layers: int, width: int, heads: int, context: int, batch: int, vocab: int, dev: str):
        self.shape, self.dev = (vocab, width, heads, layers, context), dev
        self.init = [t.detach().clone() for t in self.torch_model().state_dict().values()]
        self.x = torch.randint(0, vocab, (batch, context), device=dev)
        self.y = torch.randint(0, vocab, (batch * context,), device=dev)

    def torch_model(self, attention: str = "manual"):
        made = model(torch, *self.shape, attention).to(self.dev, torch.bfloat16)
        if hasattr(self, "init"):
            with torch.no_grad():
                for t, value in zip(made.state_dict().values(), self.init):
                    t.copy_(value)
        return made

    def torch_step(self, compiled: bool, cpu: bool, attention: str) -> Callable[[], object]:
        made = self.torch_model(attention)
        step = training_step(TF, made, torch.optim.AdamW(made.parameters(), lr=3e-4))
        if compiled:
            step = torch.compile(step, backend="eager") if cpu else torch.compile(step)
        return lambda: step(self.x, self.y)

    def ember_step(self, jit: bool, attention: str) -> Callable[[], object]:
        made = model(ember, *self.shape, attention).to("cuda").to(ember.bfloat16)
        for name, value in zip(made.state_dict(), self.init):
            _assign(made, name, to_ember(value.clone()))
        step = training_step(EF, made, ember.optim.AdamW(made.parameters(), lr=3e-4))
        step = ember.jit(step) if jit else step
        x, y = to_ember(self.x), to_ember(self.y)
        return lambda: step(x, y)


def run_row(row: str, args) -> list[Line]:
    cpu = args.cpu_smoke
    layers, width, heads, context, batch, vocab = ROWS[row][args.which]
    work = Workload(layers, width, heads, context, batch, vocab, args.dev)
    workload = f"GPT {layers} layers, width {width}, {heads} heads, T {context} x {batch}, vocabulary {vocab}, bf16"
    makers = {}
    for attention, suffix in (("manual", ""), ("sdpa", " (SDPA)")):
        makers.update({
            f"torch eager{suffix}": lambda a=attention: work.torch_step(False, cpu, a),
            f"torch.compile{suffix}": lambda a=attention: work.torch_step(True, cpu, a),
            f"ember lazy{suffix}": lambda a=attention: work.ember_step(False, a),
            f"ember.jit{suffix}": lambda a=attention: work.ember_step(True, a)})
    return run_variants(row, workload, makers, VARIANTS, batch * context, args)


def main(argv: list[str] | None = None) -> None:
    bench_main(argv, "gpt.py", __doc__, ROWS, VARIANTS, run_row, "GPT benchmark", "tokens",
               ["AdamW lr 3e-4; torch.compile compiles the whole step, optimizer.step() included",
                "(SDPA): attention through the library's scaled_dot_product_attention(is_causal=True), otherwise "
                "written out; every variant's losses are checked against torch eager's (written out)"],
               "a tiny model")

if __name__ == "__main__":
    main()
