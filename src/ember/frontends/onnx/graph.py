"""Running an ONNX graph on ember tensors: each node, in the graph's (topological) order, calls its op's ember
function from `registry.OPS`, so one forward builds one lazy ember graph that the compiler fuses like native code.

An op ember has no function for, but that ONNX defines as a function of other ops (LayerNormalization, Attention,
the losses, Gelu ...), runs as that function body, taken from onnx's own schema for the node's opset; the model's
local functions run the same way. Subgraphs (If, Loop, Scan) run through the same `GraphRunner`, seeing the names
of the scopes around them.

Values are ember tensors, Python lists of tensors (sequences) and None (an absent optional input). Where ONNX
computes a shape or an axis list as a tensor, the op that needs it as a number reads it with `NodeContext.static`:
known on the host where the graph computed it from constants and shapes (`host.HostValues`, which folds such
nodes), or else computed now, while the data path stays lazy.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Callable

import numpy as np
import onnx
from onnx import AttributeProto, helper

from ember.device import Device
from ember.errors import EmberError, UnsupportedOperatorError
from ember.frontends.onnx.host import HostValues
from ember.frontends.onnx.values import UnsupportedType, ember_dtype, proto_array
from ember.tensor import Tensor


def attributes(node: onnx.NodeProto) -> dict:
    """A node's attributes as Python values: tensors as NumPy arrays, strings decoded, graphs kept as protos."""
    out = {}
    for a in node.attribute:
        if a.ref_attr_name:
            continue  # bound by the calling function (run_function)
        value = helper.get_attribute_value(a)
        if a.type == AttributeProto.TENSOR:
            value = proto_array(value)
        elif a.type == AttributeProto.STRING:
            value = value.decode()
        elif a.type == AttributeProto.STRINGS:
            value = [v.decode() for v in value]
        elif a.type == AttributeProto.TENSORS:
            value = [proto_array(v) for v in value]
        out[a.name] = value
    return out


def op_key(domain: str, op_type: str) -> str:
    """An operator's key in the op table: its type in the default domain, "domain.OpType" in another."""
    return f"{domain}.{op_type}" if domain else op_type


class NodeContext:
    """What an op's ember function knows of its node besides the input values: attributes, opset, device."""

    def __init__(self, node: onnx.NodeProto, opset: int, attrs: dict, runner: GraphRunner, scope: ChainMap):
        self.node, self.opset, self.attrs, self.runner, self.scope = node, opset, attrs, runner, scope

    @property
    def device(self) -> Device:
        return self.runner.device

    def attr(self, name: str, default=None):
        return self.attrs.get(name, default)

    def static(self, t: Tensor | None) -> np.ndarray | None:
        """A shape-like input's value (ONNX passes shapes, axes and sizes as tensors): known on the host, or
        computed now."""
        if t is None:
            return None
        known = self.runner.host.get(t)
        return known if known is not None else t.numpy()

    def ints(self, t: Tensor | None) -> list[int] | None:
        return None if t is None else [int(v) for v in np.asarray(self.static(t)).reshape(-1)]

    def const(self, value, dtype=None) -> Tensor:
        """A constant on this node's device, of `dtype` (an ember dtype, or that of a tensor given as `dtype`)."""
        dtype = dtype.dtype if isinstance(dtype, Tensor) else dtype
        return self.runner.host.constant(np.asarray(value, dtype=None if dtype is None else dtype.np), self.device)

    def declared_type(self, i: int) -> int | None:
        """The ONNX element type the graph declares for input `i` (ember may hold it in a wider type)."""
        return self.runner.declared.get(self.node.input[i])

    def dtype_of(self, elem_type: int):
        try:
            return ember_dtype(elem_type)
        except UnsupportedType as e:
            raise self.unsupported(str(e)) from None

    def unsupported(self, what: str) -> UnsupportedOperatorError:
        return unsupported(self.node, self.opset, what)


def unsupported(node: onnx.NodeProto, opset: int, what: str) -> UnsupportedOperatorError:
    domain = f"{node.domain}." if node.domain not in ("", "ai.onnx") else ""
    name = f" {node.name!r}" if node.name else ""
    return UnsupportedOperatorError(f"ONNX node{name} ({domain}{node.op_type}, opset {opset}, outputs "
                                    f"{list(node.output)}): {what}")


