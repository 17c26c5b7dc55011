"""Attention as torch.nn.functional.scaled_dot_product_attention computes it, written as the graph a user would
write by hand: scores q @ kᵀ scaled, a causal or given mask, softmax over the keys, dropout, then @ v. The
fusion planner sees the same graph whichever way it was written. `MultiheadAttention` is torch.nn's module on it.
"""

from __future__ import annotations

import math

from ember import dtypes
from ember.errors import DTypeError, ShapeError, operands
from ember.nn import init
from ember.nn.layers import Linear
from ember.nn.module import Module, Parameter
from ember.ops import attention as fused_attention
from ember.ops import dropout, linear, softmax
from ember.ops.creation import empty, ones
from ember.ops.pointwise import broadcast_shapes, where
from ember.tensor import Tensor, expect_tensors


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> Tensor:
    """softmax(query @ keyᵀ * scale + mask) @ value over (..., L, E) queries, (..., S, E) keys and (..., S, Ev)
    values: `scale` defaults to 1 / sqrt(E); `attn_mask` is boolean (True: the query attends to the key) or added
    to the scores, broadcast to (..., L, S); `is_causal`: query i attends to keys 0..i; `dropout_p`: dropout on the
    attention weights; `enable_gqa`: the keys' and values' heads (dim -3) each serve a group of query heads. A
    query row no key is left to after masking gets zeros, as PyTorch's."""
    fn = "scaled_dot_product_attention"
    expect_tensors(fn, query=query, key=key, value=value)
    if attn_mask is not None:
        expect_tensors(fn, attn_mask=attn_mask)
    _check(fn, query, key, value, attn_mask, dropout_p, is_causal)
    if enable_gqa:
        key, value = _grouped(fn, query, key), _grouped(fn, query, value)
    scale = scale if scale is not None else 1 / math.sqrt(query.shape[-1])
    length, keys = query.shape[-2], key.shape[-2]
    # one fused kernel forward and one backward, where one holds the problem
    masks = [attn_mask.shape[:-2]] if attn_mask is not None and attn_mask.ndim > 2 else []
    batch = broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2], *masks, op=fn)
    q, k, v = (t.expand(batch + t.shape[-2:]) for t in (query, key, value))
    mask = attn_mask.expand(batch + (length, keys)) if attn_mask is not None else None
    if fused_attention.fusable(q, k, v, mask):
        return fused_attention.attention(q, k, v, mask, scale, is_causal, safe=True, dropout=dropout_p)
    weights = attention_weights(query, key, attn_mask, is_causal, scale)
    if dropout_p > 0:
        weights = dropout(weights, dropout_p, True)
    return weights @ value


def attention_weights(query: Tensor, key: Tensor, attn_mask: Tensor | None, is_causal: bool,
                      scale: float) -> Tensor:
    """The attention weights (..., L, S) of checked operands before dropout: softmax over the keys of the scaled
    scores, masked; a query row no key is left to gets zeros."""
    length, keys = query.shape[-2], key.shape[-2]
    scores = (query @ key.transpose(-2, -1)) * scale
    if is_causal:
        allowed = ones(length, keys, dtype=dtypes.bool_, device=query.device).tril()
        scores = scores.masked_fill(allowed.logical_not(), -math.inf)
    if attn_mask is not None and attn_mask.dtype is dtypes.bool_:
        scores = scores.masked_fill(attn_mask.logical_not(), -math.inf)
    elif attn_mask is not None:
        scores = scores + attn_mask
    weights = softmax(scores, -1)
    if attn_mask is not None:  # a row masked whole: zeros, not the NaN of a softmax over -inf alone
        weights = where((scores == -math.inf).all(-1, keepdim=True), 0.0, weights)
    return weights


