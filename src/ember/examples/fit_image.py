"""Learn an image as a function of its pixel coordinates: a coordinate MLP with a frequency encoding.

Each step draws a random batch of pixels; the network maps a pixel's (y, x), encoded as sines and cosines at
octave frequencies, to its colour, and learns it with MSE and Adam. The image is scikit-learn's bundled
sample photo (no download). On the GPU the network's layers run as one fused kernel in each direction (the
forward, then the input gradient walked back through the layers), the weight gradients summed inside those
kernels or in GEMMs split over the batch, with Adam's update after them; `ember.jit` replays the whole step as one
CUDA graph.
At the end the image is predicted (the whole network is one kernel there), and its PSNR and a side-by-side
PNG are written.

    python -m ember.examples.fit_image [--steps 2000] [--size 256] [--device cpu|cuda] [--out fit_image.png]
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

import ember
import ember.nn as nn
import ember.nn.functional as F
from ember.examples import default_device


def load_image(size: int, name: str = "china.jpg") -> np.ndarray:
    """scikit-learn's sample photo, its longer side resized to `size` pixels: float32 RGB in [0, 1]."""
    from PIL import Image  # optional packages, loaded only for this example's data and output
    from sklearn.datasets import load_sample_image

    image = Image.fromarray(load_sample_image(name))
    scale = size / max(image.size)
    image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))),
                         Image.Resampling.LANCZOS)
    return np.asarray(image, dtype=np.float32) / 255.0


def encode(height: int, width: int, frequencies: int) -> np.ndarray:
    """Each pixel's centre (y, x) in [0, 1), as sin and cos of 2^k * pi * coordinate for k < frequencies:
    [height * width, 4 * frequencies] float32, row-major over the pixels."""
    ys, xs = np.meshgrid((np.arange(height) + 0.5) / height, (np.arange(width) + 0.5) / width, indexing="ij")
    coords = np.stack([ys.ravel(), xs.ravel()], axis=1)  # [pixels, 2]
    angles = coords[:, :, None] * (np.pi * 2.0 ** np.arange(frequencies))  # [pixels, 2, frequencies]
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=2).reshape(len(coords), -1).astype(np.float32)


def make_model(inputs: int, width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(inputs, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 3))
    return nn.Sequential(*layers)


def psnr(predicted: np.ndarray, image: np.ndarray) -> float:
    mse = float(np.mean((np.clip(predicted, 0, 1) - image) ** 2))
    return 10 * math.log10(1 / mse) if mse > 0 else math.inf if mse == 0 else math.nan


@dataclass
class Result:
    psnr: float
    steps: int
    seconds: float  # all the steps, the first (compiling) included
    first_step_seconds: float
    steps_per_second: float  # after the first two (compiling, then planning the steady state)
    final_loss: float
    step_kernels: int  # fused kernels of one training step
    inference_kernels: int  # fused kernels of predicting a batch of pixels
    out: Path | None
    inference_plan: list[str] = field(default_factory=list)  # what the planner decided for the prediction

    def __str__(self) -> str:
        written = f"  |  wrote {self.out}" if self.out else ""
        return (f"PSNR {self.psnr:.2f} dB  |  {self.steps} steps in {self.seconds:.1f} s "
                f"({self.steps_per_second:.0f} steps/s; first step {self.first_step_seconds:.1f} s)  |  "
                f"final loss {self.final_loss:.5f}  |  one step = {self.step_kernels} fused kernels, "
                f"prediction = {self.inference_kernels} ({'; '.join(self.inference_plan)}){written}")


