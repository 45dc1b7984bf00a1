"""Two-batch overlap priced (issue 21, item 2's simulator half): the MoE layers of a step as two micro-batches'
operations, in SGLang's stage order (sglang operations_strategy.py, `_compute_moe_deepseek_blog_prefill` /
`_decode`), on a GPU with one compute stream and one communication engine.

A layer is a list of stages; a stage a list of operations:
- ("compute", s): kernels on the compute stream, in the order the host issues them;
- ("send", name, s): a dispatch or combine launched (it starts once the micro-batch's last compute is done and the
  link is free, and holds the link for s seconds);
- ("recv", name): the micro-batch's stream waits for that transfer (DeepEP's hook / event wait): the compute stream
  stalls until it lands, as a CUDA stream does.

Micro-batch B starts `delta` stages after A (decode 2, prefill 0), then at each tick A's stage runs before B's
(plugins/moe/lib/tbo.py's `schedule`, rewritten here: a cost plugin imports no other plugin).
"""
from __future__ import annotations


def decode_layer(proj: float, core: float, gate: float, shared: float, experts: float, dispatch: float,
                 combine: float) -> list[list[tuple]]:
    """SGLang's decode strategy: [prepare] | [core, gate] | [dispatch_a, shared] | [dispatch_b, experts, combine_a]
    | [combine_b] (tbo_delta_stages=2)."""
    return [[("compute", proj)], [("compute", core + gate)], [("send", "d", dispatch), ("compute", shared)],
            [("recv", "d"), ("compute", experts), ("send", "c", combine)], [("recv", "c")]]


def prefill_layer(proj: float, core: float, gate: float, shared: float, experts: float, dispatch: float,
                  combine: float) -> list[list[tuple]]:
    """SGLang's prefill strategy: [attention, gate, dispatch_a] | [dispatch_b, experts, combine_a] | [shared,
    combine_b] (tbo_delta_stages=0)."""
    return [[("compute", proj + core + gate), ("send", "d", dispatch)],
            [("recv", "d"), ("compute", experts), ("send", "c", combine)],
            [("compute", shared), ("recv", "c")]]


def schedule(stages: int, delta: int) -> list[tuple[int, int]]:
    order = []
    for t in range(stages + delta):
        if t < stages:
            order.append((0, t))
        if 0 <= t - delta < stages:
            order.append((1, t - delta))
    return order


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
