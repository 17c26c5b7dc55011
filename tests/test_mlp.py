"""Chains of narrow Linear layers as one MLP kernel (run by Triton's interpreter in CI, at size under
`pytest -m gpu`), against torch on the same rounded weights; the planner's fused/unfused decision; and
`ember.from_torch`, which imports a torch model sharing its parameters."""

from __future__ import annotations

import copy

import ml_dtypes
import numpy as np
import pytest
import torch
from conftest import check_relu_rounding, plan_unfused

import ember
import ember.nn as nn
from ember.compiler.fused import KernelKind
from ember.explain import plan

pytestmark = pytest.mark.usefixtures("cuda_backend")

ACTIVATIONS = {
    "relu": torch.nn.ReLU, "leaky_relu": lambda: torch.nn.LeakyReLU(0.1), "sigmoid": torch.nn.Sigmoid,
    "tanh": torch.nn.Tanh, "gelu": torch.nn.GELU, "silu": torch.nn.SiLU, "softplus": torch.nn.Softplus,
    "identity": torch.nn.Identity,
}
DTYPES = {"float16": (torch.float16, ember.float16, np.float16), "bfloat16": (torch.bfloat16, ember.bfloat16,
                                                                               ml_dtypes.bfloat16),
          "float32": (torch.float32, ember.float32, np.float32)}


@pytest.fixture(autouse=True, scope="module")
def fresh_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EMBER_CACHE_DIR", str(tmp_path_factory.mktemp("ember-cache")))
        yield


def torch_mlp(widths: list[int], activation: str, seed: int, bias: bool = True) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1], bias=bias))
        if i < len(widths) - 2:
            layers.append(ACTIVATIONS[activation]())
    return torch.nn.Sequential(*layers)


def rounded(model: torch.nn.Sequential, dtype: str) -> torch.nn.Sequential:
    """The model with parameters rounded to `dtype` (kept in float64 for the reference)."""
    tdt = DTYPES[dtype][0]
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(tdt).to(p.dtype))
    return model


