"""``ms-deepseek plan``'s arguments as one typed, frozen request: ``plan.run`` builds it from the argparse namespace
and hands it on; nothing past that edge reads the namespace or changes what the command line asked for (a step
that needs another value, such as the compile's own micro-batch count, makes a changed copy with
``dataclasses.replace``)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class PlanRequest:
    # what is planned: a model searched or checked, or a recipe
    model: Optional[str] = None
    recipe: Optional[str] = None
    overrides: Tuple[str, ...] = ()
    # the checks run on a recipe
    simulate: bool = False
    compile: bool = False
    ranks: str = "default"
    layers: Optional[int] = None
    cann: Optional[str] = None
    no_eval: bool = False
    keep: Optional[str] = None
    memory: bool = False
    tolerance: float = 0.10
    execute: bool = False
    steps: Optional[int] = None
    # the workload
    npus: Optional[int] = None
    seq_len: Optional[int] = None
    global_batch: Optional[int] = None
    micro_batch_size: Optional[int] = None
    # the layout
    dp: Optional[int] = None
    tp: Optional[int] = None
    pp: Optional[int] = None
    ep: Optional[int] = None
    micro_batches: Optional[int] = None
    recompute: Optional[str] = None
    optimizer_shard: bool = False
    sequence_parallel: bool = False
    no_vocab_parallel: bool = False
    stage_layers: Optional[str] = None
    # model and precision
    compute_dtype: Optional[str] = None
    param_dtype: Optional[str] = None
    capacity_factor: Optional[float] = None
    grad_bytes: Optional[int] = None
    optimizer_bytes: Optional[int] = None
    master_bytes: Optional[int] = None
    optimizer_level: Optional[str] = None
    lora_r: Optional[int] = None
    lora_targets: Optional[str] = None
    train_router: bool = False
    quant_bits: Optional[int] = None
    quant_group_size: Optional[int] = None
    flash_attention: bool = False
    # hardware and efficiencies
    hbm_gb: Optional[float] = None
    peak_tflops: float = 313.0
    compute_efficiency: Optional[str] = None
    comm_efficiency: Optional[str] = None
    overlap: Optional[str] = None
    hbm_tbps: float = 1.6
    hccs_gbps: float = 56.0
    roce_gbps: float = 25.0
    npus_per_node: int = 8
    runtime_reserved_gb: float = 3.0
    hccl_buffer_mb: float = 200.0
    workspace_gb: float = 1.0
    # output
    top: Optional[int] = None
    json: bool = False
    # every command's (ms_deepseek.cli.main): MindSpore's warnings shown; the command owns its process
    verbose: bool = False
    owns_process: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "PlanRequest":
        """The request for the parsed command line; every option of the parser is a field (an option without
        one is a programming error, raised here rather than lost)."""
        given = vars(args)
        names = {f.name for f in dataclasses.fields(cls)}
        extra = sorted(set(given) - names)
        if extra:
            raise TypeError(f"PlanRequest has no field for the plan option(s) {', '.join(extra)}")
        values = dict(given)
        values["overrides"] = tuple(values.get("overrides") or ())
        return cls(**values)
