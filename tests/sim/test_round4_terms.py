"""Issue 19, round 4: round 3's setup and 2024 SGLang's own host work, measured by experiments/sglang035_host and
committed in data/calibration/sglang035_host_*.json, on every cell (PR #2170's v0.4 workers stream the same way)."""
import json
from pathlib import Path

import pytest

from framework.config import compose
from framework.runs.sim import simulate
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[2]


def test_round4_is_round3_with_the_measured_host_work_on_every_cell():
    predict = load_script("experiments/sim_repro/predict.py")
    (exp3, per3), (exp4, per4) = predict.SETUPS[3], predict.SETUPS[4]
    assert exp4 == exp3 and per4["dp_attn"] == per3["dp_attn"]
    assert per4["all"] == per3["all"] + ["<host_2024>"] and predict.ROUTER_SETUPS[4] == ["<host_2024>"]
    dec = json.loads((ROOT / "data/calibration/sglang035_host_decode.json").read_text())
    host = dict(o.removeprefix("sim.cost.").split("=") for o in predict.host_2024())
    assert float(host["host_output_token_us"]) == pytest.approx(dec["scheduler_decode"]["per_output_token_us"], 1e-3)
    assert float(host["stream_us_per_chunk"]) == pytest.approx(
        dec["chunk_fits"]["tokenizer_manager_http"]["per_chunk_us"], 1e-3)
    # the TokenizerManager is the slowest front-end process for PR #1970's outputs (up to 512 tokens)
    fits = dec["chunk_fits"]
    for n in (1, 256, 512):
        tm = fits["tokenizer_manager_http"]["per_chunk_us"] + n * fits["tokenizer_manager_http"]["per_output_token_us"]
        assert all(tm >= f["per_chunk_us"] + n * f["per_output_token_us"] for f in fits.values())
    cfg = compose(predict.expand(["experiment=pr1970_nov2024", "parallel=tp"] + per4["all"]))
    assert cfg.sim.cost.fused_moe_rates is True and cfg.sim.cost.host_output_token_us > 0
    # round 5: round 4's with the decode run measured at PR #1970's own 10,000 prompts
    exp5, per5 = predict.SETUPS[5]
    assert (exp5, per5["dp_attn"]) == (exp4, per4["dp_attn"]) and per5["all"] == per3["all"] + ["<host_2024_10k>"]
    ten_k = json.loads((ROOT / "data/calibration/sglang035_host_decode_10k.json").read_text())
    assert ten_k["settings"]["num_prompts"] == 10000 and ten_k["scheduler_decode"]["running_max"] >= 1000
    # round 6: round 5's, a request's extend and front-end work split by two prompt lengths (512, 128): the split
    # prices each prefill run's own extends and requests as measured
    exp6, per6 = predict.SETUPS[6]
    assert per6["all"] == per3["all"] + ["<host_2024_split>"] and per6["dp_attn"] == per4["dp_attn"]
    split = dict(o.removeprefix("sim.cost.").split("=") for o in predict.expand(["<host_2024_split>"]))
    for name in ("sglang035_host_prefill.json", "sglang035_host_prefill_128.json"):
        pre = json.loads((ROOT / "data/calibration" / name).read_text())
        ext, prompt = pre["scheduler_extend"], pre["input_tokens"] / pre["settings"]["num_prompts"]
        priced = (float(split["host_step_us"]) + float(split["host_new_req_us"]) * ext["requests_median"]
                  + float(split["host_new_token_us"]) * ext["new_tokens_median"])
        assert priced == pytest.approx(ext["cpu_per_step_ms_median"] * 1e3, rel=1e-3)
        front = float(split["tokenize_us_per_request"]) + float(split["tokenize_us_per_token"]) * prompt
        assert front + float(split["stream_us_per_chunk"]) == pytest.approx(
            pre["cpu_us_per_request"]["tokenizer_manager_http"], rel=1e-3)


def test_rounds_4_and_5_still_derive_the_overrides_they_registered():
    predict = load_script("experiments/sim_repro/predict.py")
    for rnd, key in ((4, "<host_2024>"), (5, "<host_2024_10k>")):
        registered = json.loads((ROOT / f"experiments/sim_repro/predictions_round{rnd}.json").read_text())
        for cell in registered["cells"]:
            host = [o for o in cell["overrides"] if o.split("=")[0].split(".")[-1] in predict.HOST_KEYS]
            assert host == predict.expand([key]), (rnd, cell["cell"])


def test_streaming_the_output_so_far_slows_a_long_decode_more_than_a_short_one():
    """The per-output-token terms grow a request's cost through its life: with them a run of long answers loses
    more throughput than one of short answers (the same tokens in all)."""
    def tput(output_len, extra):
        base = ["experiment=pr1970_nov2024", "parallel=tp", "workload.input_len=1",
                f"workload.output_len={output_len}", f"workload.num_prompts={65536 // output_len}"]
        return simulate(compose(base + extra))[0]["output_throughput_tok_s"]
    plain = {n: tput(n, []) for n in (32, 512)}
    for grow in (["sim.cost.host_output_token_us=0.07"], ["sim.cost.stream_us_per_output_token=0.5"]):  # each alone
        short, long = (tput(n, grow) / plain[n] for n in (32, 512))
        assert long < short < 1.0, grow
