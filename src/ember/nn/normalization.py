"""BatchNorm1d/2d and LayerNorm.

BatchNorm keeps running estimates of each channel's mean and (unbiased) variance as
buffers, updated in training (lazily, outside autograd) and used in eval.
"""

from __future__ import annotations

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
