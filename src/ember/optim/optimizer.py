"""Optimizer: parameter groups, per-parameter state, and the one-graph step.

`step()` builds the update of every parameter and every state tensor lazily and then
realizes them all at once, so the forward pass, the backward pass and the update of
a training step are computed as one graph, and nothing of the step's graph survives
it. What changes at every step (Adam's step count) lives in state tensors that the
step updates; hyper-parameters (the learning rate, betas, momentum...) enter the graph
as Python floats, runtime scalars of the kernels, and a captured step (`ember.jit`)
guards them: a replay after one of them changed captures the step again.

A parameter's update is built by running `_update` once per kind of parameter (its shapes, dtypes,
device, state and group settings); that call is recorded as a template (`ember.ir.template`), and the
update of every parameter of that kind is one composite node per result (the new parameter, each new
state tensor), which the compiler expands into the recorded graph: without the template, the optimizer's
nodes were the bulk of a lazy step's graph (an Adam update is about 35 nodes, 4 as a template).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

from ember import dtypes
from ember.autograd import enable_grad, no_grad
from ember.errors import describe
from ember.ir.template import Template, recording, template
from ember.ops.creation import tensor as _tensor
from ember.ops.creation import zeros_like
from ember.runtime import executor
from ember.tensor import Tensor, expect_tensors, realize

# The `_update` functions whose updates may be built from templates: a graph that depends on nothing but its
# tensors (shapes, dtypes, devices), the group's settings other than the learning rate, and `self._lr`'s tensor.
# A subclass's own `_update` (which may read group["lr"], or a value read back with .item()) is not in it.
TEMPLATED: set = set()


class _Required:
    def __repr__(self) -> str:
        return "<required parameter>"


required = _Required()


class Optimizer:
    """Base class: subclasses set `defaults` and implement `_update(param, grad, state, group)`."""

    def __init__(self, params: Iterable[Tensor] | Iterable[dict], defaults: dict) -> None:
        self._templates: dict[tuple, Template | None] = {}
        if isinstance(params, (Tensor, str)) or hasattr(params, "shape") or not isinstance(params, Iterable):
            raise TypeError(f"{type(self).__name__}: params must be an iterable of ember Tensors or dicts "
                            f"(model.parameters() or [tensor]), got {describe(params)}")
        self.defaults = defaults
        self.state: dict[Tensor, dict] = {}
        self._rates: dict[tuple, list] = {}  # (id(group), device, dtype) -> [lr value, 0-d Tensor showing it]
        self.param_groups: list[dict] = []
        groups = list(params)
        if not groups:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for group in groups:
            self.add_param_group(group)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group of parameters with its own hyper-parameters (missing ones take the defaults)."""
        group = dict(param_group)
        params = group["params"]
        group["params"] = [params] if isinstance(params, Tensor) else list(params)
        for i, p in enumerate(group["params"]):
            expect_tensors(type(self).__name__, **{f"params[{i}]": p})
            if not p.is_leaf:
                raise ValueError("can't optimize a non-leaf Tensor")
        for name, default in self.defaults.items():
            if default is required and name not in group:
                raise ValueError(f"parameter group didn't specify a value of required optimization parameter {name}")
            group.setdefault(name, default)
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if any(id(p) in seen for p in group["params"]):
            raise ValueError("some parameters appear in more than one parameter group")
        self.param_groups.append(group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad = None if set_to_none else zeros_like(p.grad)

    def step(self, closure: Callable[[], Tensor] | None = None):
        """Update every parameter that has a gradient, computing the whole step in one realize."""
        loss = None
        if closure is not None:
            with enable_grad():
                loss = closure()
        recorder = executor.this_thread.recorder
        if recorder is not None:
            recorder.guard(self._hyper_parameters)
            recorder.refresh(self._refresh_rates)
        updated = []
        with no_grad():
            for group in self.param_groups:
                settings = _settings(group)
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if recorder is not None:
                        recorder.note_grad_read(p)
                    state = self.state.setdefault(p, {})
                    if settings is not None and type(self)._update in TEMPLATED:
                        if not state:
                            self._init_state(p, state, group)
                        self._update_from_template(p, p.grad, state, group, settings)
                    else:
                        self._update(p, p.grad, state, group)
                    updated.append(p)
        states = [v for p in updated for v in self.state[p].values() if isinstance(v, Tensor)]
        realize(*updated, *states, *([loss] if isinstance(loss, Tensor) else []))
        return loss

    def _update(self, param: Tensor, grad: Tensor, state: dict, group: dict) -> None:
        raise NotImplementedError

    def _init_state(self, param: Tensor, state: dict, group: dict) -> None:
        """Make a parameter's state before its first update (where it does not depend on the update), so the
        first update's graph is every later one's."""

    def _update_from_template(self, param: Tensor, grad: Tensor, state: dict, group: dict, settings: tuple) -> None:
        """`_update`, built from the template of the first update of its kind (recorded now if there is none)."""
        names = tuple(state)
        held = [state[k] for k in names]
        if not all(isinstance(v, Tensor) for v in held):
            self._update(param, grad, state, group)
            return
        inputs = [param._node, grad._node, self._lr(group, param.device, param.dtype)._node, *(v._node for v in held)]
        key = (settings, names, *((n.shape, n.dtype, n.device) for n in inputs))
        recorded = self._templates.get(key, False)
        if recorded is False:
            with recording() as made:
                self._update(param, grad, state, group)
            same = tuple(state) == names and all(state[k] is v for k, v in zip(names, held))
            outputs = [param._node, *(v._node for v in held)]
            recorded = self._templates[key] = template(inputs, outputs, made) if same else None
            if recorded is None:
                return
        elif recorded is None:  # this kind of update cannot be recorded
            self._update(param, grad, state, group)
            return
        # the update as one node per result, from the first one on (the recorded nodes are dropped), so every
        # step builds the same graph
        for t, node in zip((param, *held), recorded.apply(inputs)):
            if t._node is not node:  # a state the update reads and leaves as it is
                t._show(node)

    def _hyper_parameters(self) -> tuple:
        """Every group's settings but its parameters and learning rate: what a captured step reads from
        Python. Insertion order, not sorted: cheaper, and a reordering only costs a harmless recapture."""
        return tuple(tuple((k, v) for k, v in group.items() if k not in ("params", "lr"))
                     for group in self.param_groups)

    def _lr(self, group: dict, device, dtype) -> Tensor:
        """The group's learning rate as a 0-d float32 tensor. The update reads it from device memory, so
        a replayed step (`ember.jit`) takes the rate a scheduler sets without being recorded again; it
        is uploaded again only when the rate changes."""
        dtype = dtypes.float64 if dtype is dtypes.float64 else dtypes.float32  # float64 parameters keep theirs
        rate = self._rates.get((id(group), device, dtype))
        if rate is None:
            rate = self._rates[id(group), device, dtype] = [group["lr"], _tensor(group["lr"], dtype=dtype,
                                                                                  device=device)]
        elif rate[0] != group["lr"]:
            rate[0] = group["lr"]
            rate[1].data = _tensor(group["lr"], dtype=dtype, device=device)  # the same Tensor, a new value
        return rate[1]

    def _refresh_rates(self) -> None:
        """Before a replay: show each group's current learning rate in the tensor the step reads."""
        for group in self.param_groups:
            for (key, device, dtype), rate in list(self._rates.items()):
                if key == id(group) and rate[0] != group["lr"]:
                    self._lr(group, device, dtype)

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """{'state': {index: {...}}, 'param_groups': [{..., 'params': [index, ...]}]}, as PyTorch lays it out."""
        index: dict[int, int] = {}
        groups = []
        for group in self.param_groups:
            for p in group["params"]:
                index.setdefault(id(p), len(index))
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [index[id(p)] for p in group["params"]]
            groups.append(packed)
        state = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p in self.state:
                    state[index[id(p)]] = {k: v.detach() if isinstance(v, Tensor) else v
                                           for k, v in self.state[p].items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(groups)} parameter groups, "
                             f"this optimizer has {len(self.param_groups)}")
        for i, (saved, own) in enumerate(zip(groups, self.param_groups)):
            if len(saved["params"]) != len(own["params"]):
                raise ValueError(f"loaded state dict's parameter group {i} has {len(saved['params'])} parameters, "
                                 f"this optimizer's has {len(own['params'])}")
        by_index = {i: p for saved, own in zip(groups, self.param_groups) for i, p in zip(saved["params"],
                                                                                           own["params"])}
        self.state = {}
        for key, values in state_dict["state"].items():
            p = by_index.get(int(key))
            if p is None:
                continue
            self.state[p] = {k: self._restore(p, k, v) for k, v in values.items()}
        for saved, own in zip(groups, self.param_groups):
            for k, v in saved.items():
                if k != "params":
                    own[k] = copy.deepcopy(v)

    @staticmethod
    def _restore(param: Tensor, key: str, value):
        """State tensors take the parameter's device and (when floating point) dtype, as in PyTorch;
        a step count becomes a 0-d float32 tensor whether it was saved as a tensor or a number."""
        if key == "step":
            return _tensor(value, dtype=dtypes.float32, device=param.device)
        if not isinstance(value, Tensor):
            return value
        if value.dtype.is_floating_point:
            value = value.to(dtype=param.dtype)
        return _tensor(value, device=param.device)

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__} ("]
        for i, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            lines.extend(f"    {k}: {v}" for k, v in sorted(group.items()) if k != "params")
        return "\n".join(lines) + "\n)"


def _settings(group: dict) -> tuple | None:
    """What an update's graph depends on in its group: every setting but the parameters and the learning
    rate (a tensor the update reads); None when a setting is not hashable."""
    settings = (id(group), *((k, v) for k, v in group.items() if k not in ("params", "lr")))
    try:
        hash(settings)
    except TypeError:
        return None
    return settings
