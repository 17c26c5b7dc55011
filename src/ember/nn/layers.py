"""Layers: Linear, Conv1d/2d/3d, Embedding, dropout, padding, resampling, reshaping, activations and distances
(the pooling layers live in pooling.py).

Each layer holds its Parameters, initialises them as PyTorch does (so ported models
train the same way), and calls into `ember.nn.functional` in `forward`.
"""

from __future__ import annotations

import math

from ember import dtypes
from ember.autograd import no_grad
from ember.nn import functional as F
from ember.nn import init
from ember.nn.module import Module, Parameter
from ember.ops.creation import arange, empty
from ember.ops.movement import flatten, unflatten
from ember.ops.pointwise import where
from ember.tensor import Tensor


def _factory(device, dtype) -> dict:
    return {"device": device, "dtype": dtypes.as_dtype(dtype) if dtype is not None else dtypes.default_float}


class Identity(Module):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__()

    def forward(self, input: Tensor) -> Tensor:
        return input


class Linear(Module):
    """y = x W^T + b, with W of shape (out_features, in_features)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(empty((out_features, in_features), **_factory(device, dtype)))
        if bias:
            self.bias = Parameter(empty(out_features, **_factory(device, dtype)))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            _uniform_fan_in_bias(self.bias, self.weight)

    def forward(self, input: Tensor) -> Tensor:
        return F.linear(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _uniform_fan_in_bias(bias: Tensor, weight: Tensor) -> None:
    fan_in, _ = init._calculate_fan_in_and_fan_out(weight)
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
    init.uniform_(bias, -bound, bound)


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


def _single(v) -> tuple[int]:
    return (v,) if isinstance(v, int) else tuple(v)


def _triple(v) -> tuple[int, int, int]:
    return (v, v, v) if isinstance(v, int) else tuple(v)


class _Conv(Module):
    """What a convolution layer and a transposed one share: channels, geometry, the weight and bias, and
    torch's default initialisation."""

    def __init__(self, name: str, in_channels: int, out_channels: int, kernel_size, stride, dilation, groups: int,
                 bias: bool, weight_channels: tuple[int, int], device, dtype, spatial=_pair) -> None:
        super().__init__()
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"{name}: in_channels ({in_channels}) and out_channels ({out_channels}) must be "
                             f"divisible by groups ({groups})")
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.memory_format = None  # the layout its activations ask for (Module.to(memory_format=...))
        self.kernel_size, self.stride, self.dilation = spatial(kernel_size), spatial(stride), spatial(dilation)
        self.weight = Parameter(empty((*weight_channels, *self.kernel_size), **_factory(device, dtype)))
        if bias:
            self.bias = Parameter(empty(out_channels, **_factory(device, dtype)))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            _uniform_fan_in_bias(self.bias, self.weight)


