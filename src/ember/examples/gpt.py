"""Train a character-level GPT on the Python documentation that ships with Python, then sample from it.

    python -m ember.examples.gpt [--steps N] [--layers N] [--width N] [--heads N] [--context T] [--batch-size N]
                                 [--lr LR] [--device cpu|cuda] [--amp/--no-amp] [--jit/--no-jit]
                                 [--samples N] [--sample-length N] [--temperature 0.8] [--top-k 20] [--prompt TEXT]

The text is the prose of Python's own documentation: the standard library's `pydoc_data.topics` (what `help()`
shows for statements and keywords), about 460,000 characters of English with code in it, found on any Python
installation: nothing is downloaded. Its characters are the vocabulary (about a hundred); the first 90% trains, the
last 10% is held out for the validation loss.

The model is a small pre-norm GPT: token and position embeddings, blocks of causal self-attention
(`F.scaled_dot_product_attention(is_causal=True)`) and a GELU MLP, each behind a layer norm and added to its input,
a final layer norm and a linear head, initialised as GPT-2 is. It trains with AdamW (weight decay on the matrices
and embeddings only), its learning rate along a one-cycle schedule (warm-up, then cosine decay), gradients clipped
to norm 1. A training step (forward, cross entropy, backward, clipping, update) is one call of a step function; on
cuda `ember.jit` records it and replays it and the forward runs under `ember.autocast` in bfloat16; on the cpu
neither is the default (the reference backend runs every op as written). At the end it samples text, with a
temperature and top-k, from a prompt.

The defaults depend on the device: on the cpu a 2-layer model of width 64 on 64 characters of context for 300 steps
(under two minutes on 2 cores: the training loss falls from 4.6 to 2.4 nats per character and the held-out loss is
2.1, below the 3.25 of guessing each character from its frequency alone); on cuda a 6-layer model of width 384 on
256 characters (10.8M parameters) for 2,000 steps, with tokens/s.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import numpy as np

import ember
import ember.nn as nn
import ember.nn.functional as F
from ember.device import as_device
from ember.examples import TrainingLog, default_device

# the sizes a run takes unless told otherwise, per device type
DEFAULTS = {
    "cpu": dict(steps=300, layers=2, width=64, heads=4, context=64, batch_size=32, lr=1e-2, eval_batches=8,
                sample_length=120),
    "cuda": dict(steps=2000, layers=6, width=384, heads=6, context=256, batch_size=64, lr=1e-3, eval_batches=32,
                 sample_length=400),
}
PROMPT = "The "


def python_docs() -> str:
    """The text of Python's `help()` topics (the standard library's `pydoc_data`), in a fixed order."""
    from pydoc_data.topics import topics

    return "".join(topics[name] for name in sorted(topics))


class Vocabulary:
    """The characters of a text, each an index."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        return np.array([self.index[c] for c in text], dtype=np.int64)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"gpt: the width {width} is not a multiple of the {heads} heads")
        self.heads = heads
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: ember.Tensor) -> ember.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """x + attention(norm(x)), then + MLP(norm(x)): a pre-norm transformer block."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attention = nn.LayerNorm(width), CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: ember.Tensor) -> ember.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, layers: int, context: int) -> None:
        super().__init__()
        self.context = context
        self.token, self.position = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)
        self.initialise(layers)

    def initialise(self, layers: int) -> None:
        """GPT-2's: weights and embeddings from N(0, 0.02), biases zero, and the layers that add to the residual
        stream (each block's attention projection and second MLP layer) scaled down by sqrt(2 * layers)."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                residual = name.endswith("proj.weight") or name.endswith("mlp.2.weight")
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers) if residual else 0.02)

    def forward(self, idx: ember.Tensor) -> ember.Tensor:
        """Logits (batch, tokens, vocabulary) of the next character after each of `idx` (batch, tokens)."""
        positions = ember.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.token(idx) + self.position(positions))))


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's groups: weight decay on the matrices and embeddings, none on biases and layer norms."""
    decay, no_decay = [], []
    for p in model.parameters():
        (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def batch(data: np.ndarray, batch_size: int, context: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """`batch_size` windows of `context` characters at random places, and the characters that follow each."""
    starts = rng.integers(0, len(data) - context - 1, size=batch_size)
    x = np.stack([data[s:s + context] for s in starts])
    y = np.stack([data[s + 1:s + context + 1] for s in starts])
    return x, y


def evaluate(model: GPT, data: np.ndarray, batches: int, batch_size: int, device: str, amp: bool) -> float:
    """The mean cross entropy (nats per character) over `batches` batches of `data`, the same ones every call."""
    rng = np.random.default_rng(1234)
    model.eval()
    losses = []
    with ember.no_grad(), ember.autocast(as_device(device).type, dtype=ember.bfloat16, enabled=amp):
        for _ in range(batches):
            x, y = batch(data, batch_size, model.context, rng)
            logits = model(ember.tensor(x, device=device))
            losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                          ember.tensor(y.reshape(-1), device=device)))
    mean = float(np.mean([loss.item() for loss in losses]))
    model.train()
    return mean


