"""sim/cost=roofline: a step's time from the FLOPs and bytes of every kernel of a DeepSeek-style MLA + MoE model,
on a GPU given as data (conf/hardware/), with efficiency terms fitted on measured profiles (framework/sim/cost/).

Per layer, as SGLang v0.4 runs it: fused add + RMSNorm, MLA projections (q_a/q_b or q, kv_a, o; q_a and kv_a
replicated across attention-TP ranks), RoPE; attention in the normal form for a prefill batch without any cached
prefix (kv_b expands the latent, causal attention over the new tokens) and in the weight-absorbed form otherwise
(decode reads each request's (kv_lora_rank + qk_rope_head_dim)-wide latent once for all heads); then a dense FFN
(the first `first_k_dense_replace` layers) or a MoE: gate, routed experts (weights read for the experts the tokens
touch: E * (1 - (1 - k/E)^T) in expectation, split per rank as the backend splits them), shared experts. Once per
step: embedding, final norm, lm_head on each request's last token. Collectives: `Step.collectives` when given, else
what the parallelism and MoE plugins declare for the step's tokens (plugins/cost/_layout.py), as is the split of
heads, vocabulary and experts over the ranks. Ranks wait for each other at every layer: a
step costs the slowest rank's attention, the FFN, and the communication, with no overlap.

Without a CUDA graph a step costs at least its kernel count x hardware.launch_overhead_us (the host launches
kernels one by one; the GPU runs them as they come).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from framework.core.registry import COST
from framework.contracts.cost import BatchShape, CostConfig, CostModel, InstanceShape, Step, itemsize
from framework.gpu.roofline import Roofline
from framework.model.config import WeightDtype
from plugins.cost._layout import declared_collectives, layout_for


@dataclass
class RooflineConfig(CostConfig):
    name: str = "roofline"       # the linear weights' format is the model's: model.weight_dtype (fp8: the fp8 peak)
    # SGLang v0.4's MLA decode kernel (triton_ops/decode_attention.py, _decode_grouped_att_m_fwd) runs one program
    # per request per block of BLOCK_H = 16 heads, and each program reads the request's whole latent: a rank with
    # h heads reads it ceil(h / 16) times (TP x8 of DeepSeek-V2: once; DP attention: 8 times). 0: once for all heads
    # (a FlashMLA-style kernel)
    decode_head_block: int = 16


def expected_touched(experts: int, top_k: int, tokens: float) -> float:
    """Distinct experts `tokens` tokens pick, in expectation under uniform routing: a token misses a given expert
    with probability 1 - k/E."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def _total(*times: float) -> tuple[float, int]:
    """(seconds, kernels) of kernels run one after another (a zero-time kernel is not launched)."""
    return sum(times), sum(1 for t in times if t > 0)