class GraphRunner:
    """Runs graphs and functions of one model: its opsets, its local functions, the device of new tensors."""

    def __init__(self, opsets: dict[str, int], functions: dict[tuple[str, str], onnx.FunctionProto],
                 device: Device, ops: dict[str, Callable], declared: dict[str, int] | None = None,
                 host: HostValues | None = None, bodies: dict | None = None):
        self.opsets, self.functions, self.device, self.ops = opsets, functions, device, ops
        self.declared = declared or {}  # value name -> the ONNX element type the graph declares
        self.host = host or HostValues()
        self.bodies = {} if bodies is None else bodies  # the function bodies of onnx's schemas run so far

    def run(self, graph: onnx.GraphProto, scope: ChainMap) -> list:
        """Runs `graph`'s nodes in `scope` (its inputs and initializers bound, outer scopes behind), returning
        its outputs' values."""
        for node in graph.node:
            self.run_node(node, scope)
        return [scope[o.name] for o in graph.output]

    def run_node(self, node: onnx.NodeProto, scope: ChainMap) -> None:
        domain = "" if node.domain == "ai.onnx" else node.domain
        opset = self.opsets.get(domain, 1)
        inputs = [scope[name] if name else None for name in node.input]
        fn = self.ops.get(op_key(domain, node.op_type))
        known = self.host.foldable(node, inputs)
        if known is not None:
            outputs = self.host.fold(node, opset, known, self.device)
        elif fn is not None:
            try:
                outputs = fn(NodeContext(node, opset, attributes(node), self, scope), *inputs)
            except (EmberError, ValueError, TypeError, IndexError) as error:
                located = _located(error, node, opset)
                if located is error:
                    raise
                raise located from error
        elif (domain, node.op_type) in self.functions:
            outputs = self.run_function(self.functions[domain, node.op_type], node, inputs)
        else:
            outputs = self.run_function(*self.schema_function(node, opset, inputs), inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        for name, value in zip(node.output, outputs):
            if name:
                scope[name] = value

    def schema_function(self, node: onnx.NodeProto, opset: int, inputs: list) -> tuple[onnx.FunctionProto,
                                                                                        onnx.NodeProto]:
        """The function body onnx defines for an op, at the node's opset (for its input types, where the body
        depends on them), and the node with the schema's defaults for the attributes it leaves out (the body reads
        them). Kept for the next forward."""
        try:
            schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
        except onnx.defs.SchemaError:
            raise unsupported(node, opset, "ember has no implementation of this operator and onnx defines "
                                           "no schema for it") from None
        types = [_type_of(v, self.declared.get(name)).SerializeToString() for v, name in zip(inputs, node.input)] \
            if schema.has_context_dependent_function and not schema.has_function else []
        key = (node.SerializeToString(), opset, *types)
        if key in self.bodies:
            return self.bodies[key]
        function = onnx.FunctionProto()
        if schema.has_function:
            function.ParseFromString(schema.get_function_with_opset_version(
                max(v for v in schema.function_opset_versions if v <= opset)))
        elif schema.has_context_dependent_function:
            function.ParseFromString(schema.get_context_dependent_function(node.SerializeToString(), types))
        if not function.node:
            raise unsupported(node, opset, "ember has no implementation of this operator, and onnx defines it as "
                                           "no function of other operators for these inputs")
        with_defaults = onnx.NodeProto()
        with_defaults.CopyFrom(node)
        given = {a.name for a in node.attribute}
        with_defaults.attribute.extend(a.default_value for a in schema.attributes.values()
                                       if a.name not in given and a.default_value.name)
        self.bodies[key] = (function, with_defaults)
        return function, with_defaults

    def run_function(self, function: onnx.FunctionProto, node: onnx.NodeProto, inputs: list) -> tuple:
        """Runs a function body for `node`: its formal inputs bound to the node's values, its attribute references
        to the node's attributes (or the function's defaults)."""
        references = {a.name: a for a in function.attribute_proto}
        references.update({a.name: a for a in node.attribute})
        scope = ChainMap({name: value for name, value in zip(function.input, inputs)})
        runner = self
        if function.opset_import:
            opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in function.opset_import}
            runner = GraphRunner({**self.opsets, **opsets}, self.functions, self.device, self.ops, self.declared,
                                 self.host, self.bodies)
        for body_node in function.node:
            runner.run_node(_with_attributes(body_node, references), scope)
        return tuple(scope.get(name) for name in function.output)


def _located(error: Exception, node: onnx.NodeProto, opset: int) -> Exception:
    """The error an op raised, of the same type, its message prefixed with the node that raised it."""
    if isinstance(error, UnsupportedOperatorError) or str(error).startswith("ONNX node"):
        return error
    where = str(unsupported(node, opset, "")).removesuffix(": ")
    try:
        return type(error)(f"{where}: {error}")
    except TypeError:  # an exception type with a constructor of its own
        return error


def _with_attributes(node: onnx.NodeProto, references: dict) -> onnx.NodeProto:
    """A function body's node with its attribute references replaced by the calling node's attributes (those it
    lacks dropped: the operator's defaults apply)."""
    if not any(a.ref_attr_name for a in node.attribute):
        return node
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    del copy.attribute[:]
    for a in node.attribute:
        if not a.ref_attr_name:
            copy.attribute.append(a)
        elif a.ref_attr_name in references:
            value = onnx.AttributeProto()
            value.CopyFrom(references[a.ref_attr_name])
            value.name = a.name
            copy.attribute.append(value)
    return copy


def _type_of(value, declared: int | None) -> onnx.TypeProto:
    """The ONNX type of a value (as the graph declares it, where it does), for a schema whose function body
    depends on its input types."""
    if value is None:
        return onnx.TypeProto()
    if isinstance(value, list):
        element = _type_of(value[0], declared) if value else onnx.TypeProto()
        return helper.make_sequence_type_proto(element)
    elem = declared or helper.np_dtype_to_tensor_dtype(value.dtype.np)
    return helper.make_tensor_type_proto(elem, list(value.shape))
