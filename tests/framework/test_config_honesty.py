"""Config honesty: a key that the run's mode, drivers or plugins would ignore is refused at start with one sentence
(the key, why it is ignored, what to do; exit status 2), never dropped. Each case runs the real composition."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from framework.config import compose, group_overrides, refuse_ignored_keys
from framework.core.errors import UserError
from framework.core.registry import WORKLOAD

ROOT = Path(__file__).resolve().parents[2]


def refusal(*overrides: str) -> str:
    """The sentence `python run.py <overrides>` stops with (what run.py checks, on what Hydra composed)."""
    overrides = group_overrides(list(overrides))
    with pytest.raises(UserError) as err:
        refuse_ignored_keys(compose(overrides), overrides)
    return str(err.value)


@pytest.mark.parametrize("overrides, key, why", [
    # cluster.http=false: one instance in this process, no router (issue 24 item 1: router= was dropped)
    (["router=round_robin", "cluster.http=false"], "router=round_robin", "no router"),
    (["cluster.http=false", "router.cache_threshold=0.2"], "router.cache_threshold=0.2", "no router"),
    (["cluster.http=false", "cluster.instances=4"], "cluster.instances=4", "one instance"),
    (["cluster.http=false", "workload.api=chat"], "workload.api=chat", "HTTP"),
    (["mode=sim", "cluster.http=false", "router=random"], "router=random", "no router"),
    # what only one mode reads
    (["sim.cost=roofline"], "sim.cost=roofline", "only mode=sim reads it"),
    (["sim.host_cores=2"], "sim.host_cores=2", "only mode=sim reads it"),
    (["hardware=h200"], "hardware=h200", "only mode=sim reads it"),
    (["verify.atol=1e-3"], "verify.atol=1e-3", "only mode=verify reads it"),
    # what a mode does not do
    (["mode=verify", "router=random"], "router=random", "starts no router"),
    (["mode=verify", "workload=trace"], "workload=trace", "plays no workload"),
    (["mode=serve", "workload.num_requests=10"], "workload.num_requests=10", "plays no workload"),
    (["mode=serve", "cluster.http=false"], "cluster.http=false", "always serves over HTTP"),
    (["mode=sim", "router.port=0"], "router.port=0", "no process, port, socket"),
    (["mode=sim", "cluster.restart_workers=false"], "cluster.restart_workers=false", "no process"),
    (["mode=sim", "parallel=dp_attn", "parallel.backend=gloo"], "parallel.backend=gloo", "no process"),
    (["mode=sim", "workload.api=completions"], "workload.api=completions", "no process, port, socket"),
    (["mode=sim", "router.impl=sglang"], "router.impl=sglang", "servelab's router core decides"),
    # the cost model that prices what it measured reads no GPU
    (["mode=sim", "hardware=h200"], "hardware=h200", "sim.cost=calibrated prices the engine it measured"),
    # servers started elsewhere
    (["cluster.url=http://127.0.0.1:9", "router=random"], "router=random", "starts nothing here"),
    (["cluster.url=http://127.0.0.1:9", "engine.kv_budget_mb=2"], "engine.kv_budget_mb=2", "starts nothing here"),
    (["cluster.url=http://127.0.0.1:9", "cluster.instances=3"], "cluster.instances=3", "starts nothing here"),
    (["cluster.workers=[http://127.0.0.1:9]", "parallel=tp"], "parallel=tp", "no local instance starts"),
    (["cluster.workers=[http://127.0.0.1:9]", "cluster.instances=3"], "cluster.instances=3", "no local instance"),
    # SGLang's router: what its command line cannot carry (RoutingPolicy.sglang_ignores, the service's defaults)
    (["router=cache_aware_v2", "router.impl=sglang", "router.tie_break=first"], "router.tie_break=first",
     "has no flag for it"),
    (["router=cache_aware_v2", "router.impl=sglang", "router.breaker_cooldown_secs=5"],
     "router.breaker_cooldown_secs=5", "keeps its own default"),
    # what the routing policy says it ignores (RoutingPolicy.ignored_keys): a switch that turns the key on is off
    (["router=precise_prefix", "router.affinity_size=10"], "router.affinity_size=10", "session_affinity is off"),
    (["router=precise_prefix", "router.spill_pressure=1"], "router.spill_pressure=1", "spill_factor is 0"),
    (["router=kv_cost", "router.pending_credit=false", "router.confirm_s=1"], "router.confirm_s=1",
     "pending_credit=false credits none"),
    # what the workload plugin says it ignores (Workload.ignored_keys)
    (["workload=trace", "workload.request_rate=4"], "workload.request_rate=4", "the trace's own arrival times"),
    (["workload=trace", "workload.use_timestamps=false", "workload.time_scale=4"], "workload.time_scale=4",
     "not by the trace's clock"),
    (["workload.burstiness=0.5"], "workload.burstiness=0.5", "sends every session at once"),
])
def test_an_ignored_key_is_refused_with_its_reason(overrides, key, why):
    sentence = refusal(*overrides)
    assert sentence.startswith(f"{key} is ignored: ") and why in sentence, sentence
    assert "drop" in sentence or "set " in sentence or "use " in sentence     # and what to do instead
    assert "\n" not in sentence


@pytest.mark.parametrize("overrides", [
    [],
    ["cluster.http=false", "workload.num_requests=3", "engine.kv_budget_mb=2"],
    ["mode=sim", "sim.cost=roofline", "hardware=h200", "model=deepseek_v2", "router.maintain_interval_secs=2"],
    ["mode=verify", "parallel=tp", "parallel.size=4", "moe=triton_fused", "verify.atol=1e-3"],
    ["mode=serve", "cluster.instances=4", "router=random"],
    ["cluster.url=http://127.0.0.1:9", "workload.api=chat", "cluster.client_retries=0"],
    ["router=cache_aware_v2", "router.impl=sglang", "router.cache_threshold=0.2", "router.port=0",
     "router.max_retries=1"],
    ["workload=trace", "workload.use_timestamps=false", "workload.request_rate=4", "workload.burstiness=0.5"],
    ["router=sticky_prefix", "router.affinity_size=10", "router.spill_pressure=2", "router.confirm_s=1"],
    ["experiment=pr1970", "parallel=dp_attn"],          # the experiment's own cluster.http=false is not an override
])
@pytest.mark.long   # ~4 s of composes; the refusals above run in the default set
def test_what_the_run_reads_passes(overrides):
    overrides = group_overrides(overrides)
    refuse_ignored_keys(compose(overrides), overrides)


def test_every_ignored_key_is_named_in_one_sentence():
    sentence = refusal("cluster.http=false", "router=random", "cluster.instances=3")
    assert sentence.count(" is ignored: ") == 2 and "router=random" in sentence and "cluster.instances=3" in sentence


# long but for one workload: each builds its workload first (seconds); trace reads the whole Mooncake trace
@pytest.mark.parametrize("workload", [w if w == "random" else pytest.param(w, marks=pytest.mark.long)
                                      for w in sorted(WORKLOAD.keys())])
def test_num_requests_above_what_a_workload_makes_is_refused(workload):
    """Every workload honours workload.num_requests up to what it makes, and refuses more (it used to run fewer
    requests than asked without a word: `workload=multi_turn workload.num_requests=100000` ran 64)."""
    cfg = compose([f"workload={workload}"])
    made = sum(len(s.turns) for s in WORKLOAD.build(workload, cfg.workload, 0).sessions())
    if workload == "trace":                 # trace.yaml keeps the first 100: the whole file is what it can make
        cfg = compose([f"workload={workload}", "workload.num_requests=0"])
        made = sum(len(s.turns) for s in WORKLOAD.build(workload, cfg.workload, 0).sessions())
    exact = compose([f"workload={workload}", f"workload.num_requests={made}"]).workload
    assert sum(len(s.turns) for s in WORKLOAD.build(workload, exact, 0).sessions()) == made
    over = compose([f"workload={workload}", f"workload.num_requests={made + 1}"]).workload
    with pytest.raises(UserError, match=rf"workload.num_requests={made + 1} asks for more requests than "
                                        rf"workload={workload} makes with these settings \({made}\); .*at most {made}"):
        WORKLOAD.build(workload, over, 0).sessions()


def test_the_issue_s_multi_turn_cap_names_what_sizes_it():
    cfg = compose(["workload=multi_turn", "workload.num_requests=100000"])
    with pytest.raises(UserError, match="raise workload.num_conversations or workload.turns"):
        WORKLOAD.build("multi_turn", cfg.workload, 0).sessions()


def test_more_sharegpt_conversations_than_pass_the_filters_is_refused():
    cfg = compose(["workload=sharegpt", "workload.num_prompts=0"])
    usable = len(WORKLOAD.build("sharegpt", cfg.workload, 0).sessions())
    over = compose(["workload=sharegpt", f"workload.num_prompts={usable + 1}"]).workload
    with pytest.raises(UserError, match=rf"workload.num_prompts={usable + 1} asks for more conversations than "
                                        rf".* \({usable}\); set workload.num_prompts to at most {usable}"):
        WORKLOAD.build("sharegpt", over, 0).sessions()


def run_py(tmp_path, *args):
    return subprocess.run([sys.executable, "run.py", *args, "logger.mode=disabled"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.long
def test_run_py_refuses_before_anything_starts(tmp_path):
    r = run_py(tmp_path, "workload=multi_turn", "workload.num_requests=100000", "cluster.http=false",
               f"hydra.run.dir={tmp_path}")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "workload.num_requests=100000 asks for more requests than workload=multi_turn makes" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "requests.jsonl").exists()


@pytest.mark.long
def test_a_multirun_that_sets_an_ignored_key_is_refused_once(tmp_path):
    """Issue 24 item 1: `run.py -m router=round_robin,cache_aware cluster.http=false` ran the same in-process bench
    twice, router= dropped; now the multirun is refused before any point runs, in one line, exit status 2."""
    r = run_py(tmp_path, "-m", "router=round_robin,cache_aware", "cluster.http=false", f"hydra.sweep.dir={tmp_path}")
    assert r.returncode == 2, r.stderr[-3000:]
    (line,) = r.stderr.splitlines()
    assert line.startswith("config error: router=round_robin is ignored: cluster.http=false plays the workload "
                           "straight into one instance") and line.endswith("none was run)"), line
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
