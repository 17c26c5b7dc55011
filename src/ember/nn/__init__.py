"""ember.nn: modules, layers, losses, initialisation and `functional`, with PyTorch's names."""

from ember.nn import functional, init, parallel, utils
from ember.nn.activation import (
    ELU,
    GELU,
    GLU,
    Hardsigmoid,
    Hardswish,
    Hardtanh,
    LeakyReLU,
    LogSoftmax,
    Mish,
    PReLU,
    ReLU,
    ReLU6,
    Sigmoid,
    SiLU,
    Softmax,
    Softplus,
    Tanh,
)
from ember.nn.attention import MultiheadAttention
from ember.nn.containers import ModuleDict, ModuleList, ParameterDict, ParameterList, Sequential
from ember.nn.layers import (
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    CosineSimilarity,
    Dropout,
    Dropout2d,
    Embedding,
    EmbeddingBag,
    Flatten,
    Identity,
    Linear,
    PixelShuffle,
    PixelUnshuffle,
    Unflatten,
    Upsample,
    UpsamplingBilinear2d,
    UpsamplingNearest2d,
    ZeroPad2d,
)
from ember.nn.losses import (
    BCELoss,
    BCEWithLogitsLoss,
    CrossEntropyLoss,
    HuberLoss,
    KLDivLoss,
    L1Loss,
    MSELoss,
    NLLLoss,
    SmoothL1Loss,
)
from ember.nn.module import Module, Parameter
from ember.nn.normalization import (
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    GroupNorm,
    InstanceNorm1d,
    InstanceNorm2d,
    InstanceNorm3d,
    LayerNorm,
    RMSNorm,
)
from ember.nn.pooling import (
    AdaptiveAvgPool1d,
    AdaptiveAvgPool2d,
    AdaptiveAvgPool3d,
    AdaptiveMaxPool1d,
    AdaptiveMaxPool2d,
    AdaptiveMaxPool3d,
    AvgPool1d,
    AvgPool2d,
    AvgPool3d,
    Fold,
    MaxPool1d,
    MaxPool2d,
    MaxPool3d,
    MaxUnpool1d,
    MaxUnpool2d,
    Unfold,
)
from ember.nn.recurrent import GRU, LSTM, RNN, GRUCell, LSTMCell, RNNBase, RNNCell, RNNCellBase
from ember.nn.transformer import (
    Transformer,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)

__all__ = [
    "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d", "AdaptiveMaxPool1d", "AdaptiveMaxPool2d",
    "AdaptiveMaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d", "BCELoss", "BCEWithLogitsLoss", "BatchNorm1d",
    "BatchNorm2d", "BatchNorm3d", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
    "CosineSimilarity",
    "CrossEntropyLoss", "Dropout", "Dropout2d", "ELU", "Embedding", "EmbeddingBag", "Flatten", "Fold", "GELU", "GLU",
    "GRU", "GRUCell", "GroupNorm", "Hardsigmoid", "Hardswish", "Hardtanh", "HuberLoss", "Identity", "InstanceNorm1d",
    "InstanceNorm2d", "InstanceNorm3d", "KLDivLoss", "L1Loss", "LSTM", "LSTMCell", "LayerNorm", "LeakyReLU", "Linear",
    "LogSoftmax", "MSELoss", "MaxPool1d", "MaxPool2d", "MaxPool3d", "MaxUnpool1d", "MaxUnpool2d", "Mish", "Module",
    "ModuleDict", "ModuleList", "MultiheadAttention", "NLLLoss", "PReLU", "Parameter", "ParameterDict", "ParameterList",
    "PixelShuffle", "PixelUnshuffle", "RMSNorm", "RNN", "RNNBase", "RNNCell", "RNNCellBase", "ReLU", "ReLU6",
    "Sequential", "SiLU", "Sigmoid", "SmoothL1Loss", "Softmax", "Softplus", "Tanh", "Transformer", "TransformerDecoder",
    "TransformerDecoderLayer", "TransformerEncoder", "TransformerEncoderLayer", "Unflatten", "Unfold", "Upsample",
    "UpsamplingBilinear2d", "UpsamplingNearest2d", "ZeroPad2d", "functional", "init", "parallel", "utils",
]
