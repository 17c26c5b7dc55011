"""BatchNorm1d/2d/3d, LayerNorm, RMSNorm, GroupNorm and InstanceNorm1d/2d/3d.

BatchNorm keeps running estimates of each channel's mean and (unbiased) variance as
buffers, updated in training (lazily, outside autograd) and used in eval.
"""

from __future__ import annotations

import warnings

from ember import dtypes
from ember.autograd import no_grad
from ember.errors import ShapeError
from ember.nn import functional as F
from ember.nn import init
from ember.nn.module import Module, Parameter
from ember.ops.creation import empty, ones, tensor, zeros
from ember.tensor import Tensor, expect_tensors


class _BatchNorm(Module):
    _dims: tuple[int, ...] = ()

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device=None, dtype=None, *, bias: bool = True) -> None:
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        dtype = dtypes.as_dtype(dtype) if dtype is not None else dtypes.default_float
        if affine:
            self.weight = Parameter(empty(num_features, dtype=dtype, device=device))
        else:
            self.register_parameter("weight", None)
        if affine and bias:
            self.bias = Parameter(empty(num_features, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        if track_running_stats:
            self.register_buffer("running_mean", zeros(num_features, dtype=dtype, device=device))
            self.register_buffer("running_var", ones(num_features, dtype=dtype, device=device))
            self.register_buffer("num_batches_tracked", tensor(0, dtype=dtypes.int64, device=device))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self.reset_parameters()

    def reset_running_stats(self) -> None:
        if self.track_running_stats:
            with no_grad():
                self.running_mean.zero_()
                self.running_var.fill_(1)
                self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        if self.weight is not None:
            init.ones_(self.weight)
        if self.bias is not None:
            init.zeros_(self.bias)

    def forward(self, input: Tensor) -> Tensor:
        expect_tensors(type(self).__name__, input=input)
        if input.ndim not in self._dims:
            raise ShapeError(f"{type(self).__name__}: expected {' or '.join(f'{d}-d' for d in self._dims)} input, "
                             f"got shape {input.shape}")
        if input.shape[1] != self.num_features:
            raise ShapeError(f"{type(self).__name__}: input of shape {input.shape} has {input.shape[1]} channels "
                             f"(dim 1), expected num_features={self.num_features}")
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            F._settle_running_stats(self.running_mean, self.running_var, self.num_batches_tracked)
            with no_grad():
                self.num_batches_tracked.add_(1)
            F._with_the_step(self.num_batches_tracked)
            if self.momentum is None:  # a cumulative moving average, its factor in double precision as PyTorch's
                momentum = 1.0 / self.num_batches_tracked.to(dtypes.float64)
        use_batch_stats = self.training or self.running_mean is None
        track = not self.training or self.track_running_stats
        return F.batch_norm(input, self.running_mean if track else None, self.running_var if track else None,
                            self.weight, self.bias, use_batch_stats, momentum, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
                f"bias={self.bias is not None}, track_running_stats={self.track_running_stats}")


class BatchNorm1d(_BatchNorm):
    """Batch normalisation over (N, C) or (N, C, L) input."""

    _dims = (2, 3)


class BatchNorm2d(_BatchNorm):
    """Batch normalisation over (N, C, H, W) input."""

    _dims = (4,)


class BatchNorm3d(_BatchNorm):
    """Batch normalisation over (N, C, D, H, W) input."""

    _dims = (5,)


def _scaled(module: Module, normalized_shape, eps, elementwise_affine: bool, device, dtype) -> tuple:
    """A norm over trailing dims: its shape, eps and, if affine, its elementwise scale (ones); (shape, dtype)."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    module.normalized_shape, module.eps, module.elementwise_affine = shape, eps, elementwise_affine
    dtype = dtypes.as_dtype(dtype) if dtype is not None else dtypes.default_float
    if elementwise_affine:
        module.weight = Parameter(ones(shape, dtype=dtype, device=device))
    else:
        module.register_parameter("weight", None)
    return shape, dtype


class LayerNorm(Module):
    """Normalise over the trailing `normalized_shape` dims, with a learned elementwise scale and shift."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        shape, dtype = _scaled(self, normalized_shape, eps, elementwise_affine, device, dtype)
        if elementwise_affine and bias:
            self.bias = Parameter(zeros(shape, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)

    def forward(self, input: Tensor) -> Tensor:
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
                f"bias={self.bias is not None}")


class RMSNorm(Module):
    """Divide by the root mean square over the trailing `normalized_shape` dims, with a learned elementwise scale."""

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True, device=None,
                 dtype=None) -> None:
        super().__init__()
        _scaled(self, normalized_shape, eps, elementwise_affine, device, dtype)

    def forward(self, input: Tensor) -> Tensor:
        return F.rms_norm(input, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class GroupNorm(Module):
    """Normalise groups of channels of (N, C, ...) input over the group's channels and spatial dims, with a learned
    per-channel scale and shift, as torch.nn.GroupNorm."""

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True, device=None,
                 dtype=None, *, bias: bool = True) -> None:
        super().__init__()
        if num_groups <= 0 or num_channels % num_groups:
            raise ValueError(f"GroupNorm: num_channels ({num_channels}) must be divisible by num_groups "
                             f"({num_groups})")
        self.num_groups, self.num_channels, self.eps, self.affine = num_groups, num_channels, eps, affine
        dtype = dtypes.as_dtype(dtype) if dtype is not None else dtypes.default_float
        if affine:
            self.weight = Parameter(ones(num_channels, dtype=dtype, device=device))
        else:
            self.register_parameter("weight", None)
        if affine and bias:
            self.bias = Parameter(zeros(num_channels, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)

    def forward(self, input: Tensor) -> Tensor:
        return F.group_norm(input, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}, "
                f"bias={self.bias is not None}")


class _InstanceNorm(_BatchNorm):
    """Instance normalisation: BatchNorm's parameters and buffers (none by default), each sample's statistics in
    training or without running statistics. Unbatched input (no N) is taken as a batch of one."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = False,
                 track_running_stats: bool = False, device=None, dtype=None, *, bias: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, bias=bias)

    def forward(self, input: Tensor) -> Tensor:
        expect_tensors(type(self).__name__, input=input)
        batched = self._dims[-1]
        if input.ndim not in self._dims:
            raise ShapeError(f"{type(self).__name__}: expected {self._dims[0]}-d or {batched}-d input, "
                             f"got shape {input.shape}")
        channel_dim = input.ndim - batched + 1
        if input.shape[channel_dim] != self.num_features:
            if self.affine:
                raise ShapeError(f"{type(self).__name__}: input of shape {input.shape} has "
                                 f"{input.shape[channel_dim]} channels (dim {channel_dim}), expected "
                                 f"num_features={self.num_features}")
            warnings.warn(f"{type(self).__name__}: input of shape {input.shape} has {input.shape[channel_dim]} "
                          f"channels (dim {channel_dim}), not num_features={self.num_features}; affine=False, so "
                          f"num_features is not used", stacklevel=2)
        x = input if input.ndim == batched else input.unsqueeze(0)
        momentum = 0.0 if self.momentum is None else self.momentum
        out = F.instance_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                              self.training or not self.track_running_stats, momentum, self.eps)
        return out if input.ndim == batched else out.squeeze(0)


class InstanceNorm1d(_InstanceNorm):
    """Instance normalisation over (N, C, L) or (C, L) input."""

    _dims = (2, 3)


class InstanceNorm2d(_InstanceNorm):
    """Instance normalisation over (N, C, H, W) or (C, H, W) input."""

    _dims = (3, 4)


class InstanceNorm3d(_InstanceNorm):
    """Instance normalisation over (N, C, D, H, W) or (C, D, H, W) input."""

    _dims = (4, 5)
