"""sim.answers (framework/sim/answers.py): printable by default; `measured` draws the real engine's measured answers,
so a multi-turn conversation's next prompt holds the answer's decoded text (as the real client appends it) and the
radix cache's hit stops where that text's re-encoding first differs from the sampled ids."""
from __future__ import annotations

import json
import random

import pytest
from hydra.errors import HydraException

from framework.config import SimAnswers, compose
from framework.core.registry import WORKLOAD
from framework.runs.sim import simulate
from framework.sim import answers as answers_mod
from framework.sim.answers import MeasuredAnswers, answer_source, divergence, load, printable_answer

# 'h' 'i', 0xD4 then 0xC3 (a lead byte with no continuation: U+FFFD), 0xC3 then '!' (U+FFFD), '!', EOS (dropped):
# by hand, the text is "hi\ufffd\ufffd!", 2 + 3 + 3 + 1 = 9 bytes, and its re-encoding first differs at token 2
CRAFTED, CRAFTED_BYTES, CRAFTED_DIVERGES = [104, 105, 212, 195, 33, 257], 9, 2
TURN = ["mode=sim", "logger.mode=disabled", "logger.plots=false", "workload=multi_turn",
        "workload.num_conversations=1", "workload.turns=3", "workload.system_prompt_len=16", "workload.user_len=24",
        "workload.output_len=6", "workload.length_jitter=0", "cluster.instances=1", "sim.cost=roofline"]


def data(**over) -> dict:
    base = {"model": "tiny_mla_moe", "vocab_size": 260, "temperature": 0.0, "answers": {"0": [[1, CRAFTED]]}}
    return {**base, **over}


@pytest.fixture
def measured_file(tmp_path, monkeypatch):
    """Point sim.answers=measured at a file of the test's own (answer_source reads DEFAULT_PATH under the repo)."""
    def write(content) -> str:
        path = tmp_path / f"answers{len(list(tmp_path.iterdir()))}.json"
        path.write_text(content if isinstance(content, str) else json.dumps(content))
        monkeypatch.setattr(answers_mod, "DEFAULT_PATH", str(path))
        return str(path)
    load.cache_clear()
    yield write
    load.cache_clear()


def test_the_default_is_printable_and_reencodes_whole():
    cfg = compose([])
    assert cfg.sim.answers is SimAnswers.printable
    assert answer_source(cfg) is printable_answer
    ids = printable_answer(0, "conv-0/0", 64)
    assert all(32 <= i < 127 for i in ids) and divergence(ids) == 64


def test_a_bad_sim_answers_value_is_refused_at_start():
    with pytest.raises(HydraException) as err:
        compose(["sim.answers=sampled"])
    assert "expected one of [printable, measured]" in str(err.value.__cause__)


def test_divergence_by_hand():
    assert divergence(CRAFTED) == CRAFTED_DIVERGES
    assert divergence([104, 256, 105]) == 1           # a special vanishes from the text
    assert divergence([0xC3, 0xA9, 33]) == 3           # valid UTF-8 ("é!") survives whole


def test_measured_answers_follow_the_measured_counts_deterministically():
    draw = MeasuredAnswers([[3, [1, 2, 3]], [1, [7, 8]]])
    got = [tuple(draw(0, f"r{i}", 2)) for i in range(4000)]
    assert got == [tuple(draw(0, f"r{i}", 2)) for i in range(4000)]          # from the request id alone
    assert set(got) == {(1, 2), (7, 8)}
    assert got.count((1, 2)) / len(got) == pytest.approx(0.75, abs=0.03)
    long = draw(0, "r0", 7)                           # longer than any measured answer: measured ones continue it
    assert len(long) == 7 and all(tuple(long[i:i + 2]) in {(1, 2), (2, 3), (3, 7), (3, 1), (8, 1), (8, 7), (7, 8)}
                                  for i in range(6))