def inputs(rows: int, width: int, dtype: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.uniform(-2, 2, size=(rows, width))
    x = np.where(np.abs(x) < 0.05, 0.05, x)
    return x.astype(DTYPES[dtype][2])


def run_ember(model: torch.nn.Sequential, x: np.ndarray, dtype: str):
    em = ember.from_torch(model).to("cuda").to(DTYPES[dtype][1])
    with ember.no_grad():
        out = em(ember.tensor(x, device="cuda"))
        kernels = plan(out).kernels
        return out.numpy().astype(np.float64), kernels


def reference(model: torch.nn.Sequential, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model.double()(torch.from_numpy(x.astype(np.float64))).numpy()


def relative(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


TOL = {"float16": 2e-2, "bfloat16": 5e-2, "float32": 1e-5}


def slow(*case):
    """A case the interpreter takes long over (thousands of rows): in the full tier only."""
    return pytest.param(*case, marks=pytest.mark.slow)


def case_ids(cases) -> list[str]:
    values = [getattr(c, "values", c) for c in cases]
    return [f"{'-'.join(map(str, c[0]))}x{c[1]}-{c[2]}-{c[3]}" for c in values]


CASES = [  # widths, rows, activation, dtype
    ([32, 64, 64, 16], 300, "relu", "float16"),
    ([64, 64, 64, 64, 64, 16], 1000, "relu", "float16"),
    ([3, 24, 100, 1], 127, "tanh", "bfloat16"),
    ([128, 128, 128], 128, "gelu", "float16"),
    ([1, 16, 1], 1, "sigmoid", "float16"),
    ([16, 16, 16], 2**16 + 3, "leaky_relu", "bfloat16"),
    ([20, 40, 30, 10], 129, "silu", "float32"),
    ([8, 100, 24, 8], 257, "softplus", "float16"),
    ([64, 32, 32, 32, 32, 32, 32, 32, 8], 200, "identity", "bfloat16"),  # depth 8
]


@pytest.mark.parametrize("widths,rows,activation,dtype", CASES, ids=case_ids(CASES))
def test_a_narrow_chain_is_one_kernel_and_matches_torch(widths, rows, activation, dtype):
    model = rounded(torch_mlp(widths, activation, seed=len(widths) + rows), dtype)
    x = inputs(rows, widths[0], dtype, seed=rows)
    got, kernels = run_ember(model, x, dtype)
    assert [k.kind for k in kernels] == [KernelKind.MLP]
    assert kernels[0].decisions == [f"one kernel: {len(widths) - 1} layers, widths {'-'.join(map(str, widths))}"]
    assert relative(got, reference(model, x)) < TOL[dtype]


@pytest.mark.parametrize("setting,dots", [("highest", "ieee"), ("high", "tf32")])
def test_a_float32_chain_multiplies_in_tf32_where_the_matmul_precision_allows_it(setting, dots):
    model = torch_mlp([20, 48, 48, 12], "tanh", seed=12)
    x = inputs(90, 20, "float32", seed=13)
    precision = ember.get_matmul_precision()
    try:
        ember.set_matmul_precision(setting)
        em = ember.from_torch(model).to("cuda")
        with ember.no_grad():
            out = em(ember.tensor(x, device="cuda"))
            p = plan(out)
            got = out.numpy().astype(np.float64)
    finally:
        ember.set_matmul_precision(precision)
    (kernel,) = p.kernels
    assert kernel.kind is KernelKind.MLP
    text = p.sources[id(kernel)].text
    other = {"ieee": "tf32", "tf32": "ieee"}[dots]
    assert text.count(f'input_precision="{dots}"') == 3 and f'input_precision="{other}"' not in text  # 3 layers
    assert relative(got, reference(model, x)) < (1e-5 if dots == "ieee" else 5e-3)


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_each_activation_fuses_and_matches_torch(activation):
    model = rounded(torch_mlp([16, 48, 48, 8], activation, seed=3), "float16")
    x = inputs(200, 16, "float16", seed=4)
    got, kernels = run_ember(model, x, "float16")
    assert [k.kind for k in kernels] == [KernelKind.MLP]
    assert relative(got, reference(model, x)) < TOL["float16"]


def test_fused_equals_unfused_on_the_same_device(monkeypatch, tmp_path):
    """The MLP kernel computes what the per-layer GEMMs compute (both round activations to the operand type)."""
    model = rounded(torch_mlp([32, 64, 64, 10], "relu", seed=5), "float16")
    x = inputs(333, 32, "float16", seed=6)
    fused, kernels = run_ember(model, x, "float16")
    plan_unfused(monkeypatch, tmp_path)
    unfused, per_layer = run_ember(model, x, "float16")
    assert KernelKind.MLP not in [k.kind for k in per_layer] and len(per_layer) == 3
    np.testing.assert_allclose(fused, unfused, rtol=2e-2, atol=2e-2)


def test_a_wide_layer_keeps_per_layer_gemms_and_says_why():
    model = rounded(torch_mlp([32, 256, 16], "relu", seed=7), "float16")
    x = inputs(64, 32, "float16", seed=8)
    got, kernels = run_ember(model, x, "float16")
    assert KernelKind.MLP not in [k.kind for k in kernels]
    assert any("width 256 is over 128" in d for k in kernels for d in k.decisions)
    assert relative(got, reference(model, x)) < TOL["float16"]


WIDE_CHAINS = [  # widths, the layers (start, stop) that share an MLP kernel
    ([200, 64, 64, 48, 256, 16], [(1, 3)]),  # a wide input, narrow layers, a wide hidden layer
    ([32, 64, 64, 256, 256, 24, 24, 8], [(0, 2), (5, 7)]),  # two narrow runs apart
    ([784, 64, 10], []),  # one narrow layer: nothing to share a kernel with
]


@pytest.mark.parametrize("widths,runs", WIDE_CHAINS, ids=["-".join(map(str, c[0])) for c in WIDE_CHAINS])
def test_the_narrow_layers_of_a_chain_with_wide_ones_share_a_kernel(widths, runs, monkeypatch, tmp_path):
    model = rounded(torch_mlp(widths, "gelu", seed=len(widths)), "float16")
    x = inputs(150, widths[0], "float16", seed=9)
    got, kernels = run_ember(model, x, "float16")
    layers = len(widths) - 1
    fused = sum(stop - start for start, stop in runs)
    assert sorted(len(k.cores) for k in kernels if k.kind is KernelKind.MLP) == sorted(
        stop - start for start, stop in runs)
    assert len([k for k in kernels if k.kind is KernelKind.MATMUL]) == layers - fused
    text = lambda ws: "-".join(map(str, ws))  # noqa: E731
    said = [d for k in kernels if k.kind is KernelKind.MLP for d in k.decisions]
    assert sorted(said) == sorted(f"one kernel: {stop - start} layers, widths {text(widths[start:stop + 1])} (layers "
                                  f"{start + 1}-{stop} of a chain of {layers}, widths {text(widths)})"
                                  for start, stop in runs)
    assert sum(d.startswith("per-layer GEMM") for k in kernels for d in k.decisions) == layers - fused
    assert relative(got, reference(model, x)) < TOL["float16"]
    plan_unfused(monkeypatch, tmp_path)
    unfused, _ = run_ember(model, x, "float16")
    np.testing.assert_allclose(got, unfused, rtol=2e-2, atol=2e-2)


@pytest.mark.slow
def test_a_training_step_through_wide_layers_fuses_the_narrow_ones_and_matches_torch(monkeypatch):
    monkeypatch.setenv("EMBER_SPLIT_K", "1")
    widths = [150, 48, 48, 48, 200, 8]
    kernels, got, want, theirs = training_step(widths, FUSED_TRAINING_BATCH + 7, "silu", "float16", seed=31)
    # the forward's layers 2-3 (48-48-48) are one kernel, and so is the input gradient's walk back through them
    # (the walk stops at the first layer's output: the input needs no gradient)
    assert [len(k.cores) for k in kernels if k.kind is KernelKind.MLP] == [2, 2]
    for i, (g, w, t) in enumerate(zip(got, want, theirs)):
        assert relative(g, w) < max(2e-2, 2 * relative(t, w)), f"value {i} (0: the loss, then the gradients)"


TRAINING_CASES = [  # widths, rows, activation, dtype
    ([16, 32, 32, 4], 50, "tanh", "float32"),
    ([64, 64, 64, 64, 64, 16], 1000, "relu", "float16"),
    ([3, 24, 100, 1], 127, "gelu", "bfloat16"),
    slow([8, 40, 40, 40, 8], 2**12 + 3, "silu", "float16"),
    slow([64, 64, 64, 64, 64, 16], 2**12, "relu", "float16"),
    ([5, 100, 24, 3], 2**11 + 1, "softplus", "float32"),
    ([16, 16], 33, "relu", "float16"),  # one layer: nothing to chain
]
# From this batch on, with split-K on (the default), the weight-gradient GEMMs split their K (the batch)
# and the bias gradients are summed in their mainloops; below it, a layer's GEMM may sum its bias gradient
# in its epilogue, across its row tiles, which a chain's MLP kernel takes per program instead (absorb_sums).
FUSED_TRAINING_BATCH = 2**11


def training_step(widths, rows, activation, dtype, seed):
    """One MSE step's loss and gradients in ember and in torch (float64, on the same rounded values), and
    ember's plan of the step."""
    model = rounded(torch_mlp(widths, activation, seed=seed), dtype)
    x, y = inputs(rows, widths[0], dtype, seed=seed + 1), inputs(rows, widths[-1], dtype, seed=seed + 2)
    em = ember.from_torch(model).to("cuda").to(DTYPES[dtype][1])
    loss = ((em(ember.tensor(x, device="cuda")).float() - ember.tensor(y, device="cuda").float()) ** 2).mean()
    loss.backward()
    grads = [p.grad for p in em.parameters()]
    kernels = plan(loss, *grads).kernels
    got = [loss.numpy().astype(np.float64)] + [g.numpy().astype(np.float64) for g in grads]
    return kernels, got, torch_step(model, x, y, torch.float64), torch_step(model, x, y, DTYPES[dtype][0])


def torch_step(model: torch.nn.Sequential, x: np.ndarray, y: np.ndarray, dtype) -> list[np.ndarray]:
    """The loss and the parameters' gradients of one MSE step in torch, computed in `dtype`."""
    import copy

    model = copy.deepcopy(model).to(dtype)
    tx, ty = (torch.from_numpy(v.astype(np.float64)).to(dtype) for v in (x, y))
    loss = ((model(tx).float() - ty.float()) ** 2).mean()
    loss.backward()
    return [loss.detach().double().numpy()] + [p.grad.double().numpy() for p in model.parameters()]


@pytest.mark.parametrize("widths,rows,activation,dtype", TRAINING_CASES,
                         ids=case_ids(TRAINING_CASES))
def test_a_training_step_fuses_its_forward_and_backward_chains_and_its_gradients_match_torch(
        widths, rows, activation, dtype, monkeypatch):
    """The forward chain is one kernel that also writes the activations the backward reads; the backward's
    chain (the input gradient walked back through the layers) is one kernel that writes each layer's
    gradient for the weight-gradient GEMMs."""
    monkeypatch.setenv("EMBER_SPLIT_K", "1")  # the weight gradients split the batch (see FUSED_TRAINING_BATCH)
    kernels, got, want, theirs = training_step(widths, rows, activation, dtype, seed=len(widths) + rows)
    mlps = [k for k in kernels if k.kind is KernelKind.MLP]
    layers = len(widths) - 1
    if layers == 1:
        assert not mlps
    elif rows >= FUSED_TRAINING_BATCH:
        forward = [k for k in mlps if len(k.cores) == layers]
        backward = [k for k in mlps if len(k.cores) == layers - 1]  # no gradient of the input
        assert forward and backward, [(k.kind, len(k.cores)) for k in kernels]
        assert any("intermediates that other kernels read" in d for d in forward[0].decisions)
    # within the type's rounding, or twice torch's own error in that type (a mean-reduced loss makes gradients
    # small enough that half precision rounds them coarsely)
    tol = {"float32": 1e-5, "float16": 2e-2, "bfloat16": 5e-2}[dtype]
    for i, (g, w, t) in enumerate(zip(got, want, theirs)):
        assert relative(g, w) < max(tol, 2 * relative(t, w)), f"value {i} (0: the loss, then the gradients)"


ABSORBED_CASES = [  # widths, rows, activation, dtype: every row count, padded widths, each type
    ([16, 32, 32, 32, 8], 1, "relu", "float16"),
    ([16, 32, 32, 32, 8], 127, "tanh", "bfloat16"),
    ([24, 24, 24, 5], 128, "silu", "float32"),
    ([8, 100, 24, 3], 1000, "gelu", "float16"),
    slow([64, 64, 64, 64, 64, 16], FUSED_TRAINING_BATCH + 3, "relu", "float16"),
    slow([5, 40, 40, 40, 7], 3 * FUSED_TRAINING_BATCH + 1, "leaky_relu", "bfloat16"),
]


@pytest.mark.parametrize("widths,rows,activation,dtype", ABSORBED_CASES,
                         ids=case_ids(ABSORBED_CASES))
def test_weight_gradients_summed_inside_mlp_kernels_match_torch(widths, rows, activation, dtype, monkeypatch):
    """A weight gradient whose operands an MLP kernel computes (or loads) for each row tile is summed inside it,
    per program, and finished by a second launch of the kernel's own (one for all its gradients), no GEMM. The
    gradients match torch whatever the kernel absorbed (below FUSED_TRAINING_BATCH, a bias gradient a layer sums
    in its epilogue is the MLP kernel's sum over its rows)."""
    monkeypatch.setenv("EMBER_SPLIT_K", "1")
    kernels, got, want, theirs = training_step(widths, rows, activation, dtype, seed=rows + len(widths))
    absorbing = [k for k in kernels if k.kind is KernelKind.MLP and k.payload.absorbed]
    for k in absorbing:
        assert sum(1 for d in k.decisions if d.startswith("sums the weight gradient")) == len(k.payload.absorbed)
        for g in k.payload.absorbed:  # a [fan_out, fan_in] product over the kernel's rows, read from its layers
            assert g.core.inputs[0].inputs[0].shape[0] == k.cores[0].shape[0] == rows
    if rows >= FUSED_TRAINING_BATCH:
        assert absorbing, [(k.kind, len(k.cores)) for k in kernels]
    tol = {"float32": 1e-5, "float16": 2e-2, "bfloat16": 5e-2}[dtype]
    for i, (g, w, t) in enumerate(zip(got, want, theirs)):
        assert relative(g, w) < max(tol, 2 * relative(t, w)), f"value {i} (0: the loss, then the gradients)"


SUM_CASES = [  # widths, rows, activation, dtype, what is summed over the rows: every row count, staged sums, padding
    ([16, 32, 32, 8], 1, "relu", "float16", "mse"),
    ([16, 32, 32, 8], 127, "tanh", "bfloat16", "columns"),
    ([24, 24, 24, 5], 1000, "silu", "float32", "mse"),
    ([3, 24, 100, 1], 129, "gelu", "float16", "sum"),
    ([64, 64, 64, 16], 2**14 + 3, "relu", "float16", "mse"),  # long enough that the sum is staged in two
    ([8, 40, 40, 64], 2**12 + 5, "softplus", "float16", "column mean"),  # per column, staged
]


def summed(out, target, what: str):
    """`what` of an MLP's output (ember or torch): a mean squared error, a sum of every element, column sums or
    means (keeping the row axis)."""
    if what == "mse":
        return ((out.float() - target) ** 2).mean()
    if what == "sum":
        return (out.float() * 0.3).sum()
    if what == "columns":
        return out.float().sum(0)
    return out.float().mean(0, keepdim=True)


def sum_step(widths, rows, activation, dtype, what, seed):
    """The sum `what` of a no-grad forward in ember (with its plan), in torch float64 and in torch in the MLP's
    own type (both on the same rounded weights)."""
    model = rounded(torch_mlp(widths, activation, seed=seed), dtype)
    x, t = inputs(rows, widths[0], dtype, seed=seed + 1), inputs(rows, widths[-1], "float32", seed=seed + 2)
    em = ember.from_torch(model).to("cuda").to(DTYPES[dtype][1])
    with ember.no_grad():
        value = summed(em(ember.tensor(x, device="cuda")), ember.tensor(t, device="cuda"), what)
        kernels = plan(value).kernels
        got = value.numpy().astype(np.float64)
    results = []
    for torch_dtype in (torch.float64, DTYPES[dtype][0]):
        with torch.no_grad():
            out = copy.deepcopy(model).to(torch_dtype)(torch.from_numpy(x.astype(np.float64)).to(torch_dtype))
            results.append(summed(out.double(), torch.from_numpy(t.astype(np.float64)), what).numpy())
    return kernels, got, *results


@pytest.mark.parametrize("widths,rows,activation,dtype,what", SUM_CASES,
                         ids=[f"{'-'.join(map(str, c[0]))}x{c[1]}-{c[2]}-{c[3]}-{c[4]}" for c in SUM_CASES])
def test_a_sum_over_an_mlps_rows_is_taken_inside_its_kernel_and_matches_torch(widths, rows, activation, dtype, what):
    """A loss over the MLP's output (or a sum of every element, or of each column) is summed by the MLP kernel's
    programs as their row tiles pass, one partial each, and finished by its second launch: one kernel in all,
    whose output layer is not written."""
    kernels, got, want, theirs = sum_step(widths, rows, activation, dtype, what, seed=rows + len(widths))
    assert [k.kind for k in kernels] == [KernelKind.MLP]
    (mlp,) = kernels
    assert len(mlp.payload.summed) == 1 and any(d.startswith(f"sums [{rows}, {widths[-1]}]") for d in mlp.decisions)
    assert not mlp.payload.layers, "the output layer's values are summed in registers, never written"
    assert got.shape == want.shape
    assert relative(got, want) < max(TOL[dtype], 2 * relative(theirs, want))


def test_a_sum_taken_inside_an_mlp_kernel_equals_the_separate_reduction(monkeypatch):
    from ember.compiler.patterns.mlp import planning

    case = ([32, 48, 48, 10], 2**12 + 7, "relu", "float16", "mse")
    fused_kernels, fused, _, _ = sum_step(*case, seed=61)
    monkeypatch.setattr(planning, "MLP_MAX_SUMS", 0)
    separate_kernels, separate, _, _ = sum_step(*case, seed=61)
    assert [k.kind for k in fused_kernels] == [KernelKind.MLP]
    assert KernelKind.REDUCE in [k.kind for k in separate_kernels]
    np.testing.assert_allclose(fused, separate, rtol=1e-5)


def test_a_sum_of_values_that_need_another_sum_of_the_kernel_stays_a_kernel_of_its_own():
    """The column sums of the output are taken inside the MLP kernel; a sum of the output weighted by them needs
    them before the kernel's finishing launch has them, so it is summed by a row kernel after it."""
    model = rounded(torch_mlp([16, 32, 32, 8], "relu", seed=70), "float16")
    x = inputs(3000, 16, "float16", seed=71)
    em = ember.from_torch(model).to("cuda").to(ember.float16)
    with ember.no_grad():
        out = em(ember.tensor(x, device="cuda")).float()
        columns = out.sum(0)
        weighted = (out * columns).mean()
        kernels = plan(columns, weighted).kernels
        got = [columns.numpy().astype(np.float64), weighted.numpy().astype(np.float64)]
    mlps = [k for k in kernels if k.kind is KernelKind.MLP]
    assert len(mlps) == 1 and len(mlps[0].payload.summed) == 1 and KernelKind.REDUCE in [k.kind for k in kernels]
    ref = reference(model, x)
    assert relative(got[0], ref.sum(0)) < TOL["float16"]
    assert relative(got[1], (ref * ref.sum(0)).mean()) < TOL["float16"]


def test_a_gradient_reading_a_sum_of_the_same_kernel_is_not_finished_beside_it():
    """Column sums of a layer's output are the MLP kernel's (its epilogue summed them); a product over its rows
    scaled by those sums reads them in its epilogue, so it is not finished by the same launch that writes them."""
    model = rounded(torch_mlp([16, 32, 16], "relu", seed=80, bias=False), "float16")
    x = inputs(300, 16, "float16", seed=81)
    em = ember.from_torch(model).to("cuda").to(ember.float16)
    with ember.no_grad():
        h = em[1](em[0](ember.tensor(x, device="cuda")))
        out = em[2](h)
        columns = out.float().sum(0)
        scaled = (h.transpose(0, 1) @ out).float() * columns
        kernels = plan(columns, scaled).kernels
        got = [t.numpy().astype(np.float64) for t in (columns, scaled)]
    mlps = [k for k in kernels if k.kind is KernelKind.MLP]
    assert len(mlps) == 1 and len(mlps[0].payload.summed) == 1 and not mlps[0].payload.absorbed
    with torch.no_grad():
        hd = model.double()[1](model.double()[0](torch.from_numpy(x.astype(np.float64))))
        od = model.double()[2](hd)
    assert relative(got[0], od.sum(0).numpy()) < TOL["float16"]
    assert relative(got[1], ((hd.T @ od) * od.sum(0)).numpy()) < TOL["float16"]


def test_an_mlp_kernel_sums_gradients_in_registers_for_only_as_many_as_fit(monkeypatch):
    """A 64-wide chain's backward kernel keeps two 64 x 64 gradient accumulators (MLP_GRADIENT_ELEMENTS); the
    other two gradients stay split-K GEMMs reading the intermediates it writes; the output layer's gradient
    joins the forward kernel, which computes both its operands. Explain shows each gradient and its finish."""
    monkeypatch.setenv("EMBER_SPLIT_K", "1")
    model = rounded(torch_mlp([64, 64, 64, 64, 64, 16], "relu", seed=40), "float16")
    x, y = inputs(FUSED_TRAINING_BATCH, 64, "float16", seed=41), inputs(FUSED_TRAINING_BATCH, 16, "float16", seed=42)
    em = ember.from_torch(model).to("cuda").to(ember.float16)
    loss = ((em(ember.tensor(x, device="cuda")).float() - ember.tensor(y, device="cuda").float()) ** 2).mean()
    loss.backward()
    p = plan(loss, *[q.grad for q in em.parameters()])
    forward, backward = [k for k in p.kernels if k.kind is KernelKind.MLP]
    assert [list(g.core.shape) for g in forward.payload.absorbed] == [[16, 64]]
    assert [list(g.core.shape) for g in backward.payload.absorbed] == [[64, 64], [64, 64]]
    # it sums the gradients of its later layers and writes its first layer's result for a GEMM (ties are broken
    # that way: see absorb_gradients)
    assert sorted(set(backward.payload.layers.values())) == [0, 3]
    assert [k.kind for k in p.kernels].count(KernelKind.MATMUL) == 2
    text = str(p)
    assert text.count("  gradient  ") == 3 and "sums the weight gradient [64, 64] over its 2048 rows" in text
    assert len(p.sources[id(backward)].launches) == 2  # the layers, then one launch finishing both gradients


def test_a_gradient_is_not_summed_by_a_kernel_that_reads_its_update(monkeypatch):
    """Two SGD steps in one graph: the second forward reads W - lr * dW. Its kernel must not sum dW itself (the
    update would be written by its finishing launch, after its layers read it): the loss matches torch."""
    monkeypatch.setenv("EMBER_SPLIT_K", "1")
    widths, rows = [32, 64, 64, 64, 64, 16], FUSED_TRAINING_BATCH
    model = rounded(torch_mlp(widths, "relu", seed=50, bias=False), "float16")
    x, y = inputs(rows, 32, "float16", seed=51), inputs(rows, 16, "float16", seed=52)
    em = ember.from_torch(model).to("cuda").to(ember.float16)
    ex, ey = ember.tensor(x, device="cuda"), ember.tensor(y, device="cuda").float()
    ((em(ex).float() - ey) ** 2).mean().backward()
    h = ex * 0.5
    for i, w in enumerate(em.parameters()):
        h = h @ (w - 0.1 * w.grad).T
        h = h.relu() if i < len(widths) - 2 else h
    loss = ((h.float() - ey) ** 2).mean()
    kernels = plan(loss).kernels
    for k in kernels:  # no kernel sums a gradient whose update its own layers read
        absorbed = k.payload.absorbed if k.kind is KernelKind.MLP else []
        updates = {id(o) for g in absorbed for o in g.outputs}
        assert not any(id(n) in updates for n in k.reads), k.index

    ref = torch_mlp(widths, "relu", seed=50, bias=False).double()
    ref.load_state_dict({key: v.double() for key, v in model.state_dict().items()})
    tx, ty = torch.from_numpy(x.astype(np.float64)), torch.from_numpy(y.astype(np.float64))
    ((ref(tx) - ty) ** 2).mean().backward()
    th = tx * 0.5
    linears = [m for m in ref if isinstance(m, torch.nn.Linear)]
    for i, m in enumerate(linears):
        th = th @ (m.weight - 0.1 * m.weight.grad).T
        th = th.relu() if i < len(linears) - 1 else th
    want = ((th - ty) ** 2).mean().item()
    assert abs(float(loss.item()) - want) < 2e-2 * abs(want)


@pytest.mark.slow
def test_an_mlp_kernel_summing_gradients_streams_its_weights_on_a_smaller_gpu(monkeypatch):
    """The streamed form of a kernel that sums gradients still walks row tiles (one partial per program), its
    loop unpipelined since it loads the weights in it; it computes the same gradients."""
    from ember.errors import CompileError
    from ember.runtime import cuda, launcher

    monkeypatch.setenv("EMBER_SPLIT_K", "1")
    monkeypatch.setattr(cuda, "multiprocessors", lambda device: 4)  # fewer programs than row tiles: they walk
    case = ([32, 48, 48, 48, 10], FUSED_TRAINING_BATCH + 5, "relu", "float16")
    _, want, _, _ = training_step(*case, seed=23)
    real = launcher._run_launches
    refused, ran = [], []

    def small_gpu(launches, ck, buffers, sig):
        if ck.kernel.kind is KernelKind.MLP and ck.kernel.payload.absorbed and ck.fallback is not None:
            refused.append(ck.source.text)
            raise CompileError("kernel failed: out of resource: shared memory, Required: 300000")
        ran.append(ck.source.text)
        return real(launches, ck, buffers, sig)

    monkeypatch.setattr(launcher, "_run_launches", small_gpu)
    _, got, _, _ = training_step(*case, seed=23)  # the same plan, its kernel refused: the streamed form runs
    assert refused and any("num_stages=1" in text for text in ran)
    for i, (a, b) in enumerate(zip(got, want)):  # rows summed in other tiles: float32 sums in another order
        assert relative(a, b) < 1e-2, f"value {i}"


@pytest.mark.slow
def test_jit_replays_a_training_step_whose_mlp_kernels_sum_and_update_the_weights(monkeypatch):
    """Under ember.jit, an MLP kernel's finishing launch writes Adam's updates (parameters, moments) in place:
    three replayed steps leave the same parameters as three steps run lazily."""
    monkeypatch.setenv("EMBER_SPLIT_K", "1")
    widths, rows = [16, 32, 32, 32, 8], FUSED_TRAINING_BATCH + 7
    model = rounded(torch_mlp(widths, "relu", seed=60), "float16")
    x = ember.tensor(inputs(rows, 16, "float16", seed=61), device="cuda")
    y = ember.tensor(inputs(rows, 8, "float16", seed=62), device="cuda")
    finals = []
    for jitted in (False, True):
        em = ember.from_torch(model).to("cuda").to(ember.float16)
        opt = ember.optim.Adam(em.parameters(), lr=1e-2, eps=1e-4)  # eps 1e-8 rounds to 0 in float16

        def step(x, y, em=em, opt=opt):
            opt.zero_grad()
            loss = ((em(x).float() - y.float()) ** 2).mean()
            loss.backward()
            opt.step()
            return loss

        run = ember.jit(step) if jitted else step
        if jitted:
            with ember.explain.capture() as plans:
                step(x, y).realize()  # the plan of one step, run once lazily: the replays below start after it
            assert any(k.kind is KernelKind.MLP and k.payload.absorbed for p in plans for k in p.kernels)
        losses = [float(run(x, y).item()) for _ in range(3 - jitted)]
        finals.append((losses[-1], [q.numpy().astype(np.float64) for q in em.parameters()]))
    (lazy_loss, lazy), (jit_loss, jitted_params) = finals
    assert abs(lazy_loss - jit_loss) <= 1e-3 * abs(lazy_loss)
    for a, b in zip(lazy, jitted_params):
        np.testing.assert_allclose(b, a, rtol=1e-2, atol=1e-3)


@pytest.mark.slow  # an interpreter run of a whole training step, twice
def test_a_fused_training_step_equals_the_unfused_one(monkeypatch, tmp_path):
    monkeypatch.setenv("EMBER_SPLIT_K", "1")
    case = ([32, 48, 48, 48, 10], FUSED_TRAINING_BATCH + 5, "relu", "float16")
    fused_kernels, fused, _, _ = training_step(*case, seed=21)
    plan_unfused(monkeypatch, tmp_path)
    unfused_kernels, unfused, _, _ = training_step(*case, seed=21)
    assert KernelKind.MLP in [k.kind for k in fused_kernels]
    assert KernelKind.MLP not in [k.kind for k in unfused_kernels]
    for i, (a, b) in enumerate(zip(fused, unfused)):
        assert relative(a, b) < 2e-2, f"value {i}"


def test_an_ember_sequential_fuses_too():
    ember.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 40), nn.SiLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 3)).to(
        "cuda").to(ember.float16)
    x = ember.tensor(inputs(77, 12, "float16", seed=11), device="cuda")
    with ember.no_grad():
        out = model(x)
        assert [k.kind for k in plan(out).kernels] == [KernelKind.MLP]
        got = out.numpy().astype(np.float64)
    ref = torch.from_numpy(x.numpy().astype(np.float64))
    for layer in model:
        if isinstance(layer, nn.Linear):
            ref = ref @ torch.from_numpy(layer.weight.numpy().astype(np.float64)).T + torch.from_numpy(
                layer.bias.numpy().astype(np.float64))
        else:
            ref = {"SiLU": torch.nn.functional.silu, "ReLU": torch.relu}[type(layer).__name__](ref)
    assert relative(got, ref.numpy()) < TOL["float16"]


