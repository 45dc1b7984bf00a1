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
from plugins.cost._host import combine, eager_floor_s, overlapped, scheduler_s
from plugins.cost._layout import declared_collectives, layout_for


@dataclass
class RooflineConfig(CostConfig):
    name: str = "roofline"       # the linear weights' format is the model's: model.weight_dtype (fp8: the fp8 peak)
    # SGLang v0.4's MLA decode kernel (triton_ops/decode_attention.py, _decode_grouped_att_m_fwd) runs one program
    # per request per block of BLOCK_H = 16 heads, and each program reads the request's whole latent: a rank with
    # h heads reads it ceil(h / 16) times (TP x8 of DeepSeek-V2: once; DP attention: 8 times). 0: once for all heads
    # (a FlashMLA-style kernel)
    decode_head_block: int = 16
    # -- SGLang v0.4's kernels (issue 19, item 5; docs/fidelity.md "Cost model terms") -----------------------------
    # the Triton MLA decode runs in two stages (decode_attention.py, num_kv_splits=8): stage 1 writes each split's
    # fp32 partial output and log-sum-exp (B x H x splits x (kv_lora_rank + 1) x 4 bytes), stage 2 reads them and
    # reduces. 0: one stage (no partials)
    mla_decode_kv_splits: int = 8
    # the fraction of the attention compute rate the absorbed-MLA extend kernel (extend_attention.py over the
    # 576/512-wide latent) reaches; no public measurement of the 2024 kernel: 1.0 (the dense-GEMM fit)
    absorbed_extend_eff: float = 1.0
    # fp8 checkpoints: every fp8 GEMM's input is quantized per token first (vLLM's scaled_fp8_quant, which v0.4
    # calls): one kernel reading the bf16 activations and writing fp8 + one scale per row
    fp8_act_quant: bool = True
    # the fraction of the fitted GEMM rates the fp8 Triton fused MoE (fused_moe_triton, default configs) reaches;
    # no public measurement of the 2024 kernel: 1.0 (the dense-GEMM fit)
    fused_moe_fp8_eff: float = 1.0
    # -- the host (issue 19, item 4; plugins/cost/_host.py) ----------------------------------------------------------
    overlap_schedule: str = "auto"    # auto: v0.4's choice (off under DP attention or on Triton attention) | on | off
    attention_backend: str = "auto"   # auto: triton (v0.4 runs every MLA model on it) | triton | flashinfer
    # servelab's scheduler on this repository's CPU (experiments/calibrate/host.py, results.json "fit")
    host_step_us: float = 57.5
    host_running_us: float = 0.84
    host_new_req_us: float = 12.8
    # the 2024 H100 host's single-thread time / this machine's (Geekbench 5 single thread: Xeon Platinum 8468,
    # Sapphire Rapids as in a DGX H100, 1,257 vs EPYC 7763 at this machine's 2.45 GHz, 1,249)
    host_speed_factor: float = 0.994
    eager_floor: bool = True          # an eager forward costs at least the host's launches per layer (below)
    # SGLang PR #1401 (bench_latency, batch 1, Triton, eager): Llama-3-8B 9.28 ms / 32 layers; DeepSeek-Coder-V2-Lite
    # "4x" its graph's 6.22 ms = 24.9 ms, less one dense layer, over its 26 MLA + MoE layers
    eager_dense_layer_us: float = 290.0
    eager_moe_layer_us: float = 946.0
    # -- the front end (issue 19, item 3; framework/sim/frontend.py): one TokenizerManager per server process ------
    frontend: bool = True
    tokenize_us_per_token: float = 0.0    # not measured (no HF tokenizer offline): 0
    stream_us_per_chunk: float = 8.0      # experiments/calibrate/host.py: detokenize + one SSE event per request
    stream_interval: int = 1              # SGLang's --stream-interval: a chunk every this many tokens


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
        bad = [f"sim.cost.{k}={getattr(cfg, k)} must be > 0 and <= 1" for k in ("absorbed_extend_eff",
                                                                              "fused_moe_fp8_eff")
               if not 0 < getattr(cfg, k) <= 1]
        bad += [f"sim.cost.{k}={getattr(cfg, k)} must be >= 0" for k in
                ("mla_decode_kv_splits", "host_step_us", "host_running_us", "host_new_req_us", "host_speed_factor",
                 "eager_dense_layer_us", "eager_moe_layer_us", "tokenize_us_per_token", "stream_us_per_chunk")
                if getattr(cfg, k) < 0]
        if cfg.stream_interval < 1:
            bad.append(f"sim.cost.stream_interval={cfg.stream_interval} must be >= 1")
        if bad:
            raise ValueError("; ".join(bad))
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
        self.overlap = overlapped(cfg, self.lay.groups)
        self.eager_floor = eager_floor_s(cfg, m.first_k_dense_replace, self.moe_layers)
        # two-stage decode: per request and head, each split's fp32 partial output and log-sum-exp, written by
        # stage 1 and read by stage 2
        self._partials_bytes = h * cfg.mla_decode_kv_splits * (m.kv_lora_rank + 1) * 4
        self._fp8_quant = cfg.fp8_act_quant and self.wdtype == "fp8"
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
        sched = scheduler_s(self.cfg, step)
        forward, total = combine(self.cfg, gpu, launch, step.graph, sched, self.overlap, self.eager_floor)
        return {"attention_s": m.num_layers * attn, "ffn_s": ffn, "head_s": head, "comm_s": comm,
                "launch_s": launch, "kernels": kernels, "gpu_s": gpu, "forward_s": forward, "scheduler_s": sched,
                "total_s": total}

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
            if b.mode == "decode" and self._partials_bytes:      # stage 1 writes the partials, stage 2 reads them
                partials = t * self._partials_bytes
                return (proj + self.rf.attention(flops, nbytes + partials)
                        + self.rf.attention(partials / 2, partials), kernels + 2)   # 2 FLOPs per fp32 read
            if b.mode == "extend":
                flops /= self.cfg.absorbed_extend_eff
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
    def _mlp(self, t: float, inter: float, batch: float = 1.0, assigned: float | None = None,
             tokens_in: float | None = None) -> tuple[float, int]:
        """SiLU-gated MLP: gate_up, act, down. `batch` experts sharing `assigned` (token, expert) rows, gathered from
        `tokens_in` tokens (the fused MoE quantizes those once for its first GEMM, the assigned rows for its second)."""
        rows = t if assigned is None else assigned
        eff = self.cfg.fused_moe_fp8_eff if assigned is not None and self.wdtype == "fp8" else 1.0
        return _total(self._gemm(t, 2 * inter, self.m.hidden_size, batch=batch, eff=eff, quant_rows=tokens_in),
                      self.rf.memop("act", rows * 3 * inter * self.act),
                      self._gemm(t, self.m.hidden_size, inter, batch=batch, eff=eff))

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
        routed = (self._mlp(assigned / touched, inter, batch=touched, assigned=assigned, tokens_in=t_routed)
                  if touched else (0.0, 0))
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

    def _gemm(self, t: float, n: float, k: float, batch: float = 1.0, quantized: bool = True,
              eff: float = 1.0, quant_rows: float | None = None) -> float:
        """A linear layer; fp8 checkpoints keep the router gate and lm_head in the model's dtype (quantized=False).
        `eff`: the kernel's fraction of the fitted GEMM rates. An fp8 GEMM's input is quantized first
        (`fp8_act_quant`: one elementwise kernel reading `quant_rows` (default t x batch) x k bf16 and writing them
        in fp8)."""
        dtype, wbytes = (self.wdtype, self.wbytes) if quantized else (self.m.dtype, self.act)
        time = self.rf.gemm(t, n, k, batch=batch, dtype=dtype, weight_bytes=wbytes, act_bytes=self.act) / eff
        if quantized and self._fp8_quant and t > 0:
            rows = t * batch if quant_rows is None else quant_rows
            time += self.rf.memop("act", rows * k * (self.act + 1))
        return time
