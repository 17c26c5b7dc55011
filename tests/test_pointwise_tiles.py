"""Pointwise kernels in tiles of rows (generated Triton, run by Triton's interpreter in CI): a kernel whose flat form
would divide positions by sizes that are not powers of two (a concatenation of permuted pieces, a permuted read)
takes tiles of rows by a power-of-two share of the innermost axis instead, and computes what the flat form
computes; a kernel that divides by powers of two only stays flat."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from conftest import ON_GPU

import ember
from ember.compiler.fused import KernelKind
from ember.explain import plan

pytestmark = [pytest.mark.usefixtures("cuda_backend"), *([pytest.mark.gpu] if ON_GPU else [])]


def drawn(rng, *shape, dtype=np.float32) -> np.ndarray:
    values = rng.uniform(-2, 2, size=shape)
    return np.where(np.abs(values) < 0.05, 0.5, values).astype(dtype)


def only_pointwise(*tensors):
    p = plan(*tensors)
    (kernel,) = p.kernels
    assert kernel.kind is KernelKind.POINTWISE, str(p)
    return p.sources[id(kernel)]


def qkv_gradients(arrays: list[np.ndarray], batch: int, tokens: int, heads: int, width: int, device: str):
    pieces = [ember.tensor(a, device=device).permute(0, 2, 1, 3).reshape(batch, tokens, heads * width)
              for a in arrays]
    return ember.cat(pieces, dim=-1)


@pytest.mark.parametrize("sizes", [(2, 12, 3, 64), (2, 3, 5, 64), (1, 5, 2, 64), (3, 2, 7, 96)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
def test_a_concatenation_of_permuted_pieces_takes_tiles_of_rows_and_is_exact(sizes, dtype, rng):
    """Attention's gradients of q, k and v, (batch, heads, tokens, width) each, into one (batch, tokens, 3 x heads x
    width) tensor: rows of tokens, columns a power of two dividing 3 x heads x width; the last tile of rows
    masked where the rows do not fill it."""
    batch, heads, tokens, width = sizes
    arrays = [drawn(rng, batch, heads, tokens, width, dtype=dtype) for _ in range(3)]
    out = qkv_gradients(arrays, batch, tokens, heads, width, "cuda")
    source = only_pointwise(out)
    (launch,) = source.launches
    inner = 3 * heads * width
    assert set(launch.constexprs) == {"ROWS", "COLS"}, source.text
    cols = launch.constexprs["COLS"]
    assert inner % cols == 0 and cols & (cols - 1) == 0 and cols < inner, launch.constexprs
    assert launch.constexprs["ROWS"] < 2 * batch * tokens, launch.constexprs  # no tile of rows mostly masked
    assert "//" not in next(line for line in source.text.splitlines() if line.strip().startswith("col =")), source.text
    want = torch.cat([torch.from_numpy(a.astype(np.float32)).permute(0, 2, 1, 3).reshape(batch, tokens, -1)
                      for a in arrays], -1).numpy()
    np.testing.assert_array_equal(out.numpy().astype(np.float32), want)
    reference = qkv_gradients(arrays, batch, tokens, heads, width, "cpu")
    np.testing.assert_array_equal(out.numpy(), reference.numpy())


def test_a_permuted_read_with_a_value_per_row_and_one_per_column(rng):
    """A value that varies along the rows only (a scale per row) and one along the columns only (a bias) meet the
    permuted read in the tile."""
    a, scale, bias = drawn(rng, 4, 3, 5, 320), drawn(rng, 4, 5, 1, 1), drawn(rng, 960)
    def fn(device):
        x, s, b = (ember.tensor(v, device=device) for v in (a, scale, bias))
        return (x.permute(0, 2, 1, 3).reshape(4, 5, 960) * s.reshape(4, 5, 1) + b).tanh()
    out = fn("cuda")
    source = only_pointwise(out)
    (launch,) = source.launches
    assert launch.constexprs.get("COLS") == 64, launch.constexprs
    # the permuted read's positions: the row's once per row, the column's (split by the reshape) once per column
    assert "offs %" not in source.text and "offs //" not in source.text, source.text
    want = np.tanh(a.transpose(0, 2, 1, 3).reshape(4, 5, 960) * scale.reshape(4, 5, 1) + bias)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.numpy(), fn("cpu").numpy(), rtol=1e-5, atol=1e-6)


FLAT = {  # name: (shape, ember function, NumPy function)
    "contiguous": ((6, 768), lambda x, y: x * y + 1, lambda a, b: a * b + 1),
    "power of two": ((3, 4, 64), lambda x, y: x.permute(1, 0, 2) * y.permute(1, 0, 2) + 1,
                     lambda a, b: a.transpose(1, 0, 2) * b.transpose(1, 0, 2) + 1),
    "narrow": ((5, 96), lambda x, y: x * y.flip(0) + 1, lambda a, b: a * b[::-1] + 1),
    "one row": ((30, 96), lambda x, y: x.mT.reshape(-1) * y.reshape(-1), lambda a, b: a.T.reshape(-1) * b.reshape(-1)),
}


@pytest.mark.parametrize("case", list(FLAT))
def test_a_kernel_that_divides_by_powers_of_two_only_or_has_one_row_stays_flat(case, rng):
    """Elementwise work over contiguous values divides nothing; one whose innermost size is a power of two divides
    by it only; an innermost size with fewer than 64 as its power-of-two part has no tile worth taking; and a space
    of one row is a flat range already."""
    shape, fn, want = FLAT[case]
    a, b = drawn(rng, *shape), drawn(rng, *shape)
    out = fn(ember.tensor(a, device="cuda"), ember.tensor(b, device="cuda"))
    (launch,) = only_pointwise(out).launches
    assert set(launch.constexprs) == {"BLOCK"}, launch.constexprs
    np.testing.assert_allclose(out.numpy(), want(a, b), rtol=1e-5, atol=1e-6)  # a GPU fuses x * y + 1 (one rounding)
