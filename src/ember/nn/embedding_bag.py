"""F.embedding_bag: sums, means or maxima of bags of embedding rows, without the (bags, rows, dim) gather torch
avoids either. A bag is a row of a 2-d input, or a run of a 1-d input between offsets. Which input positions
belong to which bag is a (bags, positions) mask computed on the device from the offsets (they are not read on
the host); the sum and mean are that mask, weighted, times the gathered rows (a matmul), the maximum a masked
reduction. Gradients reach the weight through the gather's and matmul's rules."""

from __future__ import annotations

from ember import dtypes
from ember.errors import DTypeError, ShapeError, operands
from ember.ops import embedding
from ember.ops.contraction import matmul
from ember.ops.creation import arange, full
from ember.ops.movement import cat, reshape, slice_axis
from ember.ops.pointwise import where
from ember.tensor import Tensor, expect_tensors

MODES = ("sum", "mean", "max")


def embedding_bag(input: Tensor, weight: Tensor, offsets: Tensor | None = None, max_norm: float | None = None,
                  norm_type: float = 2, scale_grad_by_freq: bool = False, mode: str = "mean", sparse: bool = False,
                  per_sample_weights: Tensor | None = None, include_last_offset: bool = False,
                  padding_idx: int | None = None) -> Tensor:
    """One (num_bags, embedding_dim) row per bag of indices into `weight`: their sum, mean or maximum, as
    torch.nn.functional.embedding_bag.

    A 2-d input (B, L) is B bags of L indices. A 1-d input is cut into bags at `offsets` (the start of each bag;
    with `include_last_offset`, one more entry that ends the last bag). `per_sample_weights` (mode 'sum' only)
    scales each index's row; indices equal to `padding_idx` are left out of their bag (and its count). An empty
    bag gives zeros. The offsets are not validated: ones that decrease or run past the input select no rows."""
    expect_tensors("embedding_bag", input=input, weight=weight)
    if max_norm is not None or scale_grad_by_freq or sparse:
        raise NotImplementedError("embedding_bag: max_norm, scale_grad_by_freq and sparse are not supported")
    if mode not in MODES:
        raise ValueError(f"embedding_bag: mode has to be one of sum, mean or max, got {mode!r}")
    if not input.dtype.is_integer:
        raise DTypeError(f"embedding_bag: indices must be an integer tensor, got {operands(input)}")
    if weight.ndim != 2:
        raise ShapeError(f"embedding_bag: weight must be 2-d (num_embeddings, dim), got shape {weight.shape}")
    if per_sample_weights is not None:
        if mode != "sum":
            raise NotImplementedError(f"embedding_bag: per_sample_weights is only supported for mode='sum' (got "
                                      f"mode={mode!r})")
        if per_sample_weights.shape != input.shape:
            raise ShapeError(f"embedding_bag: per_sample_weights of shape {per_sample_weights.shape} must have the "
                             f"input's shape {input.shape}")
    if padding_idx is not None:
        rows = weight.shape[0]
        if not -rows <= padding_idx < rows:
            raise ValueError(f"embedding_bag: padding_idx must be within the number of embeddings, {-rows} through "
                             f"{rows - 1}, but got {padding_idx}")
        padding_idx %= rows
    member = _membership(input, offsets, include_last_offset)
    if padding_idx is not None:
        member = member & (input != padding_idx)
    rows = embedding(input, weight)  # (B, L, D) for 2-d input, (n, D) for 1-d
    if mode == "max":
        masked = where(member.unsqueeze(-1), rows, float("-inf")).amax(-2)
        return where(member.any(-1, keepdim=True), masked, 0)
    scale = member.to(weight.dtype)
    if per_sample_weights is not None:
        scale = scale * per_sample_weights
    total = matmul(scale.unsqueeze(-2), rows).squeeze(-2)
    if mode == "sum":
        return total
    count = member.sum(-1, keepdim=True)
    return total / where(count > 0, count, 1).to(weight.dtype)


def _membership(input: Tensor, offsets: Tensor | None, include_last_offset: bool) -> Tensor:
    """Which input positions each bag holds: (B, L) all True for 2-d input, (B, n) for 1-d input and offsets."""
    if input.ndim == 2:
        if offsets is not None:
            raise ValueError("embedding_bag: if input is 2-d, then offsets has to be None, as input is treated as a "
                             "mini-batch of fixed length sequences")
        return full(input.shape, True, dtype=dtypes.bool_, device=input.device)
    if input.ndim != 1:
        raise ShapeError(f"embedding_bag: input has to be a 1-d or 2-d tensor, got shape {input.shape}")
    if offsets is None or not isinstance(offsets, Tensor) or offsets.ndim != 1:
        got = "None" if offsets is None else getattr(offsets, "shape", type(offsets).__name__)
        raise ValueError(f"embedding_bag: offsets has to be a 1-d tensor for 1-d input, got {got}")
    if not offsets.dtype.is_integer:
        raise DTypeError(f"embedding_bag: offsets must be an integer tensor, got {operands(offsets)}")
    n = input.shape[0]
    offsets = offsets.to(dtypes.int64)
    if include_last_offset:
        if offsets.shape[0] < 1:
            raise ShapeError("embedding_bag: with include_last_offset, offsets needs at least one entry")
        starts, ends = slice_axis(offsets, 0, 0, offsets.shape[0] - 1), slice_axis(offsets, 0, 1, offsets.shape[0])
    else:
        starts = offsets
        ends = cat([slice_axis(offsets, 0, 1, offsets.shape[0]), full((1,), n, dtype=dtypes.int64,
                                                                       device=offsets.device)])
    position = reshape(arange(n, dtype=dtypes.int64, device=input.device), (1, n))
    return (position >= starts.unsqueeze(-1)) & (position < ends.unsqueeze(-1))
