"""Start sglang 0.3.5's server (its launch_server: TokenizerManager and HTTP in this process, the detokenizer and
the scheduler in their own) with the host-only worker (host_only_worker.py). Run by run.py in the side environment.

    python launch.py --port P --model-dir DIR [--dp N]   (settings for the worker in $SGLANG035_HOST_ONLY)
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import host_only_worker  # noqa: E402  (the shims first)
import sglang.srt.server as server  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--chunked-prefill-size", type=int, default=8192)
    ap.add_argument("--max-running-requests", type=int, default=None)
    a = ap.parse_args()
    server.run_scheduler_process = host_only_worker.run_scheduler_process
    # PR #1970's server flags that reach the host path: radix cache off, its chunk, stream_interval 1 (0.3.5's
    # default), no overlap scheduler (0.3.5's default), one scheduler (tp 1: rank 0's work; the other ranks'
    # broadcast of the received requests is not here).
    args = ServerArgs(model_path=a.model_dir, tokenizer_path=a.model_dir, port=a.port, host="127.0.0.1",
                      disable_radix_cache=True, chunked_prefill_size=a.chunked_prefill_size,
                      attention_backend="triton", sampling_backend="pytorch", disable_cuda_graph=True,
                      max_running_requests=a.max_running_requests, log_level="warning", random_seed=0)
    server.launch_server(args)
