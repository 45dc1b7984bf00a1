"""servelab_oot: a third-party package with one servelab plugin of each kind, as a user would write it outside the
repository (tests/extension/test_out_of_tree.py installs it through a dist-info and runs each with run.py).

Its `servelab.plugins` entry point names `register`: servelab calls it once per process (run.py, every worker, every
rank) before the first registry lookup that misses; importing the modules runs their decorators. Hydra finds the
YAML files with `hydra.searchpath=[pkg://servelab_oot.conf]`.
"""


def register() -> None:
    from servelab_oot import cost, moe, parallelism, routing, workload  # noqa: F401 - the decorators register
