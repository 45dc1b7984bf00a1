from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional


class SchedulePolicy(enum.StrEnum):
    """The order a prefill batch takes waiting requests in (`engine.schedule_policy`, SGLang's)."""
    fcfs = "fcfs"   # arrival order
    lpm = "lpm"     # longest prefix match first (fcfs beyond 128 waiting)


class EngineScheduler(enum.StrEnum):
    """Whose scheduler an engine runs (`engine.scheduler`)."""
    sglang = "sglang"              # SGLang v0.4's (framework/engine/scheduler.py, schedule_policy.py)
    vllm_v0_1_7 = "vllm_v0_1_7"    # vLLM's, as DistServe's artifact ran its baseline (framework/engine/vllm_policy.py)


class Device(enum.StrEnum):
    """Where the engine runs (`engine.device`)."""
    auto = "auto"   # cuda when a GPU is visible, else cpu
    cpu = "cpu"
    cuda = "cuda"


class Role(enum.StrEnum):
    """What an instance serves (`engine.role`; per worker: `cluster.roles`): SGLang's --disaggregation-mode."""
    mixed = "mixed"      # prefill and decode on one instance (SGLang's "null")
    prefill = "prefill"  # computes a prompt's KV, hands it to a decode instance, answers with the first token
    decode = "decode"    # pre-allocates a request's KV slots, receives the KV and the first token, then decodes


SCHEDULE_POLICIES = tuple(p.value for p in SchedulePolicy)
ENGINE_SCHEDULERS = tuple(e.value for e in EngineScheduler)
ROLES = tuple(r.value for r in Role)
DEVICES = tuple(d.value for d in Device)
# when a prefill instance prefills a paired request (`engine.disaggregation_order`): sglang, once its decode side
# has pre-allocated the slots and sent the room's destination (SGLang's bootstrap queue); distserve, at once, its KV
# held until the destination comes (DistServe's pull; can deadlock, broken by engine.disaggregation_timeout_s)
DISAGGREGATION_ORDERS = ("sglang", "distserve")


