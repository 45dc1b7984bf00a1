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
    """The tuner's plumbing under the interpreter on CPU (timings are meaningless there); an invalid candidate is
    skipped, not fatal."""
    import torch

    from kernels.tune_fused_moe import search_space, tune, write_configs

    candidates = [dict(c, BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, GROUP_SIZE_M=1) for c in search_space(quick=True)[:1]]
    candidates.append(dict(candidates[0], BLOCK_SIZE_N=48))  # not a power of two: rejected, skipped
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    table = tune(4, 16, 32, 2, torch.float32, device, batch_sizes=(1, 5), candidates=candidates, repeats=1)
    assert sorted(table) == [1, 5] and all(cfg == candidates[0] for cfg in table.values())
    path = write_configs(table, 4, 16, "Test Device", tmp_path, dtype=torch.float32)
    assert path.name == "E=4,N=16,device_name=Test_Device,dtype=float32.json"
    assert get_config(4, 16, "Test Device", 4, config_dir=tmp_path, dtype="float32") == candidates[0]
    assert get_config(4, 16, "Test Device", 4, config_dir=tmp_path) == default_config(4, 4)  # 16-bit: no file
    assert len(search_space()) == 384 and len(search_space(quick=True)) == 16
