"""The one end of every mode driver: results.json (+ requests.jsonl, the resolved config, plots, W&B, the console
table), then the run's failure, if any, as one sentence (a UserError: exit status 2, or the point's `error` in a
multirun). Every driver returns its headline figure so sweepers can optimise it."""
from __future__ import annotations

from framework.core.errors import UserError
from framework.core.records import RequestRecord
from framework.report.metrics import failure_summary, report

HEADLINE = "output_throughput_tok_s"


def finish(cfg, out_dir: str, resolved: dict, title: str, results: dict,
           records: list[RequestRecord] | None = None, failure: str | None = None, headline: str = HEADLINE) -> float:
    """Report the run; raise its failure (given, or that of its records: any request that failed) after the figures
    are written, so a failed run still leaves what it measured."""
    report(results, out_dir, resolved, cfg.logger, title, records)
    if failure is None and records is not None:
        failure = failure_summary(records)
    if failure:
        raise UserError(failure)
    return results[headline]
