"""The load generator's arrivals (gamma / Poisson) and datasets (random, ShareGPT) against their definitions."""
from __future__ import annotations

import gzip
import json
import statistics

import pytest

from framework.core.registry import WORKLOAD
from plugins.workload.random import RandomConfig
from plugins.workload.sharegpt import MIN_LEN, ShareGPTConfig


def arrivals(**kw) -> list[float]:
    return [s.arrival_s for s in WORKLOAD.build("random", RandomConfig(input_len=4, output_len=2, **kw), 0).sessions()]


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_gamma_arrivals_have_the_rate_and_the_burstiness(burstiness):
    """Gaps of mean 1/rate and squared coefficient of variation 1/shape (1: Poisson), the first request at 0."""
    t = arrivals(num_prompts=4000, request_rate=20.0, burstiness=burstiness)
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert t[0] == 0.0 and all(g >= 0 for g in gaps)
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / 20.0, rel=0.08)
    assert statistics.pvariance(gaps) / mean ** 2 == pytest.approx(1 / burstiness, rel=0.15)


def test_rate_zero_sends_everything_at_once_and_bad_values_are_refused():
    assert set(arrivals(num_prompts=5)) == {0.0}
    for kw, msg in ((dict(burstiness=0.0), "burstiness"), (dict(request_rate=-1.0), "request_rate"),
                    (dict(max_concurrency=-2), "max_concurrency"), (dict(range_ratio=1.5), "range_ratio")):
        with pytest.raises(ValueError, match=msg):
            arrivals(num_prompts=2, **kw)


def test_random_lengths_are_uniform_in_the_range():
    ss = WORKLOAD.build("random", RandomConfig(num_prompts=400, input_len=100, output_len=20, range_ratio=0.5), 3
                        ).sessions()
    ins, outs = [len(s.prompt(0, [])) for s in ss], [s.turns[0].max_new_tokens for s in ss]
    assert min(ins) >= 50 and max(ins) <= 100 and min(outs) >= 10 and max(outs) <= 20
    assert max(ins) - min(ins) > 40                              # spread over the range, not stuck at one end
    assert len({s.prompt(0, [])[:8] for s in ss}) == len(ss)      # random prompts share no prefix
    exact = WORKLOAD.build("random", RandomConfig(num_prompts=5, input_len=33, output_len=7, range_ratio=1.0), 0)
    assert {(len(s.prompt(0, [])), s.turns[0].max_new_tokens) for s in exact.sessions()} == {(33, 7)}


def conv(*texts: str) -> dict:
    return {"conversations": [{"from": "human" if i % 2 == 0 else "gpt", "value": t} for i, t in enumerate(texts)]}


DATA = [conv("hello there", "general kenobi!"),            # kept: 11 and 15 tokens
        conv("hi", "a long enough answer"),                # dropped: prompt under MIN_LEN
        conv("a question", "no"),                          # dropped: answer under MIN_LEN (kept with output_len)
        conv("only one message"),                          # dropped: fewer than 2 messages
        conv("x" * 2000, "y" * 10),                        # dropped: prompt over max_prompt_len
        conv("q" * 1000, "r" * 1100),                      # dropped: prompt + output over max_total_len
        conv("turn one?", "answer one", "turn two?", "answer two", "tw", "short")]   # kept; 3rd exchange fails


def sharegpt(tmp_path, name="d.json", data=DATA, **kw):
    path = tmp_path / name
    raw = json.dumps(data).encode()
    path.write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)
    return WORKLOAD.build("sharegpt", ShareGPTConfig(path=str(path), num_prompts=0, **kw), 0).sessions()


def test_sharegpt_samples_as_sglang_does(tmp_path):
    ss = sharegpt(tmp_path)
    got = sorted((s.prompt(0, []), s.turns[0].max_new_tokens) for s in ss)
    assert got == [("hello there", len("general kenobi!")), ("turn one?", len("answer one"))]
    assert all(len(s.turns) == 1 and not s.carry_history for s in ss)
    fixed = sharegpt(tmp_path, output_len=9)                 # a fixed output length: short answers no longer drop
    assert sorted(s.prompt(0, []) for s in fixed) == ["a question", "hello there", "q" * 1000, "turn one?"]
    assert {s.turns[0].max_new_tokens for s in fixed} == {9}
    assert MIN_LEN == 4


def test_sharegpt_multi_turn_keeps_exchanges_with_history(tmp_path):
    ss = sharegpt(tmp_path, "d.jsonl.gz", multi_turn=True, output_scale=0.5, max_output_len=4)
    (long,) = [s for s in ss if len(s.turns) > 1]
    assert [t.text for t in long.turns] == ["turn one?", "turn two?"] and long.carry_history
    assert [t.max_new_tokens for t in long.turns] == [4, 4]     # 10 * 0.5 = 5, capped at 4
    assert long.prompt(1, ["ANSWER"]) == "turn one?ANSWERturn two?"
    assert long.messages(1, ["ANSWER"]) == [{"role": "user", "content": "turn one?"},
                                            {"role": "assistant", "content": "ANSWER"},
                                            {"role": "user", "content": "turn two?"}]


def test_sharegpt_num_prompts_and_errors(tmp_path):
    assert len(sharegpt(tmp_path, data=[conv(f"prompt {i}", "an answer") for i in range(10)], )) == 10
    assert len(WORKLOAD.build("sharegpt", ShareGPTConfig(path=str(tmp_path / "d.json"), num_prompts=3), 0)
               .sessions()) == 3
    with pytest.raises(ValueError, match="entry 1 is not"):
        sharegpt(tmp_path, data=[conv("fine prompt", "fine answer"), {"conversations": "nope"}])
    with pytest.raises(ValueError, match="no conversation passes the filters"):
        sharegpt(tmp_path, data=[conv("hi", "no")])
    with pytest.raises(FileNotFoundError, match="synthetic_sharegpt"):
        WORKLOAD.build("sharegpt", ShareGPTConfig(path="missing.json"), 0).sessions()


def test_the_shipped_sample_runs_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ss = WORKLOAD.build("sharegpt", ShareGPTConfig(num_prompts=50), 0).sessions()
    assert len(ss) == 50 and all(MIN_LEN <= len(s.prompt(0, [])) <= 1024 for s in ss)