@dataclass
class EngineConfig:
    mem_budget_mb: float = 72.0           # per rank, weights + KV (SGLang's static memory): KV = budget - weights
    kv_budget_mb: Optional[float] = None  # set: the KV pool per rank is exactly this, whatever the weights
    chunked_prefill_tokens: int = 512      # extend tokens per step; a longer prompt is prefilled in chunks
    max_prefill_tokens: int = 16384        # SGLang's max_prefill_tokens: input tokens one prefill batch admits
    max_running_requests: Optional[int] = 256   # None: SGLang's, from the KV pool (sglang_max_running_requests)
    schedule_policy: SchedulePolicy = SchedulePolicy.lpm
    radix_cache: bool = True
    # whose scheduler: sglang, or vllm_v0_1_7 (DistServe's vLLM baseline: prefill-first, no chunking, blocks with a
    # watermark, preemption by recomputation; engine.max_prefill_tokens is its max_num_batched_tokens and
    # engine.max_running_requests its max_num_seqs; needs radix_cache=false)
    scheduler: EngineScheduler = EngineScheduler.sglang
    vllm_block_size: int = 16             # vLLM's --block-size
    vllm_watermark: float = 0.01          # vLLM's BlockSpaceManager watermark (a share of the blocks)
    # SGLang's new-token ratio (global_config.py): admission reserves running requests' future tokens times the
    # ratio; it starts at init x schedule_conservativeness, decays to factor x that over decay_steps decode steps,
    # and resets when the engine idles
    init_new_token_ratio: float = 0.7
    min_new_token_ratio_factor: float = 0.14
    new_token_ratio_decay_steps: float = 600
    # servelab's variant (off = SGLang): after an EXTEND step a DECODE step follows whenever requests are decoding,
    # so a burst of prefills never stalls running decodes for more than one step
    alternate_extend_decode: bool = False
    device: Device = Device.auto
    # keep freed host memory mapped (framework/engine/host_memory.py), as PyTorch's CUDA caching allocator keeps device
    # memory: false is glibc's default, a fresh mmap and page faults for every large activation of every step
    host_allocator_cache: bool = True
    # a path prefix: each engine appends one JSON line per step to <prefix>.<pid>.<n>.jsonl: its rank, the batches'
    # shapes as the simulator prices them and the rank's CPU seconds in the step (experiments/sim_fidelity/
    # step_shapes.py reads them)
    step_cpu_log: Optional[str] = None
    # CUDA graphs for decode (SGLang's CudaGraphRunner, framework/engine/cuda_graph.py): a graph per batch-size
    # bucket captured at start, a decode step padded to its bucket and replayed; on a CUDA device only
    cuda_graph: bool = True               # false: SGLang's --disable-cuda-graph
    cuda_graph_max_bs: Optional[int] = None   # the largest bucket; None: SGLang's 160 (under DP attention: below)
    cuda_graph_bs: list[int] = field(default_factory=list)   # the buckets; empty: [1, 2, 4] + multiples of 8
    # the default cap under DP attention: SGLang v0.4.1's 160 (PR #2484); 96: v0.4.0's min(cuda_graph_max_bs, 96)
    cuda_graph_dp_attention_max_bs: int = 160
    cuda_graph_max_context: int = 2048    # slots a captured decode attends over; a longer context runs eagerly
    # prefill/decode disaggregation (framework/instance/kv_connector.py; SGLang's --disaggregation-* flags)
    role: Role = Role.mixed
    disaggregation_transfer_backend: str = "auto"   # mooncake | tcp | auto (mooncake where it loads, else tcp)
    disaggregation_bootstrap_port: int = 8998   # prefill: where decode instances send a room's destination
    disaggregation_host: str = "127.0.0.1"      # the address this instance's transfer endpoints are reached at
    disaggregation_layerwise: bool = False      # true: one transfer per layer; false: one per request
    disaggregation_decode_prefix_reuse: bool = False   # decode: receive only what its radix cache lacks (servelab)
    disaggregation_local_prefill: bool = False   # decode: serve a request without bootstrap fields whole (servelab)
    disaggregation_timeout_s: float = 60.0      # a room unpaired, or a transfer unanswered, this long fails
    disaggregation_order: str = "sglang"        # prefill: sglang | distserve (DISAGGREGATION_ORDERS; sim.pd_order)
    # decode: future tokens kept free per decoding request before another request's slots are pre-allocated (SGLang's
    # SGLANG_NUM_RESERVED_DECODE_TOKENS, 512); 0: DistServe's decode admission (a request is taken when its prompt's
    # blocks fit; running out later retracts, where DistServe swaps to CPU)
    disaggregation_decode_reserve_tokens: int = 512

    def validate(self) -> None:
        problems = []
        if self.mem_budget_mb <= 0:
            problems.append(f"engine.mem_budget_mb must be > 0, got {self.mem_budget_mb}")
        if self.kv_budget_mb is not None and self.kv_budget_mb <= 0:
            problems.append(f"engine.kv_budget_mb must be > 0 (or null: KV = mem_budget_mb - weights), "
                            f"got {self.kv_budget_mb}")
        for key in ("chunked_prefill_tokens", "max_prefill_tokens", "max_running_requests"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                problems.append(f"engine.{key} must be >= 1, got {getattr(self, key)}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            problems.append(f"engine.schedule_policy={self.schedule_policy!r} is not one of {', '.join(SCHEDULE_POLICIES)}")
        if self.scheduler not in ENGINE_SCHEDULERS:
            problems.append(f"engine.scheduler={self.scheduler!r} is not one of {', '.join(ENGINE_SCHEDULERS)}")
        elif self.scheduler != EngineScheduler.sglang:
            if self.radix_cache:
                problems.append(f"engine.scheduler={self.scheduler} has no prefix caching: "
                                f"set engine.radix_cache=false")
            if self.role != Role.mixed or self.alternate_extend_decode:
                problems.append(f"engine.scheduler={self.scheduler} runs a mixed instance with its own step order: "
                                f"engine.role must be mixed and engine.alternate_extend_decode false")
        if self.vllm_block_size < 1:
            problems.append(f"engine.vllm_block_size must be >= 1, got {self.vllm_block_size}")
        if not 0 <= self.vllm_watermark < 1:
            problems.append(f"engine.vllm_watermark must be in [0, 1), got {self.vllm_watermark}")
        if not 0 <= self.init_new_token_ratio <= 1:
            problems.append(f"engine.init_new_token_ratio must be in [0, 1], got {self.init_new_token_ratio}")
        if not 0 <= self.min_new_token_ratio_factor <= 1:
            problems.append(f"engine.min_new_token_ratio_factor must be in [0, 1], got {self.min_new_token_ratio_factor}")
        if self.new_token_ratio_decay_steps <= 0:
            problems.append(f"engine.new_token_ratio_decay_steps must be > 0, got {self.new_token_ratio_decay_steps}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            problems.append(f"engine.cuda_graph_max_bs must be >= 1 (or null: SGLang's 160), got "
                            f"{self.cuda_graph_max_bs}")
        if self.cuda_graph_dp_attention_max_bs < 1:
            problems.append(f"engine.cuda_graph_dp_attention_max_bs must be >= 1 (160: SGLang v0.4.1, 96: v0.4.0), "
                            f"got {self.cuda_graph_dp_attention_max_bs}")
        if any(b < 1 for b in self.cuda_graph_bs):
            problems.append(f"engine.cuda_graph_bs must hold batch sizes >= 1 (or be empty: SGLang's buckets), "
                            f"got {list(self.cuda_graph_bs)}")
        if self.cuda_graph_max_context < 1:
            problems.append(f"engine.cuda_graph_max_context must be >= 1, got {self.cuda_graph_max_context}")
        if self.role not in ROLES:
            problems.append(f"engine.role={self.role!r} is not one of {', '.join(ROLES)}")
        if self.disaggregation_order not in DISAGGREGATION_ORDERS:
            problems.append(f"engine.disaggregation_order={self.disaggregation_order!r} is not one of "
                            f"{', '.join(DISAGGREGATION_ORDERS)}")
        if self.disaggregation_timeout_s <= 0:
            problems.append(f"engine.disaggregation_timeout_s must be > 0, got {self.disaggregation_timeout_s}")
        if self.disaggregation_decode_reserve_tokens < 0:
            problems.append(f"engine.disaggregation_decode_reserve_tokens must be >= 0 (512: SGLang's, 0: DistServe's), "
                            f"got {self.disaggregation_decode_reserve_tokens}")
        if not 0 <= self.disaggregation_bootstrap_port < 65536:
            problems.append(f"engine.disaggregation_bootstrap_port must be a port (0-65535), got "
                            f"{self.disaggregation_bootstrap_port}")
        if self.device not in DEVICES:
            problems.append(f"engine.device={self.device!r} is not one of {', '.join(DEVICES)}")
        if problems:
            raise ValueError("; ".join(problems))


def sglang_max_running_requests(kv_tokens: int, context_len: int) -> int:
    """SGLang v0.4's running-request cap with --max-running-requests unset: the req_to_token pool holds
    clamp(kv_tokens / context_len * 512, 2048, 4096) + 1 rows (model_runner.init_memory_pool) and the scheduler
    admits at most min(kv_tokens // 2, that) (tp_worker); per DP rank under DP attention (each has its own pool)."""
    rows = min(max(int(kv_tokens / context_len * 512), 2048), 4096) + 1
    return max(min(kv_tokens // 2, rows), 1)
