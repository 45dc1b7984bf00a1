"""Bad input and failures of a multi-rank instance end in one clear message, with no rank left behind."""
import socket

import pytest

from framework.app import run
from framework.core.errors import UserError
from framework.dist import RankFailed
from framework.instance.handle import EngineDown, SyncFace
from framework.instance.rank_loop import InstanceSpec
from framework.instance.client import open_engine
from framework.engine.request import Req, SamplingParams
from parallel_helpers import assert_no_rank_left, make_cfg


@pytest.mark.parametrize("parallel,size,message", [
    ("tp", 3, "model.num_heads=8 is not divisible by parallel.size=3"),
    ("tp", 16, "model.num_heads=8 is not divisible by parallel.size=16"),
    ("dp_attn", 3, "model.intermediate_size=256 (dense FFN, tensor-parallel) is not divisible by parallel.size=3"),
])
def test_a_size_that_does_not_fit_the_model_fails_before_any_rank_starts(tmp_path, parallel, size, message):
    for mode in ("bench", "verify"):
        cfg = make_cfg(f"mode={mode}", f"parallel={parallel}", f"parallel.size={size}")
        with pytest.raises(UserError, match=f"parallel={parallel} parallel.size={size} does not fit: ") as info:
            run(cfg, str(tmp_path), {})
        assert message in str(info.value)
        assert_no_rank_left([])


@pytest.mark.long  # processes for ~5-10 s: CI's second command (README's default run is near 5 min)
def test_a_port_in_use_is_one_message(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = make_cfg("parallel=dp_attn", "parallel.size=2", f"parallel.master_port={port}")
        with pytest.raises(UserError, match=f"port {port} is in use; set master_port= to a free port"):
            run(cfg, str(tmp_path), {})
    assert_no_rank_left([])


def test_without_idle_batches_the_busy_rank_times_out_in_the_ffn_collective_not_hangs():
    """The design document's exercise 1: rank 1 has no request and skips the step instead of running an IDLE batch;
    rank 0 waits for it in the first FFN layer's all-gather and gets a CollectiveTimeout naming itself, the
    collective and the step; the launcher then stops every rank."""
    cfg = make_cfg("parallel=dp_attn", "parallel.size=2", "parallel.idle_batches=false", "parallel.timeout_s=2")
    client = open_engine(InstanceSpec(cfg.model, cfg.engine, cfg.parallel, cfg.moe, cfg.seed))
    pids = client.instance.pids
    try:
        req = Req(client.tokenizer.encode("hello ranks"), SamplingParams(max_new_tokens=4))
        face = SyncFace(client)
        face.add(req, dp_rank=0)
        with pytest.raises(EngineDown, match="rank 0 failed: CollectiveTimeout"):
            face.wait_all([req], timeout=60)
    finally:
        client.terminate()
    err = client.failure
    assert isinstance(err, RankFailed)
    assert (err.rank, err.exc_type) == (0, "CollectiveTimeout")
    assert err.exc_message.startswith("rank 0: all_gather_uneven timed out after 2.0 s at step ")
    assert "parallel.idle_batches" in err.exc_message
    assert "in ffn" in err.traceback_text                       # raised inside the parallelism plugin's FFN
    assert client.error.startswith("rank 0 failed: CollectiveTimeout: rank 0: all_gather_uneven timed out")
    assert_no_rank_left(pids)


def test_the_same_instance_with_idle_batches_serves_the_request():
    cfg = make_cfg("parallel=dp_attn", "parallel.size=2", "parallel.timeout_s=10")
    client = open_engine(InstanceSpec(cfg.model, cfg.engine, cfg.parallel, cfg.moe, cfg.seed))
    pids = client.instance.pids
    try:
        req = Req(client.tokenizer.encode("hello ranks"), SamplingParams(max_new_tokens=4, ignore_eos=True))
        face = SyncFace(client)
        face.add(req, dp_rank=0)
        face.wait_all([req], timeout=60)
        ranks = client.close_ranks()
    finally:
        client.terminate()
    assert len(req.output_ids) == 4 and req.finish_reason == "length"
    assert ranks[1]["requests"] == 0 and ranks[1]["idle_steps"] == ranks[0]["steps"] > 0
    assert_no_rank_left(pids)
