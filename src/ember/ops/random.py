"""Random numbers: a counter-based generator, so a value is a pure function of (seed, offset).

Each draw takes the next `numel` offsets of the global stream. Because nothing is
stateful at run time, a lazy random tensor gives the same values however often it is
computed, and a fused kernel can recompute a dropout mask instead of storing it. At the end, the
RAND primitive's rules.
"""

from __future__ import annotations

import math
import operator
import threading

import numpy as np

from ember import dtypes
from ember.device import as_device
from ember.errors import DTypeError, ShapeError, operands
from ember.ir import Op
from ember.ir.ops import NOT_DIFFERENTIABLE, define
from ember.ir.philox import philox_normal, philox_uniform
from ember.ops.creation import _like, _shape
from ember.ops.movement import unsqueeze
from ember.ops.pointwise import cast, floor, isfinite, log, maximum, minimum, where
from ember.ops.reduce import amax, argmax
from ember.ops.sorting import argsort, topk
from ember.runtime import executor
from ember.tensor import Tensor, expect_tensors, leaf, realize

_state = threading.local()


def manual_seed(seed: int) -> None:
    """Restart the random stream at `seed`. Each thread draws from a stream of its own (seed 0 until the thread
    sets one), so threads seeded alike draw alike however their draws interleave."""
    _state.seed = int(seed)
    _state.offset = 0


def initial_seed() -> int:
    return getattr(_state, "seed", 0)


def take_offsets(n: int) -> tuple[int, int]:
    """The seed and the first of the next `n` offsets of the global stream, which moves past them."""
    if not hasattr(_state, "seed"):
        manual_seed(0)
    start = _state.offset
    _state.offset += n
    recorder = executor.this_thread.recorder
    if recorder is not None:
        recorder.note_draw(_state.seed, start, n)
    return _state.seed, start


def _draw(op: str, size, distribution: str, device) -> Tensor:
    shape = _shape(op, size)
    seed, offset = take_offsets(math.prod(shape))
    return leaf(Op.RAND, as_device(device), shape=shape, seed=seed, offset=offset, distribution=distribution)