def test_a_simulated_conversation_hits_up_to_where_the_answers_text_diverges(measured_file):
    """Turn k+1's prompt is turn k's prompt, the answer's decoded text and the next user text; its cache hit is turn
    k's prompt plus the answer's tokens before the divergence (both by hand above, not by the code under test)."""
    measured_file(data())
    results = {}
    for answers in ("printable", "measured"):
        cfg = compose(TURN + [f"sim.answers={answers}"])
        _, records = simulate(cfg)
        results[answers] = sorted(records, key=lambda r: r.turn)
    cfg = compose(TURN)
    (session,) = WORKLOAD.build(cfg.workload.name, cfg.workload, cfg.seed).sessions()
    for answers, answer_bytes, hit_tokens in (("printable", 6, 6), ("measured", CRAFTED_BYTES, CRAFTED_DIVERGES)):
        recs = results[answers]
        for a, b in zip(recs, recs[1:]):
            user = len(session.turns[b.turn].text.encode())
            assert b.prompt_tokens == a.prompt_tokens + answer_bytes + user, answers
            assert b.cached_tokens == a.prompt_tokens + min(hit_tokens, 6 - 1), answers   # the last token's KV: none
    assert [r.completion_tokens for r in results["measured"]] == [6, 6, 6]    # ignore_eos: the EOS does not stop it


def test_the_shipped_answers_lower_the_multi_turn_hit_rate():
    """data/calibration/answers.json: the tiny model's answers do not survive re-encoding (its summary), so the
    same conversations hit less than with printable answers, and their prompts grow by the texts' bytes."""
    shipped = load(str(answers_mod.REPO_ROOT / answers_mod.DEFAULT_PATH))
    rows = shipped["summary"]["0"]
    assert rows["survive_whole"] < rows["answers"] and rows["text_bytes"] > rows["tokens"]
    figures = {}
    for answers in ("printable", "measured"):
        _, records = simulate(compose(TURN[:4] + ["workload.num_conversations=4", "workload.turns=3",
                                                  "cluster.instances=1", "sim.cost=roofline",
                                                  f"sim.answers={answers}"]))
        figures[answers] = (sum(r.cached_tokens for r in records), sum(r.prompt_tokens for r in records))
    assert figures["measured"][0] < figures["printable"][0]
    assert figures["measured"][1] > figures["printable"][1]


@pytest.mark.parametrize("content, error", [
    (None, "is missing"),
    ("{not json", "is not JSON"),
    ({"model": "tiny_mla_moe"}, "lacks"),
    (data(vocab_size=100), "vocab_size must be an integer >= 259"),
    (data(temperature=-1), "temperature must be a number >= 0"),
    (data(answers={}), "must map weight seeds"),
    (data(answers={"0": []}), "must be a non-empty list"),
    (data(answers={"0": [[0, CRAFTED]]}), r"times measured >= 1"),
    (data(answers={"0": [[1, []]]}), r"times measured >= 1"),
    (data(answers={"0": [[1, [104, 300]]]}), r"id 300, not a token id in \[0, 260\)"),
    (data(answers={"0": [[1, [104, 1.5]]]}), r"id 1.5, not a token id"),
    (data(model="deepseek_v3"), "holds deepseek_v3's answers"),
    (data(temperature=0.7), "sampled at temperature 0.7"),
    (data(answers={"1": [[1, CRAFTED]]}), "no answers of weight seed 0"),
])
def test_bad_measured_answers_are_refused_clearly(measured_file, tmp_path, monkeypatch, content, error):
    if content is None:
        monkeypatch.setattr(answers_mod, "DEFAULT_PATH", str(tmp_path / "absent.json"))
    else:
        measured_file(content)
    with pytest.raises(ValueError, match=error):
        answer_source(compose(["mode=sim", "sim.answers=measured"]))


def test_a_refused_file_stops_the_simulation(measured_file):
    measured_file(data(answers={"0": [[1, [104, 300]]]}))
    with pytest.raises(ValueError, match="not a token id"):
        simulate(compose(TURN + ["sim.answers=measured"]))


def test_printable_answers_are_unchanged():
    """The default's answers as before the switch (committed figures of every other experiment rest on them)."""
    rng = random.Random("0/conv-3/1")
    assert printable_answer(0, "conv-3/1", 16) == [32 + b % 95 for b in rng.randbytes(16)]
