"""Reports over runs: plots (matplotlib PNG), the W&B mirror, and `python -m framework.report RUN_DIR...`, which
compares any runs (single runs, multiruns) in one table and a plot per metric, each run named by its overrides
(see aggregate.py)."""
