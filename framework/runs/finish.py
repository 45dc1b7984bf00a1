"""The one end of every mode driver: results.json (+ requests.jsonl, the resolved config, plots, W&B, the console
table), then the run's failure, if any, as one sentence (a UserError: exit status 2, or the point's `error` in a
multirun). Every driver returns its headline figure so sweepers can optimise it."""
from __future__ import annotations

import json
import math
from typing import Any

from framework.core.errors import UserError
from framework.core.records import RequestRecord
from framework.report.metrics import failure_summary, report

HEADLINE = "output_throughput_tok_s"


def finish(cfg, out_dir: str, resolved: dict, title: str, results: dict,
           records: list[RequestRecord] | None = None, failure: str | None = None, headline: str = HEADLINE) -> float:
    """Report the run; raise its failure (given, or that of its records: any request that failed) after the figures
    are written, so a failed run still leaves what it measured."""
    report(json_safe(results), out_dir, resolved, cfg.logger, title, records)
    if failure is None and records is not None:
        failure = failure_summary(records)
    if failure:
        raise UserError(failure)
    return results[headline]


def json_safe(value: Any) -> Any:
    """`value` with every NaN or infinite float (a figure with nothing to measure: no request hit, no decode step)
    as None, so results.json is strict JSON (`null`), as other tools' parsers require."""
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def strict_json(value: Any) -> str:
    """`value` as strict JSON text (no NaN), indented, with a final newline."""
    return json.dumps(json_safe(value), indent=2, default=str, allow_nan=False) + "\n"
