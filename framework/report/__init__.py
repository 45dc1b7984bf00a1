"""Reports over runs: plots (matplotlib PNG), the W&B mirror, and `python -m framework.report RUN_DIR...`, which
aggregates runs or a multirun into one table and its plots (see aggregate.py)."""
