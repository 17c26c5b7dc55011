"""Math helpers that generated Triton kernels import.

They are written with core `tl` operations, so the same kernels run on the GPU and
under Triton's CPU interpreter, which is how CI tests generated code. fmod, div_rn, relu_to_f16 and
tanh_approx alone have two bodies: libdevice's or inline PTX on the GPU, and `<name>_interpreted`
for the interpreter, which can run neither (the interpret target binds it as `<name>`,
see `ember.runtime.triton_interpreter`).
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def fmod(a, b):
    """C's fmod, exact, with the sign of the dividend. A GPU computes a % b as a - trunc(a / b) * b:
    wrong for large quotients, and inf for fmod(inf, inf)."""
    return libdevice.fmod(a, b)


@triton.jit
def fmod_interpreted(a, b):
    return a % b  # the interpreter's a % b is NumPy's fmod, exact


@triton.jit
def div_rn(a, b):
    """float32 division rounded correctly, as torch and NumPy divide (a GPU's a / b is within 2 ulp)."""
    return libdevice.div_rn(a, b)


@triton.jit
def div_rn_interpreted(a, b):
    return a / b  # NumPy's division, exact


@triton.jit
def relu_to_f16(x):
    """max(x as float16, 0), NaN kept: one instruction per two elements (the conversion's own ReLU) where a cast
    and a maximum take two. Rounding is monotonic and keeps 0, so clamping before or after it is the same."""
    return tl.inline_asm_elementwise("cvt.rn.relu.f16x2.f32 $0, $2, $1;", "=r,r,r", [x.to(tl.float32)],
                                     dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def relu_to_f16_interpreted(x):
    h = x.to(tl.float16)
    return tl.maximum(h, tl.zeros_like(h), propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def tanh(x):
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    t = (1.0 - e) / (1.0 + e)
    small = x * (1.0 + x * x * (-1.0 / 3.0 + x * x * (2.0 / 15.0 - x * x * (17.0 / 315.0))))
    return tl.where(a < 0.0625, small, tl.where(x < 0, -t, t))


@triton.jit
def tanh_approx(x):
    """tanh of a float32 within 2**-10.7 of it relatively: one instruction (the SFU's tanh.approx.f32) for a result
    rounded to bfloat16, whose unit is 2**-8 relatively. In a GEMM's epilogue, fc1's tanh GELU (H200, 8192 x 3072 x
    768) took 15 us of 148 as `tanh` above."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def tanh_approx_interpreted(x):
    return tanh(x)


@triton.jit
def log1p(x):
    u = 1.0 + x
    # log(u) * x / (u - 1) cancels the rounding of 1 + x
    return tl.where((u == 1.0) | (u == float("inf")), tl.where(u == 1.0, x, u), tl.log(u) * (x / (u - 1.0)))


@triton.jit
def rint(x, big):
    """Round half to even; values of magnitude `big` (2**23 or 2**52) and above are integers."""
    r = tl.floor(x + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    r = tl.where((r - x == 0.5) & odd, r - 1.0, r)
    return tl.where(tl.abs(x) >= big, x, r)


@triton.jit
def pow_float(a, b):
    """C's pow, special values included."""
    r = tl.exp(b * tl.log(tl.abs(a)))
    whole = b == tl.floor(b)
    odd = whole & ((2.0 * tl.floor(b * 0.5)) != b)
    r = tl.where(((a < 0) | (1.0 / a < 0)) & odd, -r, r)  # 1 / a < 0: a is -0.0 too
    r = tl.where((a < 0) & (a > float("-inf")) & (whole == 0), float("nan"), r)
    r = tl.where((a == 1) | ((tl.abs(a) == 1) & (tl.abs(b) == float("inf"))), 1.0, r)
    return tl.where(b == 0, 1.0, r)


@triton.jit
def pow_int(a, b):
    """a ** b for integers: exact (by squaring) and wrapping around, as in torch; a negative power
    is 0 unless the base is 1 or -1."""
    base = a + b * 0
    e = tl.where(b < 0, 0, b + a * 0)
    result = base * 0 + 1
    while tl.max(e) > 0:
        result = tl.where((e & 1) != 0, result * base, result)
        base = base * base
        e = e >> 1
    inverse = tl.where(a == 1, 1, tl.where(a + 1 == 0, 1 - 2 * (b & 1), 0))  # a + 1 == 0: a is -1
    return tl.where(b < 0, inverse, result)


@triton.jit
def floordiv_int(a, b):
    q = a // b
    r = a - q * b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), q - 1, q)


@triton.jit
def truncdiv_int(a, b):
    q = a // b
    r = a - q * b
    return tl.where((r != 0) & ((r < 0) != (a < 0)), q + 1, q)


@triton.jit
def remainder_int(a, b):
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def remainder_float(a, b):
    r = fmod(a, b)
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def floordiv_float(a, b):
    """torch's floor division: a less its exact remainder, divided by b, is a whole number up to rounding."""
    mod = fmod(a, b)
    div = (a - mod) / b
    div = tl.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1.0, div)
    floor = tl.floor(div)
    floor = tl.where(div - floor > 0.5, floor + 1.0, floor)
    return tl.where(b == 0, a / b, tl.where(div != 0, floor, 0.0 * (a / b)))  # 0.0 * (a / b): a signed zero


