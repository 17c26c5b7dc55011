"""ONNX's optimizer operators (domain ai.onnx.preview.training: Adagrad, Momentum, Adam) as ember ops: one update
of n tensors, the step count read as a number."""

from __future__ import annotations

import math

import numpy as np

import ember
from ember.frontends.onnx.graph import NodeContext


def _groups(values: tuple, count: int) -> list[list]:
    size = len(values) // count
    return [list(values[i * size:(i + 1) * size]) for i in range(count)]


def _adagrad(n: NodeContext, rate, step, *tensors):
    xs, gs, hs = _groups(tensors, 3)
    t = float(np.asarray(n.static(step)).reshape(-1)[0])
    r = rate / (1 + t * n.attr("decay_factor", 0.0))
    new_xs, new_hs = [], []
    for x, g, h in zip(xs, gs, hs):
        g = x * n.attr("norm_coefficient", 0.0) + g
        h = h + g * g
        new_xs.append(x - r * g / (ember.sqrt(h) + n.attr("epsilon", 1e-6)))
        new_hs.append(h)
    return (*new_xs, *new_hs)


def _momentum(n: NodeContext, rate, step, *tensors):
    xs, gs, vs = _groups(tensors, 3)
    t = float(np.asarray(n.static(step)).reshape(-1)[0])
    alpha, beta = n.attr("alpha"), n.attr("beta") if t > 0 else 1.0
    new_xs, new_vs = [], []
    for x, g, v in zip(xs, gs, vs):
        g = x * n.attr("norm_coefficient", 0.0) + g
        v = v * alpha + g * beta
        new_xs.append(x - rate * (g + v * alpha) if n.attr("mode") == "nesterov" else x - rate * v)
        new_vs.append(v)
    return (*new_xs, *new_vs)


def _adam(n: NodeContext, rate, step, *tensors):
    xs, gs, vs, hs = _groups(tensors, 4)
    t = float(np.asarray(n.static(step)).reshape(-1)[0])
    alpha, beta = n.attr("alpha", 0.9), n.attr("beta", 0.999)
    if t > 0:
        rate = rate * (math.sqrt(1 - beta ** t) / (1 - alpha ** t))
    new_xs, new_vs, new_hs = [], [], []
    for x, g, v, h in zip(xs, gs, vs, hs):
        g = x * n.attr("norm_coefficient", 0.0) + g
        v = v * alpha + g * (1 - alpha)
        h = h * beta + g * g * (1 - beta)
        new_x = x - rate * (v / (ember.sqrt(h) + n.attr("epsilon", 1e-6)))
        new_xs.append(new_x * (1 - n.attr("norm_coefficient_post", 0.0)))
        new_vs.append(v)
        new_hs.append(h)
    return (*new_xs, *new_vs, *new_hs)


OPS = {"ai.onnx.preview.training.Adagrad": _adagrad, "ai.onnx.preview.training.Momentum": _momentum,
       "ai.onnx.preview.training.Adam": _adam}
