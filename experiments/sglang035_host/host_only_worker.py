"""SGLang 0.3.5's own scheduler process with the GPU taken out (issue 19, items 3, 4 and 6).

Runs in the side environment of this folder's requirements.txt (sglang 0.3.5 and its 2024 front end), never in
servelab's. `Scheduler` is sglang's, unchanged; only its tensor-parallel worker is replaced by `HostOnlyWorker`,
which owns real sglang memory pools on the CPU and, for each forward, sleeps the GPU time it is given and returns
the next token of each request from a text's token stream. Everything the scheduler does around a forward (batch
formation, prepare_for_decode, get_model_worker_batch, result processing, stream_output and its zmq send) is
sglang's code. What the worker itself does around the GPU in the real server (ForwardBatch.init_new, the attention
backend's metadata, sampling's host part) is not here: the figures are a lower bound of the scheduler process's.

Three modules that only the GPU path uses (the model worker, its overlap twin, the logits processor) do not import
without vllm 0.6.3's compiled ops; they are replaced by empty modules before sglang's scheduler is imported, and
`vllm.logger` (whose level the scheduler sets at start) by a plain logger; `pyairports` (outlines imports it for
a regex type; its only wheel installs no module) by an empty list. No function of theirs runs on the measured path.
"""
import json
import logging
import os
import sys
import time
import types

for _name in ("sglang.srt.managers.tp_worker", "sglang.srt.managers.tp_worker_overlap_thread",
              "sglang.srt.layers.logits_processor"):
    _m = types.ModuleType(_name)
    _m.TpModelWorker = _m.TpModelWorkerClient = _m.LogitsProcessorOutput = None
    sys.modules.setdefault(_name, _m)
if "pyairports" not in sys.modules:     # outlines' airport regex type: its pyairports wheel has no module
    sys.modules["pyairports"] = types.ModuleType("pyairports")
    sys.modules["pyairports.airports"] = types.ModuleType("pyairports.airports")
    sys.modules["pyairports.airports"].AIRPORT_LIST = []
if "vllm" not in sys.modules:
    sys.modules["vllm"] = types.ModuleType("vllm")
    sys.modules["vllm.logger"] = types.ModuleType("vllm.logger")
    sys.modules["vllm.logger"].logger = logging.getLogger("vllm")

import torch  # noqa: E402
import sglang.srt.managers.scheduler as sglang_scheduler  # noqa: E402
from sglang.srt.configs.model_config import AttentionArch, ModelConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.managers.schedule_batch import global_server_args_dict  # noqa: E402
from sglang.srt.hf_transformers_utils import get_tokenizer  # noqa: E402

# The harness's settings reach the spawned scheduler process through the environment (launch_server pickles only
# sglang's own arguments).
ENV = "SGLANG035_HOST_ONLY"


def settings() -> dict:
    return json.loads(os.environ[ENV])


