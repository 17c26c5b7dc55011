"""Image preprocessing benchmark: ember.vision pipelines against torch eager, torch.compile and OpenCV (CPU),
side by side in one run, with the bytes floor.

Rows:
  F  FKL's example: 5 crops of different sizes from a 3840x2160 RGB uint8 frame, each resized to 60x60 keeping
     the aspect ratio on a black background, x1.4 - 0.5, RGB->BGR, /255, into one packed float32 batch
  N  a 3840x2160 NV12 frame -> RGB (BT.601 limited) -> resize to 224x224 -> normalise -> planar float32
  C  64 crops of mixed sizes from a 3840x2160 RGB frame -> 224x224 -> normalise -> planar [64, 3, 224, 224]

The floor is the bytes a pipeline must move (its output, and one source sample per output value) at the
measured copy rate. Times ("ms"): median of single steps, call to GPU done, host launch overhead included
(OpenCV: on the host, from host arrays). "GPU ms", for torch.compile and ember.jit: the device time of one
step, the summed durations of the kernels, copies and memsets it runs (kernels replayed from CUDA graphs
included), from torch's profiler: the measure of the project's GPU-time targets ("-" without a GPU).
check: max |ember - torch eager| over the output.

    python benchmarks/vision.py                 # every row, appended to RESULTS.md
    python benchmarks/vision.py --rows F,N
    python benchmarks/vision.py --cpu-smoke     # no GPU: tiny frames, every code path
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import (  # noqa: E402
    cell,
    device_ms,
    environment,
    gpu_cell,
    guarded,
    markdown_table,
    median_ms,
    parse_options,
    publish,
)

import ember  # noqa: E402
import ember.vision as V  # noqa: E402

VARIANTS = ["torch eager", "torch.compile", "OpenCV (CPU)", "ember lazy", "ember.jit"]
DEVICE_TIMED = ["torch.compile", "ember.jit"]  # the variants whose GPU time is measured too
FRAME = {0: (2160, 3840), 1: (540, 960), 2: (48, 64)}  # full, --quick, --cpu-smoke
MEAN, STD = (123.675, 116.28, 103.53), (58.395, 57.12, 57.375)
YUV = (1220542 / 2**20, 1673527 / 2**20, -409993 / 2**20, -852492 / 2**20, 2116026 / 2**20)  # OpenCV's BT.601


def boxes_for(rows: str, height: int, width: int, count: int, seed: int = 0) -> np.ndarray:
    """(x, y, w, h) boxes of different sizes inside the frame."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        w = int(rng.integers(max(2, width // 20), max(3, width // 3)))
        h = int(rng.integers(max(2, height // 20), max(3, height // 3)))
        out.append((int(rng.integers(0, width - w)), int(rng.integers(0, height - h)), w, h))
    return np.array(out, dtype=np.int64)


def cases(which: int, dev: str):
    h, w = FRAME[which]
    side = 224 if which < 2 else 16
    yield "F", ("F", h, w, 5, (60, 60) if which < 2 else (12, 12))
    yield "N", ("N", h, w, 1, (side, side))
    yield "C", ("C", h, w, 64 if which < 2 else 6, (side, side))


# -- torch ----------------------------------------------------------------------------------------

def torch_resize(chw: torch.Tensor, size) -> torch.Tensor:
    return torch.nn.functional.interpolate(chw[None], size=size, mode="bilinear", align_corners=False,
                                           antialias=False)[0]


def torch_fkl(frame: torch.Tensor, boxes: list, size) -> torch.Tensor:
    out = []
    for x, y, w, h in boxes:
        crop = frame[y:y + h, x:x + w].permute(2, 0, 1).float()
        s = max(h / size[0], w / size[1])
        ch, cw = max(1, round(h / s)), max(1, round(w / s))
        canvas = torch.zeros(3, *size, device=frame.device)
        top, left = (size[0] - ch) // 2, (size[1] - cw) // 2
        canvas[:, top:top + ch, left:left + cw] = torch_resize(crop, (ch, cw))
        out.append(canvas)
    batch = torch.stack(out) * 1.4 - 0.5
    return (batch.flip(1) / 255.0).permute(0, 2, 3, 1)


def torch_nv12(nv: torch.Tensor, size) -> torch.Tensor:
    height = nv.shape[0] * 2 // 3
    y = nv[:height].float()
    uv = nv[height:].reshape(height // 2, -1, 2).float().repeat_interleave(2, 0).repeat_interleave(2, 1)
    luma = (y - 16).clamp(min=0) * YUV[0]
    u, v = uv[..., 0] - 128, uv[..., 1] - 128
    rgb = torch.stack([luma + YUV[1] * v, luma + YUV[2] * u + YUV[3] * v, luma + YUV[4] * u])
    mean = torch.tensor(MEAN, device=nv.device)[:, None, None]
    std = torch.tensor(STD, device=nv.device)[:, None, None]
    return (torch_resize(rgb, size) - mean) / std


def torch_crops(frame: torch.Tensor, boxes: list, size) -> torch.Tensor:
    mean = torch.tensor(MEAN, device=frame.device)[:, None, None]
    std = torch.tensor(STD, device=frame.device)[:, None, None]
    return torch.stack([(torch_resize(frame[y:y + h, x:x + w].permute(2, 0, 1).float(), size) - mean) / std
                        for x, y, w, h in boxes])


# -- OpenCV (host) --------------------------------------------------------------------------------

def opencv_fkl(frame: np.ndarray, boxes, size) -> np.ndarray:
    import cv2

    out = np.zeros((len(boxes), *size, 3), np.float32)
    for i, (x, y, w, h) in enumerate(boxes):
        s = max(h / size[0], w / size[1])
        ch, cw = max(1, round(h / s)), max(1, round(w / s))
        top, left = (size[0] - ch) // 2, (size[1] - cw) // 2
        out[i, top:top + ch, left:left + cw] = cv2.resize(frame[y:y + h, x:x + w], (cw, ch),
                                                          interpolation=cv2.INTER_LINEAR)
    return (out * 1.4 - 0.5)[..., ::-1] / 255.0


def opencv_nv12(nv: np.ndarray, size) -> np.ndarray:
    import cv2

    rgb = cv2.resize(cv2.cvtColor(nv, cv2.COLOR_YUV2RGB_NV12), (size[1], size[0]), interpolation=cv2.INTER_LINEAR)
    return ((rgb.astype(np.float32) - np.float32(MEAN)) / np.float32(STD)).transpose(2, 0, 1)


def opencv_crops(frame: np.ndarray, boxes, size) -> np.ndarray:
    import cv2

    return np.stack([((cv2.resize(frame[y:y + h, x:x + w], (size[1], size[0]), interpolation=cv2.INTER_LINEAR)
                       .astype(np.float32) - np.float32(MEAN)) / np.float32(STD)).transpose(2, 0, 1)
                     for x, y, w, h in boxes])


# -- ember ----------------------------------------------------------------------------------------

def ember_fkl(frame: ember.Tensor, boxes: ember.Tensor, size) -> ember.Tensor:
    crops = V.crop_resize(frame, boxes, size, keep_aspect="center")
    return V.normalize(V.cvt_color(crops, "RGB2BGR") * 1.4 - 0.5, 0.0, 255.0)


def ember_nv12(nv: ember.Tensor, size) -> ember.Tensor:
    return V.to_planar(V.normalize(V.resize(V.cvt_color(nv, "YUV2RGB_NV12"), size), MEAN, STD))


def ember_crops(frame: ember.Tensor, boxes: ember.Tensor, size) -> ember.Tensor:
    return V.to_planar(V.normalize(V.crop_resize(frame, boxes, size), MEAN, STD))


def run_row(kind: str, height: int, width: int, count: int, size, dev: str, cpu: bool, warmup: int, reps: int):
    rng = np.random.default_rng(1)
    if kind == "N":
        host = rng.integers(0, 256, (height * 3 // 2, width), dtype=np.uint8)
    else:
        host = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    boxes = boxes_for(kind, height, width, count)
    box_list = [tuple(int(v) for v in b) for b in boxes]
    frame = torch.from_numpy(host).to(dev)
    eframe = ember.tensor(host, device="cuda")
    eboxes = ember.tensor(boxes.astype(np.float32), device="cuda")
    torch_fn = {"F": lambda f: torch_fkl(f, box_list, size), "N": lambda f: torch_nv12(f, size),
                "C": lambda f: torch_crops(f, box_list, size)}[kind]
    cv_fn = {"F": lambda: opencv_fkl(host, box_list, size), "N": lambda: opencv_nv12(host, size),
             "C": lambda: opencv_crops(host, box_list, size)}[kind]
    ember_fn = {"F": lambda f, b: ember_fkl(f, b, size), "N": lambda f, b: ember_nv12(f, size),
                "C": lambda f, b: ember_crops(f, b, size)}[kind]
    times, gpu_times, reference, check = {}, {}, None, None
    kernels = guarded("ember plan", lambda: len(ember.explain.plan(ember_fn(eframe, eboxes)).kernels))
    for variant in VARIANTS:
        if variant == "OpenCV (CPU)":
            if guarded(variant, cv_fn) is not None:
                times[variant] = guarded(variant, lambda: median_ms(cv_fn, warmup, reps, True))
            continue
        if variant.startswith("torch"):
            fn = torch_fn if variant == "torch eager" else torch.compile(
                torch_fn, backend="eager" if cpu else "inductor")
            step = lambda fn=fn: fn(frame)  # noqa: E731
            out = guarded(variant, step)
            if out is not None and variant == "torch eager":
                reference = out.float().cpu().numpy()
        else:
            fn = ember.jit(ember_fn) if variant == "ember.jit" else ember_fn
            step = lambda fn=fn: fn(eframe, eboxes).realize()  # noqa: E731
            out = guarded(variant, step)
            if out is not None and reference is not None:
                got = out.numpy()
                check = max(check or 0.0, float(np.abs(got - reference.reshape(got.shape)).max()))
        if out is not None:
            times[variant] = guarded(variant, lambda step=step: median_ms(step, warmup, reps, cpu))
        if out is not None and variant in DEVICE_TIMED:
            gpu_times[variant] = guarded(f"{variant} (profiler)", lambda step=step: device_ms(step, warmup, reps))
    out_elements = count * size[0] * size[1] * 3
    floor_bytes = out_elements * 4 + out_elements  # the output, and one uint8 source sample per value
    return times, gpu_times, kernels, check, floor_bytes


def main(argv: list[str] | None = None) -> None:
    opts = parse_options(argv, "vision.py", __doc__, cases, rows_example="F,N")
    args, dev, cpu = opts.args, opts.dev, opts.args.cpu_smoke
    from fusion import copy_gbs

    gbs = guarded("copy rate", lambda: copy_gbs((1 << 30, 1 << 26, 1 << 16)[opts.which], dev, args.warmup,
                                                args.reps, cpu))
    lines = []
    for row, (kind, height, width, count, size) in opts.cases:
        if row not in opts.selected:
            continue
        print(f"row {row}", flush=True)
        times, gpu_times, kernels, check, floor_bytes = run_row(kind, height, width, count, size, dev, cpu,
                                                                 args.warmup, args.reps)
        floor = floor_bytes / (gbs * 1e9) * 1e3 if gbs else None
        best_ember = min((t for v, t in times.items() if v.startswith("ember") and t), default=None)
        compiled = times.get("torch.compile")
        compiled_gpu, jit_gpu = gpu_times.get("torch.compile"), gpu_times.get("ember.jit")
        lines.append([row, f"{count} x {size[0]}x{size[1]} from {height}x{width}", cell(floor, "{:.4f}"),
                      *[cell(times.get(v), "{:.4f}") for v in VARIANTS],
                      *[gpu_cell(gpu_times.get(v)) for v in DEVICE_TIMED], cell(kernels, "{}"),
                      cell(compiled / best_ember if compiled and best_ember else None, "{:.2f}"),
                      gpu_cell(compiled_gpu / jit_gpu if compiled_gpu and jit_gpu else None, "{:.2f}"),
                      cell(check, "{:.1e}")])
    head = ["row", "outputs", "floor ms", *[f"{v} ms" for v in VARIANTS], *[f"{v} GPU ms" for v in DEVICE_TIMED],
            "ember kernels", "compile / ember", "compile / ember (GPU)", "check"]
    notes = [f"floor: output bytes plus one uint8 source sample per output value, at the measured copy rate "
             f"{cell(gbs, '{:.0f}')} GB/s",
             "OpenCV runs on the host from host arrays; the others on the device from device tensors",
             "GPU ms: the summed durations of the GPU work one step runs (kernels, copies, memsets; kernels "
             "replayed from CUDA graphs too), from torch's profiler; ms: call to GPU done, launches included",
             "compile / ember: torch.compile ms over the best ember ms; (GPU): torch.compile GPU ms over ember.jit "
             "GPU ms",
             "check: max |ember - torch eager| over the output"]
    publish(f"vision benchmark: {environment(cpu)}", markdown_table(head, lines), notes, opts.results_file)


if __name__ == "__main__":
    main()