def sample(model: GPT, vocabulary: Vocabulary, prompt: str, length: int, temperature: float = 0.8,
           top_k: int | None = 20, device: str = "cpu", amp: bool = False) -> str:
    """`prompt` and `length` more characters drawn one at a time from the model: its logits for the next character
    divided by `temperature`, all but the `top_k` largest left out, then a draw from their softmax.

    Every call runs the model on a window of the same length (the last `context` characters, padded at the end),
    so every character reuses one compiled plan; the padding is after the position read, which causal attention
    does not let it see."""
    ids = list(vocabulary.encode(prompt))
    model.eval()
    with ember.no_grad(), ember.autocast(as_device(device).type, dtype=ember.bfloat16, enabled=amp):
        for _ in range(length):
            window = ids[-model.context:]
            last = ember.tensor([len(window) - 1], device=device)
            padded = np.zeros((1, model.context), dtype=np.int64)
            padded[0, :len(window)] = window
            logits = model(ember.tensor(padded, device=device))[0].index_select(0, last).float() / temperature
            if top_k is not None:
                values, _ = ember.topk(logits, min(top_k, len(vocabulary)), dim=-1)
                logits = logits.masked_fill(logits < values[:, -1:], -math.inf)
            ids.append(int(ember.multinomial(F.softmax(logits, dim=-1), num_samples=1).item()))
    model.train()
    return vocabulary.decode(ids)


@dataclass
class Summary:
    device: str
    amp: bool
    jit: bool
    parameters: int
    layers: int
    width: int
    context: int
    steps: int
    batch_size: int
    first_loss: float
    final_loss: float  # the mean over the last few steps
    val_loss: float  # on the held-out 10%
    unigram_entropy: float  # nats per character of the training text's character frequencies: a baseline
    seconds: float  # the whole training run
    tokens_per_s: float  # over the steps after the warm-up (TrainingLog)
    peak_bytes: int | None  # ember.memory_stats peak on cuda; None on the cpu
    samples: list[str]
    jit_stats: dict | None = None

    def __str__(self) -> str:
        precision = "bfloat16 autocast" if self.amp else "float32"
        stats = self.jit_stats or {}
        jit = f"ember.jit: {stats.get('captures')} captures, {stats.get('replays')} replays" if self.jit else "no jit"
        memory = (f"peak device memory {self.peak_bytes / 2**20:.1f} MiB" if self.peak_bytes is not None
                  else "device memory not tracked on the cpu")
        lines = [f"GPT ({self.parameters / 1e6:.2f}M parameters: {self.layers} layers, width {self.width}, context "
                 f"{self.context}) on Python's docs, {self.device}, {precision}, {jit}",
                 f"  {self.steps} steps of {self.batch_size} x {self.context} characters in {self.seconds:.1f} s: "
                 f"loss {self.first_loss:.3f} -> {self.final_loss:.3f}  |  val loss {self.val_loss:.3f} nats/char "
                 f"(unigram entropy {self.unigram_entropy:.3f})",
                 f"  {self.tokens_per_s:,.0f} tokens/s  |  {memory}"]
        for i, text in enumerate(self.samples):
            lines += [f"--- sample {i + 1} ---", text]
        return "\n".join(lines)