class _PaddedConv(_Conv):
    """A convolution layer with torch.nn.ConvNd's arguments and padding modes: zero padding is the convolution's
    own; 'reflect', 'replicate' and 'circular' pad the input first (padding='same' split as torch splits it, the
    odd extra on the far side). A subclass names its functional form (`_convolve`) and how its int-or-tuple
    arguments are read (`_spatial`, by its rank)."""

    _spatial = staticmethod(_pair)

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None, dtype=None) -> None:
        name = type(self).__name__
        if padding_mode not in ("zeros", "reflect", "replicate", "circular"):
            raise ValueError(f"{name}: padding_mode must be 'zeros', 'reflect', 'replicate' or 'circular', "
                             f"not {padding_mode!r}")
        if isinstance(padding, str) and padding not in ("valid", "same"):
            raise ValueError(f"{name}: padding must be an int, a tuple, 'valid' or 'same', not {padding!r}")
        super().__init__(name, in_channels, out_channels, kernel_size, stride, dilation, groups, bias,
                         (out_channels, in_channels // groups), device, dtype, spatial=self._spatial)
        if padding == "same" and set(self.stride) != {1}:
            raise ValueError(f"{name}: padding='same' is not supported for strided convolutions")
        self.padding = padding if isinstance(padding, str) else self._spatial(padding)
        self.padding_mode = padding_mode

    def _convolve(self, input: Tensor, padding) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} names no convolution")

    def forward(self, input: Tensor) -> Tensor:
        if self.padding_mode == "zeros" or self.padding == "valid":
            return self._convolve(input, self.padding)
        if self.padding == "same":
            totals = [d * (k - 1) for d, k in zip(self.dilation, self.kernel_size)]
        else:
            totals = [2 * p for p in self.padding]
        amounts = [a for total in reversed(totals) for a in (total // 2, total - total // 2)]
        return self._convolve(F.pad(input, amounts, mode=self.padding_mode), 0)

    def extra_repr(self) -> str:
        rank = len(self.kernel_size)
        text = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"
        if self.padding != (0,) * rank:
            text += f", padding={self.padding!r}" if isinstance(self.padding, str) else f", padding={self.padding}"
        if self.dilation != (1,) * rank:
            text += f", dilation={self.dilation}"
        if self.groups != 1:
            text += f", groups={self.groups}"
        if self.bias is None:
            text += ", bias=False"
        if self.padding_mode != "zeros":
            text += f", padding_mode={self.padding_mode}"
        return text


class Conv1d(_PaddedConv):
    """1-d cross-correlation over (N, C, L) input, as torch.nn.Conv1d: weight (out, in / groups, k)."""

    _spatial = staticmethod(_single)

    def _convolve(self, input: Tensor, padding) -> Tensor:
        return F.conv1d(input, self.weight, self.bias, self.stride, padding, self.dilation, self.groups)


class Conv2d(_PaddedConv):
    """2-d cross-correlation over (N, C, H, W) input, as torch.nn.Conv2d."""

    def _convolve(self, input: Tensor, padding) -> Tensor:
        return F.conv2d(input, self.weight, self.bias, self.stride, padding, self.dilation, self.groups,
                        memory_format=self.memory_format)


class Conv3d(_PaddedConv):
    """3-d cross-correlation over (N, C, D, H, W) input, as torch.nn.Conv3d: weight (out, in / groups, kD, kH,
    kW)."""

    _spatial = staticmethod(_triple)

    def _convolve(self, input: Tensor, padding) -> Tensor:
        return F.conv3d(input, self.weight, self.bias, self.stride, padding, self.dilation, self.groups)


class _TransposedConv(_Conv):
    """A transposed convolution layer with torch.nn.ConvTransposeNd's arguments: the gradient of a convolution with
    respect to its input; the weight is (in_channels, out_channels / groups, *kernel_size). A subclass names its
    functional form (`_convolve`) and how its int-or-tuple arguments are read (`_spatial`, by its rank)."""

    _spatial = staticmethod(_pair)

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, output_padding=0,
                 groups: int = 1, bias: bool = True, dilation=1, padding_mode: str = "zeros", device=None,
                 dtype=None) -> None:
        name = type(self).__name__
        if padding_mode != "zeros":
            raise ValueError(f"{name}: only padding_mode='zeros' is supported (as torch), not {padding_mode!r}")
        super().__init__(name, in_channels, out_channels, kernel_size, stride, dilation, groups, bias,
                         (in_channels, out_channels // groups), device, dtype, spatial=self._spatial)
        self.padding, self.output_padding = self._spatial(padding), self._spatial(output_padding)

    def _convolve(self, input: Tensor, output_padding: tuple[int, ...]) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} names no transposed convolution")

    def forward(self, input: Tensor, output_size=None) -> Tensor:
        """The transposed convolution of `input`; `output_size` (the output's spatial size, or its whole shape)
        chooses the output padding among the sizes this geometry can give, as torch's."""
        return self._convolve(input, self._output_padding(input, output_size))

    def _output_padding(self, input: Tensor, output_size) -> tuple[int, ...]:
        if output_size is None:
            return self.output_padding
        name, rank = type(self).__name__, len(self.kernel_size)
        size = tuple(output_size)
        if len(size) == input.ndim:  # the whole shape: its spatial dims
            size = size[-rank:]
        if len(size) != rank:
            raise ValueError(f"{name}: output_size must have {rank} or {input.ndim} elements (got {len(size)})")
        smallest = tuple((i - 1) * s - 2 * p + d * (k - 1) + 1 for i, s, p, d, k in zip(
            input.shape[-rank:], self.stride, self.padding, self.dilation, self.kernel_size))
        largest = tuple(m + s - 1 for m, s in zip(smallest, self.stride))
        if not all(m <= n <= M for m, n, M in zip(smallest, size, largest)):
            raise ValueError(f"{name}: requested an output size of {size}, but valid sizes range from {smallest} to "
                             f"{largest} (for an input of {input.shape[-rank:]})")
        return tuple(n - m for n, m in zip(size, smallest))

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, output_padding={self.output_padding}, groups={self.groups}, "
                f"bias={self.bias is not None}")


class ConvTranspose1d(_TransposedConv):
    """1-d transposed convolution over (N, C, L) input, as torch.nn.ConvTranspose1d: the gradient of a Conv1d with
    respect to its input. The weight is (in_channels, out_channels / groups, k)."""

    _spatial = staticmethod(_single)

    def _convolve(self, input: Tensor, output_padding: tuple[int, ...]) -> Tensor:
        return F.conv_transpose1d(input, self.weight, self.bias, self.stride, self.padding, output_padding,
                                  self.groups, self.dilation)


class ConvTranspose2d(_TransposedConv):
    """2-d transposed convolution over (N, C, H, W) input, as torch.nn.ConvTranspose2d: the gradient of a
    Conv2d with respect to its input. The weight is (in_channels, out_channels / groups, kH, kW)."""

    def _convolve(self, input: Tensor, output_padding: tuple[int, ...]) -> Tensor:
        return F.conv_transpose2d(input, self.weight, self.bias, self.stride, self.padding, output_padding,
                                  self.groups, self.dilation, memory_format=self.memory_format)


class ConvTranspose3d(_TransposedConv):
    """3-d transposed convolution over (N, C, D, H, W) input, as torch.nn.ConvTranspose3d: the gradient of a
    Conv3d with respect to its input. The weight is (in_channels, out_channels / groups, kD, kH, kW)."""

    _spatial = staticmethod(_triple)

    def _convolve(self, input: Tensor, output_padding: tuple[int, ...]) -> Tensor:
        return F.conv_transpose3d(input, self.weight, self.bias, self.stride, self.padding, output_padding,
                                  self.groups, self.dilation)


class _EmbeddingTable(Module):
    """The weight of Embedding and EmbeddingBag: `num_embeddings` rows of `embedding_dim`, the row at
    `padding_idx` starting at zero."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None, _weight: Tensor | None,
                 _freeze: bool, device, dtype) -> None:
        super().__init__()
        name = type(self).__name__
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"{name}: padding_idx {padding_idx} must be within num_embeddings "
                                 f"({num_embeddings})")
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        if _weight is None:
            self.weight = Parameter(empty((num_embeddings, embedding_dim), **_factory(device, dtype)),
                                    requires_grad=not _freeze)
            self.reset_parameters()
        else:
            if _weight.shape != (num_embeddings, embedding_dim):
                raise ValueError(f"{name}: _weight of shape {_weight.shape} must have shape "
                                 f"({num_embeddings}, {embedding_dim})")
            self.weight = Parameter(_weight, requires_grad=not _freeze)

    def reset_parameters(self) -> None:
        init.normal_(self.weight)
        if self.padding_idx is not None:
            with no_grad():
                rows = arange(self.num_embeddings, device=self.weight.device).reshape(-1, 1)
                self.weight.assign(where(rows == self.padding_idx, 0.0, self.weight))

    def extra_repr(self) -> str:
        text = f"{self.num_embeddings}, {self.embedding_dim}"
        return text + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else "")


def _check_supported(name: str, max_norm: float | None, scale_grad_by_freq: bool, sparse: bool) -> None:
    if max_norm is not None or scale_grad_by_freq or sparse:
        raise NotImplementedError(f"{name}: max_norm, scale_grad_by_freq and sparse are not supported")


class Embedding(_EmbeddingTable):
    """A lookup table of `num_embeddings` vectors; the row at `padding_idx` starts at zero and gets no gradient."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, _weight: Tensor | None = None, _freeze: bool = False, device=None,
                 dtype=None) -> None:
        _check_supported("Embedding", max_norm, scale_grad_by_freq, sparse)
        super().__init__(num_embeddings, embedding_dim, padding_idx, _weight, _freeze, device, dtype)

    @classmethod
    def from_pretrained(cls, embeddings: Tensor, freeze: bool = True, padding_idx: int | None = None) -> Embedding:
        rows, dim = embeddings.shape
        return cls(rows, dim, padding_idx=padding_idx, _weight=embeddings.detach(), _freeze=freeze)

    def forward(self, input: Tensor) -> Tensor:
        return F.embedding(input, self.weight, self.padding_idx)


class EmbeddingBag(_EmbeddingTable):
    """Sums, means or maxima of bags of embedding rows (see F.embedding_bag); indices equal to `padding_idx` are
    left out of their bag, and that row starts at zero."""

    def __init__(self, num_embeddings: int, embedding_dim: int, max_norm: float | None = None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False, mode: str = "mean", sparse: bool = False,
                 _weight: Tensor | None = None, include_last_offset: bool = False, padding_idx: int | None = None,
                 device=None, dtype=None, _freeze: bool = False) -> None:
        _check_supported("EmbeddingBag", max_norm, scale_grad_by_freq, sparse)
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"EmbeddingBag: mode has to be one of sum, mean or max, got {mode!r}")
        super().__init__(num_embeddings, embedding_dim, padding_idx, _weight, _freeze, device, dtype)
        self.mode, self.include_last_offset = mode, include_last_offset

    @classmethod
    def from_pretrained(cls, embeddings: Tensor, freeze: bool = True, max_norm: float | None = None,
                        norm_type: float = 2.0, scale_grad_by_freq: bool = False, mode: str = "mean",
                        sparse: bool = False, include_last_offset: bool = False,
                        padding_idx: int | None = None) -> EmbeddingBag:
        rows, dim = embeddings.shape
        return cls(rows, dim, max_norm, norm_type, scale_grad_by_freq, mode, sparse, embeddings.detach(),
                   include_last_offset, padding_idx, _freeze=freeze)

    def forward(self, input: Tensor, offsets: Tensor | None = None,
                per_sample_weights: Tensor | None = None) -> Tensor:
        return F.embedding_bag(input, self.weight, offsets, mode=self.mode, per_sample_weights=per_sample_weights,
                               include_last_offset=self.include_last_offset, padding_idx=self.padding_idx)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}"


