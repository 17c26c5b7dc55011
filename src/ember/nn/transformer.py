"""torch.nn's Transformer: encoder and decoder layers (attention, then a feed-forward block, each with a residual
connection and a LayerNorm after it, or before it with `norm_first`), their stacks, and the encoder-decoder model.

Modules, parameter names and their order are PyTorch's, so `load_state_dict(torch_model.state_dict())` fits. The
layers are plain ember graphs (MultiheadAttention, Linear, LayerNorm, Dropout): there is no fused fast path to
choose, and a mask is always applied as given (`is_causal` is only a hint, as it is in PyTorch).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

from ember import dtypes
from ember.errors import ShapeError
from ember.nn import functional as F
from ember.nn import init
from ember.nn.attention import MultiheadAttention
from ember.nn.containers import ModuleList
from ember.nn.layers import Dropout, Linear
from ember.nn.module import Module
from ember.nn.normalization import LayerNorm
from ember.ops.creation import full
from ember.tensor import Tensor

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}


def _activation(layer: str, activation: str | Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    if not isinstance(activation, str):
        return activation
    if activation not in ACTIVATIONS:
        raise ValueError(f"{layer}: activation should be relu, gelu or a callable, not {activation!r}")
    return ACTIVATIONS[activation]


def _check_heads(layer: str, d_model: int, nhead: int) -> None:
    if d_model <= 0 or nhead <= 0 or d_model % nhead:
        raise ValueError(f"{layer}: d_model ({d_model}) must be a positive multiple of nhead ({nhead})")


def _clones(module: Module, n: int) -> ModuleList:
    """`n` copies of `module` with its values but parameters and buffers of their own (torch's `_get_clones`)."""
    return ModuleList(copy.deepcopy(module) for _ in range(n))


class _TransformerLayer(Module):
    """What encoder and decoder layers share, registered in PyTorch's order: one MultiheadAttention per name in
    `_attentions`, the feed-forward block (linear1, dropout, linear2), then a LayerNorm and a Dropout for each of
    the blocks (the attentions and the feed-forward one)."""

    _attentions: tuple[str, ...] = ()

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str | Callable[[Tensor], Tensor] = F.relu, layer_norm_eps: float = 1e-5,
                 batch_first: bool = False, norm_first: bool = False, bias: bool = True, device=None,
                 dtype=None) -> None:
        super().__init__()
        _check_heads(type(self).__name__, d_model, nhead)
        activation = _activation(type(self).__name__, activation)
        factory = dict(device=device, dtype=dtype)
        for name in self._attentions:
            setattr(self, name, MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias,
                                                   batch_first=batch_first, **factory))
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, **factory)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, **factory)
        self.norm_first = norm_first
        blocks = range(1, len(self._attentions) + 2)
        for i in blocks:
            setattr(self, f"norm{i}", LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory))
        for i in blocks:
            setattr(self, f"dropout{i}", Dropout(dropout))
        self.activation = activation

    def _sa_block(self, x: Tensor, attn_mask: Tensor | None, key_padding_mask: Tensor | None,
                  is_causal: bool) -> Tensor:
        x = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False,
                           is_causal=is_causal)[0]
        return self.dropout1(x)

    def _ff_block(self, x: Tensor, dropout: Dropout) -> Tensor:
        return dropout(self.linear2(self.dropout(self.activation(self.linear1(x)))))


class TransformerEncoderLayer(_TransformerLayer):
    """Self-attention, then linear2(dropout(activation(linear1(x)))), each added to its input. Inputs are
    (S, N, E), (N, S, E) with `batch_first`, or unbatched (S, E); masks as MultiheadAttention's."""

    _attentions = ("self_attn",)

    def forward(self, src: Tensor, src_mask: Tensor | None = None, src_key_padding_mask: Tensor | None = None,
                is_causal: bool = False) -> Tensor:
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            return x + self._ff_block(self.norm2(x), self.dropout2)
        x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal))
        return self.norm2(x + self._ff_block(x, self.dropout2))


class TransformerDecoderLayer(_TransformerLayer):
    """Self-attention over the target, attention from the target to `memory` (the encoder's output), then the
    feed-forward block, each added to its input; shapes and masks as TransformerEncoderLayer's."""

    _attentions = ("self_attn", "multihead_attn")

    def forward(self, tgt: Tensor, memory: Tensor, tgt_mask: Tensor | None = None, memory_mask: Tensor | None = None,
                tgt_key_padding_mask: Tensor | None = None, memory_key_padding_mask: Tensor | None = None,
                tgt_is_causal: bool = False, memory_is_causal: bool = False) -> Tensor:
        x = tgt
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), tgt_mask, tgt_key_padding_mask, tgt_is_causal)
            x = x + self._mha_block(self.norm2(x), memory, memory_mask, memory_key_padding_mask, memory_is_causal)
            return x + self._ff_block(self.norm3(x), self.dropout3)
        x = self.norm1(x + self._sa_block(x, tgt_mask, tgt_key_padding_mask, tgt_is_causal))
        x = self.norm2(x + self._mha_block(x, memory, memory_mask, memory_key_padding_mask, memory_is_causal))
        return self.norm3(x + self._ff_block(x, self.dropout3))

    def _mha_block(self, x: Tensor, memory: Tensor, attn_mask: Tensor | None, key_padding_mask: Tensor | None,
                   is_causal: bool) -> Tensor:
        x = self.multihead_attn(x, memory, memory, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                                need_weights=False, is_causal=is_causal)[0]
        return self.dropout2(x)


