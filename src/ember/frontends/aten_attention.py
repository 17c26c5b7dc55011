"""torch's attention operators in ATen graphs as ember attention: the scaled dot-product operator, and the forms of
torch's fused kernels (flash, memory-efficient, cuDNN, the cpu's flash) with their backward operators, which the
graphs AOTAutograd makes on a GPU hold. Each becomes `F.scaled_dot_product_attention`, ember's fused attention.
A GPU kernel form's log-sum-exp is the rows' log-sum-exp of ember's kernel, written beside its output; its backward
reads the forward's output and log-sum-exp as torch's kernels do and computes nothing of the forward again
(ATTENTION_GRAD over the given rows). Where no fused kernel computes the attention (dropout, a mask that needs a
gradient, float64), and for the cpu's form (whose forward torch decomposes), the backward is the vector-Jacobian
product of ember's forward (`aten._vjp`). The other auxiliary outputs (a random seed and offset, a debug mask) are
read only by the backward and not computed, except that with dropout the seed's place holds ember's dropout mask,
so the backward drops the weights the forward dropped.

The entries join `aten.OPS`, the one table, when this module is imported (`aten_graph` imports it).
"""

from __future__ import annotations

import math

import ember
from ember.frontends.aten import OPS, _NotComputed, _vjp
from ember.ir import Op
from ember.nn import functional as F
from ember.nn.attention import attention_weights
from ember.tensor import Tensor, apply


def _attention(q, k, v, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale)


