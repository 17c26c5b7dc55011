"""Pooling layers (1-d, 2-d and 3-d: max, average, adaptive; max_unpool) and the sliding-block layers Unfold and
Fold, each calling its `ember.nn.functional` form with the arguments it was built with."""

from __future__ import annotations

from ember.nn import functional as F
from ember.nn.module import Module
from ember.tensor import Tensor


class _Pool(Module):
    """A pooling layer: `_pool` is its functional form (for the layer's rank), called with the input and the
    layer's attributes named in `_arguments`, in order."""

    _pool = None
    _arguments: tuple[str, ...] = ()

    def forward(self, input: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        return type(self)._pool(input, *(getattr(self, name) for name in self._arguments))


class _MaxPool(_Pool):
    _arguments = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, return_indices: bool = False,
                 ceil_mode: bool = False) -> None:
        super().__init__()
        self.kernel_size, self.stride = kernel_size, stride if stride is not None else kernel_size
        self.padding, self.dilation, self.ceil_mode = padding, dilation, ceil_mode
        self.return_indices = return_indices

    def extra_repr(self) -> str:
        return (f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
                f"dilation={self.dilation}, ceil_mode={self.ceil_mode}")


class MaxPool1d(_MaxPool):
    """The maximum over windows along the last dim of (N, C, L) or (C, L) input."""

    _pool = F.max_pool1d


class MaxPool2d(_MaxPool):
    """The maximum over windows of (N, C, H, W) or (C, H, W) input; with `return_indices`, also each maximum's
    flat position in its input plane."""

    _pool = F.max_pool2d


class MaxPool3d(_MaxPool):
    """The maximum over windows of (N, C, D, H, W) or (C, D, H, W) input; with `return_indices`, also each
    maximum's flat position in its input volume."""

    _pool = F.max_pool3d


class _AvgPool(_Pool):
    _arguments = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")

    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode: bool = False, count_include_pad: bool = True,
                 divisor_override: int | None = None) -> None:
        super().__init__()
        self.kernel_size, self.stride = kernel_size, stride if stride is not None else kernel_size
        self.padding, self.ceil_mode = padding, ceil_mode
        self.count_include_pad, self.divisor_override = count_include_pad, divisor_override

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class AvgPool1d(_AvgPool):
    """The mean over windows along the last dim of (N, C, L) or (C, L) input (its sizes held as 1-tuples, as
    torch holds them)."""

    _pool = F.avg_pool1d
    _arguments = _AvgPool._arguments[:-1]

    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
                 count_include_pad: bool = True) -> None:
        super().__init__(_single(kernel_size), _single(stride if stride is not None else kernel_size),
                         _single(padding), ceil_mode, count_include_pad)


def _single(v) -> tuple[int]:
    return (v,) if isinstance(v, int) else tuple(v)


class AvgPool2d(_AvgPool):
    """The mean over windows of (N, C, H, W) or (C, H, W) input."""

    _pool = F.avg_pool2d


class AvgPool3d(_AvgPool):
    """The mean over windows of (N, C, D, H, W) or (C, D, H, W) input."""

    _pool = F.avg_pool3d


class _AdaptivePool(_Pool):
    _arguments = ("output_size",)

    def __init__(self, output_size) -> None:
        super().__init__()
        self.output_size = output_size

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}"


class AdaptiveAvgPool1d(_AdaptivePool):
    _pool = F.adaptive_avg_pool1d


class AdaptiveAvgPool2d(_AdaptivePool):
    _pool = F.adaptive_avg_pool2d


class AdaptiveAvgPool3d(_AdaptivePool):
    _pool = F.adaptive_avg_pool3d


class _AdaptiveMaxPool(_AdaptivePool):
    _arguments = ("output_size", "return_indices")

    def __init__(self, output_size, return_indices: bool = False) -> None:
        super().__init__(output_size)
        self.return_indices = return_indices


class AdaptiveMaxPool1d(_AdaptiveMaxPool):
    _pool = F.adaptive_max_pool1d


class AdaptiveMaxPool2d(_AdaptiveMaxPool):
    _pool = F.adaptive_max_pool2d


class AdaptiveMaxPool3d(_AdaptiveMaxPool):
    _pool = F.adaptive_max_pool3d


class MaxUnpool2d(Module):
    """max_pool2d's partial inverse: values placed at their indices in planes of zeros."""

    def __init__(self, kernel_size, stride=None, padding=0) -> None:
        super().__init__()
        self.kernel_size, self.stride = kernel_size, stride if stride is not None else kernel_size
        self.padding = padding

    def forward(self, input: Tensor, indices: Tensor, output_size=None) -> Tensor:
        return F.max_unpool2d(input, indices, self.kernel_size, self.stride, self.padding, output_size)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class MaxUnpool1d(MaxUnpool2d):
    """max_pool1d's partial inverse: values placed at their indices in rows of zeros."""

    def forward(self, input: Tensor, indices: Tensor, output_size=None) -> Tensor:
        return F.max_unpool1d(input, indices, self.kernel_size, self.stride, self.padding, output_size)


class Unfold(Module):
    """The sliding blocks of (N, C, H, W) input as columns (N, C * kh * kw, L) (see F.unfold)."""

    def __init__(self, kernel_size, dilation=1, padding=0, stride=1) -> None:
        super().__init__()
        self.kernel_size, self.dilation, self.padding, self.stride = kernel_size, dilation, padding, stride

    def forward(self, input: Tensor) -> Tensor:
        return F.unfold(input, self.kernel_size, self.dilation, self.padding, self.stride)

    def extra_repr(self) -> str:
        return (f"kernel_size={self.kernel_size}, dilation={self.dilation}, padding={self.padding}, "
                f"stride={self.stride}")


class Fold(Module):
    """Columns (N, C * kh * kw, L) summed into (N, C, H, W) planes of `output_size` (see F.fold)."""

    def __init__(self, output_size, kernel_size, dilation=1, padding=0, stride=1) -> None:
        super().__init__()
        self.output_size, self.kernel_size = output_size, kernel_size
        self.dilation, self.padding, self.stride = dilation, padding, stride

    def forward(self, input: Tensor) -> Tensor:
        return F.fold(input, self.output_size, self.kernel_size, self.dilation, self.padding, self.stride)

    def extra_repr(self) -> str:
        return (f"output_size={self.output_size}, kernel_size={self.kernel_size}, dilation={self.dilation}, "
                f"padding={self.padding}, stride={self.stride}")
