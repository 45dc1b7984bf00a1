"""`python -m framework.report RUN_DIR... [--out DIR] [--wandb offline]`: one table and its plots over runs."""
import sys

from framework.report.aggregate import main

sys.exit(main())