class Dropout(Module):
    """Zero elements with probability p in training (scaling the rest by 1 / (1 - p)); identity in eval."""

    def __init__(self, p: float = 0.5, inplace: bool = False) -> None:
        super().__init__()
        if not 0 <= p <= 1:
            raise ValueError(f"Dropout: p must be in [0, 1], got {p}")
        self.p, self.inplace = p, inplace

    def forward(self, input: Tensor) -> Tensor:
        return F.dropout(input, self.p, self.training, self.inplace)

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}"


class Flatten(Module):
    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, input: Tensor) -> Tensor:
        return flatten(input, self.start_dim, self.end_dim)

    def extra_repr(self) -> str:
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"


# -- resampling ---------------------------------------------------------------------------

class Upsample(Module):
    """Resample (N, C, L), (N, C, H, W) or (N, C, D, H, W) input to `size` or by `scale_factor`, as
    torch.nn.Upsample (see F.interpolate)."""

    def __init__(self, size=None, scale_factor=None, mode: str = "nearest", align_corners: bool | None = None,
                 recompute_scale_factor: bool | None = None) -> None:
        super().__init__()
        self.size, self.mode = size, mode
        if isinstance(scale_factor, (tuple, list)):
            self.scale_factor = tuple(float(f) for f in scale_factor)
        else:
            self.scale_factor = float(scale_factor) if scale_factor is not None else None
        self.align_corners, self.recompute_scale_factor = align_corners, recompute_scale_factor

    def forward(self, input: Tensor) -> Tensor:
        return F.interpolate(input, self.size, self.scale_factor, self.mode, self.align_corners,
                             recompute_scale_factor=self.recompute_scale_factor)

    def extra_repr(self) -> str:
        given = f"scale_factor={self.scale_factor!r}" if self.scale_factor is not None else f"size={self.size!r}"
        return f"{given}, mode={self.mode!r}"


