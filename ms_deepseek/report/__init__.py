"""A training run's metrics, read and judged: the alert rules and the health report.

* :mod:`.metrics_io`  reading ``metrics.jsonl`` (the records a run writes, a file still being written);
* :mod:`.alerts`      the alert rules, run live by the trainer's log and over a whole file by the report;
* :mod:`.html` and :mod:`.svg`  ``ms-deepseek report RUN_DIR``: the self-contained HTML page and its charts.
"""