class TransformerEncoder(Module):
    """`num_layers` copies of `encoder_layer` (all starting from its values) applied in turn, then `norm` if
    given. `enable_nested_tensor` and `mask_check` are accepted for PyTorch's signature: there are no nested
    tensors here, so padded positions are computed like the others."""

    def __init__(self, encoder_layer: Module, num_layers: int, norm: Module | None = None,
                 enable_nested_tensor: bool = True, mask_check: bool = True) -> None:
        super().__init__()
        self.layers = _clones(encoder_layer, num_layers)
        self.num_layers = num_layers
        self.norm = norm
        self.enable_nested_tensor, self.mask_check = enable_nested_tensor, mask_check

    def forward(self, src: Tensor, mask: Tensor | None = None, src_key_padding_mask: Tensor | None = None,
                is_causal: bool | None = None) -> Tensor:
        output = src
        for layer in self.layers:
            output = layer(output, src_mask=mask, src_key_padding_mask=src_key_padding_mask,
                           is_causal=bool(is_causal))
        return self.norm(output) if self.norm is not None else output


class TransformerDecoder(Module):
    """`num_layers` copies of `decoder_layer` (all starting from its values) applied in turn, each attending to
    the same `memory`, then `norm` if given."""

    def __init__(self, decoder_layer: Module, num_layers: int, norm: Module | None = None) -> None:
        super().__init__()
        self.layers = _clones(decoder_layer, num_layers)
        self.num_layers = num_layers
        self.norm = norm

    def forward(self, tgt: Tensor, memory: Tensor, tgt_mask: Tensor | None = None, memory_mask: Tensor | None = None,
                tgt_key_padding_mask: Tensor | None = None, memory_key_padding_mask: Tensor | None = None,
                tgt_is_causal: bool | None = None, memory_is_causal: bool = False) -> Tensor:
        output = tgt
        for layer in self.layers:
            output = layer(output, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                           tgt_key_padding_mask=tgt_key_padding_mask, memory_key_padding_mask=memory_key_padding_mask,
                           tgt_is_causal=bool(tgt_is_causal), memory_is_causal=memory_is_causal)
        return self.norm(output) if self.norm is not None else output


class Transformer(Module):
    """An encoder over `src` and a decoder over `tgt` attending to the encoder's output, each a stack of layers
    followed by a LayerNorm (or `custom_encoder` / `custom_decoder`). Every parameter of two or more dims is
    re-initialised Xavier-uniform, as PyTorch does."""

    def __init__(self, d_model: int = 512, nhead: int = 8, num_encoder_layers: int = 6, num_decoder_layers: int = 6,
                 dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str | Callable[[Tensor], Tensor] = F.relu, custom_encoder: Module | None = None,
                 custom_decoder: Module | None = None, layer_norm_eps: float = 1e-5, batch_first: bool = False,
                 norm_first: bool = False, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        layer_args = (d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps, batch_first, norm_first,
                      bias)
        factory = dict(device=device, dtype=dtype)
        if custom_encoder is not None:
            self.encoder = custom_encoder
        else:
            self.encoder = TransformerEncoder(TransformerEncoderLayer(*layer_args, **factory), num_encoder_layers,
                                              LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory))
        if custom_decoder is not None:
            self.decoder = custom_decoder
        else:
            self.decoder = TransformerDecoder(TransformerDecoderLayer(*layer_args, **factory), num_decoder_layers,
                                              LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory))
        for p in self.parameters():
            if p.ndim > 1:
                init.xavier_uniform_(p)
        self.d_model, self.nhead, self.batch_first = d_model, nhead, batch_first

    def forward(self, src: Tensor, tgt: Tensor, src_mask: Tensor | None = None, tgt_mask: Tensor | None = None,
                memory_mask: Tensor | None = None, src_key_padding_mask: Tensor | None = None,
                tgt_key_padding_mask: Tensor | None = None, memory_key_padding_mask: Tensor | None = None,
                src_is_causal: bool | None = None, tgt_is_causal: bool | None = None,
                memory_is_causal: bool = False) -> Tensor:
        batch_dim = 0 if self.batch_first else 1
        if src.ndim == 3 and (tgt.ndim != 3 or src.shape[batch_dim] != tgt.shape[batch_dim]):
            raise ShapeError(f"Transformer: src {src.shape} and tgt {tgt.shape} must have the same batch size "
                             f"(dim {batch_dim})")
        if src.shape[-1] != self.d_model or tgt.shape[-1] != self.d_model:
            raise ShapeError(f"Transformer: the features (last dim) of src {src.shape} and tgt {tgt.shape} must be "
                             f"d_model={self.d_model}")
        memory = self.encoder(src, mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=src_is_causal)
        return self.decoder(tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                            tgt_key_padding_mask=tgt_key_padding_mask, memory_key_padding_mask=memory_key_padding_mask,
                            tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal)

    @staticmethod
    def generate_square_subsequent_mask(sz: int, device=None, dtype=None) -> Tensor:
        """The causal mask as a float mask: -inf above the diagonal (a later position), 0 on and below it."""
        dtype = dtypes.as_dtype(dtype) if dtype is not None else dtypes.default_float
        return full((sz, sz), -math.inf, dtype=dtype, device=device).triu(1)
