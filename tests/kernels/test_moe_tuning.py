"""get_config: file lookup by (E, N, device), nearest M key, default fallback, and the shipped files are valid."""

import json

import pytest

from kernels.tuning import CONFIG_DIR, config_file_name, default_config, get_config, load_configs, validate_config


def test_shipped_files_load_and_are_valid():
    files = sorted(CONFIG_DIR.glob("E=*,N=*,device_name=*.json"))
    names = {f.name for f in files}
    assert {"E=8,N=64,device_name=NVIDIA_H200.json", "E=64,N=1408,device_name=NVIDIA_H200.json"} <= names
    for f in files:
        for m, cfg in json.loads(f.read_text()).items():
            assert int(m) >= 1
            validate_config(cfg, f.name)


def test_nearest_m_key():
    table = load_configs(64, 1408, "NVIDIA H200")
    assert table is not None
    assert get_config(64, 1408, "NVIDIA H200", 1) == table[1]
    assert get_config(64, 1408, "NVIDIA_H200", 100) == table[96]  # |100-96| < |100-128|
    assert get_config(64, 1408, "NVIDIA H200", 10**6) == table[max(table)]
    assert get_config(64, 1408, "NVIDIA H200", 20) == table[16]  # tie between 16 and 24 -> smaller


def test_fallback_to_default(tmp_path):
    assert get_config(8, 64, "cpu", 4) == default_config(8, 4)
    assert get_config(8, 64, "cpu", 4)["BLOCK_SIZE_M"] == 16
    assert get_config(8, 64, "cpu", 1000)["BLOCK_SIZE_M"] == 64
    assert get_config(7, 64, "NVIDIA H200", 4) == default_config(7, 4)  # no file for E=7
    assert get_config(8, 64, "NVIDIA H200", 4, config_dir=tmp_path) == default_config(8, 4)
    # float32 looks for a ",dtype=float32" file: the shipped (16-bit) H200 tables do not apply
    assert get_config(8, 64, "NVIDIA H200", 4, dtype="float32") == default_config(8, 4)
    assert get_config(8, 64, "NVIDIA H200", 4) != default_config(8, 4)


def test_custom_dir_and_bad_file(tmp_path):
    good = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 4, "num_warps": 4,
            "num_stages": 3}
    (tmp_path / config_file_name(4, 32, "Some GPU")).write_text(json.dumps({"16": good}))
    assert get_config(4, 32, "Some GPU", 5, config_dir=tmp_path) == good
    (tmp_path / config_file_name(4, 48, "Some GPU")).write_text(json.dumps({"16": dict(good, BLOCK_SIZE_N=48)}))
    with pytest.raises(ValueError, match="BLOCK_SIZE_N=48 must be a power of two"):
        get_config(4, 48, "Some GPU", 5, config_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown keys \\['BLOCK_M'\\]"):
        validate_config(dict(good, BLOCK_M=16))


def test_tuner_writes_a_file_get_config_reads(tmp_path):
    """The tuner's plumbing under the interpreter on CPU (timings are meaningless there): an invalid candidate is
    skipped, not fatal; the file it writes is what get_config reads, merged into an existing one."""
    import torch

    from kernels.tune_fused_moe import tune, write_configs

    good = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=16, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
    candidates = [dict(good, BLOCK_SIZE_N=48), good]  # 48: not a power of two, rejected and skipped
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = tune(4, 16, 32, 2, torch.float32, device, batch_sizes=(1, 5), candidates=candidates, repeats=1)
    assert result["tried"] == 2 and result["skipped"] == 1
    assert sorted(result["table"]) == [1, 5] and all(cfg == good for cfg in result["table"].values())
    for timing in result["timings"].values():
        assert timing["ms"] > 0 and timing["weight_gbs"] > 0 and timing["shipped_ms"] > 0
    old = dict(good, BLOCK_SIZE_N=64)
    (tmp_path / "E=4,N=16,device_name=Test_Device,dtype=float32.json").write_text(json.dumps({"5": old, "64": old}))
    path = write_configs(result["table"], 4, 16, "Test Device", tmp_path, dtype=torch.float32)
    assert path.name == "E=4,N=16,device_name=Test_Device,dtype=float32.json"
    assert json.loads(path.read_text()) == {"1": good, "5": good, "64": old}   # tuned keys replaced, others kept
    assert get_config(4, 16, "Test Device", 4, config_dir=tmp_path, dtype="float32") == good
    assert get_config(4, 16, "Test Device", 4, config_dir=tmp_path) == default_config(4, 4)  # 16-bit: no file


def test_tuner_budget_and_candidate_order():
    import torch

    from kernels.tune_fused_moe import AXES, search_space, tune

    space = search_space()
    assert len(space) == len({tuple(c.values()) for c in space}) == 768
    assert space[0] == {axis: values[0] for axis, values in AXES.items()}   # the preferred value of every axis first
    for config in space:
        validate_config(config)
    # a spent budget still tries one candidate, so every batch size gets a config
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    small = [dict(space[0], BLOCK_SIZE_N=16, BLOCK_SIZE_K=16), dict(space[0], BLOCK_SIZE_N=32, BLOCK_SIZE_K=16)]
    result = tune(4, 16, 32, 2, torch.float32, device, batch_sizes=(3,), candidates=small, budget_s=0.0, repeats=1)
    assert result["tried"] == 1 and result["table"] == {3: small[0]}
