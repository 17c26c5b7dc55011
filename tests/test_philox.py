"""ember.ir.philox must reproduce Triton's tl.randint / tl.rand / tl.randn bit-for-bit.

The Triton side runs under the CPU interpreter on torch CPU tensors: the kernel is made an interpreted
function explicitly, so nothing else in the process is interpreted.
"""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from ember.ir import philox
from ember.runtime.triton_interpreter import interpreted

BLOCK = 256


def _random_kernel(seed, off_ptr, int_ptr, uni_ptr, nrm_ptr, n, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    offsets = tl.load(off_ptr + idx, mask=mask, other=0)
    r = tl.randint(seed, offsets)
    tl.store(int_ptr + idx, r.to(tl.int32, bitcast=True), mask=mask)
    tl.store(uni_ptr + idx, tl.rand(seed, offsets), mask=mask)
    tl.store(nrm_ptr + idx, tl.randn(seed, offsets), mask=mask)


_random_kernel = interpreted(_random_kernel)


def _triton_draws(seed: int, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    off = torch.from_numpy(np.ascontiguousarray(offsets))
    n = off.numel()
    ints = torch.empty(n, dtype=torch.int32)
    uni = torch.empty(n, dtype=torch.float32)
    nrm = torch.empty(n, dtype=torch.float32)
    _random_kernel[(triton.cdiv(n, BLOCK),)](seed, off, ints, uni, nrm, n, BLOCK=BLOCK)
    return ints.numpy().view(np.uint32), uni.numpy(), nrm.numpy()


SEEDS = [0, 1, 42, 2**31 - 1, 2**32 + 7, 0x7FEDCBA987654321, -1]

_rng = np.random.default_rng(1234)
OFFSETS = {
    "arange_i32": np.arange(0, 1000, dtype=np.int32),
    "near_2p31_i32": np.arange(2**31 - 500, 2**31, dtype=np.int64).astype(np.int32),
    "random_i32": _rng.integers(0, 2**31 - 1, size=700, dtype=np.int32),
    "negative_i32": _rng.integers(-(2**31), 0, size=300, dtype=np.int32),
    "arange_i64": np.arange(0, 600, dtype=np.int64),
    "across_2p31_2p32_i64": np.concatenate(
        [np.arange(2**31 - 200, 2**31 + 200), np.arange(2**32 - 200, 2**32 + 200)]
    ).astype(np.int64),
    "random_i64": _rng.integers(-(2**62), 2**62, size=500, dtype=np.int64),
}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", list(OFFSETS))
def test_matches_triton(seed: int, name: str) -> None:
    offsets = OFFSETS[name]
    t_int, t_uni, t_nrm = _triton_draws(seed, offsets)

    n_int = philox.philox_randint(seed, offsets)
    n_uni = philox.philox_uniform(seed, offsets)
    n_nrm = philox.philox_normal(seed, offsets)

    assert n_int.dtype == np.uint32 and n_int.shape == offsets.shape
    assert n_uni.dtype == np.float32 and n_uni.shape == offsets.shape
    assert n_nrm.dtype == np.float32 and n_nrm.shape == offsets.shape
    np.testing.assert_array_equal(n_int, t_int)
    np.testing.assert_array_equal(n_uni, t_uni)
    np.testing.assert_allclose(n_nrm, t_nrm, rtol=0, atol=1e-6)


def test_known_answer_random123() -> None:
    # Random123 known-answer vector for Philox4x32-10: counter (0, 0, 0, 0), key (0, 0).
    words = philox._philox4x32(0, np.zeros(1, dtype=np.int32))
    assert [int(w[0]) for w in words] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


def test_deterministic_and_shape_preserving() -> None:
    offsets = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    for fn in (philox.philox_randint, philox.philox_uniform, philox.philox_normal):
        a = fn(7, offsets)
        b = fn(7, offsets)
        assert a.shape == offsets.shape
        np.testing.assert_array_equal(a, b)
        # Pure function of (seed, offset): a value does not depend on its neighbours.
        np.testing.assert_array_equal(fn(7, offsets.ravel()[5:6]), a.ravel()[5:6])
        # A different seed gives a different stream.
        assert not np.array_equal(fn(8, offsets), a)


def test_offset_width_semantics() -> None:
    # Non-negative offsets below 2**31 give the same draws whether held as int32 or int64.
    off = np.arange(0, 100, dtype=np.int64) * 12345
    np.testing.assert_array_equal(
        philox.philox_randint(3, off), philox.philox_randint(3, off.astype(np.int32))
    )
    # Offsets that differ only in the high 32 bits give different draws.
    assert not np.array_equal(philox.philox_randint(3, off), philox.philox_randint(3, off + 2**32))


def test_uniform_extremes_stay_in_unit_interval() -> None:
    words = np.array([0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF], dtype=np.uint32)
    u = philox._uint_to_uniform(words)
    assert u.dtype == np.float32
    assert u[0] == 0.0 and u[-1] == 0.0  # 0 and ~0 both fold to 0
    assert float(u.max()) < 1.0


def test_rejects_float_offsets() -> None:
    with pytest.raises(TypeError):
        philox.philox_uniform(0, np.arange(4, dtype=np.float32))


def test_statistics() -> None:
    offsets = np.arange(100_000, dtype=np.int32)
    u = philox.philox_uniform(2024, offsets)
    assert u.min() >= 0.0 and u.max() < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005
    assert abs(float(u.var()) - 1.0 / 12.0) < 0.002
    # Roughly flat histogram over 10 bins.
    counts = np.histogram(u, bins=10, range=(0.0, 1.0))[0]
    assert np.all(np.abs(counts - 10_000) < 500)

    z = philox.philox_normal(2024, offsets)
    assert np.all(np.isfinite(z))
    assert abs(float(z.mean())) < 0.02
    assert abs(float(z.std()) - 1.0) < 0.02
    assert abs(float(np.mean(np.abs(z) < 1.0)) - 0.6827) < 0.01

    r = philox.philox_randint(2024, offsets)
    # Each of the 32 bits is set about half the time.
    bits = (r[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    assert np.all(np.abs(bits.mean(axis=0) - 0.5) < 0.01)
