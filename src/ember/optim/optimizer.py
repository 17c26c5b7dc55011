"""Optimizer: parameter groups, per-parameter state, and the one-graph step.

`step()` builds the update of every parameter and every state tensor lazily and then
realizes them all at once, so the forward pass, the backward pass and the update of
a training step are computed as one graph, and nothing of the step's graph survives
it. What changes at every step (Adam's step count) lives in state tensors that the
step updates; hyper-parameters (the learning rate, betas, momentum...) enter the graph
as Python floats, runtime scalars of the kernels, and a captured step (`ember.jit`)
guards them: a replay after one of them changed captures the step again.

A group's updates are one multi-tensor update, as torch's foreach optimizers are one call: `_update` runs
for every parameter of the group with a gradient once per kind of group step (which parameters, their shapes,
dtypes, devices and state, the group's settings); that run is recorded as a template (`ember.ir.template`),
and every later step of that kind is one composite node per result (each new parameter and state tensor),
all reading one tuple of inputs, which the compiler expands into the recorded graph once per plan. An Adam
update is about 35 nodes built through operator dispatch; as part of a template it is 4 nodes made without
running the optimizer's Python, and a realize reads the group's inputs once.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

from ember import dtypes
from ember.autograd import enable_grad, no_grad
from ember.errors import describe
from ember.ir.node import Node
from ember.ir.template import Template, recording, template
from ember.ops.creation import tensor as _tensor
from ember.ops.creation import zeros_like
from ember.runtime import executor
from ember.tensor import Tensor, expect_tensors, realize

# The `_update` functions whose updates may be built from templates: a graph that depends on nothing but its
# tensors (shapes, dtypes, devices), the group's settings other than the learning rate, and `self._lr`'s tensor.
# A subclass's own `_update` (which may read group["lr"], or a value read back with .item()) is not in it.
TEMPLATED: set = set()
TEMPLATES_KEPT = 16  # per optimizer: kinds of group update (which parameters have gradients, their shapes...)


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
                templated = settings is not None and type(self)._update in TEMPLATED
                batch = []  # (parameter, state) of the group's templated updates
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if recorder is not None:
                        recorder.note_grad_read(p)
                    state = self.state.setdefault(p, {})
                    if templated:
                        if not state:
                            self._init_state(p, state, group)
                        batch.append((p, state))
                    else:
                        self._update(p, p.grad, state, group)
                    updated.append(p)
                if batch:
                    self._update_group(batch, group, settings)
        states = [v for p in updated for v in self.state[p].values() if isinstance(v, Tensor)]
        realize(*updated, *states, *([loss] if isinstance(loss, Tensor) else []))
        return loss

    def _update(self, param: Tensor, grad: Tensor, state: dict, group: dict) -> None:
        raise NotImplementedError

    def _init_state(self, param: Tensor, state: dict, group: dict) -> None:
        """Make a parameter's state before its first update (where it does not depend on the update), so the
        first update's graph is every later one's."""

    def _update_group(self, batch: list[tuple[Tensor, dict]], group: dict, settings: tuple) -> None:
        """`_update` of every (parameter, state) of `batch`, a group's, built as one multi-tensor update per device:
        from the template of the first such update (recorded now if there is none), one node per new parameter
        and state tensor, all reading one tuple of inputs. A parameter whose state holds more than tensors, or
        whose gradient or state is on another device, is updated by `_update` itself."""
        device = batch[0][0]._node.device
        if any(p._node.device is not device and p._node.device != device for p, _ in batch):
            for where in dict.fromkeys(p._node.device for p, _ in batch):
                self._update_group([(p, s) for p, s in batch if p._node.device == where], group, settings)
            return
        rates: dict = {}  # the learning rates' nodes, one per dtype: inputs read once
        inputs: list[Node] = []
        parts: list[tuple] = []
        shown: list[tuple] = []  # per update: the Tensors its results go to
        for param, state in batch:
            held = tuple(state.values())
            node, grad = param._node, param.grad._node
            nodes = [node, grad]
            for v in held:  # (a loop, not all(): this runs for every parameter at every step)
                if not isinstance(v, Tensor) or (v._node.device is not device and v._node.device != device):
                    break
                nodes.append(v._node)
            else:
                if grad.device is device or grad.device == device:
                    dtype = node.dtype
                    if dtype not in rates:
                        rates[dtype] = self._lr(group, device, dtype)._node
                    inputs += nodes
                    parts.append(tuple(state))
                    parts += [(n.shape, n.dtype) for n in nodes]
                    shown.append((param, *held))
                    continue
            self._update(param, param.grad, state, group)
        if not shown:
            return
        inputs[:0] = rates.values()
        key = (settings, device, tuple(rates), *parts)
        recorded = self._templates.get(key, False)
        if recorded is False:
            while len(self._templates) >= TEMPLATES_KEPT:  # (a group whose parameters with gradients keep changing)
                del self._templates[next(iter(self._templates))]
            recorded = self._templates[key] = self._record(batch, group, inputs, shown)
            if recorded is None:  # the updates are built by now, node for node
                return
        elif recorded is None:  # this kind of update cannot be recorded
            for param, *_ in shown:
                self._update(param, param.grad, self.state[param], group)
            return
        # one node per result, from the first update on (the recorded nodes are dropped), so every step builds
        # the same graph
        results = iter(recorded.apply(inputs))
        for tensors in shown:
            for t in tensors:
                node = next(results)
                if t._node is not node:  # a state the update reads and leaves as it is
                    t._show(node)

    def _record(self, batch: list[tuple[Tensor, dict]], group: dict, inputs: list[Node],
                shown: list[tuple]) -> Template | None:
        """Run `_update` for the updates `shown` lists, recording a template of them all (None where they cannot
        be recorded: one reads a node twice, or changes which tensors its state holds)."""
        params = {id(tensors[0]) for tensors in shown}
        states = [(state, tuple(state.items())) for p, state in batch if id(p) in params]
        with recording() as made:
            for param, state in batch:
                if id(param) in params:
                    self._update(param, param.grad, state, group)
        if not all(len(state) == len(items) and all(state[k] is v for k, v in items) for state, items in states):
            return None
        return template(inputs, [t._node for tensors in shown for t in tensors], made)

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
