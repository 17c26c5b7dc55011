"""The interpreter of ATen graphs on ember tensors: `AtenGraph` runs a torch.fx graph of ATen operators (what
torch.export and AOTAutograd produce) by the table of `ember.frontends.aten`, building one lazy ember graph per call.
A graph is checked when it is made: an operator the table lacks, or an auxiliary output ember does not compute read
elsewhere than by its backward, is an error naming them all.

A graph runs the same way call after call, so its first call on inputs of given shapes, dtypes and devices is
recorded as a template (ir.template), and later ones are built from it: one node per output, which the compiler
expands once per plan, instead of the Python of every operator (for a ResNet's training step, thousands of ember
ops a call). The first call's results come from the template too, so every call's graph is the same and a steady
loop compiles one plan; a graph that draws random numbers (dropout) is built node for node, with new offsets each
call. A call whose inputs need ember's autograd (an imported module training), or whose graph realizes a value
while it is built, is interpreted every time.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

from ember import nested
from ember.frontends import aten_attention, strided  # noqa: F401  (aten_attention: its entries join OPS)
from ember.frontends.aten import OPS, _placement
from ember.ir.template import Template, recording, template
from ember.ops.random import take_offsets
from ember.runtime import executor
from ember.tensor import Tensor

_RESULT = object()  # in a template's record of a call's results: the place of a Tensor it builds

# the auxiliary outputs ember does not compute, and the backward operators that alone may read them
_READERS_OF_AUXILIARY = {
    "aten.max_pool2d_with_indices": ("aten.max_pool2d_with_indices_backward",),
    "aten.max_pool3d_with_indices": ("aten.max_pool3d_with_indices_backward",),
    "aten._scaled_dot_product_flash_attention": ("aten._scaled_dot_product_flash_attention_backward",),
    "aten._scaled_dot_product_flash_attention_for_cpu": (
        "aten._scaled_dot_product_flash_attention_for_cpu_backward",),
    "aten._scaled_dot_product_efficient_attention": ("aten._scaled_dot_product_efficient_attention_backward",),
    "aten._scaled_dot_product_cudnn_attention": ("aten._scaled_dot_product_cudnn_attention_backward",),
}


def auxiliary(node) -> bool:
    """Whether an fx node is an auxiliary output ember does not compute (`_READERS_OF_AUXILIARY`: max-pooling's
    indices, an attention's log-sum-exp), which only the backward of its operator reads."""
    if getattr(node, "target", None) is not operator.getitem or node.args[1] == 0:
        return False
    source = node.args[0]
    name = name_of(getattr(source, "target", None))
    return name in _READERS_OF_AUXILIARY or name.rsplit(".", 1)[0] in _READERS_OF_AUXILIARY


def _foreach(op: Callable) -> Callable:
    """An `aten._foreach_*` operator: `op` applied to each position of its list arguments."""
    def each(*args, **kwargs):
        count = next(len(a) for a in args if isinstance(a, (list, tuple)))
        pick = [a if isinstance(a, (list, tuple)) else [a] * count for a in args]
        return [op(*column, **kwargs) for column in zip(*pick)]
    return each


def name_of(target) -> str:
    """An FX node target's table name: "aten.add.Tensor" for an ATen overload, "_operator.mul" for Python's."""
    if hasattr(target, "_schema") or type(target).__name__ == "OpOverload":
        return str(target)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__name__', target)}"


def lookup(target) -> Callable | None:
    """The ember function for an FX node's target: by overload, else by packet."""
    name = name_of(target)
    if name in OPS:
        return OPS[name]
    if name.startswith("aten._foreach_"):
        op = lookup_name("aten." + name.removeprefix("aten._foreach_").rstrip("_").replace("_.", "."))
        return _foreach(op) if op is not None else None
    return lookup_name(name)


def lookup_name(name: str) -> Callable | None:
    if name in OPS:
        return OPS[name]
    packet = name.rsplit(".", 1)[0] if name.startswith(("aten.", "prims.")) else None
    if packet is not None and packet.endswith("_") and packet.rstrip("_") in OPS:  # an in-place form, functional
        return OPS[packet.rstrip("_")]
    return OPS.get(packet) if packet is not None else None


class AtenGraph:
    """A torch.fx graph of ATen operators, run on ember tensors: each call builds the ember graph of its nodes
    (lazy, nothing computed) and returns its outputs. Checked when made: an operator the table lacks, or an
    auxiliary output read elsewhere than by its backward, is an error naming them all."""

    def __init__(self, graph, what: str = "graph") -> None:
        self.graph = graph
        missing: dict[str, None] = {}
        self.functions: dict = {}  # per call_function node: the ember function it runs
        self.arguments: dict = {}  # per call_function node run on other arguments than its own: those
        for node in graph.nodes:
            if node.op == "call_function":
                fn, why = lookup(node.target), ""
                if name_of(node.target).rsplit(".", 1)[0] in strided.OPERATORS:
                    fn, self.arguments[node], why = strided.translate(node)
                if fn is None:
                    missing[name_of(node.target) + (f" ({why})" if why else "")] = None
                self.functions[node] = fn
                self._check_auxiliary(node)
            elif node.op not in ("placeholder", "output", "get_attr"):
                missing[f"{node.op} {node.target}"] = None
        if missing:
            raise NotImplementedError(f"ember cannot run this {what}: no ember op for {', '.join(missing)}")
        self.nodes = list(graph.nodes)
        self.attribute_names = list(dict.fromkeys(n.target for n in self.nodes if n.op == "get_attr"))
        # by the inputs' description: (template, the results' nesting, their leaves with Tensors as _RESULT), or
        # None where a call on such inputs cannot be recorded
        self._templates: dict[tuple, tuple[Template, object, list] | None] = {}

    @staticmethod
    def _check_auxiliary(node) -> None:
        name = name_of(node.target)
        packet = name.rsplit(".", 1)[0]
        readers = _READERS_OF_AUXILIARY.get(name) or _READERS_OF_AUXILIARY.get(packet)
        if readers is None:
            return
        for user in node.users:
            if user.target is not operator.getitem or user.args[1] == 0:
                continue
            for reader in user.users:
                reader_name = name_of(getattr(reader, "target", None))
                if reader.op == "output" or reader_name.rsplit(".", 1)[0] in readers or reader_name in readers:
                    continue
                if reader_name == "aten.permute.default" and all(u.op == "output" for u in reader.users):
                    continue  # returned in the memory order torch keeps it in (frontends.layouts.in_memory_order)
                raise NotImplementedError(f"ember cannot run this graph: {reader_name} reads output "
                                          f"{user.args[1]} of {name}, which ember does not compute")

    def __call__(self, *args, attributes: Callable[[str], object] | None = None, device=None) -> list:
        """The graph's outputs on `args`; `device`, if given, is where the tensors it creates go (a program
        captured on one device, run on another), else where the graph says."""
        outer = getattr(_placement, "device", None)
        _placement.device = device
        try:
            values = {name: attributes(name) for name in self.attribute_names}
            return self._replayed(args, values, device)
        finally:
            _placement.device = outer

    def _replayed(self, args, attributes: dict, device):
        """The outputs, from the template of these inputs' first call where there is one."""
        values = [*args, *attributes.values()]
        tensors = [v for v in values if isinstance(v, Tensor)]
        if any(t.requires_grad for t in tensors):  # ember's autograd records through each operator
            return self._run(args, attributes)
        key = (device, *[(v.shape, v.dtype, v.device) if isinstance(v, Tensor) else (type(v), v) for v in values])
        try:
            recorded = self._templates.get(key, False)
        except TypeError:  # an unhashable argument
            return self._run(args, attributes)
        if recorded is None:
            return self._run(args, attributes)
        inputs = [t._node for t in tensors]
        if recorded is False:
            recorded = self._templates[key] = self._record(args, attributes, inputs)
            if recorded is None:
                return self._run(args, attributes)
        built, structure, leaves = recorded
        one_device = len({n.device for n in inputs}) <= 1
        nodes = iter(built.apply(inputs) if one_device and not built.random else built.build(inputs, take_offsets))
        return nested.rebuild(structure, iter([Tensor(next(nodes)) if leaf is _RESULT else leaf for leaf in leaves]))

    def _record(self, args, attributes: dict, inputs: list) -> tuple[Template, object, list] | None:
        """The template of a call on these inputs, None where it realizes a value while it builds its graph (a
        value read on the host) or its outputs are not all made of its inputs by it."""
        realized = []
        observe = lambda order, keep: realized.append(True)  # noqa: E731
        executor.this_thread.observers.append(observe)
        try:
            with recording() as made:
                result = self._run(args, attributes)
        finally:
            executor.this_thread.observers.remove(observe)
        leaves = nested.leaves(result)
        outputs = [leaf._node for leaf in leaves if isinstance(leaf, Tensor)]
        built = template(inputs, outputs, made, random=True) if not realized else None
        if built is None:
            return None
        return built, nested.structure(result), [_RESULT if isinstance(leaf, Tensor) else leaf for leaf in leaves]

    def _run(self, args, attributes: dict) -> list:
        env: dict = {}
        inputs = iter(args)
        result = None
        for node in self.nodes:
            if node.op == "placeholder":
                env[node] = next(inputs)
            elif node.op == "get_attr":
                env[node] = attributes[node.target]
            elif node.op == "call_function":
                fn = self.functions[node]
                a = _fetch(self.arguments.get(node, node.args), env)
                kw = _fetch(node.kwargs, env) if node not in self.arguments else {}
                try:
                    env[node] = fn(*a, **kw)
                except Exception as error:
                    error.add_note(f"(running {name_of(node.target)}, node {node.name} of the ATen graph)")
                    raise
            elif node.op == "output":
                result = _fetch(node.args[0], env)
        return result


def _fetch(value, env):
    if isinstance(value, (list, tuple)):
        return type(value)(_fetch(v, env) for v in value)
    if isinstance(value, dict):
        return {k: _fetch(v, env) for k, v in value.items()}
    if hasattr(value, "op") and hasattr(value, "users"):
        return env[value]
    return value