class HostOnlyWorker:
    """TpModelWorker's interface (sglang 0.3.5 managers/tp_worker.py) without a model or a GPU."""

    def __init__(self, server_args, gpu_id, tp_rank, dp_rank, nccl_port):
        cfg = settings()
        # ModelRunner.__init__'s update (sglang 0.3.5 model_executor/model_runner.py), which the batches read
        global_server_args_dict.update({k: getattr(server_args, k) for k in (
            "attention_backend", "sampling_backend", "triton_attention_reduce_in_fp32", "disable_mla",
            "torchao_config", "disable_penalizer", "disable_nan_detection")})
        self.model_config = ModelConfig(server_args.model_path, trust_remote_code=server_args.trust_remote_code,
                                        context_length=server_args.context_length,
                                        model_override_args=server_args.json_model_override_args,
                                        is_embedding=server_args.is_embedding)
        self.max_total_num_tokens = int(cfg["max_total_num_tokens"])
        # ModelRunner.init_memory_pool's request pool: between 2,048 and 4,096 slots
        max_num_reqs = min(max(int(self.max_total_num_tokens / self.model_config.context_len * 512), 2048), 4096)
        if server_args.max_running_requests is not None:
            max_num_reqs = min(max_num_reqs, server_args.max_running_requests)
        self.req_to_token_pool = ReqToTokenPool(size=max_num_reqs + 1,
                                                max_context_len=self.model_config.context_len + 4,
                                                device="cpu", use_records=False)
        # One layer: the pool's bookkeeping (free slots, groups) is per token, not per layer.
        if self.model_config.attention_arch == AttentionArch.MLA:
            self.token_to_kv_pool = MLATokenToKVPool(
                self.max_total_num_tokens, dtype=torch.bfloat16, kv_lora_rank=self.model_config.kv_lora_rank,
                qk_rope_head_dim=self.model_config.qk_rope_head_dim, layer_num=1, device="cpu")
        else:
            self.token_to_kv_pool = MHATokenToKVPool(self.max_total_num_tokens, dtype=torch.bfloat16, head_num=1,
                                                     head_dim=8, layer_num=1, device="cpu")
        self.max_prefill_tokens = server_args.max_prefill_tokens
        self.max_running_requests = min(self.max_total_num_tokens // 2 if server_args.max_running_requests is None
                                        else server_args.max_running_requests, self.req_to_token_pool.size)
        self.max_req_len = min(self.model_config.context_len - 1, self.max_total_num_tokens - 1)
        self.max_req_input_len = self.max_req_len - 5
        self.random_seed = server_args.random_seed
        # The answers: consecutive tokens of an English text, each request from its own offset, so the
        # detokenizer sees text-like pieces (a model's output), not random ids.
        tok = get_tokenizer(server_args.tokenizer_path)
        with open(cfg["answer_text"]) as f:
            self.stream = tok.encode(f.read(), add_special_tokens=False)
        self.decode_s, self.extend_s = cfg["decode_s"], cfg["extend_s"]
        self.log = open(cfg["step_log"], "w", buffering=1)
        self.log.write(f"pid {os.getpid()}\n")
        self.last_cpu = time.process_time()

    def get_worker_info(self):
        return (self.max_total_num_tokens, self.max_prefill_tokens, self.max_running_requests, self.max_req_len,
                self.max_req_input_len, self.random_seed, "cpu", global_server_args_dict,
                self.req_to_token_pool.size, self.req_to_token_pool.max_context_len, self.token_to_kv_pool.size)

    def get_pad_input_ids_func(self):
        return None

    def get_tp_cpu_group(self):
        return None  # tp_size 1: the scheduler broadcasts nothing

    def get_memory_pool(self):
        return self.req_to_token_pool, self.token_to_kv_pool

    def forward_batch_generation(self, batch):
        # The process's CPU since the last forward returned is the scheduler's work around this one.
        cpu = time.process_time()
        decode = batch.forward_mode.is_decode()
        bs = len(batch.seq_lens)
        new_tokens = bs if decode else int(batch.extend_num_tokens)
        self.log.write(f"{'D' if decode else 'E'} {bs} {new_tokens} {int(batch.seq_lens_sum)} "
                       f"{cpu - self.last_cpu:.6f} {time.time():.6f}\n")
        time.sleep(self.decode_s if decode else self.extend_s)
        seq_lens = batch.seq_lens.tolist()
        pool = batch.req_pool_indices.tolist()
        n = len(self.stream)
        next_ids = torch.tensor([self.stream[(p * 7919 + s) % n] for p, s in zip(pool, seq_lens)], dtype=torch.int64)
        self.last_cpu = time.process_time()
        return None, next_ids


def run_scheduler_process(server_args, port_args, gpu_id, tp_rank, dp_rank, pipe_writer):
    """sglang's run_scheduler_process, with the host-only worker in the scheduler module's TpModelWorker."""
    sglang_scheduler.TpModelWorker = HostOnlyWorker
    sglang_scheduler.run_scheduler_process(server_args, port_args, gpu_id, tp_rank, dp_rank, pipe_writer)
