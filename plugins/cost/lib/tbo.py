"""Two-batch overlap priced (issue 21, item 2's simulator half): the MoE layers of a step as two micro-batches'
operations, in SGLang's stage order (framework/contracts/tbo.py's DECODE_STAGES / PREFILL_STAGES, the lists the MoE
backend's real overlap shares), on a GPU with one compute stream and one communication engine.

A layer is a list of stages; a stage a list of operations:
- ("compute", s): kernels on the compute stream, in the order the host issues them (a stage's consecutive compute
  operations are one, their seconds summed in order);
- ("send", name, s): a dispatch or combine launched (it starts once the micro-batch's last compute is done and the
  link is free, and holds the link for s seconds);
- ("recv", name): the micro-batch's stream waits for that transfer (DeepEP's hook / event wait): the compute stream
  stalls until it lands, as a CUDA stream does.

Micro-batch B starts `delta` stages after A (decode 2, prefill 0), then at each tick A's stage runs before B's
(framework/contracts/tbo.py's `schedule`).
"""
from __future__ import annotations

from framework.contracts.tbo import DECODE_STAGES, PREFILL_STAGES, schedule


def layer_ops(stages: tuple[tuple[str, ...], ...], seconds: dict[str, float]) -> list[list[tuple]]:
    """One layer's operations from named stages and each name's seconds (see framework/contracts/tbo.py)."""
    layer = []
    for stage in stages:
        ops: list[tuple] = []
        for name in stage:
            if name.endswith(">"):
                ops.append(("send", name[:-1], seconds[name[:-1]]))
            elif name.startswith("<"):
                ops.append(("recv", name[1:]))
            elif ops and ops[-1][0] == "compute":
                ops[-1] = ("compute", ops[-1][1] + seconds[name])
            else:
                ops.append(("compute", seconds[name]))
        layer.append(ops)
    return layer


def decode_layer(proj: float, core: float, gate: float, shared: float, experts: float, dispatch: float,
                 combine: float) -> list[list[tuple]]:
    """SGLang's decode strategy: [prepare] | [core, gate] | [dispatch_a, shared] | [dispatch_b, experts, combine_a]
    | [combine_b] (tbo_delta_stages=2)."""
    return layer_ops(DECODE_STAGES, dict(proj=proj, core=core, gate=gate, shared=shared, experts=experts,
                                         dispatch=dispatch, combine=combine))


def prefill_layer(proj: float, core: float, gate: float, shared: float, experts: float, dispatch: float,
                  combine: float) -> list[list[tuple]]:
    """SGLang's prefill strategy: [attention, gate, dispatch_a] | [dispatch_b, experts, combine_a] | [shared,
    combine_b] (tbo_delta_stages=0)."""
    return layer_ops(PREFILL_STAGES, dict(proj=proj, core=core, gate=gate, shared=shared, experts=experts,
                                          dispatch=dispatch, combine=combine))


def overlapped_s(layers: tuple[list[list[tuple]], list[list[tuple]]], num_layers: int, delta: int) -> float:
    """Seconds until both micro-batches finish `num_layers` layers (layers[m]: micro-batch m's stages of one layer)."""
    per_layer = len(layers[0])
    compute_free = link_free = 0.0
    ready = [0.0, 0.0]                       # when each micro-batch's last compute finished
    inflight: list[dict[str, float]] = [{}, {}]
    for micro, stage in schedule(per_layer * num_layers, delta):
        for op in layers[micro][stage % per_layer]:
            if op[0] == "compute":
                compute_free = max(compute_free, ready[micro]) + op[1]
                ready[micro] = compute_free
            elif op[0] == "send":
                start = max(link_free, ready[micro])
                link_free = start + op[2]
                inflight[micro][op[1]] = link_free
            else:                            # the stream waits on the transfer
                done = inflight[micro].pop(op[1])
                compute_free = max(compute_free, done)
                ready[micro] = max(ready[micro], done)
    return max(compute_free, link_free, *ready)
