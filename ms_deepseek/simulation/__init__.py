"""``plan --simulate``: the parts of a sharded layout whose semantics are ours, checked on CPU without a compile.

* :mod:`.layout`  the plan applied to the model, its strategies linted, the checkpoint slices each rank loads;
* :mod:`.moe`     one sharded MoE layer run rank by rank with the AllToAll emulated, against the unsharded layer.
"""
