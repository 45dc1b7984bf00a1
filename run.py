"""servelab's one entry point: `python run.py [group=option ...] [key=value ...]` (see README.md)."""
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from framework.config import check_overrides, register_configs, to_objects

register_configs()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    from framework.app import UserError, run
    resolved = OmegaConf.to_container(cfg, resolve=True)
    try:
        return run(to_objects(cfg), HydraConfig.get().runtime.output_dir, resolved)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    check_overrides(sys.argv[1:])
    main()
