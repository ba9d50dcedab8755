"""``plan --recipe R --compile``: MindSpore's compiler judges a recipe's sharded layout.

* :mod:`.check`     selects the ranks, runs a worker per rank, checks what came back, formats the report;
* :mod:`.worker`    the per-rank process: builds the recipe as ``train`` does and compiles its graphs;
* :mod:`.ir_rules`  rules read from the dumped IR (folded constants, gathered heads, recompute regions);
* :mod:`.traffic`   the collectives and bytes MindSpore inserted, per group and kind;
* :mod:`.memory_accounting`  ``--memory``: MindSpore's level-1 accounting of the device memory, beside the planner.
"""