@COST.register("roofline")
class RooflineCost(CostModel):
    Config = RooflineConfig

    def __init__(self, cfg: RooflineConfig, instance: InstanceShape) -> None:
        super().__init__(cfg, instance)
        if cfg.decode_head_block < 0:
            raise ValueError(f"sim.cost.decode_head_block must be >= 0 (0: the latent read once), got "
                             f"{cfg.decode_head_block}")
        m = instance.model
        self.m, self.lay, self.rf = m, layout_for(instance), Roofline(instance.hardware)
        if m.num_heads % self.lay.attn_tp:
            raise ValueError(f"model.num_heads={m.num_heads} is not divisible by the attention-TP degree "
                             f"{self.lay.attn_tp}")
        self.heads = m.num_heads // self.lay.attn_tp
        self.act = itemsize(m.dtype)
        self.wdtype, self.wbytes = ("fp8", 1) if m.weight_dtype == WeightDtype.fp8 else (m.dtype, self.act)
        self.moe_layers = m.num_layers - m.first_k_dense_replace
        h, a, width = self.heads, self.act, m.kv_cache_width
        self._normal_flops = h * (m.qk_head_dim + m.v_head_dim)       # x n(n+1) per request: causal, half of n x n
        self._normal_bytes = h * (2 * m.qk_head_dim + 2 * m.v_head_dim) * a   # per token: q, k, v in, out
        self._absorbed_flops = 2 * h * (width + m.kv_lora_rank)          # per (query, key) pair: scores, values
        self._absorbed_bytes = h * (width + m.kv_lora_rank) * a          # per token: q in latent space, out
        self._latent_bytes = width * a                                  # per cached token
        block = cfg.decode_head_block
        self._decode_latent_reads = -(-h // block) if block > 0 else 1   # per cached token per decode step
        # all but attention over the KV depends on token counts only, and a simulator asks for the same few counts
        # again and again: cache those parts per instance
        for part in ("_projections", "_head", "_ffn", "_declared_comm"):
            setattr(self, part, lru_cache(maxsize=16384)(getattr(self, part)))

    # -- the step ------------------------------------------------------------------------------------------------
    def step_time(self, step: Step) -> float:
        return self.step_breakdown(step)["total_s"]

    def step_breakdown(self, step: Step) -> dict[str, float]:
        """Seconds per part of the step (attention, ffn, head, comm, launch), its kernel count, and the total."""
        lay, m = self.lay, self.m
        if len(step.batches) != lay.groups:
            raise ValueError(f"a step of parallel={self.instance.parallel} on {lay.size} GPUs has {lay.groups} "
                             f"batches (one per scheduler), got {len(step.batches)}")
        attn = head = 0.0
        kernels = t_max = total = 0
        for b in step.batches:
            t = sum(b.new_tokens)
            total += t
            t_max = t if t > t_max else t_max
            if b.mode == "idle" or not t:
                continue                                  # an IDLE batch skips attention but joins every FFN
            a, ka = self._attention(b, t)
            h, kh = self._head(t, len(b.new_tokens))
            # ranks wait for each other at every layer: the slowest batch sets each part's pace
            attn, head = (a if a > attn else attn), (h if h > head else head)
            kernels = max(kernels, ka * m.num_layers + kh)
        ffn, kf = self._ffn(t_max, total)
        if step.collectives is None:
            comm, kc = self._declared_comm(tuple(sum(b.new_tokens) for b in step.batches),
                                           tuple(len(b.new_tokens) for b in step.batches))
        else:
            comm = sum(c.count * self.rf.collective(c.kind, c.nbytes, c.ranks) for c in step.collectives)
            kc = sum(c.count for c in step.collectives)
        gpu = m.num_layers * attn + ffn + head + comm
        kernels += kf + kc
        launch = 0.0 if step.graph else kernels * self.instance.hardware.launch_overhead_us * 1e-6
        return {"attention_s": m.num_layers * attn, "ffn_s": ffn, "head_s": head, "comm_s": comm,
                "launch_s": launch, "kernels": kernels, "total_s": max(gpu, launch)}

    def _ffn(self, t_max: int, total: int) -> tuple[float, int]:
        """Every dense FFN and MoE layer of a step whose largest batch has `t_max` tokens, `total` in all."""
        lay, m = self.lay, self.m
        gathered = lay.groups * t_max                     # padded to the largest batch (SGLang v0.4's all-gather)
        dense, kd = self._dense(gathered)
        if lay.moe_tokens == "all":
            moe, km = self._moe(gathered, gathered)
        else:                                             # each rank passes its own tokens; its experts get theirs
            moe, km = self._moe(t_max if lay.groups > 1 else -(-t_max // lay.size), total)
        n_dense = m.first_k_dense_replace
        return n_dense * dense + self.moe_layers * moe, n_dense * kd + self.moe_layers * km

    def _declared_comm(self, tokens: tuple[int, ...], reqs: tuple[int, ...]) -> tuple[float, int]:
        collectives = declared_collectives(self.instance, self.lay, tokens, reqs)
        return (sum(c.count * self.rf.collective(c.kind, c.nbytes, c.ranks) for c in collectives),
                sum(c.count for c in collectives))

    # -- attention: one layer, one scheduler's batch ----------------------------------------------------------------
    def _attention(self, b: BatchShape, t: int) -> tuple[float, int]:
        """SGLang v0.4 runs the normal form for a prefill batch without any cached prefix, else the absorbed one."""
        normal = b.mode == "extend" and not any(b.prefix)
        proj, kernels = self._projections(t, normal)
        if normal:                                        # kv_b expands the latent; causal attention per request
            flops = self._normal_flops * sum(n * (n + 1) for n in b.new_tokens)
            nbytes = t * self._normal_bytes
        else:                                             # over the latent (decode: read once per head block)
            seen = sum(b.prefix) + t
            scored = seen if b.mode == "decode" else sum(n * p + n * (n + 1) / 2
                                                         for n, p in zip(b.new_tokens, b.prefix))
            flops = self._absorbed_flops * scored
            reads = self._decode_latent_reads if b.mode == "decode" else 1
            nbytes = seen * self._latent_bytes * reads + t * self._absorbed_bytes
        return proj + self.rf.attention(flops, nbytes), kernels + 1

    def _projections(self, t: int, normal: bool) -> tuple[float, int]:
        """Everything of an attention layer but the attention kernel: it depends on the token count only."""
        m, rf, h, a = self.m, self.rf, self.heads, self.act
        gemm = self._gemm
        if m.q_lora_rank:
            q = (gemm(t, m.q_lora_rank, m.hidden_size), rf.memop("rmsnorm", 2 * t * m.q_lora_rank * a),
                 gemm(t, h * m.qk_head_dim, m.q_lora_rank))
        else:
            q = (gemm(t, h * m.qk_head_dim, m.hidden_size),)
        if normal:                                        # kv_b: the latent -> per-head keys and values
            latent = (gemm(t, h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),)
        else:                                             # W_UK folds q_nope into latent space, W_UV lifts the out
            latent = (gemm(t, m.kv_lora_rank, m.qk_nope_head_dim, batch=h),
                      gemm(t, m.v_head_dim, m.kv_lora_rank, batch=h))
        return _total(*[rf.memop("rmsnorm", 4 * t * m.hidden_size * a)] * 2,   # fused add + norm, before attn and ffn
                      *q, gemm(t, m.kv_cache_width, m.hidden_size),
                      rf.memop("rmsnorm", 2 * t * m.kv_lora_rank * a),
                      rf.memop("rope", 2 * t * (h + 1) * m.qk_rope_head_dim * a),
                      *latent, gemm(t, m.hidden_size, h * m.v_head_dim))

    # -- FFN layers ------------------------------------------------------------------------------------------------
    def _mlp(self, t: float, inter: float, batch: float = 1.0, assigned: float | None = None) -> tuple[float, int]:
        """SiLU-gated MLP: gate_up, act, down. `batch` experts sharing `assigned` (token, expert) rows."""
        rows = t if assigned is None else assigned
        return _total(self._gemm(t, 2 * inter, self.m.hidden_size, batch=batch),
                      self.rf.memop("act", rows * 3 * inter * self.act),
                      self._gemm(t, self.m.hidden_size, inter, batch=batch))

    def _dense(self, t: int) -> tuple[float, int]:
        return self._mlp(t, self.m.intermediate_size / self.lay.size)

    def _moe(self, t_in: int, t_routed: int) -> tuple[float, int]:
        """One MoE layer on a rank whose backend takes `t_in` tokens and whose experts serve `t_routed` tokens' picks
        (the same unless an all-to-all backend brings each rank the tokens routed to its experts)."""
        m, lay, rf = self.m, self.lay, self.rf
        e, k = m.n_routed_experts, m.num_experts_per_tok
        gate = _total(self._gemm(t_in, e, m.hidden_size, quantized=False),
                      rf.memop("act", t_in * e * 4))                        # logits, then the fp32 top-k
        assigned = t_routed * k / lay.expert_split
        touched = expected_touched(e, k, t_routed) / lay.expert_split
        inter = m.moe_intermediate_size / lay.inter_split
        routed = self._mlp(assigned / touched, inter, batch=touched, assigned=assigned) if touched else (0.0, 0)
        combine = _total(rf.memop("add", (assigned + t_in) * m.hidden_size * self.act))       # weighted sum
        shared = (0.0, 0)
        if m.n_shared_experts:
            sliced = lay.size if lay.moe_partial else 1
            shared = self._mlp(t_in, m.n_shared_experts * m.moe_intermediate_size / sliced)
        parts = (gate, routed, combine, shared)
        return sum(p[0] for p in parts), sum(p[1] for p in parts)

    def _head(self, t: int, reqs: int) -> tuple[float, int]:
        """Embedding, final norm, lm_head on each request's last token (vocabulary split across attention TP)."""
        m, rf, a = self.m, self.rf, self.act
        return _total(rf.memop("emb", 2 * t * m.hidden_size * a), rf.memop("rmsnorm", 2 * t * m.hidden_size * a),
                      self._gemm(reqs, m.vocab_size / self.lay.attn_tp, m.hidden_size, quantized=False))

    def _gemm(self, t: float, n: float, k: float, batch: float = 1.0, quantized: bool = True) -> float:
        """A linear layer; fp8 checkpoints keep the router gate and lm_head in the model's dtype (quantized=False)."""
        dtype, wbytes = (self.wdtype, self.wbytes) if quantized else (self.m.dtype, self.act)
        return self.rf.gemm(t, n, k, batch=batch, dtype=dtype, weight_bytes=wbytes, act_bytes=self.act)
