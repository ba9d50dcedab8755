"""Checks that run MindSpore itself on any machine before cluster time: no NPU, no CANN, no weights.

* :mod:`.compile`  ``plan --recipe R --compile``: MindSpore's compiler on each selected rank's sharded
  graphs under its dry run; the compiled layouts against the plan, the collectives it inserted, the IR
  rules, and (``--memory``) its level-1 memory accounting beside the planner;
* :mod:`.executor`  ``plan --recipe R --execute``: the compiled per-rank programs run on CPU by the
  executor (:mod:`.executor.executor`), their collectives done between them, and compared with the
  product's one-device run of the same recipe;
* :mod:`.dryrun`   what both share: the reduced recipe a rank compiles, the parallel section it is
  given as ``--set`` strings, one simulated rank's environment and where its IR is dumped;
* :mod:`.cann_stubs`  the stub CANN libraries that let MindSpore's Ascend plugin load without CANN.
"""
