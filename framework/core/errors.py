"""One exception family for what a run cannot do because of what was asked or what the machine allows. `run.py`
prints a `UserError` as one sentence and exits with status 2 (a multirun records it as the point's `error`); any
other exception is a bug and keeps its traceback."""
from __future__ import annotations


class UserError(Exception):
    """A problem with what the user asked for, or with the machine under it: one sentence, exit status 2."""


class ClusterError(UserError):
    """A cluster could not start or serve: a port in use, a worker that failed or did not come up, a request lost."""
