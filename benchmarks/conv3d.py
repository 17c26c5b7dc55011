"""3-d CNN training benchmark: a small volumetric network's training step (forward, cross entropy, backward, SGD
with momentum) in ember (a plain lazy loop, and ember.jit) against PyTorch eager and torch.compile, with volumes/s,
the GPU time of each variant's kernels, peak memory and the first step's time.

The network is written once for torch.nn and ember.nn (`network`): two Conv3d 3x3x3 + BatchNorm3d + ReLU stages, a
MaxPool3d, a third Conv3d, trilinear upsampling back to the input's size with a skip connection, global average
pooling and a linear head. torch runs cuDNN's 3-d convolutions; ember's conv3d is one conv2d over the depth taps
gathered into channels (ember/ops/conv3d.py), so this measures what that gather costs against the vendor's kernel.

Rows:
 1  volumes 32x64x64, 8 channels in, width 32, batch 4, bfloat16 parameters and inputs
 2  volumes 16x32x32, 16 channels in, width 64, batch 16, bfloat16

    python benchmarks/conv3d.py                          # full size on a CUDA GPU, appended to RESULTS.md
    python benchmarks/conv3d.py --rows 1 --skip torch.compile
    EMBER_INTERPRET=1 python benchmarks/conv3d.py --cpu-smoke   # no GPU: a tiny network, every code path
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as TF
from cnn import Line, _assign, bench_main, run_variants
from common import to_ember, training_step

import ember
import ember.nn.functional as EF

# row: (depth, height and width, channels in, width, batch) at (full, --quick, --cpu-smoke)
ROWS = {"1": ((32, 64, 8, 32, 4), (16, 32, 8, 32, 2), (4, 8, 2, 4, 2)),
        "2": ((16, 32, 16, 64, 16), (8, 16, 16, 64, 4), (4, 4, 2, 4, 2))}
CLASSES = 10
VARIANTS = ("torch eager", "torch.compile", "ember lazy", "ember.jit")


def network(lib, channels: int, width: int):
    """The volumetric network in `lib` (torch or ember): the same modules under both names."""
    nn = lib.nn

    class Volumes(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv3d(channels, width, 3, padding=1, bias=False), nn.BatchNorm3d(width),
                                      nn.ReLU(), nn.Conv3d(width, width, 3, padding=1, bias=False),
                                      nn.BatchNorm3d(width), nn.ReLU())
            self.down = nn.Sequential(nn.MaxPool3d(2), nn.Conv3d(width, width, 3, padding=1), nn.ReLU())
            self.up = nn.Upsample(scale_factor=2, mode="trilinear", align_corners=False)
            self.head = nn.Linear(width, CLASSES)

        def forward(self, x):
            h = self.stem(x)
            h = self.up(self.down(h)) + h
            return self.head(lib.nn.functional.adaptive_avg_pool3d(h, 1).flatten(1))

    return Volumes()


class Workload:
    """One initial state and batch, from which each variant builds its own model and optimizer."""

    def __init__(self, depth: int, side: int, channels: int, width: int, batch: int, dev: str):
        self.shape, self.dev = (channels, width), dev
        self.init = [t.detach().clone() for t in self.torch_model().state_dict().values()]
        self.x = torch.randn(batch, channels, depth, side, side, device=dev, dtype=torch.bfloat16)
        self.y = torch.randint(0, CLASSES, (batch,), device=dev)

    def torch_model(self):
        made = network(torch, *self.shape).to(self.dev, torch.bfloat16)
        if hasattr(self, "init"):
            with torch.no_grad():
                for t, value in zip(made.state_dict().values(), self.init):
                    t.copy_(value)
        return made

    def torch_step(self, compiled: bool, cpu: bool) -> Callable[[], object]:
        made = self.torch_model()
        step = training_step(TF, made, torch.optim.SGD(made.parameters(), lr=0.05, momentum=0.9))
        if compiled:
            step = torch.compile(step, backend="eager") if cpu else torch.compile(step)
        return lambda: step(self.x, self.y)

    def ember_step(self, jit: bool) -> Callable[[], object]:
        made = network(ember, *self.shape).to("cuda").to(ember.bfloat16)
        for name, value in zip(made.state_dict(), self.init):
            _assign(made, name, to_ember(value.clone()))
        step = training_step(EF, made, ember.optim.SGD(made.parameters(), lr=0.05, momentum=0.9))
        step = ember.jit(step) if jit else step
        x, y = to_ember(self.x), to_ember(self.y)
        return lambda: step(x, y)


def run_row(row: str, args) -> list[Line]:
    cpu = args.cpu_smoke
    depth, side, channels, width, batch = ROWS[row][args.which]
    work = Workload(depth, side, channels, width, batch, args.dev)
    workload = f"3-d CNN {depth}x{side}x{side} x {batch}, {channels} -> {width} channels, bf16"
    makers = {"torch eager": lambda: work.torch_step(False, cpu), "torch.compile": lambda: work.torch_step(True, cpu),
              "ember lazy": lambda: work.ember_step(False), "ember.jit": lambda: work.ember_step(True)}
    return run_variants(row, workload, makers, VARIANTS, batch, args)


def main(argv: list[str] | None = None) -> None:
    torch.backends.cudnn.benchmark = True  # torch's variants pick their convolution algorithms as users do
    bench_main(argv, "conv3d.py", __doc__, ROWS, VARIANTS, run_row, "3-d CNN benchmark", "volumes",
               ["torch.backends.cudnn.benchmark = True; SGD lr 0.05 momentum 0.9; torch.compile compiles the whole "
                "step, optimizer.step() included"], "a tiny network")


if __name__ == "__main__":
    main()