CLAMPS = {  # an activation ending in clamps at constants, and whether the operand type holds every constant
    "relu": (nn.functional.relu, True),  # where(x <= 0, 0, x)
    "at least 0": (lambda h: h.clamp(min=0), True),  # where(x < 0, 0, x)
    "at most 0": (lambda h: h.clamp(max=0), True),  # where(x > 0, 0, x)
    "relu then at most 0": (lambda h: nn.functional.relu(h).clamp(max=0), True),  # two clamps
    "hardtanh": (nn.functional.hardtanh, True),  # where(x > 1, 1, where(x < -1, -1, x))
    # constants other than 0, +-1, 2, 0.5 and +-inf are kernel arguments, not known when the kernel is generated
    "relu6": (nn.functional.relu6, False),
}


def _layers(seed: int, widths: list[int], dtype) -> list:
    ember.manual_seed(seed)
    return [nn.Linear(a, b).to("cuda").to(dtype) for a, b in zip(widths, widths[1:])]


def _run_layers(layers, activation, x):
    with ember.no_grad():
        h = x
        for i, layer in enumerate(layers):
            h = layer(h)
            if i < len(layers) - 1:
                h = activation(h)
        p = plan(h)
        return h.numpy().astype(np.float64), p


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(CLAMPS))
def test_clamps_ending_a_layer_apply_to_its_half_operand_and_keep_nan(name, dtype, monkeypatch, tmp_path):
    """An MLP kernel clamps the next dot's float16 operand after casting it (the same values: rounding is
    monotonic), where float16 holds the constants, a ReLU in the conversion itself; NaN still passes through,
    as in torch. bfloat16 operands are clamped before the cast."""
    activation, rewritten = CLAMPS[name]
    layers = _layers(31, [24, 40, 40, 8], DTYPES[dtype][1])
    x = inputs(300, 24, dtype, seed=32)
    x[7, 3] = np.nan  # a row of NaN from the first layer on
    x[11] = 0  # a row of the first layer's biases: some land exactly on a clamp's constant after rounding
    got, p = _run_layers(layers, activation, ember.tensor(x, device="cuda"))
    assert [k.kind for k in p.kernels] == [KernelKind.MLP]
    text = p.sources[id(p.kernels[0])].text
    half = rewritten and dtype == "float16"
    assert ("relu_to_f16(" in text or "_combine(h_" in text) == half
    # a ReLU applied first is the conversion's own
    assert ("relu_to_f16(" in text) == (half and name in ("relu", "at least 0", "relu then at most 0"))
    plan_unfused(monkeypatch, tmp_path)
    want, unfused = _run_layers(layers, activation, ember.tensor(x, device="cuda"))
    assert KernelKind.MLP not in [k.kind for k in unfused.kernels]
    assert np.isnan(got[7]).all() and np.isnan(want[7]).all()
    rest = np.arange(300) != 7
    np.testing.assert_allclose(got[rest], want[rest], rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("rows", [1, 37])
def test_relu_in_the_operands_conversion_rounds_and_clamps_as_torch(rows):
    check_relu_rounding(rows)


@pytest.mark.parametrize("widths,hoisted", [([32, 48, 48, 16], True), ([128, 128, 128, 128, 16], False)])
def test_a_persistent_mlp_kernel_loads_its_biases_once_before_walking_row_tiles(widths, hoisted, monkeypatch):
    """Unless they would take too many registers across the loop (MLP_HOISTED_ELEMENTS)."""
    from ember.runtime import cuda

    monkeypatch.setattr(cuda, "multiprocessors", lambda device: 1)  # 2 programs for 8 row tiles: they walk
    model = rounded(torch_mlp(widths, "relu", seed=33), "float16")
    x = inputs(1000, widths[0], "float16", seed=34)
    got, kernels = run_ember(model, x, "float16")
    text = plan_text(model, x)
    loop = text[text.index("for tile"):]
    # the rows; the weights, and the biases if hoisted, load before the loop
    assert loop.count("tl.load(") == (1 if hoisted else len(widths))
    assert relative(got, reference(model, x)) < TOL["float16"]


def plan_text(model: torch.nn.Sequential, x: np.ndarray) -> str:
    em = ember.from_torch(model).to("cuda").to(ember.float16)
    with ember.no_grad():
        p = plan(em(ember.tensor(x, device="cuda")))
    return "\n".join(p.sources[id(k)].text for k in p.kernels)


def test_explain_names_the_layers():
    model = rounded(torch_mlp([64, 64, 64, 64, 64, 16], "relu", seed=12), "float16")
    em = ember.from_torch(model).to("cuda").half()
    with ember.no_grad():
        text = str(ember.explain(em(ember.tensor(inputs(256, 64, "float16", seed=13), device="cuda"))))
    assert "mlp" in text and "one kernel: 5 layers, widths 64-64-64-64-64-16" in text


# -- from_torch ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_from_torch_shares_parameters_and_computes_the_same(device):
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.LeakyReLU(0.2),
                                torch.nn.Sequential(torch.nn.Linear(10, 3, bias=False), torch.nn.GELU("tanh")),
                                torch.nn.Flatten(), torch.nn.Dropout(0.5)).eval()
    em = ember.from_torch(model)
    assert not em.training and [name for name, _ in em.named_parameters()] == [
        name for name, _ in model.named_parameters()]
    x = torch.randn(7, 6)
    with torch.no_grad():
        model[0].weight.mul_(2.0)  # shared: the import sees a later in-place change
        ref = model(x).numpy()
    em = em.to(device)
    got = em(ember.tensor(x.numpy(), device=device)).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_from_torch_names_unsupported_layers():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.RReLU(),
                                torch.nn.Sequential(torch.nn.Bilinear(4, 4, 4)))
    with pytest.raises(TypeError, match=r"unsupported layer 1: RReLU; unsupported layer 2\.0: Bilinear"):
        ember.from_torch(model, via="fx")
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        ember.from_torch(np.zeros(3))


