"""What the executor (ms_deepseek.verification.execute.executor) refuses rather than guesses: an attribute that did not decode
when something reads it, a primitive with neither a MindSpore CPU kernel nor a stand-in, and a communication
primitive it does not run between the ranks (MindSpore's single-process kernel would run it as if alone). The
programs are MindIR built here field by field, as MindSpore writes them (mindspore/train/mind_ir_pb2.py)."""

import numpy as np
import pytest
from mindspore import Tensor
from mindspore.common import dtype as mstype
from mindspore.train import mind_ir_pb2 as pb

from ms_deepseek.verification.execute import executor as ex
from ms_deepseek.verification.execute import scheduler as xr

X = np.array([[3.0, 1.0, 2.0], [0.5, 4.0, -1.0]], np.float32)


def _attr(name, kind, value=None):
    attr = pb.AttributeProto(name=name, type=getattr(pb.AttributeProto, kind))
    if kind == "INT64":
        attr.i = value
    elif kind == "BOOL":
        attr.i = int(value)
    elif kind == "STRING":
        attr.s = value.encode()
    return attr  # DICT: a type the executor does not decode


def _program(op, attrs, prim_type="PRIMITIVE"):
    """One primitive node ``y = op(x)`` in a MindIR model."""
    model = pb.ModelProto()
    prim = model.primitives.add(
        name="p0", op_type=op, instance_name=op, prim_type=getattr(pb.PrimitiveProto, prim_type)
    )
    prim.attribute.extend(attrs)
    model.graph.node.add(op_type="REF::p0", input=["x"], output=["y"], domain=f"test/{op}-op0")
    model.graph.input.add(name="x")
    model.graph.output.add(name="y")
    return ex.RankProgram.from_bytes(0, model.SerializeToString())


def _run(program, kernels=None):
    env = {"x": Tensor(X)}
    xr.run_ranks([program], [env], 1, kernels)
    return env["y"]


def test_an_undecoded_attribute_is_refused_when_a_primitive_is_built_from_it():
    program = _program("Sort", [_attr("axis", "INT64", -1), _attr("descending", "DICT")])
    with pytest.raises(
        ex.ExecutionError, match=r"rank 0: Sort at test/Sort-op0: its attribute 'descending' of MindIR type DICT"
    ):
        _run(program)


def test_an_undecoded_attribute_nobody_reads_is_tolerated():
    program = _program(
        "Sort", [_attr("axis", "INT64", -1), _attr("descending", "BOOL", True), _attr("in_strategy", "DICT")]
    )
    assert isinstance(dict(program.nodes[0].attrs)["in_strategy"], ex.Undecoded)
    values, _ = _run(program)
    np.testing.assert_array_equal(values.asnumpy(), -np.sort(-X, axis=-1))


def test_a_stand_in_reading_an_undecoded_attribute_is_refused():
    program = _program("Custom", [_attr("func_type", "STRING", "aot"), _attr("func_name", "DICT")])
    with pytest.raises(
        ex.ExecutionError, match=r"Custom at test/Custom-op0: its attribute 'func_name' of MindIR type DICT"
    ):
        _run(program)


def test_a_type_attribute_decodes_to_its_dtype():
    """MindIR stores a type-valued attribute (Receive's dtype) as one TensorProto holding only its data type."""
    attr = pb.AttributeProto(name="dtype", type=pb.AttributeProto.TENSORS)
    attr.tensors.add(data_type=pb.TensorProto.FLOAT16, name="value0")
    assert ex.attribute_value(attr) == mstype.float16
    attr.tensors[0].data_type = pb.TensorProto.BFLOAT16
    assert ex.attribute_value(attr) == mstype.bfloat16


def test_a_primitive_without_a_cpu_kernel_or_a_stand_in_is_refused_by_name():
    kernels = ex.Kernels()
    del kernels.references["SoftmaxBackward"]
    node = ex.Node("y", "SoftmaxBackward", "function", {}, ["x", "x", "dim"], scope="model/attn/SoftmaxBackward-op2")
    program = ex.RankProgram(0, {"dim": -1}, {}, ["x"], [node], "y")
    with pytest.raises(
        ex.ExecutionError,
        match=r"rank 0: SoftmaxBackward at model/attn/SoftmaxBackward-op2: no MindSpore CPU kernel and no stand-in",
    ):
        _run(program, kernels)
    with pytest.raises(ex.ExecutionError, match=r"NoSuchOp at test/NoSuchOp-op0: no MindSpore CPU kernel"):
        _run(_program("NoSuchOp", []))


@pytest.mark.parametrize(
    "op, prim_type",
    [
        ("Reduce", "PRIMITIVE"),  # mindspore.ops.operations.comm_ops
        ("_MirrorOperator", "PRIMITIVE"),
        ("NeighborExchange", "PRIMITIVE"),
        ("InnerCommAllReduce", "PRIMITIVE_FUNCTION"),  # gen_ops_prim, named like a collective
        ("MatmulReduceScatter", "PRIMITIVE_FUNCTION"),
    ],
)
def test_communication_the_executor_does_not_run_between_ranks_is_refused(op, prim_type):
    program = _program(op, [_attr("op", "STRING", "sum"), _attr("dest_rank", "INT64", 0)], prim_type)
    with pytest.raises(ex.ExecutionError, match=rf"rank 0: {op} at test/{op}-op0: a communication primitive"):
        _run(program)
