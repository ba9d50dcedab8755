"""``ms-deepseek convert``: checkpoints turned from one layout or format into another, streamed tensor by tensor.

* :mod:`.hf`            HF <-> ms_deepseek, dtype-preserving (:mod:`.byte_map` maps the output's bytes);
* :mod:`.sharded`       per-rank loading, pre-sharded conversion, merge back to HF, resharding;
* :mod:`.quantize`      ``convert quantize``: the int8 / int4 frozen base of QLoRA, in :mod:`.quant_format`;
* :mod:`.synthetic`     random checkpoints of any config in either layout (tests and benchmarks).
"""
