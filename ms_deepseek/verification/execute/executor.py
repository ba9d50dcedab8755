"""The executor: MindSpore's compiled per-rank programs run on CPU, the ranks' collectives done between them.

A dry-run compile (``plan --compile``) hands back each rank's compiled training step as MindIR
(``_cell_graph_executor._get_func_graph_proto(cell, exec_id, "mind_ir")``, ``mindspore.train.mind_ir_pb2``):
one flat list of nodes in a valid execution order for that rank, after MindSpore's parallel passes, with
this rank's slice shapes, every collective MindSpore inserted, the backward and the optimizer update
(``mindspore/train/mind_ir_pb2.py``; ``mindspore/common/api.py`` ``_CellGraphExecutor``). :class:`RankProgram` decodes one such list; :func:`.scheduler.run_ranks` executes
all ranks' lists together:

* every computing primitive runs on MindSpore's own CPU kernel, called in PyNative with the inputs the node
  names. Auto-generated primitives (``mindspore.ops.auto_generate.gen_ops_prim``: ``PRIMITIVE_FUNCTION`` in
  the proto) take their former ``__init__`` arguments as trailing graph inputs (``MatMul(x, w, transpose_a,
  transpose_b)``); older primitives (``PRIMITIVE``) take them from the primitive's attributes;
* ``Load`` reads a parameter's current value, ``Depend`` passes its first input, ``UpdateState`` and the
  monads are ordering only; parameters are ``Parameter`` objects, so in-place updates (``Assign``,
  ``AssignAdd``, ``AdamWeightDecay``) land where the next step reads them;
* our custom operators (``Custom``, ``func_type`` aot, compiled as the Ascend C ops) run on their CPU kernels
  (:mod:`ms_deepseek.ops.cpu`), and the Ascend-only primitives on references of the same math
  (:mod:`ms_deepseek.verification.execute.standins`);
* the communication primitives are done here, between the ranks, with MindSpore's documented semantics
  (``mindspore.ops.AllReduce`` / ``AllGather`` / ``ReduceScatter`` / ``AlltoAll`` / ``Send`` / ``Receive``)
  over the members each primitive carries (``group_rank_ids``; the world group when it has none).

What the executor cannot run as MindSpore would is refused by name, never approximated: an attribute that did
not decode when something reads it (:class:`Attrs`), a primitive with neither a CPU kernel nor a stand-in, and a
communication primitive it does not run between the ranks (:func:`is_communication`).

Each rank runs as a generator that yields at a collective; the scheduler resumes a group's ranks when all
of them have arrived at the same collective (the group's n-th on each), after checking that they agree on
the operator, its attributes, shape and dtype; a received message must be what its ``Receive`` declares. A rank waiting on ranks that can no longer come is a deadlock, reported with
every waiting rank's operator and group, never a hang. Per rank the executor counts the operators run and,
per group and kind, the collectives and the bytes they moved.
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, List, Optional, Tuple

import numpy as np

from ms_deepseek.verification.execute.execution_error import ExecutionError

COLLECTIVES = ("AllReduce", "AllGather", "ReduceScatter", "AlltoAll", "Broadcast", "_MicroStepAllGather")
POINT_TO_POINT = ("Send", "Receive")


class _Monad:
    """The ordering tokens (``U``, ``IO``, ``UpdateState``'s output): never a kernel input."""

    def __repr__(self) -> str:
        return "U"


MONAD = _Monad()

# mind_ir.proto's TensorProto.DataType -> numpy (bfloat16 read through MindSpore's own type)
_NP_DTYPES = {
    1: np.float32,
    2: np.uint8,
    3: np.int8,
    4: np.uint16,
    5: np.int16,
    6: np.int32,
    7: np.int64,
    9: np.bool_,
    10: np.float16,
    11: np.float64,
    12: np.uint32,
    13: np.uint64,
    17: np.float64,
}


def tensor_of(proto):
    """A ``TensorProto`` (dims, data_type, raw_data) as a MindSpore Tensor."""
    from mindspore import Tensor
    from mindspore.common import dtype as mstype

    dims = tuple(proto.dims)
    if proto.data_type == 16:  # bfloat16: its raw bits as uint16 widened to float32
        bits = np.frombuffer(proto.raw_data, np.uint16).astype(np.uint32) << 16
        return Tensor(bits.view(np.float32).reshape(dims), mstype.bfloat16)
    dtype = _NP_DTYPES.get(proto.data_type)
    if dtype is None:
        raise ExecutionError(f"constant tensor of MindIR data type {proto.data_type}: not supported by the executor")
    if proto.raw_data or math.prod(dims) == 0:
        return Tensor(np.frombuffer(proto.raw_data, dtype).reshape(dims).copy())
    # small constants may keep their values in the typed fields instead of raw_data (mind_ir.proto TensorProto)
    for values in (proto.float_data, proto.int32_data, proto.int64_data, proto.double_data, proto.uint64_data):
        if len(values):
            return Tensor(np.asarray(values, dtype).reshape(dims))
    raise ExecutionError(f"constant tensor {proto.name!r} {list(dims)} has no data in its MindIR")


def attribute_value(attr):
    """An ``AttributeProto`` as a Python value (mind_ir.proto ``AttributeType``): scalars, strings, tuples and
    lists of them, tensors, None, and the monads. A scalar nested in a tuple holds its value in ``ints[0]`` /
    ``floats[0]``; a top-level one in ``i`` / ``f``."""
    from mindspore.train import mind_ir_pb2 as pb

    kind = pb.AttributeProto.AttributeType.Name(attr.type)
    if kind in ("FLOAT", "DOUBLE", "FLOAT16", "BFLOAT16"):
        if attr.floats:
            return float(attr.floats[0])
        if attr.doubles:
            return float(attr.doubles[0])
        return float(attr.f if kind != "DOUBLE" else attr.d)
    if kind in ("UINT8", "INT8", "UINT16", "INT16", "INT32", "INT64", "UINT32", "UINT64"):
        return int(attr.ints[0]) if attr.ints else int(attr.i)
    if kind == "BOOL":
        return bool(attr.ints[0]) if attr.ints else bool(attr.i)
    if kind == "STRING":
        return (attr.strings[0] if attr.strings else attr.s).decode()
    if kind in ("TUPLE", "LIST"):
        values = [attribute_value(v) for v in attr.values]
        return tuple(values) if kind == "TUPLE" else values
    if kind == "TENSORS":
        if _is_type_only(attr.tensors[0]):
            return _type_of(attr.tensors[0].data_type)
        return tensor_of(attr.tensors[0])
    if kind == "TENSOR":
        return tensor_of(attr.t)
    if kind in ("UMONAD", "IOMONAD"):
        return MONAD
    if kind in ("NONE", "TYPE_NULL"):
        return None
    if kind == "SCALAR" and attr.HasField("t"):
        return tensor_of(attr.t)
    raise ExecutionError(f"attribute {attr.name!r} of MindIR type {kind}: not supported by the executor")


def _is_type_only(proto) -> bool:
    """A tensor with a data type and nothing else: how MindIR stores an attribute whose value is a type
    (``Receive(..., dtype=mstype.float32)``: one ``TensorProto`` with ``data_type`` only; measured on an exported
    primitive attribute)."""
    values = (proto.float_data, proto.int32_data, proto.int64_data, proto.double_data, proto.uint64_data)
    return not proto.dims and not proto.raw_data and not any(len(v) for v in values)


# mind_ir.proto's TensorProto.DataType name -> mindspore.common.dtype name
_MS_TYPES = {
    "FLOAT": "float32",
    "FLOAT64": "float64",
    "DOUBLE": "float64",
    "FLOAT16": "float16",
    "BFLOAT16": "bfloat16",
    "BOOL": "bool_",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "UINT8": "uint8",
    "UINT16": "uint16",
    "UINT32": "uint32",
    "UINT64": "uint64",
}


def _type_of(data_type: int):
    from mindspore.common import dtype as mstype
    from mindspore.train import mind_ir_pb2 as pb

    name = pb.TensorProto.DataType.Name(data_type)
    if name not in _MS_TYPES:
        raise ExecutionError(f"a type attribute of MindIR data type {name}: not supported by the executor")
    return getattr(mstype, _MS_TYPES[name])


@dataclass(frozen=True)
class Undecoded:
    """An attribute the decoder could not read, kept by name and MindIR type: decoding stays tolerant of attributes
    nobody reads (a strategy, a layout), and :class:`Attrs` refuses the read of one."""

    name: str
    mindir_type: str
    reason: str


class Attrs(dict):
    """A primitive's attributes. Reading one that did not decode (``attrs[name]``, ``attrs.get(name)``) raises
    :class:`ExecutionError` naming the operator, the attribute and its MindIR type: a default in its place would
    run the primitive with a value the program does not hold."""

    def __init__(self, values, op: str = "", where: str = ""):
        super().__init__(values)
        self.op, self.where = op, where

    def __getitem__(self, name):
        value = super().__getitem__(name)
        if isinstance(value, Undecoded):
            raise ExecutionError(
                f"{self.op} at {self.where}: its attribute {name!r} of MindIR type {value.mindir_type} is read "
                f"and did not decode ({value.reason})"
            )
        return value

    def get(self, name, default=None):
        return self[name] if name in self else default


@dataclass
class Node:
    """One computing node of a rank's program: ``output = op(*inputs)``."""

    output: str
    op: str  # the primitive's op type (its class name)
    kind: str  # "function" (auto-generated primitive), "primitive", or "builtin" (Load, Depend, ...)
    attrs: Dict[str, object]
    inputs: List[str]
    scope: str = ""
    prim_name: str = ""

    def __post_init__(self):
        if not isinstance(self.attrs, Attrs):
            self.attrs = Attrs(self.attrs, self.op, self.scope or self.output)


@dataclass
class RankProgram:
    """One rank's compiled program, decoded: constants, parameters, inputs, nodes and output."""

    rank: int
    constants: Dict[str, object]
    parameters: Dict[str, str]  # graph name -> parameter name (the Parameter's own name)
    inputs: List[str]
    nodes: List[Node]
    output: str

    @classmethod
    def from_bytes(cls, rank: int, data: bytes) -> "RankProgram":
        from mindspore.train import mind_ir_pb2 as pb

        model = pb.ModelProto()
        model.ParseFromString(data)
        if len(model.functions):
            raise ExecutionError(
                f"rank {rank}: the compiled program has {len(model.functions)} sub-functions; the executor runs "
                "flat programs only (MindSpore inlines every sub-graph of a training step it compiles)"
            )
        prims = {p.name: p for p in model.primitives}
        graph = model.graph
        constants: Dict[str, object] = {}
        nodes: List[Node] = []
        for n in graph.node:
            if n.op_type == "Constant":
                constants[n.output[0]] = attribute_value(n.attribute[0])
                continue
            if not n.op_type.startswith("REF::"):
                raise ExecutionError(f"rank {rank}: node {n.name} calls {n.op_type}, not a primitive")
            prim = prims[n.op_type[5:]]
            kind = pb.PrimitiveProto.PrimType.Name(prim.prim_type)
            scope = n.domain or n.doc_string
            nodes.append(
                Node(
                    output=n.output[0],
                    op=prim.op_type,
                    kind="function" if kind == "PRIMITIVE_FUNCTION" else "primitive",
                    attrs=Attrs({a.name: _safe_attr(a) for a in prim.attribute}, prim.op_type, scope or n.output[0]),
                    inputs=list(n.input),
                    scope=scope,
                    prim_name=prim.instance_name,
                )
            )
        parameters = {p.name: (p.ref_key or p.name.rsplit(":", 1)[-1]) for p in graph.parameter}
        return cls(rank, constants, parameters, [i.name for i in graph.input], nodes, graph.output[0].name)


def _safe_attr(attr):
    """The attribute's value, or an :class:`Undecoded` marker that refuses its read (a strategy of a type the
    executor does not decode is never read)."""
    from mindspore.train import mind_ir_pb2 as pb

    try:
        return attribute_value(attr)
    except ExecutionError as exc:
        return Undecoded(attr.name, pb.AttributeProto.AttributeType.Name(attr.type), str(exc))


# ------------------------------------------------------------------------------------ kernels
# MindSpore's scalar primitives (``mindspore/ops/operations/_sequence_ops.py``, ``gen_ops_prim``) compute on the
# host, on Python numbers; their CPU kernels are not registered for PyNative, so they are Python here
_SCALAR_OPS = {
    "ScalarAdd": operator.add,
    "AddScalar": operator.add,
    "ScalarSub": operator.sub,
    "SubScalar": operator.sub,
    "ScalarMul": operator.mul,
    "ScalarDiv": operator.truediv,
    "ScalarFloorDiv": operator.floordiv,
    "FloorDivScalar": operator.floordiv,
    "ScalarMod": operator.mod,
    "ScalarPow": operator.pow,
    "ScalarEq": operator.eq,
    "EqScalar": operator.eq,
    "ScalarLt": operator.lt,
    "LessScalar": operator.lt,
    "ScalarGt": operator.gt,
    "ScalarLe": operator.le,
    "ScalarGe": operator.ge,
    "GreaterEqualScalar": operator.ge,
    "ScalarMax": max,
    "ScalarMin": min,
    "ScalarBool": bool,
    "ScalarUsub": operator.neg,
    "ScalarUadd": operator.pos,
}


def _primitive_class(name: str):
    from mindspore.ops.auto_generate import gen_ops_prim
    from mindspore.ops.operations import _grad_ops, _inner_ops, array_ops, comm_ops, math_ops, nn_ops, other_ops

    for module in (gen_ops_prim, array_ops, math_ops, nn_ops, _grad_ops, _inner_ops, other_ops, comm_ops):
        cls = getattr(module, name, None)
        if isinstance(cls, type):
            return cls
    from mindspore.ops import operations as P

    return getattr(P, name, None)


# names of MindSpore's communication primitives outside ``comm_ops`` (``gen_ops_prim``: DistComm*, InnerComm*, the
# fused MatmulAllReduce* / AllGatherMatmul / MatmulReduceScatter)
_COMMUNICATION_PARTS = (
    "AllReduce",
    "AllGather",
    "ReduceScatter",
    "AlltoAll",
    "AllToAll",
    "AllSwap",
    "Barrier",
    "Isend",
    "Irecv",
    "NeighborExchange",
    "CollectiveScatter",
    "CollectiveGather",
    "MirrorOperator",
    "MirrorMicroStep",
    "MirrorMiniStep",
    "DistComm",
    "InnerComm",
)


@functools.lru_cache(maxsize=None)
def _comm_op_names() -> FrozenSet[str]:
    """The primitives ``mindspore/ops/operations/comm_ops.py`` defines."""
    from mindspore.ops import Primitive
    from mindspore.ops.operations import comm_ops

    return frozenset(
        name
        for name, cls in vars(comm_ops).items()
        if isinstance(cls, type) and issubclass(cls, Primitive) and cls.__module__ == comm_ops.__name__
    )


def is_communication(op: str) -> bool:
    """A primitive that communicates: one of ``comm_ops``, or named like a collective. In PyNative on one process
    MindSpore runs such a primitive as if the process were alone (an ``AllReduce`` returns its input), so the
    executor runs only those it implements between the ranks (:data:`COLLECTIVES`, :data:`POINT_TO_POINT`)."""
    return (
        op in _comm_op_names() or op in ("Send", "Receive", "Broadcast") or any(p in op for p in _COMMUNICATION_PARTS)
    )


def _dtype_positions(op: str) -> Tuple[int, ...]:
    """The inputs that MindIR stores as a type id (an int) where the primitive takes a MindSpore dtype: those its
    ``__call__`` names ``dtype`` / ``dst_type`` (``Cast(input_x, dtype)``, ``SumExt(input, dim, keepdim, dtype)``)."""
    cls = _primitive_class(op)
    if cls is None or "__call__" not in vars(cls):
        return ()
    names = list(inspect.signature(cls.__call__).parameters)[1:]
    return tuple(i for i, n in enumerate(names) if n in ("dtype", "dst_type"))


def _with_dtypes(positions: Tuple[int, ...], args: list) -> list:
    if not positions:
        return args
    from mindspore._c_expression import typing

    return [typing.type_id_to_type(a) if i in positions and isinstance(a, int) else a for i, a in enumerate(args)]


def _init_parameters(cls) -> List[str]:
    sig = inspect.signature(cls.__init__)
    return [p for p in list(sig.parameters)[1:] if sig.parameters[p].kind not in (inspect.Parameter.VAR_KEYWORD,)]


class Kernels:
    """Node -> callable on its evaluated (non-monad) inputs, built once per node."""

    def __init__(self, references: Optional[Dict[str, Callable]] = None):
        from ms_deepseek.verification.execute import standins

        self.references = dict(standins.REFERENCES)
        self.references.update(references or {})
        self.cache: Dict[int, Callable] = {}
        self.positions: Dict[str, Tuple[int, ...]] = {}

    def call(self, node: Node, args: list):
        if node.op not in self.positions:
            self.positions[node.op] = _dtype_positions(node.op)
        args = _with_dtypes(self.positions[node.op], args)
        fn = self.cache.get(id(node))
        if fn is None:
            fn = self._build(node, args)
            if fn is None:
                return self._call_function(node, args)  # init arguments that are not constants
            self.cache[id(node)] = fn
        return fn(args)

    def _build(self, node: Node, args: list) -> Optional[Callable]:
        scalar_op = _SCALAR_OPS.get(node.op)
        if scalar_op is not None:
            return lambda a: _scalar_call(scalar_op, a)
        if node.op in self.references:
            ref = self.references[node.op]
            return lambda a: ref(node, a)
        where = node.scope or node.output
        if is_communication(node.op):
            raise ExecutionError(
                f"{node.op} at {where}: a communication primitive the executor does not run between the ranks (it "
                f"runs {', '.join(COLLECTIVES + POINT_TO_POINT)}); MindSpore's kernel would run it as if alone"
            )
        cls = _primitive_class(node.op)
        if cls is None:
            raise ExecutionError(
                f"{node.op} at {where}: no MindSpore CPU kernel and no stand-in in verification.execute.standins"
            )
        if node.kind == "function":
            names = _init_parameters(cls)
            k = len(names)
            if k == 0:
                prim = cls()
                return lambda a: prim(*a)
            if not all(_is_constant(x) for x in args[len(args) - k :]):
                return None
            prim = cls(*[python_value(x) for x in args[len(args) - k :]])
            return lambda a: prim(*a[: len(a) - k])
        names = _init_parameters(cls)
        kwargs = {n: node.attrs[n] for n in names if n in node.attrs and node.attrs[n] is not None}
        try:
            prim = cls(**kwargs)
        except TypeError as exc:
            raise ExecutionError(f"{node.op}: cannot build it from its attributes {sorted(kwargs)}: {exc}") from None
        return lambda a: prim(*a)

    def _call_function(self, node: Node, args: list):
        cls = _primitive_class(node.op)
        k = len(_init_parameters(cls))
        prim = cls(*[python_value(x) for x in args[len(args) - k :]])
        return prim(*args[: len(args) - k])


def _scalar_call(fn: Callable, args: list):
    """A scalar primitive on Python numbers; on a tensor (``LessScalar(x, 256.0)``: a tensor against a scalar,
    no CPU kernel either) elementwise in numpy, keeping the tensor's dtype for arithmetic."""
    from mindspore import Tensor

    tensors = [a for a in args if isinstance(a, Tensor)]
    if not tensors:
        return fn(*[python_value(x) for x in args])
    out = np.asarray(fn(*[a.asnumpy() if isinstance(a, Tensor) else a for a in args]))
    if out.dtype != np.bool_:
        out = out.astype(tensors[0].asnumpy().dtype)
    return Tensor(out)


def _is_constant(x) -> bool:
    from mindspore import Tensor

    return not isinstance(x, Tensor) or x.size == 1


def python_value(x):
    """An init argument as the primitive's ``__init__`` takes it (a one-element tensor as a Python scalar)."""
    from mindspore import Tensor

    if isinstance(x, Tensor):
        return x.asnumpy().item()
    return x
