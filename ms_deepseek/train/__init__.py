"""A training run of a recipe: the trainer and the parts it is built from.

* :mod:`.trainer`      recipe -> trained model: the run's phases and the step loop;
* :mod:`.build`        this rank's data, the model, the optimizer and the compiled step;
* :mod:`.context`      what a run is given: the recipe, the run folder, the rank, the options;
* :mod:`.parallelism`  the layout strategy: data parallel or sharded (SEMI_AUTO_PARALLEL);
* :mod:`.step`, :mod:`.optim`, :mod:`.schedules`  the train step, AdamW, the learning-rate schedules;
* :mod:`.lora_run`     the model converter: a full model, or LoRA / QLoRA on a frozen base;
* :mod:`.components`, :mod:`.resume`  counters, RNG, throughput, checkpointing and resuming;
* :mod:`.evaluate`, :mod:`.preflight`, :mod:`.metrics`, :mod:`.run_log`  validation, the refusals before
  anything is built, the metrics file and the console.

A job's processes, signals, lease and heartbeats are :mod:`ms_deepseek.jobs`'; the alert rules and the metrics
readers are :mod:`ms_deepseek.report`'s.
"""
