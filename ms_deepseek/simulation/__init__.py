"""``plan --simulate``: the parts of a sharded layout whose semantics are ours, checked on CPU without a compile.

* :mod:`.simulate`   the plan applied to the model, its strategies linted, the checkpoint slices each rank loads;
* :mod:`.moe_layer`  one sharded MoE layer run rank by rank with the AllToAll emulated, against the unsharded layer.
"""
