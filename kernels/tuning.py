"""Launch settings for ``fused_moe_kernel``: data on disk, keyed by shape and device, never sniffed from hardware.

Files in ``kernels/configs/`` follow vLLM's naming, ``E={E},N={N},device_name={device_name}.json``, where E is the
number of (local) experts, N the expert intermediate size held by this rank (``w2.shape[-1]``, i.e. I, or I/tp when
the intermediate dim is sliced) and device_name is what the caller got from ``torch.cuda.get_device_name()`` with
spaces replaced by underscores. As in vLLM, float32 runs look for a file with a ``,dtype=float32`` suffix (tiles
tuned for 16-bit inputs can overflow shared memory at 4 bytes per element); 16-bit runs use the plain name. Each file maps a batch size M (number of tokens, as a string key) to a dict with
BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "configs"
CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")


def config_file_name(E: int, N: int, device_name: str, dtype: str | None = None) -> str:
    suffix = f",dtype={dtype}" if dtype else ""
    return f"E={E},N={N},device_name={device_name.replace(' ', '_')}{suffix}.json"


def default_config(E: int, M: int) -> dict[str, int]:
    """vLLM's fallback when no tuned file exists: small tiles for decode-sized batches (M <= E, each expert sees
    about one token), larger grouped tiles otherwise."""
    if M <= E:
        return {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1,
                "num_warps": 4, "num_stages": 2}
    return {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 8,
            "num_warps": 4, "num_stages": 2}


def validate_config(config: dict, where: str = "config") -> dict[str, int]:
    missing = [k for k in CONFIG_KEYS if k not in config]
    unknown = [k for k in config if k not in CONFIG_KEYS]
    if missing or unknown:
        raise ValueError(f"{where}: missing keys {missing}, unknown keys {unknown}; allowed keys are {list(CONFIG_KEYS)}")
    for key in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"):
        value = config[key]
        # tl.dot needs every tile dim >= 16 and tl.arange needs powers of two.
        if not isinstance(value, int) or value < 16 or value & (value - 1):
            raise ValueError(f"{where}: {key}={value!r} must be a power of two >= 16")
    for key in ("GROUP_SIZE_M", "num_warps", "num_stages"):
        if not isinstance(config[key], int) or config[key] < 1:
            raise ValueError(f"{where}: {key}={config[key]!r} must be a positive int")
    return dict(config)


@functools.lru_cache(maxsize=None)
def load_configs(
    E: int, N: int, device_name: str, config_dir: str | None = None, dtype: str | None = None
) -> dict[int, dict[str, int]] | None:
    """The M -> config table of the matching file, or None when no file matches."""
    path = Path(config_dir or CONFIG_DIR) / config_file_name(E, N, device_name, dtype)
    if not path.is_file():
        return None
    table = json.loads(path.read_text())
    return {int(m): validate_config(cfg, f"{path.name}[{m}]") for m, cfg in table.items()}


def get_config(
    E: int, N: int, device_name: str, M: int, config_dir: str | None = None, dtype: str | None = None
) -> dict[str, int]:
    """Launch settings for M tokens: the entry of the matching file whose M key is nearest (ties go to the smaller
    key), else ``default_config(E, M)`` (always the case for device_name "cpu"). ``dtype``: None for 16-bit inputs,
    "float32" for float32 ones. Returns a fresh dict."""
    table = load_configs(E, N, device_name, None if config_dir is None else str(config_dir), dtype)
    if not table:
        return default_config(E, M)
    nearest = min(table, key=lambda m: (abs(m - M), m))
    return dict(table[nearest])