@triton.jit
def sign(x):
    return tl.where(x > 0, 1, tl.where(x < 0, -1, 0)).to(x.dtype)  # NaN gives 0, as in torch


@triton.jit
def prod_combine(a, b):
    return a * b


@triton.jit
def max_combine(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)  # NaN wins, as in torch (tl.max drops it)


@triton.jit
def min_combine(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def argmax_combine(a, i, b, j):
    """The (value, index) pair of the larger value; as in torch, NaN is larger than everything and of
    equal values the first index wins."""
    b_nan = b != b
    take_b = (b > a) | (b_nan & (a == a)) | (((a == b) | (b_nan & (a != a))) & (j < i))
    return tl.where(take_b, b, a), tl.where(take_b, j, i)


@triton.jit
def argmin_combine(a, i, b, j):
    b_nan = b != b
    take_b = (b < a) | (b_nan & (a == a)) | (((a == b) | (b_nan & (a != a))) & (j < i))
    return tl.where(take_b, b, a), tl.where(take_b, j, i)


@triton.jit
def _counter_words(offset):
    """A 64-bit offset as Philox's first two 32-bit counter words (below 2^31 the counter tl.rand uses)."""
    wide = offset.to(tl.int64)
    return wide.to(tl.uint32), (wide >> 32).to(tl.uint32)


@triton.jit
def rand(seed, offset):
    """tl.rand(seed, offset) for offsets of any size: Philox 4x32 on the offset's two words."""
    low, high = _counter_words(offset)
    c0, _, _, _ = tl.philox(seed, low, high, low * 0, low * 0)
    return tl.uint_to_uniform_float(c0)


@triton.jit
def randn(seed, offset):
    """tl.randn(seed, offset) for offsets of any size (Box-Muller on the first two words, as tl.randn)."""
    low, high = _counter_words(offset)
    c0, c1, _, _ = tl.philox(seed, low, high, low * 0, low * 0)
    normal, _ = tl.pair_uniform_to_normal(tl.uint_to_uniform_float(c0), tl.uint_to_uniform_float(c1))
    return normal


@triton.jit
def record_index(flag, index, out_of_range):
    """An index check's record: where `out_of_range` holds, word 0 of its flag becomes 1 and word 1 the index
    (of the lanes racing to write it, one). Nothing is written where every lane is in range."""
    at = flag + tl.zeros_like(out_of_range.to(tl.int32))
    tl.store(at, 1, mask=out_of_range)
    tl.store(at + 1, index.to(tl.int64), mask=out_of_range)
