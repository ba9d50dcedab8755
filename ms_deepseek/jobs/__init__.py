"""A job's processes on a shared cluster: supervision, signals, the run folder's lease, heartbeats, collectives.

* :mod:`.supervise`    ``launch`` watches msrun and stops the whole job when a worker dies or a signal comes;
* :mod:`.processes`    the job's processes on this node, read from /proc, and how to stop every one;
* :mod:`.lease`        one writer per run folder (``RUN_DIR/.lease``), taken over only from a dead holder;
* :mod:`.preempt`      a stop signal turned into a save at the next step boundary, and the workers' heartbeats;
* :mod:`.distributed`  the collective group of the workers and the small collectives around the step.
"""
