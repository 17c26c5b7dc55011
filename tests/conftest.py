"""Shared helpers of the op suite: one set of random inputs for ember and torch, compared.

A test names an op once, as a function of the library: `lambda m, x: m.gelu(x)` runs with
`m = ember` and with `m = TORCH` (torch with torch.nn.functional on top), on tensors built
from the same NumPy arrays. `check_against_torch` compares forward values, dtypes and
gradients (with a random output cotangent); `check_finite_differences` checks ember's
gradients against central differences in float64, independently of torch.
"""

from __future__ import annotations

import atexit
import math
import os
import shutil
import tempfile
import zlib
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
import tiers
import torch
import torch.nn.functional as F

import ember

# The suite neither reads nor writes the user's caches (~/.cache/ember, Triton's): each test process compiles into a
# fresh directory of its own, removed at its exit, so no test sees what an earlier run (or another process) compiled.
_CACHE_DIR = tempfile.mkdtemp(prefix="ember-tests-")
os.environ["EMBER_CACHE_DIR"] = _CACHE_DIR
os.environ["TRITON_CACHE_DIR"] = os.path.join(_CACHE_DIR, "triton")
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)

# The cuda backend runs generated Triton kernels; without a GPU, Triton's interpreter runs them
# on the CPU (EMBER_INTERPRET=1), which is how the generated code is tested here. The choice is
# ember's alone: Triton's process-wide TRITON_INTERPRET is neither needed nor read.
if not torch.cuda.is_available():
    os.environ.setdefault("EMBER_INTERPRET", "1")

# On a machine with a GPU (and EMBER_INTERPRET unset), modules that test generated kernels on the
# cuda device mark themselves `gpu` with this, so they run in the GPU suite (`pytest -m gpu`)
# against the real device; without one they run in the default suite, through the interpreter.
ON_GPU = torch.cuda.is_available() and os.environ.get("EMBER_INTERPRET", "0") in ("", "0")


# GEMM autotuning profiles a dozen configurations per new problem on a GPU: the suite checks results, so
# it runs with the size-based default; tests/test_gpu_gemm.py turns profiling on where it is the subject.
os.environ.setdefault("EMBER_AUTOTUNE", "0")


def pytest_addoption(parser) -> None:
    tiers.add_option(parser)


def pytest_configure(config) -> None:
    tiers.configure(config)


def pytest_terminal_summary(terminalreporter, config) -> None:
    """Say how to replay this run: its tier, and its order's seed where the order was random."""
    seed = getattr(config.option, "randomly_seed", None)
    order = f", in a random order: replay it with --randomly-seed={seed}" if seed is not None else ""
    terminalreporter.write_line(f"tier {config.getoption('--tier')}{order}")


@pytest.fixture
def fresh_caches(monkeypatch, tmp_path) -> None:
    """Plans and kernels compiled from here on are new: an empty plan cache in memory and on disk."""
    use_fresh_caches(monkeypatch, tmp_path)


def use_fresh_caches(monkeypatch, tmp_path) -> None:
    from ember.runtime import plan_cache

    monkeypatch.setattr(plan_cache, "_plans", {})
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))


@pytest.fixture
def fresh_dynamo():
    """torch.compile's caches emptied before the test: a test may otherwise run frames dynamo compiled for an
    earlier test's backend options (seen: AdamW's step compiled for ember's cpu device, then run in a test compiling
    with options={"device": "cuda"}, with tensors on both devices)."""
    import torch._dynamo

    torch._dynamo.reset()


@pytest.fixture
def cuda_backend():
    from ember.runtime import cuda

    if not cuda.is_available():
        pytest.skip("the cuda backend needs a GPU or EMBER_INTERPRET=1")


# -- the op suite's device dimension ----------------------------------------------------------------
# A module that uses the `device` fixture (`pytestmark = pytest.mark.usefixtures("device")`) runs each
# of its tests once per device, with ids `[cpu-...]` and `[cuda-...]`. The fixture makes the device
# ember's default, so `ember.tensor(array)` and the creation ops put the inputs there; results are
# read back with `.numpy()` and compared with torch on the CPU as before.


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    """The reference backend, or generated Triton kernels (through Triton's interpreter without a GPU)."""
    if request.param == "cuda":
        request.getfixturevalue("cuda_backend")
    with ember.device(request.param):
        yield request.param


@pytest.hookimpl(trylast=True)  # after -k and -m have chosen: the tier samples what they kept
def pytest_collection_modifyitems(config, items) -> None:
    """`@pytest.mark.cuda_xfail(reason=...)` marks the test's cuda run, and only that one, xfail(strict); then the
    tier (`--tier`) keeps its share of the parametrizations."""
    for item in items:
        mark = item.get_closest_marker("cuda_xfail")
        callspec = getattr(item, "callspec", None)
        if mark is not None and callspec is not None and callspec.params.get("device") == "cuda":
            item.add_marker(pytest.mark.xfail(strict=True, **mark.kwargs))
    tiers.select(config, items)


DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64", "bool")
FLOATS = ("float32", "float64", "float16", "bfloat16")
HALVES = ("float16", "bfloat16")
INTS = ("int8", "uint8", "int16", "int32", "int64")
NUMERIC = FLOATS + INTS

# torch's functions with torch.nn.functional's on top: the torch twin of the `ember` namespace
TORCH = SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("_")})
for _name in dir(F):
    if not _name.startswith("_"):
        setattr(TORCH, _name, getattr(F, _name))

# (rtol, atol) for values, by dtype; half types are compared with torch computing in the same dtype
TOLERANCES = {
    "float64": (1e-9, 1e-11),
    "float32": (1e-5, 1e-6),
    "float16": (1e-2, 1e-3),
    "bfloat16": (1e-2, 1e-2),
}
# gradients pass through several rounded steps (each primitive's VJP stores in the input dtype)
GRAD_TOLERANCES = {
    "float64": (1e-8, 1e-10),
    "float32": (1e-4, 1e-5),
    "float16": (2e-2, 1e-2),
    "bfloat16": (4e-2, 4e-2),
}


def ember_dtype(name: str) -> ember.DType:
    return ember.dtypes.as_dtype(name)


def numpy_dtype(name: str) -> np.dtype:
    return ember_dtype(name).np


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded by the test's id less its device: each test sees the same data on every run
    and on every device."""
    nodeid = request.node.nodeid
    callspec = getattr(request.node, "callspec", None)
    device = callspec.params.get("device") if callspec is not None else None
    if device is not None:
        nodeid = nodeid.replace(f"[{device}-", "[").replace(f"[{device}]", "")
    return np.random.default_rng(zlib.crc32(nodeid.encode()))


def random_array(rng: np.random.Generator, shape, dtype: str, low: float = -2.0, high: float = 2.0,
                 avoid: float | None = None) -> np.ndarray:
    """Random values of `dtype` (a name) in [low, high]; floats stay at least 0.1 away from `avoid`."""
    shape = tuple(shape)
    if dtype == "bool":
        return np.asarray(rng.random(shape) < 0.5)
    if dtype in INTS:
        info = np.iinfo(numpy_dtype(dtype))
        lo, hi = max(math.floor(low), info.min), min(math.ceil(high), info.max)
        values = rng.integers(lo, hi + 1, size=shape)
        if avoid is not None:
            values = np.where(values == avoid, hi if avoid != hi else lo, values)
        return np.asarray(values, dtype=numpy_dtype(dtype))
    values = rng.uniform(low, high, size=shape)
    if avoid is not None:
        shift = np.where(values >= avoid, 0.1, -0.1)
        values = np.where(np.abs(values - avoid) < 0.1, values + shift, values)
    return np.asarray(values, dtype=numpy_dtype(dtype))


def dtype_name(array: np.ndarray) -> str:
    return ember.dtypes.from_numpy(array.dtype).name


def to_torch(array: np.ndarray) -> torch.Tensor:
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.array(array))


def to_numpy(t) -> np.ndarray:
    """The value of an ember or torch tensor as a NumPy array of the same dtype."""
    if isinstance(t, torch.Tensor):
        t = t.detach()
        if t.dtype == torch.bfloat16:
            return t.float().numpy().astype(ml_dtypes.bfloat16)
        return t.numpy()
    return t.numpy()


# -- layouts: the same logical values reached through a non-contiguous view ----------------------
# "contiguous", "transposed" (the leaf holds the transpose) or "strided" (the leaf holds every other
# element of a twice-as-long last dim)

def _make_view(m, leaf, layout: str):
    if layout == "transposed":
        return leaf.transpose(-1, -2)
    if layout == "strided":
        return leaf[..., ::2]
    return leaf


def _storage(array: np.ndarray, layout: str) -> np.ndarray:
    """The array a leaf holds so that `_make_view(leaf)` shows `array`."""
    if layout == "transposed":
        return np.ascontiguousarray(np.swapaxes(array, -1, -2))
    if layout == "strided":
        storage = np.zeros(array.shape[:-1] + (2 * array.shape[-1],), dtype=array.dtype)
        storage[..., ::2] = array
        storage[..., 1::2] = array[..., ::-1] if array.shape[-1] else array  # junk the view must skip
        return storage
    return array


def _layout_for(array: np.ndarray, layout: str) -> str:
    if layout == "transposed" and array.ndim < 2:
        return "strided" if array.ndim == 1 else "contiguous"
    if layout == "strided" and array.ndim < 1:
        return "contiguous"
    return layout


def make_inputs(inputs, layout: str = "contiguous", grad: bool = True):
    """ember and torch arguments for `inputs` (NumPy arrays, Python scalars or anything else passed
    through as is), and the leaves that gradients are taken for."""
    e_args, t_args, e_leaves, t_leaves = [], [], [], []
    for x in inputs:
        if not isinstance(x, np.ndarray):
            e_args.append(x)
            t_args.append(x)
            continue
        how = _layout_for(x, layout)
        storage = _storage(x, how)
        name = dtype_name(x)
        wants_grad = grad and name in FLOATS
        e_leaf = ember.tensor(storage, dtype=ember_dtype(name), requires_grad=wants_grad)
        t_leaf = to_torch(storage).requires_grad_(wants_grad)
        e_args.append(_make_view(ember, e_leaf, how))
        t_args.append(_make_view(torch, t_leaf, how))
        if wants_grad:
            e_leaves.append(e_leaf)
            t_leaves.append(t_leaf)
    return e_args, t_args, e_leaves, t_leaves


def _as_list(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def assert_same(e, t, rtol: float | None = None, atol: float | None = None, what: str = "value") -> None:
    """ember tensor `e` equals torch tensor `t`: shape, dtype and values (NaN equal to NaN)."""
    assert isinstance(e, ember.Tensor), f"{what}: expected an ember Tensor, got {type(e).__name__}"
    assert tuple(e.shape) == tuple(t.shape), f"{what}: shape {e.shape} != torch's {tuple(t.shape)}"
    assert e.dtype.name == str(t.dtype).removeprefix("torch."), f"{what}: dtype {e.dtype.name} != torch's {t.dtype}"
    got, want = to_numpy(e), to_numpy(t)
    name = e.dtype.name
    if name in FLOATS:
        default_rtol, default_atol = TOLERANCES[name]
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), equal_nan=True,
                                   rtol=default_rtol if rtol is None else rtol,
                                   atol=default_atol if atol is None else atol, err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


def check_against_torch(fn, *inputs, layout: str = "contiguous", grad: bool = True, rtol=None, atol=None,
                        grad_rtol=None, grad_atol=None, seed: int = 0):
    """Run `fn(m, *args)` under ember and torch on the same inputs and compare outputs and gradients.

    Outputs may be a tensor or a tuple of tensors. Gradients are compared for every floating-point
    array input, with one random cotangent per differentiable output. Returns the ember outputs.
    """
    e_args, t_args, e_leaves, t_leaves = make_inputs(inputs, layout, grad)
    t_out = _as_list(fn(TORCH, *t_args))
    e_out = _as_list(fn(ember, *e_args))
    assert len(e_out) == len(t_out), f"ember gives {len(e_out)} outputs, torch {len(t_out)}"
    for i, (e, t) in enumerate(zip(e_out, t_out)):
        assert_same(e, t, rtol, atol, what=f"output {i}")
    if not t_leaves:
        return e_out
    pairs = [(e, t) for e, t in zip(e_out, t_out) if t.requires_grad]
    for i, (e, t) in enumerate(zip(e_out, t_out)):
        assert e.requires_grad == t.requires_grad, f"output {i}: requires_grad {e.requires_grad} != torch's"
    if not pairs:
        return e_out
    rng = np.random.default_rng(seed)
    cotangents = [random_array(rng, t.shape, str(t.dtype).removeprefix("torch.")) for _, t in pairs]
    t_grads = torch.autograd.grad([t for _, t in pairs], t_leaves, [to_torch(c) for c in cotangents],
                                  allow_unused=True)
    e_grads = ember.grad([e for e, _ in pairs], e_leaves,
                         [ember.tensor(c, dtype=ember_dtype(dtype_name(c))) for c in cotangents],
                         allow_unused=True)
    for i, (eg, tg, leaf) in enumerate(zip(e_grads, t_grads, t_leaves)):
        tg = torch.zeros_like(leaf) if tg is None else tg
        eg = ember.zeros(leaf.shape, dtype=ember_dtype(str(leaf.dtype).removeprefix("torch."))) if eg is None else eg
        name = eg.dtype.name
        g_rtol, g_atol = GRAD_TOLERANCES.get(name, (0, 0))
        assert_same(eg, tg, g_rtol if grad_rtol is None else grad_rtol, g_atol if grad_atol is None else grad_atol,
                    what=f"gradient of input {i}")
    return e_out


def check_finite_differences(fn, *inputs, samples: int = 4, eps: float = 1e-6, rtol: float = 1e-5,
                             atol: float = 1e-7, seed: int = 0) -> None:
    """ember's gradients of `fn(ember, *inputs)` against central differences, in float64.

    float64 array inputs are differentiated; for each, `samples` random elements (all of them
    for tiny inputs) are perturbed by ±eps and the change of sum(cotangent * output) measured.
    """
    rng = np.random.default_rng(seed)
    leaves = [ember.tensor(x, requires_grad=True) if _is_f64(x) else x for x in inputs]
    wrt = [x for x in leaves if isinstance(x, ember.Tensor) and x.requires_grad]
    assert wrt, "check_finite_differences needs at least one float64 array input"
    outs = [o for o in _as_list(fn(ember, *_wrapped(leaves))) if o.dtype is ember.float64]
    cotangents = [rng.standard_normal(o.shape) for o in outs]
    analytic = ember.grad(outs, wrt, [ember.tensor(c) for c in cotangents], allow_unused=True)

    def objective(arrays) -> float:
        with ember.no_grad():
            values = _as_list(fn(ember, *_wrapped(arrays)))
        values = [v for v in values if v.dtype is ember.float64]
        return float(sum(np.sum(c * v.numpy()) for c, v in zip(cotangents, values)))

    base = [np.array(x, copy=True) if _is_f64(x) else x for x in inputs]
    k = 0
    for i, x in enumerate(inputs):
        if not _is_f64(x):
            continue
        g = np.zeros(x.shape) if analytic[k] is None else analytic[k].numpy()
        k += 1
        n = x.size
        picks = range(n) if n <= samples else rng.choice(n, size=samples, replace=False)
        for flat in picks:
            idx = np.unravel_index(flat, x.shape)
            plus = list(base)
            minus = list(base)
            plus[i] = base[i].copy()
            minus[i] = base[i].copy()
            plus[i][idx] += eps
            minus[i][idx] -= eps
            numeric = (objective(plus) - objective(minus)) / (2 * eps)
            assert abs(g[idx] - numeric) <= atol + rtol * abs(numeric), (
                f"input {i} element {idx}: analytic gradient {g[idx]!r} != finite difference {numeric!r}")


def _is_f64(x) -> bool:
    return isinstance(x, np.ndarray) and x.dtype == np.float64


def _wrapped(items) -> list:
    return [ember.tensor(x) if isinstance(x, np.ndarray) else x for x in items]


def plan_unfused(monkeypatch, tmp_path) -> None:
    """From here on, plan without MLP kernels: a fresh plan cache, in memory and on disk, so that no plan made
    with them is found again (a plan's key does not hold the planner's settings)."""
    from ember.compiler.patterns.mlp import planning

    monkeypatch.setattr(planning, "MLP_MAX_WIDTH", 0)
    use_fresh_caches(monkeypatch, tmp_path)


def check_relu_rounding(rows: int) -> None:
    """A float16 MLP's ReLU at the values where rounding and the clamp meet: tiny values of either sign that
    round to a zero or a subnormal, negative zeros, ties, the largest finite values, NaN. The first layer
    scales each column by 1 or 1/2 and adds a bias, the second is the identity, so the kernel's output is
    exactly max(round(x * s + b), 0), computed here in NumPy."""
    import torch

    from ember.compiler.fused import KernelKind
    from ember.explain import plan

    tiny = 2.0**-24  # float16's smallest subnormal
    values = np.array([0.0, -0.0, tiny, -tiny, 3 * tiny, -3 * tiny, 2**-14, -(2**-14), 65504, -65504, 1, -1,
                       0.1, -0.1, 1000.0, -7.0], np.float16)
    scale = np.where(np.arange(16) % 2 == 1, 0.5, 1.0).astype(np.float16)
    bias = np.array([0, 0, tiny, -tiny, 2 * tiny, -2 * tiny, 0.25, -0.25] * 2, np.float16)
    bias[8:10] = -0.0
    x = values[(np.arange(rows)[:, None] + np.arange(16)[None, :]) % 16]
    x[min(5, rows - 1), 2] = np.nan  # a row of NaN
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16)).half()
    with torch.no_grad():
        model[0].weight.copy_(torch.diag(torch.from_numpy(scale)))
        model[0].bias.copy_(torch.from_numpy(bias))
        model[2].weight.copy_(torch.eye(16, dtype=torch.float16))
        model[2].bias.zero_()
    em = ember.from_torch(model).to("cuda")
    with ember.no_grad():
        out = em(ember.tensor(x, device="cuda"))
        p = plan(out)
        assert [k.kind for k in p.kernels] == [KernelKind.MLP]
        assert "relu_to_f16(" in p.sources[id(p.kernels[0])].text
        got = out.numpy()
    hidden = (x.astype(np.float32) * scale.astype(np.float32) + bias.astype(np.float32)).astype(np.float16)
    want = np.maximum(hidden, np.float16(0))  # NaN kept
    want[np.isnan(want).any(axis=1)] = np.nan  # NaN times the identity's zeros: the whole row
    np.testing.assert_array_equal(got, want)