def _dropped_attention(q, k, v, dropout_p, is_causal, attn_mask, scale, keep=None):
    """Attention whose weights are dropped where the boolean `keep` is False (drawn here when None), and `keep`.
    torch's GPU attention kernels hand their backward the random generator's seed and offset to draw their mask
    again; ember hands it the mask itself, in the seed's place, so the backward drops the same weights."""
    weights = attention_weights(q, k, attn_mask, is_causal, scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if keep is None:
        keep = ember.rand(weights.shape, device=q.device) >= dropout_p
    return (weights * keep.to(weights.dtype) * (1.0 / (1.0 - dropout_p))) @ v, keep


def _fused(out: Tensor, q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether `out` is one fused attention kernel's output over q, k and v as given (none broadcast)."""
    node = out._node
    return node.op is Op.ATTENTION and [i.shape for i in node.inputs[:3]] == [q.shape, k.shape, v.shape]


def _rows(out: Tensor, q: Tensor, k: Tensor, v: Tensor):
    """The log-sum-exp of the attention rows whose output is `out`, computed by the same kernel (both pending), which
    the backward reads instead of computing the forward again; nothing where no fused kernel computes `out`."""
    if not _fused(out, q, k, v):
        return _NotComputed("the log-sum-exp of an attention", (*q.shape[:-1],))
    return apply(Op.ATTENTION, *(Tensor(i) for i in out._node.inputs), **{**out._node.attrs, "result": "lse"})


def _kernel_attention(q, k, v, dropout_p, is_causal, attn_mask, scale):
    """A GPU kernel form's output, its rows' log-sum-exp and what its backward reads in the seed's place: the
    dropout mask, or nothing."""
    if not dropout_p:
        out = _attention(q, k, v, 0.0, is_causal, attn_mask, scale)
        return out, _rows(out, q, k, v), _NotComputed("a seed", ())
    out, keep = _dropped_attention(q, k, v, dropout_p, is_causal, attn_mask, scale)
    return out, _NotComputed("the log-sum-exp of an attention", (*q.shape[:-1],)), keep


def _flash_attention(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, scale=None, **_):
    out, lse, keep = _kernel_attention(q, k, v, dropout_p, is_causal, None, scale)
    return (out, lse, None, None, q.shape[-2], k.shape[-2], keep, _NotComputed("an offset", ()),
            _NotComputed("a debug mask", ()))


def _flash_attention_cpu(q, k, v, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    # torch decomposes this form's forward (its decomposition hands the backward the attention weights in the
    # log-sum-exp's place), so its backward reads neither: ember's autograd derives it from the inputs
    out = _attention(q, k, v, dropout_p, is_causal, attn_mask, scale)
    return out, _NotComputed("the log-sum-exp of an attention", (*q.shape[:-1],))


def _efficient_attention(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, scale=None):
    out, lse, keep = _kernel_attention(q, k, v, dropout_p, is_causal, attn_bias, scale)
    return out, lse, keep, _NotComputed("an offset", ())


def _cudnn_attention(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                     scale=None):
    out, lse, keep = _kernel_attention(q, k, v, dropout_p, is_causal, attn_bias, scale)
    lse = lse.reshape(*lse.shape, 1) if isinstance(lse, Tensor) else lse  # (..., L, 1), as torch's cuDNN form
    return (out, lse, None, None, q.shape[-2], k.shape[-2], keep, _NotComputed("an offset", ()),
            _NotComputed("a debug mask", ()))


def _attention_backward(grad, q, k, v, attn_mask, is_causal, scale, mask_wanted=False, dropout_p=0.0, keep=None,
                        out=None, lse=None):
    """The gradients of q, k, v and (where `mask_wanted`) the additive mask; with dropout, of the attention whose
    weights `keep` kept (the mask its forward drew). Where one fused kernel computed the forward, from its output
    `out` and rows' log-sum-exp `lse` as the forward wrote them (see `_rows`): its scores are computed again tile by
    tile, the forward itself is not."""
    if not dropout_p and not mask_wanted and out is not None:
        forward = _attention(q, k, v, 0.0, is_causal, attn_mask, scale)  # the node the forward's kernel computed
        if _fused(forward, q, k, v):  # as when the forward ran: its log-sum-exp is there to read
            node, lse = forward._node, lse.reshape(q.shape[:-1])
            delta = (grad.float() * out.float()).sum(-1)  # each row's sum of dO * O
            inputs = [Tensor(i) for i in node.inputs]
            grads = [apply(Op.ATTENTION_GRAD, *inputs[:3], grad, lse, delta, *inputs[3:],
                           **{**node.attrs, "result": r}) for r in ("dq", "dk", "dv")]
            return [*grads, None]
    if dropout_p:
        def forward(a, b, c, m):
            return _dropped_attention(a, b, c, dropout_p, is_causal, m, scale, keep)[0]
    else:
        def forward(a, b, c, m):
            return _attention(a, b, c, 0.0, is_causal, m, scale)
    return _vjp(forward, [q, k, v, attn_mask], grad, [True, True, True, mask_wanted])


def _flash_attention_backward(grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed,
                              offset, scale=None):
    return _attention_backward(grad, q, k, v, None, is_causal, scale, False, dropout_p, seed, out, lse)[:3]


def _flash_attention_cpu_backward(grad, q, k, v, out, lse, dropout_p, is_causal, attn_mask=None, scale=None):
    if dropout_p:
        raise NotImplementedError(f"aten._scaled_dot_product_flash_attention_for_cpu_backward with dropout_p="
                                  f"{dropout_p}: its forward hands it no dropout mask to drop the same weights by")
    return _attention_backward(grad, q, k, v, attn_mask, is_causal, scale)[:3]


def _efficient_attention_backward(grad, q, k, v, attn_bias, out, lse, seed, offset, dropout_p, grad_input_mask,
                                  is_causal=False, scale=None):
    return _attention_backward(grad, q, k, v, attn_bias, is_causal, scale, bool(grad_input_mask[3]), dropout_p, seed,
                               out, lse)


def _cudnn_attention_backward(grad, q, k, v, out, lse, seed, offset, attn_bias, cum_q, cum_k, max_q, max_k, dropout_p,
                              is_causal, scale=None):
    return _attention_backward(grad, q, k, v, attn_bias, is_causal, scale, False, dropout_p, seed, out, lse)[:3]


OPS.update({
    "aten.scaled_dot_product_attention": lambda q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
    enable_gqa=False: F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa),
    "aten._scaled_dot_product_flash_attention": _flash_attention,
    "aten._scaled_dot_product_flash_attention_for_cpu": _flash_attention_cpu,
    "aten._scaled_dot_product_efficient_attention": _efficient_attention,
    "aten._scaled_dot_product_flash_attention_backward": _flash_attention_backward,
    "aten._scaled_dot_product_flash_attention_for_cpu_backward": _flash_attention_cpu_backward,
    "aten._scaled_dot_product_efficient_attention_backward": _efficient_attention_backward,
    "aten._scaled_dot_product_cudnn_attention": _cudnn_attention,
    "aten._scaled_dot_product_cudnn_attention_backward": _cudnn_attention_backward,
})
