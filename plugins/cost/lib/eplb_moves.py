"""What an EPLB rebalance costs the simulator (issue 21, item 1): the expert weights it moves and how long serving
stops while they move, as SGLang 2025 moves them.

SGLang (sgl-project/sglang; python/sglang/srt/eplb/eplb_manager.py at 53e29da, expert_location_updater.py at
dc0fdf0; server_args.py: --enable-eplb, --eplb-rebalance-num-iterations 1000, --eplb-rebalance-layers-per-chunk None):

- when: `ModelRunner.forward` calls `EPLBManager.on_forward_pass_end()` after every forward pass (IDLE passes of DP
  attention included), which steps a generator: N = --eplb-rebalance-num-iterations passes, then a rebalance. With
  layers per chunk None (the default) the whole rebalance runs inside the end of pass N + 1, then 2N + 1, ...
  (`schedule`); with chunks, pass N + 1 computes the placement and each later pass moves one chunk of layers, and the
  next count of N starts after the last chunk (a period of N + chunks).
- blocking: the rebalance runs in the forward loop (`ModelRunner.update_expert_location` ->
  `ExpertLocationUpdater.update`), so serving stops while the weights move: a stall of that pass, no overlap.
- how: layer by layer, each rank posts its sends and receives as one `torch.distributed.batch_isend_irecv` and waits
  on them (NCCL point-to-point: NVLink inside a node, the GPU's NIC between nodes). A rank receives each expert it
  holds under the new placement and did not hold before, once (a second slot of it copies the first: "free-rider");
  from a rank of its own node that held it if there is one, else from any holder (receivers spread in contiguous
  chunks over the holders, `_ChunkUtils`). Received experts land in a temporary buffer and are copied into the weights
  after the wait; an expert the rank already held moves slot by a copy to the buffer before the wait and back after.

Priced here: per layer, each rank's time is the copies before, the slower of its two links (NVLink, NIC; each a
latency plus the larger of the bytes it sends and receives over the link's point-to-point bandwidth), then the
copies after; a layer waits for its slowest rank; a chunk's stall is the sum of its layers. The counters are the
real path's (plugins/moe/ep.py, framework/model/moe_stats.py): per MoE layer re-placed, one rebalance and one move
per (rank, expert) newly held, of 3 x hidden x moe_intermediate weights. Not priced: computing the placement (CPU),
the recorder's dump, and load drift (the simulator's expert loads are one distribution for the whole run, so every
rebalance after the first finds the same placement and moves nothing).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

Link = tuple[float, float]        # (bytes/s, seconds of latency) of one GPU's link, one direction


def schedule(forward_pass: int, every: int, chunks: int = 1) -> tuple[int, int] | None:
    """(rebalance from 0, chunk from 0) whose weights SGLang's EPLBManager moves at the end of forward pass
    `forward_pass` (from 1) when it rebalances every `every` passes in `chunks` chunks of layers; None: none."""
    if every < 1 or chunks < 1:
        return None
    first, period = (every + 1, every) if chunks == 1 else (every + 2, every + chunks)
    if forward_pass < first:
        return None
    k, c = divmod(forward_pass - first, period)
    return (k, c) if c < chunks else None


def _chunk_of(index: int, elements: int, chunks: int) -> int:
    """The chunk that element `index` of `elements` falls in, cut into `chunks` contiguous chunks whose sizes differ by
    at most one, the longer ones first (SGLang's _ChunkUtils)."""
    short, longer = divmod(elements, chunks)
    in_long = longer * (short + 1)
    return index // (short + 1) if index < in_long else longer + (index - in_long) // short


@dataclass(frozen=True)
class RankWork:
    """One rank's part of one layer's move."""
    sent: dict[bool, int]        # experts sent over the intra-node (True) / inter-node (False) link
    received: dict[bool, int]
    copies_before: int           # slot-to-buffer copies of experts the rank already held
    copies_after: int            # buffer-to-weight copies, one per slot that changed expert


def transfers(old: Sequence[int], new: Sequence[int], ranks: int, gpus_per_node: int) -> list[tuple[int, int, int]]:
    """(expert, from rank, to rank) for every expert a rank holds under `new` (physical slot -> logical expert) and
    not under `old`, from the rank SGLang's ExpertLocationUpdater takes it from."""
    per_rank = len(old) // ranks
    node = [r // gpus_per_node for r in range(ranks)]
    holders: dict[int, list[int]] = {}
    for s, e in enumerate(old):
        if not holders.setdefault(e, []) or holders[e][-1] != s // per_rank:
            holders[e].append(s // per_rank)
    wanted: dict[int, list[int]] = {}           # expert -> ranks that newly hold it, in rank order
    for s, e in enumerate(new):
        r = s // per_rank
        if r not in holders[e] and (not wanted.setdefault(e, []) or wanted[e][-1] != r):
            wanted[e].append(r)
    out = []
    for e, receivers in sorted(wanted.items()):
        src_nodes = {node[h] for h in holders[e]}
        for r in receivers:
            local = [h for h in holders[e] if node[h] == node[r]]
            if local:               # from the node's own holders, the node's receivers split among them
                peers = [x for x in receivers if node[x] == node[r]]
                src = local[_chunk_of(peers.index(r), len(peers), len(local))]
            else:                   # across nodes: the receivers of nodes without a holder, split over all holders
                peers = [x for x in receivers if node[x] not in src_nodes]
                src = holders[e][_chunk_of(peers.index(r), len(peers), len(holders[e]))]
            out.append((e, src, r))
    return out


def rank_work(old: Sequence[int], new: Sequence[int], ranks: int, gpus_per_node: int,
              moves: list[tuple[int, int, int]]) -> list[RankWork]:
    """Each rank's sends, receives and device copies for one layer moving from `old` to `new` by `moves`."""
    per_rank = len(old) // ranks
    sent = [{True: 0, False: 0} for _ in range(ranks)]
    received = [{True: 0, False: 0} for _ in range(ranks)]
    for _, src, dst in moves:
        intra = src // gpus_per_node == dst // gpus_per_node
        sent[src][intra] += 1
        received[dst][intra] += 1
    out = []
    for r in range(ranks):
        slots = range(r * per_rank, (r + 1) * per_rank)
        held = {old[s] for s in slots}
        changed = [s for s in slots if old[s] != new[s]]
        out.append(RankWork(sent[r], received[r], sum(1 for s in changed if new[s] in held), len(changed)))
    return out


def layer_seconds(work: list[RankWork], expert_bytes: float, links: dict[bool, Link],
                  copy_s: Callable[[float], float]) -> float:
    """One layer's move: its slowest rank's copies before, its slower link, its copies after. `links[True]`: the
    intra-node link, `links[False]`: the inter-node one; `copy_s(bytes)`: a device copy reading and writing them."""
    slowest = 0.0
    for w in work:
        wire = 0.0
        for intra, (bandwidth, latency) in links.items():
            experts = max(w.sent[intra], w.received[intra])
            if experts:
                wire = max(wire, latency + experts * expert_bytes / bandwidth)
        t = copy_s(2 * w.copies_before * expert_bytes) + wire + copy_s(2 * w.copies_after * expert_bytes)
        slowest = max(slowest, t)
    return slowest


@dataclass(frozen=True)
class LayerMove:
    moved: int                   # (rank, expert) pairs newly held
    seconds: float


class EPLBMoves:
    """The rebalances of one instance's MoE layers: `initial` slots before the first, `placed[layer]` after every one
    (the loads do not change over a run), priced with SGLang's schedule. `at(n)`: what moves at the end of forward
    pass n, as the MoE contract's counters (framework/model/moe_stats.py PLACEMENT_KEYS) plus the stall."""

    def __init__(self, every: int, layers_per_chunk: int, initial: Sequence[int], placed: list[Sequence[int]],
                 ranks: int, gpus_per_node: int, expert_bytes: int, links: dict[bool, Link],
                 copy_s: Callable[[float], float]):
        if every < 0 or layers_per_chunk < 0:
            raise ValueError(f"moe.eplb.rebalance_every={every} and sim.cost.eplb_layers_per_chunk="
                             f"{layers_per_chunk} must be >= 0")
        self.every, self.layers = every, len(placed)
        size = layers_per_chunk or self.layers
        self.chunks = [range(i, min(i + size, self.layers)) for i in range(0, self.layers, size)]
        self.initial, self.placed, self.ranks, self.nodes = tuple(initial), placed, ranks, gpus_per_node
        self.expert_bytes, self.links, self.copy_s = expert_bytes, links, copy_s
        self._first: list[LayerMove] | None = None

    def first_rebalance(self) -> list[LayerMove]:
        """Per layer, the first rebalance's move from the initial slots (computed once, when first needed)."""
        if self._first is None:
            self._first = []
            for new in self.placed:
                moves = transfers(self.initial, new, self.ranks, self.nodes)
                work = rank_work(self.initial, new, self.ranks, self.nodes, moves)
                self._first.append(LayerMove(len(moves), layer_seconds(work, self.expert_bytes, self.links,
                                                                       self.copy_s)))
        return self._first

    def at(self, forward_pass: int) -> dict[str, float]:
        when = schedule(forward_pass, self.every, len(self.chunks))
        out = {"eplb_rebalances": 0, "eplb_experts_moved": 0, "eplb_bytes_moved": 0, "eplb_stall_s": 0.0}
        if when is None:
            return out
        rebalance, chunk = when
        layers = self.chunks[chunk]
        out["eplb_rebalances"] = len(layers)
        if rebalance == 0:              # later ones find the same placement: nothing moves
            moves = [self.first_rebalance()[i] for i in layers]
            out["eplb_experts_moved"] = sum(m.moved for m in moves)
            out["eplb_bytes_moved"] = out["eplb_experts_moved"] * self.expert_bytes
            out["eplb_stall_s"] = sum(m.seconds for m in moves)
        return out
