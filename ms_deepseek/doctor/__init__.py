"""``ms-deepseek doctor``: preflight checks of a host, a node or a cluster before a job is started on it.

* :mod:`.core`   the check registry, results and run context; :mod:`.probe` what a check reads of the system;
* :mod:`.host`   one host and device (level 1): Python, MindSpore and CANN pins, NPU state, the smoke run;
* :mod:`.node`   one node (level 8): the devices, HCCS links and the collective benchmark;
* :mod:`.pins`   the pinned versions; :mod:`.npu_parse` ``npu-smi`` output;
* :mod:`.smoke` and :mod:`.collective_bench`  the programs doctor starts (a short training run; msrun workers).
"""
