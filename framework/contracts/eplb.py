"""Expert-parallel load balancing: where the physical expert slots of one MoE layer go, from its experts' loads.

Shared by the MoE backend that places experts (plugins/moe/ep.py) and the cost model that prices the placement
(plugins/cost/roofline.py): plugins may not import each other, so the one algorithm lives here (L2, pure Python).

The algorithm of deepseek-ai/EPLB (eplb.py), rewritten for one layer at a time (a layer has tens to hundreds of
experts; a placement is recomputed every few thousand steps):

- `balanced_packing`: n weighted items into m packs of exactly n/m items each, heaviest first into the lightest pack
  that still has room (greedy longest-processing-time with a capacity);
- `replicate_experts`: num_physical slots for num_logical experts, each extra slot to the expert whose load per
  replica is largest now;
- `rebalance_hierarchical`: expert groups packed onto nodes (so a token's group-limited top-k stays on few nodes),
  experts replicated inside each node, replicas packed onto the node's GPUs;
- `rebalance`: hierarchical when the groups divide among the nodes, else the global policy (one group, one node:
  replicate over all experts, pack over all GPUs), as EPLB's rebalance_experts.

The result is `phy2log`: physical slot s holds logical expert phy2log[s]; slot s lives on rank s // (slots / ranks).
"""
from __future__ import annotations

import enum
import heapq

# Which of EPLB's policies places the experts (`moe.eplb.policy`): auto is EPLB's rule (hierarchical when the groups
# divide among the nodes, else global). The functional form: `global` is a keyword, and the config names the member.
Policy = enum.StrEnum("Policy", {"auto": "auto", "hierarchical": "hierarchical", "global": "global"})


def balanced_packing(weights: list[float], num_packs: int) -> tuple[list[int], list[int]]:
    """(pack of each item, its position in the pack): every pack gets len(weights) / num_packs items, the heaviest
    item first into the lightest pack with room (ties: the lower pack; equal weights: the lower item)."""
    n = len(weights)
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"balanced_packing needs the {n} items to divide into {num_packs} packs")
    per_pack = n // num_packs
    pack, rank = [0] * n, [0] * n
    counts = [0] * num_packs
    lightest = [(0.0, p) for p in range(num_packs)]          # packs with room: (load, pack), lightest first
    for item in sorted(range(n), key=lambda i: (-weights[i], i)):
        load, p = heapq.heappop(lightest)
        pack[item], rank[item] = p, counts[p]
        counts[p] += 1
        if counts[p] < per_pack:
            heapq.heappush(lightest, (load + weights[item], p))
    return pack, rank


def replicate_experts(weights: list[float], num_physical: int) -> tuple[list[int], list[int]]:
    """(phy2log, replica counts per logical expert): one slot each, then each extra slot to the expert with the
    highest load per replica (ties: the lower id)."""
    num_logical = len(weights)
    if num_physical < num_logical:
        raise ValueError(f"{num_physical} physical slots cannot hold {num_logical} experts")
    phy2log, count = list(range(num_logical)), [1] * num_logical
    heaviest = [(-weights[e], e) for e in range(num_logical)]   # (-load per replica, expert)
    heapq.heapify(heaviest)
    for _ in range(num_physical - num_logical):
        _, e = heapq.heappop(heaviest)
        phy2log.append(e)
        count[e] += 1
        heapq.heappush(heaviest, (-weights[e] / count[e], e))
    return phy2log, count


def rebalance_hierarchical(weights: list[float], num_physical: int, num_groups: int, num_nodes: int,
                           num_gpus: int) -> list[int]:
    """phy2log over `num_gpus` ranks in `num_nodes` nodes, keeping each expert group (`num_groups` of consecutive
    experts) on one node. Slots of a GPU are consecutive, GPUs of a node too."""
    num_logical = len(weights)
    problems = [f"{what}" for ok, what in (
        (num_logical % num_groups == 0, f"{num_logical} experts into {num_groups} groups"),
        (num_groups % num_nodes == 0, f"{num_groups} groups onto {num_nodes} nodes"),
        (num_gpus % num_nodes == 0, f"{num_gpus} GPUs into {num_nodes} nodes"),
        (num_physical % num_gpus == 0, f"{num_physical} slots onto {num_gpus} GPUs")) if not ok]
    if problems:
        raise ValueError("EPLB placement needs whole splits; these do not divide: " + "; ".join(problems))
    group_size = num_logical // num_groups
    gpus_per_node, slots_per_node = num_gpus // num_nodes, num_physical // num_nodes

    # 1. groups onto nodes
    group_loads = [sum(weights[g * group_size:(g + 1) * group_size]) for g in range(num_groups)]
    group_node, group_rank = balanced_packing(group_loads, num_nodes)
    groups_per_node = num_groups // num_nodes
    node_experts: list[list[int]] = [[0] * (groups_per_node * group_size) for _ in range(num_nodes)]
    for g in range(num_groups):
        for j in range(group_size):
            node_experts[group_node[g]][group_rank[g] * group_size + j] = g * group_size + j

    phy2log: list[int] = []
    for node in range(num_nodes):
        experts = node_experts[node]
        # 2. replicas inside the node
        local_phy, count = replicate_experts([weights[e] for e in experts], slots_per_node)
        # 3. replicas onto the node's GPUs, by load per replica
        replica_loads = [weights[experts[le]] / count[le] for le in local_phy]
        gpu, pos = balanced_packing(replica_loads, gpus_per_node)
        slots_per_gpu = slots_per_node // gpus_per_node
        node_slots = [0] * slots_per_node
        for i, le in enumerate(local_phy):
            node_slots[gpu[i] * slots_per_gpu + pos[i]] = experts[le]
        phy2log.extend(node_slots)
    return phy2log


def rebalance(weights: list[float], num_physical: int, num_groups: int, num_nodes: int, num_gpus: int,
              policy: Policy | str = Policy.auto) -> list[int]:
    """EPLB's rebalance_experts for one layer: phy2log of `num_physical` slots over `num_gpus` ranks."""
    if policy not in tuple(Policy):
        raise ValueError(f"moe.eplb.policy={policy!r} is not one of {', '.join(Policy)}")
    hierarchical = policy == Policy.hierarchical or (policy == Policy.auto and num_groups % num_nodes == 0)
    if hierarchical:
        return rebalance_hierarchical(weights, num_physical, num_groups, num_nodes, num_gpus)
    return rebalance_hierarchical(weights, num_physical, 1, 1, num_gpus)