@pytest.mark.parametrize("reuse", ["residual", "as_weight"])
def test_an_activation_read_again_after_the_next_layer_is_not_chained(reuse):
    """The next layer's epilogue (a residual) or its weight reading the activation needs it stored."""
    rng = np.random.default_rng(14)
    a, w1, w2 = (rng.uniform(-1, 1, size=s).astype(np.float32) for s in ((40, 16), (16, 24), (24, 24)))
    x, u, v = (ember.tensor(t, device="cuda") for t in (a, w1, w2))
    h = (x @ u).relu()
    out = (h @ v + h) if reuse == "residual" else h @ h.T
    assert KernelKind.MLP not in [k.kind for k in plan(out).kernels]
    th = torch.relu(torch.from_numpy(a).double() @ torch.from_numpy(w1).double())
    ref = th @ torch.from_numpy(w2).double() + th if reuse == "residual" else th @ th.T
    np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=1e-4, atol=1e-5)


def test_an_mlp_kernel_that_cannot_hold_its_weights_on_this_gpu_streams_them(monkeypatch):
    """The persistent form holds every weight in shared memory; where a GPU has less than the plan assumed,
    its launch fails to compile and the step runs the kernel's streamed form instead, with the same result."""
    from ember.errors import CompileError
    from ember.runtime import launcher

    model = rounded(torch_mlp([32, 64, 64, 10], "relu", seed=30), "float16")
    x = inputs(128 * 300, 32, "float16", seed=31)  # more row tiles than the programs the GPU holds at once
    want, _ = run_ember(model, x, "float16")
    real = launcher._run_launches
    ran, refused = [], []

    def small_gpu(launches, ck, buffers, sig):
        if ck.kernel.kind is KernelKind.MLP and ck.fallback is not None:
            refused.append(ck.source.text)
            raise CompileError("kernel failed: out of resource: shared memory, Required: 300000")
        ran.append(ck.source.text)
        return real(launches, ck, buffers, sig)

    monkeypatch.setattr(launcher, "_run_launches", small_gpu)
    em = ember.from_torch(model).to("cuda").to(ember.float16)
    with ember.no_grad():
        got = em(ember.tensor(x * 1, device="cuda")).numpy().astype(np.float64)  # a new plan: x * 1
    assert refused and "for tile in range(" in refused[0]  # the persistent form: programs walk row tiles
    assert ran and "for tile in range(" not in ran[-1]  # the streamed form: one row tile per program
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("width", [32, 64])
def test_a_training_steps_plan_does_not_depend_on_object_addresses(width, monkeypatch):
    """The planner never orders by id(): run to run, objects land at other addresses, and the launch order decides
    which weight gradients an MLP kernel sums. The same step planned with every ember module's id() scrambled two
    ways (bijections, so identity still holds) gives the same kernels."""
    import builtins
    import sys

    from ember.explain import Plan
    from ember.runtime import executor, plan_cache

    def planned(scramble) -> str:
        for name, module in list(sys.modules.items()):
            if name == "ember" or name.startswith("ember."):
                monkeypatch.setattr(module, "id", scramble, raising=False)
        monkeypatch.setattr(plan_cache, "_plans", {})
        monkeypatch.setattr(executor.this_thread, "observers", [])
        ember.manual_seed(5)
        model = nn.Sequential(*[m for i in range(4) for m in (nn.Linear(width, 16 if i == 3 else width),)
                                + ((nn.ReLU(),) if i < 3 else ())]).to("cuda").to(ember.float16)
        opt = ember.optim.Adam(model.parameters(), lr=1e-3)
        x = ember.tensor(inputs(2**18, width, "float16", seed=6), device="cuda")
        y = ember.tensor(inputs(2**18, 16, "float16", seed=7), device="cuda")
        ember.realize(x, y, *model.parameters())
        texts = []

        class Planned(Exception):
            pass

        def observe(order, keep):
            p = Plan(order, keep)
            texts.extend(p.sources[scramble(k)].text for k in p.kernels)
            raise Planned

        monkeypatch.setattr(executor.this_thread, "observers", [observe])
        opt.zero_grad()
        nn.functional.mse_loss(model(x).float(), y.float()).backward()
        with pytest.raises(Planned):
            opt.step()
        return "\n".join(texts)

    forward = planned(builtins.id)
    assert "ember_mlp" in forward
    assert planned(lambda x: -builtins.id(x)) == forward
    assert planned(lambda x: builtins.id(x) ^ 0x5A5A50) == forward


def test_an_mlp_kernel_holds_its_weights_on_chip_only_where_the_gpus_shared_memory_fits_them():
    from ember.compiler.patterns.mlp.chain import NOMINAL_SHARED_MEMORY, mlp_blocks

    widths = [128] * 5 + [16]  # 132 KiB of float16 weights: held with 64-row tiles on an H100 (227 KiB a block)
    assert mlp_blocks(widths, 2, 0) == mlp_blocks(widths, 2, NOMINAL_SHARED_MEMORY) == ([128] * 5 + [16], 64, 4, True)
    assert mlp_blocks(widths, 2, 163 * 1024) == ([128] * 5 + [16], 128, 4, False)  # an A100's 163 KiB: streamed
    small = [64] * 4 + [16]  # 26 KiB: held with 128-row tiles on both
    assert mlp_blocks(small, 2, 163 * 1024)[1:] == mlp_blocks(small, 2, 0)[1:] == (128, 4, True)
