# Counter-based Philox4x32-10 random numbers: the generator both backends implement.
# A value is a pure function of (seed, offset); the NumPy reference backend calls these
# functions and the Triton backend emits tl.randint / tl.rand / tl.randn, bit-for-bit equal.
from __future__ import annotations

import numpy as np

__all__ = ["philox_normal", "philox_randint", "philox_uniform"]

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
_N_ROUNDS = 10
# Weyl increments added to the key after every round.
_KEY_STEP_0 = 0x9E3779B9
_KEY_STEP_1 = 0xBB67AE85
# Round multipliers (the pair (M0, c0) feeds the new c2/c3, (M1, c2) the new c0/c1).
_ROUND_MUL_0 = np.uint64(0xD2511F53)
_ROUND_MUL_1 = np.uint64(0xCD9E8D57)
_SHIFT32 = np.uint64(32)
_LOW32 = np.uint64(_MASK32)
# Largest float32 scale with (2**31 - 1) * scale < 1 after rounding; maps int31 -> [0, 1).
_UNIFORM_SCALE = np.float32(4.6566127342e-10)
_TWO_PI = np.float32(6.283185307179586)
_MIN_U = np.float32(1.0e-7)


def _counters(offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split integer offsets into the (low, high) 32-bit counter words, widened to uint64.

    As in Triton: the low word is the offset truncated to 32 bits; the high word is
    `offset >> 32` for 64-bit offsets (arithmetic shift if signed) and 0 otherwise.
    """
    off = np.asarray(offsets)
    if not np.issubdtype(off.dtype, np.integer):
        raise TypeError(f"philox offsets must be an integer array, got {off.dtype}")
    lo = off.astype(np.uint32).astype(np.uint64)
    if off.dtype.itemsize > 4:
        hi = (off >> 32).astype(np.uint32).astype(np.uint64)
    else:
        hi = np.zeros_like(lo)
    return lo, hi


def _philox4x32(seed: int, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Run 10 Philox4x32 rounds on counters (off_lo, off_hi, 0, 0) keyed by the seed.

    The seed is taken as a 64-bit two's-complement integer: key = (low 32 bits, high 32 bits).
    Returns the four uint32 output words, each shaped like `offsets`.
    """
    seed64 = int(seed) & _MASK64
    k0, k1 = seed64 & _MASK32, seed64 >> 32
    # Counters are held in uint64 so that 32x32-bit products are exact; every word is kept < 2**32.
    c0, c1 = _counters(offsets)
    c2 = np.zeros_like(c0)
    c3 = np.zeros_like(c0)
    for _ in range(_N_ROUNDS):
        prod_a = _ROUND_MUL_0 * c0  # full 64-bit product, no overflow
        prod_b = _ROUND_MUL_1 * c2
        c0, c1, c2, c3 = (
            (prod_b >> _SHIFT32) ^ c1 ^ np.uint64(k0),
            prod_b & _LOW32,
            (prod_a >> _SHIFT32) ^ c3 ^ np.uint64(k1),
            prod_a & _LOW32,
        )
        k0 = (k0 + _KEY_STEP_0) & _MASK32
        k1 = (k1 + _KEY_STEP_1) & _MASK32
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))  # type: ignore[return-value]


def _uint_to_uniform(x: np.ndarray) -> np.ndarray:
    """Map uint32 words to float32 in [0, 1) exactly as Triton's `uint_to_uniform_float`.

    The word is read as int32, negatives are folded with bitwise not (giving 0..2**31-1),
    then converted to float32 (round-to-nearest) and multiplied by a float32 scale.
    """
    signed = x.view(np.int32)
    folded = np.where(signed < 0, ~signed, signed)
    return folded.astype(np.float32) * _UNIFORM_SCALE


def philox_randint(seed: int, offsets: np.ndarray) -> np.ndarray:
    """Random uint32 words, one per offset, equal to `tl.randint(seed, offsets)`.

    `offsets` is an int32 or int64 array (any shape); the result has the same shape.
    """
    return _philox4x32(seed, offsets)[0]


def philox_uniform(seed: int, offsets: np.ndarray) -> np.ndarray:
    """Random float32 values in [0, 1), one per offset, equal to `tl.rand(seed, offsets)`.

    Uses the first Philox output word, as `tl.rand` does.
    """
    return _uint_to_uniform(_philox4x32(seed, offsets)[0])


def philox_normal(seed: int, offsets: np.ndarray) -> np.ndarray:
    """Standard-normal float32 values, one per offset, matching `tl.randn(seed, offsets)`.

    Box-Muller on the first two Philox words (u1 clamped to >= 1e-7), keeping the cosine branch;
    computed in float32 so results agree with Triton to within an ulp of exp/log/cos.
    """
    w0, w1, _, _ = _philox4x32(seed, offsets)
    u1 = np.maximum(_MIN_U, _uint_to_uniform(w0))
    u2 = _uint_to_uniform(w1)
    radius = np.sqrt(np.float32(-2.0) * np.log(u1))
    return (radius * np.cos(_TWO_PI * u2)).astype(np.float32)