class UpsamplingNearest2d(Upsample):
    def __init__(self, size=None, scale_factor=None) -> None:
        super().__init__(size, scale_factor, mode="nearest")


class UpsamplingBilinear2d(Upsample):
    """Bilinear resampling with align_corners=True."""

    def __init__(self, size=None, scale_factor=None) -> None:
        super().__init__(size, scale_factor, mode="bilinear", align_corners=True)


# -- distances, padding, reshaping and channel dropout ------------------------------------

class CosineSimilarity(Module):
    def __init__(self, dim: int = 1, eps: float = 1e-8) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps

    def forward(self, x1: Tensor, x2: Tensor) -> Tensor:
        return F.cosine_similarity(x1, x2, self.dim, self.eps)


class ZeroPad2d(Module):
    """Pad the last two dims with zeros: `padding` is one int for all four sides or (left, right, top, bottom);
    negative amounts crop."""

    def __init__(self, padding) -> None:
        super().__init__()
        padding = (padding,) * 4 if isinstance(padding, int) else tuple(padding)
        if len(padding) != 4:
            raise ValueError(f"ZeroPad2d: padding must be an int or 4 ints (left, right, top, bottom), got {padding}")
        self.padding = padding

    def forward(self, input: Tensor) -> Tensor:
        return F.pad(input, self.padding)

    def extra_repr(self) -> str:
        return f"{self.padding}"


