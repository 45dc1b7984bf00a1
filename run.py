"""servelab's one entry point: `python run.py [group=option ...] [key=value ...]` (see README.md)."""
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from framework.config import check_overrides, group_overrides, refuse_ignored_keys, register_configs, to_objects

register_configs()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    from framework.app import run
    from framework.core.errors import UserError
    from framework.multirun import in_multirun, name_run, record_failure
    hydra_cfg = HydraConfig.get()
    resolved = OmegaConf.to_container(cfg, resolve=True)
    try:
        objects = to_objects(cfg)
        refuse_ignored_keys(objects, hydra_cfg.overrides.task)   # a key this run would ignore: one sentence, exit 2
        if objects.mode.value == "sim":       # millions of live objects at scale: no full GC re-scans of them
            from framework.serving.http.server_base import tune_gc_for_serving
            tune_gc_for_serving()
        name_run(objects.logger, hydra_cfg)
        return run(objects, hydra_cfg.runtime.output_dir, resolved)
    except Exception as e:
        if in_multirun(hydra_cfg):     # one failed point: results.json says why, the sweep goes on
            return record_failure(hydra_cfg.runtime.output_dir, e, resolved)
        if not isinstance(e, UserError):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    sys.argv[1:] = group_overrides(sys.argv[1:])      # `sim.cost=roofline` as users type it
    check_overrides(sys.argv[1:])
    main()