def entropy(data: np.ndarray) -> float:
    """Nats per character of guessing each character from its frequency in `data` alone."""
    p = np.bincount(data) / len(data)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def train(steps: int | None = None, layers: int | None = None, width: int | None = None, heads: int | None = None,
          context: int | None = None, batch_size: int | None = None, lr: float | None = None,
          weight_decay: float = 0.1, device: str | None = None, amp: bool | None = None, jit: bool | None = None,
          eval_batches: int | None = None, samples: int = 1, sample_length: int | None = None,
          temperature: float = 0.8, top_k: int | None = 20, prompt: str = PROMPT, seed: int = 0,
          progress: bool = True) -> Summary:
    """Train on Python's docs and sample; a size left None takes the device's default (DEFAULTS)."""
    device = device or default_device()
    device_type = as_device(device).type
    given = dict(steps=steps, layers=layers, width=width, heads=heads, context=context, batch_size=batch_size, lr=lr,
                 eval_batches=eval_batches, sample_length=sample_length)
    size = {k: v if v is not None else DEFAULTS.get(device_type, DEFAULTS["cpu"])[k] for k, v in given.items()}
    amp = device_type == "cuda" if amp is None else amp
    jit = device_type == "cuda" if jit is None else jit
    ember.manual_seed(seed)
    rng = np.random.default_rng(seed)

    text = python_docs()
    vocabulary = Vocabulary(text)
    data = vocabulary.encode(text)
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]
    with ember.device(device):
        model = GPT(len(vocabulary), size["width"], size["heads"], size["layers"], size["context"])
    optimizer = ember.optim.AdamW(parameter_groups(model, weight_decay), lr=size["lr"], betas=(0.9, 0.95))
    schedule = ember.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=size["lr"], total_steps=size["steps"],
                                                   pct_start=0.1, cycle_momentum=False)

    def train_step(x: ember.Tensor, y: ember.Tensor) -> ember.Tensor:
        with ember.autocast(device_type, dtype=ember.bfloat16, enabled=amp):
            logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()  # realizes forward, backward, clipping and update as one plan
        return loss

    step = ember.jit(train_step) if jit else train_step
    total, batch_size, tokens = size["steps"], size["batch_size"], size["batch_size"] * size["context"]
    log = TrainingLog(total, f"GPT on {device}", progress, digits=3)
    for _ in range(total):
        x, y = batch(train_data, batch_size, size["context"], rng)
        log.step(step(ember.tensor(x, device=device), ember.tensor(y, device=device)))
        schedule.step()  # outside the step: a replay reads the new rate
    log.close()
    val_loss = evaluate(model, val_data, size["eval_batches"], batch_size, device, amp)
    peak = ember.memory_stats(device)["peak"] if device_type == "cuda" else None
    texts = [sample(model, vocabulary, prompt, size["sample_length"], temperature, top_k, device, amp)
             for _ in range(samples)]
    return Summary(device, amp, jit, sum(p.numel() for p in model.parameters()), size["layers"], size["width"],
                   size["context"], total, batch_size, log.first_loss, log.final_loss, val_loss, entropy(train_data),
                   log.seconds, log.per_second(tokens), peak, texts,
                   dict(step.stats) if jit else None)


def main(argv: list[str] | None = None) -> Summary:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sizes = ", ".join(f"{name} {values['layers']} layers width {values['width']} context {values['context']} "
                      f"{values['steps']} steps" for name, values in DEFAULTS.items())
    parser.add_argument("--steps", type=int, default=None, help=f"training steps (defaults per device: {sizes})")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--context", type=int, default=None, help="characters the model sees")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None, help="AdamW's peak learning rate (one-cycle schedule)")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--device", default=None, help="default: cuda where a GPU is usable, else cpu")
    parser.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                        help="bfloat16 autocast (default: on for cuda, off for cpu)")
    parser.add_argument("--jit", action=argparse.BooleanOptionalAction, default=None,
                        help="record the training step with ember.jit and replay it (default: on for cuda)")
    parser.add_argument("--eval-batches", type=int, default=None, help="batches of held-out text for the val loss")
    parser.add_argument("--samples", type=int, default=1, help="texts to sample after training (0: none)")
    parser.add_argument("--sample-length", type=int, default=None, help="characters per sample")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=20, help="sample among the k likeliest characters (0: all)")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    summary = train(args.steps, args.layers, args.width, args.heads, args.context, args.batch_size, args.lr,
                    args.weight_decay, args.device, args.amp, args.jit, args.eval_batches, args.samples,
                    args.sample_length, args.temperature, args.top_k or None, args.prompt, args.seed)
    print(summary)
    return summary


if __name__ == "__main__":
    main()
