"""torch.nn.utils's helpers: gradient clipping and flat parameter vectors (`parameters`), and packed
variable-length sequences for the recurrent layers (`rnn`)."""

from ember.nn.utils import rnn
from ember.nn.utils.parameters import (
    clip_grad_norm_,
    clip_grad_value_,
    clip_grads_with_norm_,
    get_total_norm,
    parameters_to_vector,
    vector_to_parameters,
)

__all__ = ["clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_", "get_total_norm", "parameters_to_vector",
           "rnn", "vector_to_parameters"]