def _check(fn: str, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, dropout_p: float,
           is_causal: bool) -> None:
    if not query.dtype.is_floating_point or not query.dtype is key.dtype is value.dtype:
        raise DTypeError(f"{fn}: query, key and value must have one floating-point dtype, got "
                         f"{operands(query, key, value)}")
    if min(query.ndim, key.ndim, value.ndim) < 2:
        raise ShapeError(f"{fn}: query, key and value need at least 2 dims (..., tokens, features), got "
                         f"{operands(query, key, value)}")
    if query.shape[-1] != key.shape[-1] or key.shape[-2] != value.shape[-2]:
        raise ShapeError(f"{fn}: query (..., L, E), key (..., S, E) and value (..., S, Ev) do not match: "
                         f"{operands(query, key, value)}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{fn}: dropout_p must be in [0, 1), got {dropout_p}")
    if is_causal and attn_mask is not None:
        raise ValueError(f"{fn}: an explicit attn_mask must not be given with is_causal=True")
    if attn_mask is not None and attn_mask.dtype is not dtypes.bool_ and attn_mask.dtype is not query.dtype:
        raise DTypeError(f"{fn}: attn_mask must be boolean or of the query's dtype, got "
                         f"{operands(query, attn_mask)}")


def _grouped(fn: str, query: Tensor, kv: Tensor) -> Tensor:
    """Keys or values with heads (dim -3) repeated, each for its group of query heads."""
    if query.ndim < 3 or kv.ndim < 3 or query.shape[-3] % kv.shape[-3]:
        raise ShapeError(f"{fn}: enable_gqa needs (..., heads, tokens, features) inputs whose query heads are a "
                         f"multiple of the key and value heads, got {operands(query, kv)}")
    return kv.repeat_interleave(query.shape[-3] // kv.shape[-3], dim=-3)


class NonDynamicallyQuantizableLinear(Linear):
    """MultiheadAttention's output projection: a Linear, under the name PyTorch gives it (state dicts and reprs
    match)."""


class MultiheadAttention(Module):
    """torch.nn.MultiheadAttention: queries, keys and values projected (packed in `in_proj_weight` when they share
    `embed_dim`, else `q_proj_weight`, `k_proj_weight`, `v_proj_weight`), attention per head, then `out_proj`.
    Inputs are (L, N, E), or (N, L, E) with `batch_first`, or unbatched (L, E). A boolean `attn_mask` or
    `key_padding_mask` marks with True what may NOT be attended to (the opposite of scaled_dot_product_attention);
    a float one is added to the scores. With `need_weights` the attention weights (after dropout, as PyTorch's) are
    returned too, averaged over the heads unless `average_attn_weights=False`."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(f"MultiheadAttention: embed_dim ({embed_dim}) must be a positive multiple of num_heads "
                             f"({num_heads})")
        if add_bias_kv or add_zero_attn:
            raise NotImplementedError("MultiheadAttention: add_bias_kv and add_zero_attn are not supported")
        self.embed_dim, self.num_heads, self.dropout, self.batch_first = embed_dim, num_heads, dropout, batch_first
        self.kdim, self.vdim = kdim or embed_dim, vdim or embed_dim
        self.head_dim = embed_dim // num_heads
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        factory = dict(device=device, dtype=dtypes.as_dtype(dtype) if dtype is not None else dtypes.default_float)
        if self._qkv_same_embed_dim:
            self.in_proj_weight = Parameter(empty((3 * embed_dim, embed_dim), **factory))
            for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                self.register_parameter(name, None)
        else:
            self.register_parameter("in_proj_weight", None)
            self.q_proj_weight = Parameter(empty((embed_dim, embed_dim), **factory))
            self.k_proj_weight = Parameter(empty((embed_dim, self.kdim), **factory))
            self.v_proj_weight = Parameter(empty((embed_dim, self.vdim), **factory))
        if bias:
            self.in_proj_bias = Parameter(empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, **factory)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        for w in (self.in_proj_weight, self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
            if w is not None:
                init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            init.constant_(self.in_proj_bias, 0.0)
            init.constant_(self.out_proj.bias, 0.0)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = True, attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        fn = "MultiheadAttention"
        expect_tensors(fn, query=query, key=key, value=value)
        if is_causal and attn_mask is None:
            raise ValueError(f"{fn}: is_causal is a hint that attn_mask is the causal mask; give attn_mask too")
        batched = query.ndim == 3
        if query.ndim not in (2, 3) or key.ndim != query.ndim or value.ndim != query.ndim:
            raise ShapeError(f"{fn}: query, key and value must all be (L, E) or batched (3 dims), got "
                             f"{operands(query, key, value)}")
        if not batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            key_padding_mask = key_padding_mask.unsqueeze(0) if key_padding_mask is not None else None
        elif self.batch_first:  # (N, L, E) -> (L, N, E)
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        if query.shape[-1] != self.embed_dim or key.shape[-1] != self.kdim or value.shape[-1] != self.vdim \
                or key.shape[:2] != value.shape[:2] or key.shape[1] != query.shape[1]:
            raise ShapeError(f"{fn}: expected query (L, N, {self.embed_dim}), key (S, N, {self.kdim}) and value "
                             f"(S, N, {self.vdim}), got {operands(query, key, value)}")
        length, batch = query.shape[:2]
        keys = key.shape[0]
        q, k, v = self._projected(query, key, value)
        # (L, N, E) -> (N, heads, L, head_dim)
        q, k, v = (t.reshape(t.shape[0], batch, self.num_heads, self.head_dim).permute(1, 2, 0, 3) for t in (q, k, v))
        mask = self._mask(fn, attn_mask, key_padding_mask, batch, length, keys, q.dtype)
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            scores = (q * (1 / math.sqrt(self.head_dim))) @ k.transpose(-2, -1)
            weights = softmax(scores + mask if mask is not None else scores, -1)
            weights = dropout(weights, dropout_p, True) if dropout_p > 0 else weights
            out = weights @ v
        else:
            weights = None
            out = scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        out = self.out_proj(out.permute(2, 0, 1, 3).reshape(length, batch, self.embed_dim))
        if self.batch_first and batched:
            out = out.transpose(0, 1)
        if weights is not None and average_attn_weights:
            weights = weights.mean(1)
        if not batched:
            out = out.squeeze(1)
            weights = weights.squeeze(0) if weights is not None else None
        return out, weights

    def _projected(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        e = self.embed_dim
        weights = ((self.in_proj_weight[:e], self.in_proj_weight[e:2 * e], self.in_proj_weight[2 * e:])
                   if self._qkv_same_embed_dim else (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight))
        biases = ((self.in_proj_bias[:e], self.in_proj_bias[e:2 * e], self.in_proj_bias[2 * e:])
                  if self.in_proj_bias is not None else (None, None, None))
        return tuple(linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))

    def _mask(self, fn: str, attn_mask: Tensor | None, key_padding_mask: Tensor | None, batch: int, length: int,
              keys: int, dtype) -> Tensor | None:
        """The masks as one float mask added to the scores, (N or 1, heads or 1, L, S): True (not allowed) is -inf."""
        def additive(mask: Tensor) -> Tensor:
            if mask.dtype is dtypes.bool_:
                return where(mask, -math.inf, 0.0).to(dtype)
            if not mask.dtype.is_floating_point:
                raise DTypeError(f"{fn}: masks must be boolean or floating-point, got {operands(mask)}")
            return mask.to(dtype)

        total = None
        if attn_mask is not None:
            if attn_mask.shape == (length, keys):
                total = additive(attn_mask)
            elif attn_mask.shape == (batch * self.num_heads, length, keys):
                total = additive(attn_mask).reshape(batch, self.num_heads, length, keys)
            else:
                raise ShapeError(f"{fn}: attn_mask must be ({length}, {keys}) or ({batch * self.num_heads}, {length}, "
                                 f"{keys}), got {operands(attn_mask)}")
        if key_padding_mask is not None:
            if key_padding_mask.shape != (batch, keys):
                raise ShapeError(f"{fn}: key_padding_mask must be ({batch}, {keys}), got {operands(key_padding_mask)}")
            padding = additive(key_padding_mask).reshape(batch, 1, 1, keys)
            total = padding if total is None else total + padding
        return total