class Unflatten(Module):
    """Split dim `dim` into `unflattened_size` (one entry may be -1)."""

    def __init__(self, dim: int, unflattened_size) -> None:
        super().__init__()
        self.dim, self.unflattened_size = dim, tuple(unflattened_size)

    def forward(self, input: Tensor) -> Tensor:
        return unflatten(input, self.dim, self.unflattened_size)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, unflattened_size={self.unflattened_size}"


class Dropout2d(Dropout):
    """Zero whole channels (dim 1 of (N, C, H, W)) with probability p in training, scaling the rest by
    1 / (1 - p); identity in eval."""

    def forward(self, input: Tensor) -> Tensor:
        return F.dropout2d(input, self.p, self.training, self.inplace)


class PixelShuffle(Module):
    """(*, C r², H, W) to (*, C, H r, W r)."""

    def __init__(self, upscale_factor: int) -> None:
        super().__init__()
        self.upscale_factor = upscale_factor

    def forward(self, input: Tensor) -> Tensor:
        return F.pixel_shuffle(input, self.upscale_factor)

    def extra_repr(self) -> str:
        return f"upscale_factor={self.upscale_factor}"


class PixelUnshuffle(Module):
    """(*, C, H r, W r) to (*, C r², H, W)."""

    def __init__(self, downscale_factor: int) -> None:
        super().__init__()
        self.downscale_factor = downscale_factor

    def forward(self, input: Tensor) -> Tensor:
        return F.pixel_unshuffle(input, self.downscale_factor)

    def extra_repr(self) -> str:
        return f"downscale_factor={self.downscale_factor}"
