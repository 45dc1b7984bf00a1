"""The host's part of a step, as SGLang v0.4 runs it (issue 19, item 4), for the roofline cost model.

- scheduler CPU per step: the event loop's work around the forward (form the batch, process its results, stream
  them out): `host_step_us` + `host_running_us` per request of a DECODE batch + `host_output_token_us` per token its
  requests have generated so far (SGLang's stream_output hands each request's whole output to the detokenizer every
  step) + `host_new_req_us` per request and `host_new_token_us` per new token of an EXTEND batch, measured by
  experiments/calibrate/host.py (servelab's SGLang-faithful scheduler) or experiments/sglang035_host (sglang 0.3.5's
  own, its GPU taken out) and carried to a 2024 H100 host by `host_speed_factor`. DP attention: every DP rank's
  scheduler runs at once; the slowest paces the step.
- overlap: SGLang's overlap scheduler runs the CPU work of step N+1 while step N's forward runs (the step costs the
  larger of the two); without it (event_loop_normal) the two add up. v0.4's choice (`overlap_schedule=auto`): off
  under DP attention (server_args: disable_overlap_schedule) and with the Triton attention backend, which v0.4 uses
  for every MLA model (model_runner); on otherwise (FlashInfer, one scheduler).
- eager floor: a forward that replays no CUDA graph is launched kernel by kernel from Python; the host's time per
  layer (`eager_dense_layer_us`, `eager_moe_layer_us`, SGLang PR #1401's eager decode at batch 1) bounds the step
  from below, the GPU running behind it.
"""
from __future__ import annotations

from framework.contracts.cost import Step

OVERLAP = ("auto", "on", "off")
BACKENDS = ("auto", "triton", "flashinfer")


def overlapped(cfg, dp_groups: int) -> bool:
    """Whether SGLang's overlap scheduler runs: the switch, or v0.4's choice (auto)."""
    if cfg.overlap_schedule not in OVERLAP:
        raise ValueError(f"sim.cost.overlap_schedule={cfg.overlap_schedule!r} is not one of {', '.join(OVERLAP)}")
    if cfg.attention_backend not in BACKENDS:
        raise ValueError(f"sim.cost.attention_backend={cfg.attention_backend!r} is not one of {', '.join(BACKENDS)}")
    if cfg.overlap_schedule != "auto":
        return cfg.overlap_schedule == "on"
    backend = "triton" if cfg.attention_backend == "auto" else cfg.attention_backend   # v0.4: MLA runs on Triton
    return dp_groups == 1 and backend != "triton"


def scheduler_s(cfg, step: Step) -> float:
    """The slowest DP rank's scheduler CPU seconds for this step on the priced host."""
    worst = 0.0
    for b in step.batches:
        n = len(b.new_tokens)
        per_req = cfg.host_new_req_us if b.mode == "extend" else cfg.host_running_us if b.mode == "decode" else 0.0
        streamed = cfg.host_output_token_us * b.outputs if b.mode == "decode" else 0.0
        filled = cfg.host_new_token_us * sum(b.new_tokens) if b.mode == "extend" else 0.0
        worst = max(worst, cfg.host_step_us + per_req * n + streamed + filled)
    return worst * cfg.host_speed_factor * 1e-6


def eager_floor_s(cfg, dense_layers: int, moe_layers: int) -> float:
    """The host's time to launch one eager forward, layer by layer."""
    return (dense_layers * cfg.eager_dense_layer_us + moe_layers * cfg.eager_moe_layer_us) * 1e-6


def combine(cfg, gpu_s: float, launch_s: float, graph: bool, sched_s: float, overlap: bool,
            floor_s: float) -> tuple[float, float]:
    """(forward seconds, step seconds): the forward is the GPU's time, or without a graph at least the host's
    launches (the eager floor when on, else kernels x launch overhead); the scheduler's CPU adds to it, or hides
    behind it under the overlap scheduler."""
    forward = gpu_s if graph else max(gpu_s, floor_s if cfg.eager_floor else launch_s)
    return forward, (max(forward, sched_s) if overlap else forward + sched_s)
