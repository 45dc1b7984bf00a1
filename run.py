"""servelab's one entry point: `python run.py [group=option ...] [key=value ...]` (see README.md)."""
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from framework.config import (check_overrides, group_overrides, print_help, refuse_ignored_keys, refuse_schema_choices,
                              register_configs, to_objects)

register_configs()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    from framework.app import run
    from framework.core.errors import UserError
    from framework.multirun import in_multirun, name_run
    from framework.runlog import console_to_log, record_error
    hydra_cfg = HydraConfig.get()
    out_dir = hydra_cfg.runtime.output_dir
    resolved = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)    # config.json: "mode": "bench"
    with console_to_log(out_dir):               # run.log: what the run prints, after Hydra's log lines
        try:
            refuse_schema_choices(hydra_cfg.runtime.choices)
            objects = to_objects(cfg)
            refuse_ignored_keys(objects, hydra_cfg.overrides.task)   # a key this run would ignore: one sentence
            if objects.mode.value == "sim":   # millions of live objects at scale: no full GC re-scans of them
                from framework.serving.http.server_base import tune_gc_for_serving
                tune_gc_for_serving()
            name_run(objects.logger, hydra_cfg)
            return run(objects, out_dir, resolved)
        except Exception as e:
            message, path = record_error(out_dir, e, resolved)     # the run's folder says why it failed
            if in_multirun(hydra_cfg):      # one failed point: the sweep goes on (NaN: a failed trial)
                print(f"error: {message} (recorded in {path}; the multirun goes on)", file=sys.stderr)
                return float("nan")
            if not isinstance(e, UserError):
                raise                       # a bug: its traceback, also in error.txt
            print(f"error: {message} (recorded in {path})", file=sys.stderr)
            sys.exit(2)


if __name__ == "__main__":
    sys.argv[1:] = group_overrides(sys.argv[1:])      # `sim.cost=roofline` as users type it
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print_help(sys.argv[1:])                     # the groups' options, without the schemas Hydra would list
        sys.exit(0)
    check_overrides(sys.argv[1:])
    main()
