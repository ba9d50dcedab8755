"""``plan --recipe R --execute``: the compiled per-rank programs, executed on CPU, judged against one device.

* :mod:`.check`       the whole check: set-up, compile, one-device run, execution, comparison, verdict;
* :mod:`.setup`       the reduced recipe, each rank's batches and the one-device batch, a rank's slice;
* :mod:`.executor`    the executor: a rank's compiled MindIR program run node by node on CPU;
* :mod:`.scheduler`   all ranks run together, their point-to-point messages and collectives between them;
* :mod:`.standins`    CPU stand-ins for primitives MindSpore implements on Ascend only;
* :mod:`.one_device`  the one-device side: the product's own run of the reduced recipe, in its own process;
* :mod:`.compare`     every update, loss and tensor of the ranks against the one device, with tolerances;
* :mod:`.cache`       reuse of a one-device run between checks that would compute it alike;
* :mod:`.execution_error`  the executor's one error type.
"""
