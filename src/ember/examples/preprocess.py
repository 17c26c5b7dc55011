"""Image preprocessing with ember.vision: two pipelines, their fused plans, timings, and the crops as a PNG grid.

1. FKL's example: 5 crops of different sizes from a 3840x2160 RGB frame, each resized to 60x60 keeping the
   aspect ratio on a black background, x1.4 - 0.5, RGB->BGR, /255, into one packed float batch.
2. The same frame as NV12 -> RGB -> resized to 224x224 -> normalised -> planar.

The frame is scikit-learn's sample photo scaled to 4K (no download). Each pipeline is planned as one kernel that
reads only the source samples its outputs need; the timings put it beside torch (where installed) and OpenCV
(where installed, on the host). The crops are written as a PNG grid a person can look at.

    python -m ember.examples.preprocess [--device cpu|cuda] [--out preprocess.png] [--reps 20]
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import numpy as np

import ember
import ember.vision as V
from ember.examples import default_device

BOXES = [(400, 300, 1200, 900), (2000, 100, 600, 1400), (3000, 1500, 800, 500), (100, 1600, 300, 300),
         (1500, 800, 1800, 1000)]
MEAN, STD = (123.675, 116.28, 103.53), (58.395, 57.12, 57.375)


def frame_4k() -> np.ndarray:
    """scikit-learn's sample photo, scaled to 3840x2160 RGB uint8."""
    from PIL import Image
    from sklearn.datasets import load_sample_image

    return np.asarray(Image.fromarray(load_sample_image("china.jpg")).resize((3840, 2160), Image.Resampling.BILINEAR))


def to_nv12(rgb: np.ndarray) -> np.ndarray:
    """An NV12 buffer [H*3/2, W] of an RGB frame (BT.601 limited range, chroma averaged over 2x2)."""
    f = rgb.astype(np.float32)
    r, g, b = f[..., 0], f[..., 1], f[..., 2]
    y = 16 + 0.257 * r + 0.504 * g + 0.098 * b
    u = 128 - 0.148 * r - 0.291 * g + 0.439 * b
    v = 128 + 0.439 * r - 0.368 * g - 0.071 * b
    h, w = y.shape
    uv = np.stack([u, v], -1).reshape(h // 2, 2, w // 2, 2, 2).mean((1, 3))
    out = np.concatenate([y, uv.reshape(h // 2, w)], 0)
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def fkl(frame: ember.Tensor, boxes: ember.Tensor) -> ember.Tensor:
    crops = V.crop_resize(frame, boxes, (60, 60), keep_aspect="center")
    return V.normalize(V.cvt_color(crops, "RGB2BGR") * 1.4 - 0.5, 0.0, 255.0)


def nv12(frame: ember.Tensor) -> ember.Tensor:
    return V.to_planar(V.normalize(V.resize(V.cvt_color(frame, "YUV2RGB_NV12"), (224, 224)), MEAN, STD))


def timed_ms(step, reps: int, sync=None) -> float:
    step()
    if sync:
        sync()
    start = time.perf_counter()
    for _ in range(reps):
        step()
    if sync:
        sync()
    return (time.perf_counter() - start) / reps * 1e3


def opencv_times(rgb: np.ndarray, nv: np.ndarray, reps: int) -> dict[str, float]:
    if importlib.util.find_spec("cv2") is None:
        return {}
    import cv2

    def crops():
        out = np.zeros((len(BOXES), 60, 60, 3), np.float32)
        for i, (x, y, w, h) in enumerate(BOXES):
            s = max(h / 60, w / 60)
            ch, cw = max(1, round(h / s)), max(1, round(w / s))
            top, left = (60 - ch) // 2, (60 - cw) // 2
            out[i, top:top + ch, left:left + cw] = cv2.resize(rgb[y:y + h, x:x + w], (cw, ch))
        return (out * 1.4 - 0.5)[..., ::-1] / 255.0

    def convert():
        small = cv2.resize(cv2.cvtColor(nv, cv2.COLOR_YUV2RGB_NV12), (224, 224)).astype(np.float32)
        return ((small - np.float32(MEAN)) / np.float32(STD)).transpose(2, 0, 1)

    return {"fkl": timed_ms(crops, reps), "nv12": timed_ms(convert, reps)}


def write_grid(path: str, batch: np.ndarray) -> Path:
    """The crops (BGR, scaled as the pipeline left them) side by side, back in RGB uint8."""
    from PIL import Image

    pixels = np.clip((batch[..., ::-1] * 255.0 + 0.5) / 1.4, 0, 255).astype(np.uint8)
    grid = np.concatenate(list(pixels), axis=1)
    target = Path(path)
    Image.fromarray(grid).resize((grid.shape[1] * 3, grid.shape[0] * 3), Image.Resampling.NEAREST).save(target)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=default_device(), help="default: cuda where a GPU is usable, else cpu")
    parser.add_argument("--out", default="preprocess.png", help="the PNG grid of the crops")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--explain", action="store_true", help="print the fused plans in full")
    args = parser.parse_args(argv)
    gpu = args.device.startswith("cuda")
    rgb = frame_4k()
    nv = to_nv12(rgb)
    frame, nv_frame = ember.tensor(rgb, device=args.device), ember.tensor(nv, device=args.device)
    boxes = ember.tensor(np.float32(BOXES), device=args.device)
    for name, out in (("FKL crops", fkl(frame, boxes)), ("NV12 -> 224 planar", nv12(nv_frame))):
        plan = ember.explain.plan(out)
        where = "" if gpu else " (as planned for the GPU; the cpu reference runs op by op)"
        print(f"{name}: {len(plan.kernels)} fused kernel(s) for {plan.unfused} ops{where}")
        if args.explain:
            print(plan)
    sync = None
    if gpu:
        import torch

        sync = torch.cuda.synchronize
    runs = {"ember lazy": (lambda: fkl(frame, boxes).realize(), lambda: nv12(nv_frame).realize())}
    if gpu:
        jit_fkl, jit_nv12 = ember.jit(fkl), ember.jit(nv12)
        runs["ember.jit"] = (lambda: jit_fkl(frame, boxes).realize(), lambda: jit_nv12(nv_frame).realize())
    reps = args.reps if gpu else max(1, args.reps // 10)
    rows = {variant: (timed_ms(a, reps, sync), timed_ms(b, reps, sync)) for variant, (a, b) in runs.items()}
    opencv = opencv_times(rgb, nv, reps)
    if opencv:
        rows["OpenCV (host)"] = (opencv["fkl"], opencv["nv12"])
    print(f"{'':16s} {'FKL crops ms':>14s} {'NV12 ms':>10s}   ({args.device}, {reps} reps)")
    for variant, (a, b) in rows.items():
        print(f"{variant:16s} {a:14.3f} {b:10.3f}")
    written = write_grid(args.out, fkl(frame, boxes).numpy())
    print(f"wrote {written}: the {len(BOXES)} crops, 60x60 each, enlarged 3x")


if __name__ == "__main__":
    main()