def fit(steps: int = 2000, size: int = 256, batch: int = 2**16, width: int = 64, depth: int = 4,
        frequencies: int = 10, lr: float = 5e-3, device: str = "cpu", seed: int = 0, out: str | None = None,
        progress: bool = True, explain: bool = False) -> Result:
    ember.manual_seed(seed)
    image = load_image(size)
    height, width_px, _ = image.shape
    pixels = height * width_px
    # on the GPU the layers compute in bfloat16 (the tensor cores' type; float32's range, so no gradient
    # underflows) from float32 parameters, which Adam updates in float32
    def precision():
        return ember.autocast(device.split(":")[0], dtype=ember.bfloat16, enabled=device.startswith("cuda"))

    features = ember.tensor(encode(height, width_px, frequencies), device=device)
    features = (features.to(ember.bfloat16) if device.startswith("cuda") else features).realize()
    colours = ember.tensor(image.reshape(pixels, 3), device=device).realize()
    with ember.device(device):
        model = make_model(4 * frequencies, width, depth)
    optimizer = ember.optim.Adam(model.parameters(), lr=lr)
    batch = min(batch, pixels)

    def step() -> ember.Tensor:
        picked = ember.randint(0, pixels, (batch,), device=device)  # a new batch each replay
        with precision():
            loss = F.mse_loss(model(features[picked]).float(), colours[picked])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss

    if device.startswith("cuda"):  # the cpu's reference backend runs op by op: nothing to replay
        step = ember.jit(step)
    start = time.perf_counter()
    loss = step()
    loss.item()
    first = time.perf_counter() - start
    with ember.explain.capture() as plans:  # the steady-state step's plan (the first may differ: Adam's state)
        step().item()
    step_kernels = len(plans[-1].kernels) if plans else 0
    if explain and plans:
        tqdm.write(f"one training step:\n{plans[-1]}")
    bar = tqdm(range(steps - 2), disable=not progress, unit="step", desc="fit_image")
    start = time.perf_counter()
    for i in bar:
        loss = step()
        if (i + 1) % 100 == 0:
            bar.set_postfix(loss=f"{loss.item():.5f}")
    final_loss = loss.item()
    steady = time.perf_counter() - start
    seconds = steady + first
    with precision():
        predicted, inference_kernels, inference_plan = predict(model, features, pixels, explain)
    predicted = predicted.reshape(height, width_px, 3)
    written = write_png(out, image, predicted) if out else None
    rate = (steps - 2) / steady if steps > 2 and steady > 0 else math.nan
    return Result(psnr(predicted, image), steps, seconds, first, rate, final_loss, step_kernels, inference_kernels,
                  written, inference_plan)


def predict(model: nn.Module, features: ember.Tensor, pixels: int, explain: bool, chunk: int = 2**18
            ) -> tuple[np.ndarray, int, list[str]]:
    """The whole image's colours, a chunk of pixels at a time, and the fused kernels of one chunk with the
    planner's decisions about them."""
    parts, kernels, decisions = [], 0, []
    with ember.no_grad():
        for start in range(0, pixels, chunk):
            out = model(features[start:start + chunk]).float()
            if start == 0:
                plan = ember.explain.plan(out)
                kernels = len(plan.kernels)
                decisions = [d for k in plan.kernels for d in k.decisions]
                if explain:
                    tqdm.write(f"prediction:\n{plan}")
            parts.append(out.numpy())
    return np.concatenate(parts), kernels, decisions


def write_png(path: str, image: np.ndarray, predicted: np.ndarray) -> Path:
    """The image and its reconstruction side by side."""
    from PIL import Image

    both = np.concatenate([image, np.clip(predicted, 0, 1)], axis=1)
    target = Path(path)
    Image.fromarray((both * 255 + 0.5).astype(np.uint8)).save(target)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    device = default_device()
    gpu = device.startswith("cuda")
    parser.add_argument("--steps", type=int, default=2000 if gpu else 300)
    parser.add_argument("--size", type=int, default=256 if gpu else 96, help="the image's longer side, pixels")
    parser.add_argument("--batch", type=int, default=2**16 if gpu else 2**12, help="pixels per step")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=4, help="hidden layers")
    parser.add_argument("--frequencies", type=int, default=10)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--device", default=device, help="default: cuda where a GPU is usable, else cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="fit_image.png", help="the PNG written: the image and its reconstruction")
    parser.add_argument("--explain", action="store_true", help="print the fused plans of a step and a prediction")
    args = parser.parse_args(argv)
    print(fit(args.steps, args.size, args.batch, args.width, args.depth, args.frequencies, args.lr, args.device,
              args.seed, args.out, explain=args.explain))


if __name__ == "__main__":
    main()
