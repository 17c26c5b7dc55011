"""The examples run end to end. train_gpu's MLP and CNN learn their synthetic data on the reference
backend, and on the cuda backend (through Triton's interpreter without a GPU) with the step replayed
by ember.jit, where they follow the reference's losses. The digits example is tested in
test_training.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ember.examples import train_gpu

SRC = Path(__file__).resolve().parents[1] / "src"

# tiny sizes: the interpreter runs every generated kernel on the CPU
TINY = dict(steps=20, batch_size=16, lr=3e-2, image_size=8, hidden=32, channels=(8, 8), train_samples=256,
            test_samples=64, progress=False)


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_train_gpu_model_learns_on_the_reference_backend(model):
    summary = train_gpu.train(model, "cpu", **TINY)
    assert summary.final_loss < 0.85 * summary.first_loss, str(summary)
    assert summary.accuracy > 0.2  # ten classes: chance is 0.1
    assert summary.steps == 20 and summary.steps_per_s > 0 and summary.samples_per_s > 0
    assert not summary.jit and summary.peak_bytes is None


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_train_gpu_model_on_cuda_with_jit_follows_the_reference_losses(model, cuda_backend):
    reference = train_gpu.train(model, "cpu", **TINY)
    summary = train_gpu.train(model, "cuda", **TINY)  # jit is the default on cuda
    assert summary.jit and summary.jit_stats["replays"] > 0, str(summary)
    assert summary.first_loss == pytest.approx(reference.first_loss, rel=1e-4)
    assert summary.final_loss == pytest.approx(reference.final_loss, rel=1e-3)
    assert summary.final_loss < 0.85 * summary.first_loss, str(summary)
    assert summary.peak_bytes is not None
    text = str(summary)
    for field in ("on cuda", "final loss", "held-out accuracy", "steps/s", "samples/s", "peak memory", "replays"):
        assert field in text, f"{field!r} missing from the summary:\n{text}"


def test_train_gpu_command_line_prints_a_summary_per_model(capsys):
    summaries = train_gpu.main(["--device", "cpu", "--steps", "4", "--batch-size", "8", "--hidden", "16",
                                "--image-size", "8"])
    out = capsys.readouterr().out
    assert [s.model for s in summaries] == ["mlp", "cnn"]
    for field in ("mlp (", "cnn (", "on cpu", "no jit", "final loss", "held-out accuracy", "steps/s", "samples/s"):
        assert field in out, f"{field!r} missing from the output:\n{out}"


def test_synthetic_images_are_reproducible_from_their_seed():
    x1, y1 = train_gpu.synthetic_images(64, 8, seed=0)
    x2, y2 = train_gpu.synthetic_images(64, 8, seed=0)
    assert x1.shape == (64, 1, 8, 8) and x1.dtype.name == "float32" and set(y1) <= set(range(10))
    assert (x1 == x2).all() and (y1 == y2).all()
    with pytest.raises(ValueError, match="multiple of 4"):
        train_gpu.synthetic_images(4, 6)


NO_TORCH = """
import sys

class NoGpuLibraries:  # torch and triton cannot be imported: the newcomer's first command has neither
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "triton"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoGpuLibraries())
from ember.examples import digits

digits.main(["--epochs", "2"])
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in ("torch", "triton"))
print("gpu libraries loaded:", loaded)
"""


def test_digits_example_trains_where_torch_and_triton_cannot_be_imported(tmp_path):
    """The cpu path (tensors, autograd, nn, optim, data, the example) needs neither torch nor triton."""
    env = {k: v for k, v in os.environ.items() if k not in ("EMBER_INTERPRET", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", NO_TORCH], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "test accuracy" in done.stdout
    assert "gpu libraries loaded: []" in done.stdout
