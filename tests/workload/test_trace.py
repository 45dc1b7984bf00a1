"""workload=trace: Mooncake-format replay; equal hash ids must mean equal text, and only they."""
import gzip
import json
import math

import pytest

from framework.core.registry import WORKLOAD
from framework.contracts.workload import REPO_ROOT
from plugins.workload.trace import DEFAULT_TRACE, TraceConfig, read_trace, resolve_trace_path

ROWS = [
    {"timestamp": 1000, "input_length": 1200, "output_length": 100, "hash_ids": [0, 1, 2]},
    {"timestamp": 1500, "input_length": 1500, "output_length": 40, "hash_ids": [0, 1, 3]},
    {"timestamp": 3000, "input_length": 300, "output_length": 10, "hash_ids": [0]},
    {"timestamp": 4000, "input_length": 600, "output_length": 700, "hash_ids": [4, 1]},
]


@pytest.fixture
def trace_file(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return p


def build(path, seed=0, **kw):
    return WORKLOAD.build("trace", TraceConfig(path=str(path), **kw), seed).sessions()


def common_prefix(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("block", [512, 32, 7])
def test_equal_hash_ids_share_text_and_lengths_scale(trace_file, block):
    ss = build(trace_file, block_tokens=block)
    prompts = [s.prompt(0, []) for s in ss]
    for row, p in zip(ROWS, prompts):
        assert len(p) == math.ceil(row["input_length"] * block / 512)     # the last block is cut
    # brute force: the shared prefix is exactly the leading equal hash ids (random text may add a few characters)
    for i, j in [(0, 1), (0, 2), (1, 2), (0, 3)]:
        ids_i, ids_j = ROWS[i]["hash_ids"], ROWS[j]["hash_ids"]
        equal_blocks = next((k for k, (x, y) in enumerate(zip(ids_i, ids_j)) if x != y), min(len(ids_i), len(ids_j)))
        shared = common_prefix(prompts[i], prompts[j])
        assert shared >= min(equal_blocks * block, len(prompts[i]), len(prompts[j]))
        assert shared < equal_blocks * block + block                       # the next, different block differs
    # same id at another position (id 1 in rows 0 and 3; row 3 ends inside it): the same block text
    tail = prompts[3][block:]
    assert tail and tail == prompts[0][block:block + len(tail)]


def test_timestamps_scale_and_outputs_scale_and_cap(trace_file):
    ss = build(trace_file, time_scale=2.0, output_scale=0.5, max_output_len=30)
    assert [s.arrival_s for s in ss] == [0.0, 0.25, 1.0, 1.5]               # (ts - first) / 1000 / time_scale
    assert [s.turns[0].max_new_tokens for s in ss] == [30, 20, 5, 30]
    untimed = build(trace_file, use_timestamps=False, request_rate=0.0)
    assert [s.arrival_s for s in untimed] == [0.0] * 4                       # all at once (or max_concurrency)


def test_num_requests_reads_only_the_first(trace_file):
    ss = build(trace_file, num_requests=2)
    assert [len(s.prompt(0, [])) for s in ss] == [1200, 1500]
    assert len(read_trace(trace_file, limit=3)) == 3


def test_deterministic_by_seed(trace_file):
    a = [s.prompt(0, []) for s in build(trace_file, seed=1)]
    assert a == [s.prompt(0, []) for s in build(trace_file, seed=1)]
    assert a != [s.prompt(0, []) for s in build(trace_file, seed=2)]


def test_bad_lines_name_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"timestamp": 1, "input_length": 5}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: missing output_length, hash_ids"):
        build(p)
    p.write_text("not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not JSON"):
        build(p)
    p.write_text(json.dumps({**ROWS[0], "input_length": 5000}) + "\n")     # 3 ids cover only 1536 tokens
    with pytest.raises(ValueError, match="fewer than input_length"):
        build(p)


def test_missing_file_says_where_it_looked(tmp_path):
    with pytest.raises(FileNotFoundError, match="workload.path='nowhere.jsonl'.*data/traces/conversation_trace"):
        build("nowhere.jsonl")


def test_gzip_reads_as_plain(trace_file, tmp_path):
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(trace_file.read_bytes()))
    assert [s.prompt(0, []) for s in build(gz)] == [s.prompt(0, []) for s in build(trace_file)]


def test_default_path_ships_in_the_repo_and_parses(tmp_path, monkeypatch):
    """The default works from a fresh clone, whatever the working directory: the traces ship in data/traces/."""
    monkeypatch.chdir(tmp_path)
    expected = (REPO_ROOT / DEFAULT_TRACE).resolve()
    assert expected.is_file() and expected.parent == REPO_ROOT / "data" / "traces"
    assert resolve_trace_path(DEFAULT_TRACE) == expected
    assert len(read_trace(resolve_trace_path("data/traces/synthetic_trace.jsonl.gz"))) == 3993
    ss = WORKLOAD.build("trace", TraceConfig(num_requests=300, block_tokens=16), 0).sessions()
    rows = read_trace(expected, 300)
    assert len(ss) == 300
    by_first_block = {}
    for row, s in zip(rows, ss):   # the trace's conversations share their first block: their prompts must too
        by_first_block.setdefault(row.hash_ids[0], []).append(s.prompt(0, []))
    shared = [ps for ps in by_first_block.values() if len(ps) > 1]
    assert shared and all(p[:16] == ps[0][:16] for ps in shared for p in ps)