def rand(*size, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """Uniform values in [0, 1)."""
    return _finish(_draw("rand", size, "uniform", device), dtype, requires_grad)


def randn(*size, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """Standard normal values (Box-Muller inside the generator)."""
    return _finish(_draw("randn", size, "normal", device), dtype, requires_grad)


def randint(low, high=None, size=None, dtype=None, device=None) -> Tensor:
    """randint(high, size) or randint(low, high, size): integers in [low, high)."""
    if size is None and isinstance(high, (tuple, list)):
        low, high, size = 0, low, high
    if high is None:
        low, high = 0, low
    if size is None:
        raise TypeError("randint: size is required, e.g. randint(0, 10, (3, 4))")
    if high <= low:
        raise ValueError(f"randint: high ({high}) must be larger than low ({low})")
    u = rand(size, device=device, dtype=dtypes.float64 if high - low > 2**24 else None)
    values = minimum(floor(u * (high - low)), high - low - 1) + low
    return cast(values, dtypes.as_dtype(dtype) if dtype is not None else dtypes.int64)


def randperm(n: int, device=None, dtype=None) -> Tensor:
    """A random permutation: the order of n uniform draws."""
    order = argsort(rand(n, device=device))
    return order if dtype is None else cast(order, dtypes.as_dtype(dtype))


def rand_like(x: Tensor, dtype=None, device=None) -> Tensor:
    shape, like = _like("rand_like", x, dtype, device)
    return rand(shape, **like)


def randn_like(x: Tensor, dtype=None, device=None) -> Tensor:
    shape, like = _like("randn_like", x, dtype, device)
    return randn(shape, **like)


def randint_like(x: Tensor, low, high=None, dtype=None, device=None) -> Tensor:
    shape, like = _like("randint_like", x, dtype, device)
    return randint(low, high, shape, **like)


def bernoulli(p: Tensor) -> Tensor:
    expect_tensors("bernoulli", input=p)
    return cast(rand(p.shape, device=p.device) < p, p.dtype)


def multinomial(x: Tensor, num_samples: int, replacement: bool = False, generator: None = None) -> Tensor:
    """int64 category indices drawn from each row of non-negative weights (1-d: one row), as torch.multinomial.

    By the Gumbel trick: adding independent Gumbel noise to the log-weights, the largest key falls on category i
    with probability w_i / sum(w). With replacement, each sample is the argmax of keys of its own; without, the
    samples are the k largest of one set of keys (Gumbel-top-k), distributed as drawing one at a time and
    removing each category drawn. The weights are checked as torch checks them, which reads them (a sync point,
    as on torch's cpu device)."""
    expect_tensors("multinomial", input=x)
    if generator is not None:
        raise ValueError("multinomial: ember has no Generator objects; seed its random stream with "
                         "ember.manual_seed and leave generator=None")
    if x.ndim not in (1, 2):
        raise ShapeError(f"multinomial: prob_dist must be 1 or 2 dim, got {operands(x)}")
    if not x.dtype.is_floating_point:
        raise DTypeError(f"multinomial: only supports floating-point dtypes for input, got {operands(x)}")
    num_samples = operator.index(num_samples)
    categories = x.shape[-1]
    if num_samples <= 0:
        raise ValueError(f"multinomial: cannot sample n_sample <= 0 samples (num_samples={num_samples})")
    if not replacement and num_samples > categories:
        raise ValueError(f"multinomial: cannot sample n_sample > prob_dist.size(-1) samples without replacement "
                         f"({num_samples} samples of {categories} categories)")
    if categories > 2**24:
        raise ValueError(f"multinomial: number of categories cannot exceed 2^24, got {categories}")
    _check_weights(x)
    weights = x if x.dtype is dtypes.float64 else cast(x, dtypes.float32)
    if replacement:  # keys of their own for every sample: (..., num_samples, categories)
        keys = unsqueeze(log(weights), -2) + _gumbel(x.shape[:-1] + (num_samples, categories), x.device)
        return argmax(keys, dim=-1)
    return topk(log(weights) + _gumbel(x.shape, x.device), num_samples).indices


def _check_weights(x: Tensor) -> None:
    """torch's errors for weights that are no distribution: a negative, infinite or NaN weight, a row of zeros."""
    if x.numel() == 0:
        if x.shape[-1] == 0 and (x.ndim == 1 or x.shape[0]):  # rows of no categories
            raise ValueError(f"multinomial: invalid multinomial distribution (sum of probabilities <= 0): "
                             f"no categories in {operands(x)}")
        return
    invalid = (~(isfinite(x) & (x >= 0))).any()
    empty = (amax(x, dim=-1) <= 0).any()
    realize(invalid, empty)
    if invalid.item():
        raise ValueError(f"multinomial: probability tensor contains either `inf`, `nan` or element < 0 "
                         f"({operands(x)})")
    if empty.item():
        raise ValueError(f"multinomial: invalid multinomial distribution (sum of probabilities <= 0): a row of "
                         f"{operands(x)} is all zeros")


def _gumbel(shape: tuple[int, ...], device) -> Tensor:
    """Standard Gumbel noise, -log(-log(u)); u is kept above 0 so that every key of a positive weight is finite."""
    u = maximum(rand(shape, device=device), float(np.finfo(np.float32).tiny))
    return -log(-log(u))


def dropout(x: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    """Zero each element with probability p and scale the rest by 1 / (1 - p)."""
    expect_tensors("dropout", input=x)
    if not 0 <= p <= 1:
        raise ValueError(f"dropout: p must be in [0, 1], got {p}")
    if not training or p == 0:
        return x
    if p == 1:
        return x * 0
    keep = rand(x.shape, device=x.device) >= p
    return where(keep, x * (1 / (1 - p)), 0)


def _finish(out: Tensor, dtype, requires_grad: bool) -> Tensor:
    if dtype is not None:
        out = cast(out, dtypes.as_dtype(dtype))
    if requires_grad:
        out = out.detach().requires_grad_()
    return out


# -- the RAND primitive -------------------------------------------------------------------------------
# Its rules side by side: shape and dtype (float32), VJP (none: a leaf), and reference implementation.

def _np_rand(shape, seed: int, offset: int, distribution: str) -> np.ndarray:
    offsets = offset + np.arange(math.prod(shape), dtype=np.int64)
    draw = philox_uniform if distribution == "uniform" else philox_normal
    return draw(seed, offsets).reshape(shape)


define(Op.RAND, shape=lambda inputs, attrs: (tuple(attrs["shape"]), dtypes.float32), vjp=NOT_DIFFERENTIABLE,
       reference=_np_rand)
