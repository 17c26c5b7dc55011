"""Train a larger MLP and a small CNN on learnable synthetic images, on the GPU when there is one.

    python -m ember.examples.train_gpu [--model mlp|cnn|both] [--device cuda] [--steps 300] [--batch-size 256]
                                       [--jit/--no-jit] [--dtype float32|bfloat16]

The data needs no download: each of ten classes is a fixed random prototype image (smooth, so a
convolution can find it), and a sample is its class's prototype plus Gaussian noise. A training step
(forward, cross entropy, backward, Adam update) is one call of a step function; with `--jit` (the
default on cuda) `ember.jit` records it once and replays it (one CUDA graph per step on a GPU),
while the DataLoader uploads the next batch during the current step. On the CPU (the NumPy reference
backend) the default sizes take minutes: try `--steps 30 --hidden 256`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

import ember
import ember.nn as nn
import ember.nn.functional as F
from ember.data import DataLoader
from ember.examples import TrainingLog, default_device

CLASSES = 10


def synthetic_images(samples: int, image_size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`samples` images of shape (1, image_size, image_size) and their labels in [0, 10).

    The prototypes (one per class, blocks of 4x4 pixels drawn from a normal distribution) depend on
    `image_size` and `seed` only, so splits drawn with different seeds share them. Their amplitude
    puts two prototypes about six noise standard deviations apart at every image size: the classes
    are separable, but only after training.
    """
    if image_size % 4:
        raise ValueError(f"synthetic_images: image_size must be a multiple of 4, got {image_size}")
    blocks = np.random.default_rng(1234).standard_normal((CLASSES, 1, image_size // 4, image_size // 4))
    prototypes = np.kron(blocks, np.ones((4, 4))) * (4.0 / image_size)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, samples)
    images = prototypes[labels] + rng.standard_normal((samples, 1, image_size, image_size))
    return images.astype(np.float32), labels.astype(np.int64)


def make_model(kind: str, image_size: int = 28, hidden: int = 2048, channels: tuple[int, int] = (32, 64),
               dtype: ember.DType = ember.float32) -> nn.Module:
    """"mlp": image_size²-hidden-hidden-10 with ReLU; "cnn": two 3x3 conv + ReLU + 2x2 max-pool blocks, then a
    linear classifier."""
    if kind == "mlp":
        pixels = image_size * image_size
        return nn.Sequential(nn.Flatten(), nn.Linear(pixels, hidden, dtype=dtype), nn.ReLU(),
                             nn.Linear(hidden, hidden, dtype=dtype), nn.ReLU(), nn.Linear(hidden, CLASSES, dtype=dtype))
    if kind == "cnn":
        c1, c2 = channels
        return nn.Sequential(nn.Conv2d(1, c1, 3, padding=1, dtype=dtype), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(c1, c2, 3, padding=1, dtype=dtype), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(c2 * (image_size // 4) ** 2, CLASSES, dtype=dtype))
    raise ValueError(f"make_model: kind must be 'mlp' or 'cnn', not {kind!r}")


@dataclass
class Summary:
    model: str
    parameters: int
    device: str
    dtype: str
    jit: bool
    steps: int
    batch_size: int
    first_loss: float
    final_loss: float  # the mean over the last few steps
    accuracy: float  # on a held-out split of the synthetic data
    seconds: float  # the timed steps: all but the warm-up (TrainingLog)
    timed_steps: int
    peak_bytes: int | None = None  # ember.memory_stats peak on cuda
    jit_stats: dict | None = None

    @property
    def steps_per_s(self) -> float:
        return self.timed_steps / self.seconds

    @property
    def samples_per_s(self) -> float:
        return self.steps_per_s * self.batch_size

    def __str__(self) -> str:
        memory = "" if self.peak_bytes is None else f"  |  peak memory {self.peak_bytes / 2**20:.1f} MiB"
        stats = self.jit_stats or {}
        jit = (f"ember.jit: {stats.get('captures')} captures, {stats.get('replays')} replays in "
               f"{stats.get('calls')} calls") if self.jit else "no jit"
        return (f"{self.model} ({self.parameters / 1e6:.2f}M parameters, {self.dtype}) on {self.device}, {jit}\n"
                f"  loss {self.first_loss:.4f} -> final loss {self.final_loss:.4f}  |  "
                f"held-out accuracy {self.accuracy:.2%}  |  {self.steps} steps of {self.batch_size}: "
                f"{self.steps_per_s:.1f} steps/s, {self.samples_per_s:.0f} samples/s{memory}")


def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray, device: str, dtype: ember.DType) -> float:
    model.eval()
    correct = 0
    with ember.no_grad():
        for xb, yb in DataLoader((x.astype(dtype.np), y), batch_size=1024, device=device):
            correct += int((model(xb).argmax(dim=1) == yb).sum().item())
    model.train()
    return correct / len(y)


def train(model: str = "mlp", device: str | None = None, steps: int = 300, batch_size: int = 256,
          jit: bool | None = None, dtype: str = "float32", lr: float = 1e-3, image_size: int = 28,
          hidden: int = 2048, channels: tuple[int, int] = (32, 64), train_samples: int = 16384,
          test_samples: int = 2048, seed: int = 0, progress: bool = True) -> Summary:
    device = device or default_device()
    jit = device.startswith("cuda") if jit is None else jit
    dt = ember.dtypes.as_dtype(dtype)
    ember.manual_seed(seed)
    x_train, y_train = synthetic_images(train_samples, image_size, seed)
    x_test, y_test = synthetic_images(test_samples, image_size, seed + 1)
    with ember.device(device):
        net = make_model(model, image_size, hidden, channels, dt)
    optimizer = ember.optim.Adam(net.parameters(), lr=lr)
    # fixed shapes (drop_last) so a jit step can be replayed; the next batch uploads during this step
    loader = DataLoader((x_train.astype(dt.np), y_train), batch_size=batch_size, shuffle=True, drop_last=True,
                        seed=seed, device=device, prefetch=1)

    def train_step(xb: ember.Tensor, yb: ember.Tensor) -> ember.Tensor:
        loss = F.cross_entropy(net(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()  # realizes forward, backward and update as one plan
        return loss

    step = ember.jit(train_step) if jit else train_step
    log_every = max(1, steps // 50)
    log = TrainingLog(steps, f"{model} {dtype} on {device}", progress, every=log_every)  # the bar's rate: steps/s
    while log.done < steps:
        for xb, yb in loader:
            log.step(step(xb, yb))
            if log.done == steps:
                break
    log.close()
    peak = ember.memory_stats(device)["peak"] if device.startswith("cuda") else None
    return Summary(model, sum(p.numel() for p in net.parameters()), device, dtype, jit, steps, batch_size,
                   log.first_loss, log.final_loss, evaluate(net, x_test, y_test, device, dt), log.timed_seconds,
                   log.timed_steps, peak, dict(step.stats) if jit else None)


def main(argv: list[str] | None = None) -> list[Summary]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("mlp", "cnn", "both"), default="both")
    parser.add_argument("--device", default=None, help="cuda when a GPU is present, else cpu")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--jit", action=argparse.BooleanOptionalAction, default=None,
                        help="record the step with ember.jit and replay it (default: on for cuda)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of parameters, activations and data")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--image-size", type=int, default=28, help="a multiple of 4")
    parser.add_argument("--hidden", type=int, default=2048, help="width of the MLP's hidden layers")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    summaries = []
    for kind in ("mlp", "cnn") if args.model == "both" else (args.model,):
        summary = train(kind, args.device, args.steps, args.batch_size, args.jit, args.dtype, args.lr,
                        args.image_size, args.hidden, seed=args.seed)
        print(summary, flush=True)
        summaries.append(summary)
    return summaries


if __name__ == "__main__":
    main()
