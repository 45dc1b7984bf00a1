"""The async HTTP load client: plays a workload's sessions against a base URL (the router, one worker, or any server
that speaks SGLang's native API or OpenAI's: an SGLang or vLLM server, a router started elsewhere), streaming, and
returns the same per-request records as the in-process driver (`framework.load.inprocess.play`).

`workload.api` picks the API: `generate` (native `POST /generate`, cumulative text and `meta_info` per event),
`completions` or `chat` (OpenAI `POST /v1/completions` / `/v1/chat/completions` with `stream_options.include_usage`,
delta text per chunk and the usage chunk at the end). `workload.max_concurrency` bounds the requests in flight (as
bench_serving's `--max-concurrency`); a multi-turn session holds no slot while it thinks.

Timing per request, from the first byte sent: TTFT at the first chunk that carries output, ITL between consecutive
such chunks, E2E at the end of the stream (as bench_serving, which waits for non-empty text; the native API's
token count also counts, so a first token that decodes to no text yet still starts the clock). Token counts come from the server (`meta_info`, or OpenAI `usage`, which
carries `prompt_tokens_details.cached_tokens`); a server that sends no usage gets the number of output chunks as its
completion tokens. A request never raises: a failure becomes a record with `ok=False` and the error. A request that
failed in a way another try may fix (a connection error, a 408/429/5xx, a stream that broke before it finished) is
sent again up to `retries` times, after a backoff with full jitter (or the server's Retry-After, when longer); the
router then picks a worker again. Every try shares one `request_timeout_s`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp
from tqdm import tqdm

from framework.core.records import RequestRecord
from framework.contracts.workload import Api, Session
from framework.load.load_sampler import LoadSampler
from framework.load.sessions import not_sent

WORKER_HEADER = "X-Servelab-Worker"    # set by servelab's router: which worker answered
ROUTE_HEADER = "X-Servelab-Route"      # ... and why: "<reason>; estimate=<cached>; of=<size>"
ENDPOINTS = {Api.generate: "/generate", Api.completions: "/v1/completions", Api.chat: "/v1/chat/completions"}
RETRY_BACKOFF_BASE_S, RETRY_BACKOFF_MAX_S = 0.2, 2.0   # retry k waits U(0, min(max, base * 2**(k-1)))


@dataclass
class _Try:
    record: RequestRecord
    answer: str = ""
    retriable: bool = False
    retry_after_s: float = 0.0        # the server's Retry-After (429/503)


@dataclass
class _Stream:
    """What one streamed answer has said so far."""
    t0: float
    text: str = ""
    chunks: list[float] = field(default_factory=list)     # arrival times of the chunks that carried output
    tokens: int = 0                                       # the server's completion-token count so far (native)
    usage: dict | None = None                             # prompt/completion/cached tokens, once the server says

    def output(self, t: float, piece: str, cumulative: bool, tokens: int | None = None) -> None:
        """A chunk with `piece` (the whole text so far when `cumulative`). It carries output when the text grew or,
        native API, the server's completion-token count did (a token can decode to no text yet)."""
        before = self.text
        self.text = piece if cumulative and piece.startswith(before) else before + piece
        grew = tokens is not None and tokens > self.tokens
        self.tokens = max(self.tokens, tokens or 0)
        if self.text != before or grew:
            self.chunks.append(t)


class LoadClient:
    def __init__(self, base_url: str, wl_cfg, *, request_timeout_s: float = 300.0, retries: int = 2,
                 progress: bool = False, metrics_url: str | None = None):
        if request_timeout_s <= 0 or retries < 0:
            raise ValueError(f"request_timeout_s must be > 0 and retries >= 0, got {request_timeout_s}, {retries}")
        self.base_url = base_url.rstrip("/")
        self.api = Api(wl_cfg.api)
        self.url = self.base_url + ENDPOINTS[self.api]
        self.metrics_url = metrics_url if metrics_url is not None else self.base_url + "/metrics"
        self.wl_cfg, self.timeout_s, self.max_retries, self.progress = wl_cfg, request_timeout_s, retries, progress
        self.model = wl_cfg.model
        self.retries = 0                  # tries beyond the first, over the whole run
        self._rng = random.Random(0)      # backoff jitter: retries of many clients do not arrive in step
        self.records: list[RequestRecord] = []   # filled as requests finish (a test can watch progress)
        self.load_timeline: dict = {}     # per-worker in-flight requests over the run (see load_sampler)

    def play(self, sessions: list[Session]) -> tuple[list[RequestRecord], float]:
        return asyncio.run(self.play_async(sessions))

    async def play_async(self, sessions: list[Session]) -> tuple[list[RequestRecord], float]:
        """Returns (records, duration_s): one record per turn, in completion order."""
        self.records = records = []
        limit = self.wl_cfg.max_concurrency
        slots = asyncio.Semaphore(limit) if limit > 0 else contextlib.nullcontext()
        bar = tqdm(total=sum(len(s.turns) for s in sessions), desc="requests", disable=not self.progress,
                   leave=False)
        connector = aiohttp.TCPConnector(limit=0)      # concurrency is the workload's to bound, not the pool's
        async with aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar(),
                                         timeout=aiohttp.ClientTimeout(total=None)) as http:
            if self.api is not Api.generate and not self.model:
                self.model = await self._served_model(http)
            start = time.perf_counter()
            sampler = LoadSampler(self.metrics_url, self.wl_cfg.sample_interval_s, start)
            sampling = asyncio.create_task(sampler.run(http)) if self.wl_cfg.sample_interval_s > 0 else None
            try:
                await asyncio.gather(*(self._session(http, s, start, slots, records, bar) for s in sessions))
            finally:
                duration = time.perf_counter() - start
                if sampling is not None:
                    sampling.cancel()
                    await asyncio.gather(sampling, return_exceptions=True)
        self.load_timeline = sampler.timeline()
        bar.close()
        return records, duration

    async def _served_model(self, http: aiohttp.ClientSession) -> str:
        """The first model id the server lists (OpenAI servers such as vLLM require a served model's name)."""
        try:
            async with http.get(self.base_url + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                return (await resp.json(content_type=None))["data"][0]["id"]
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError):
            return "default"

    async def _session(self, http, s: Session, start: float, slots, records: list, bar) -> None:
        await asyncio.sleep(max(0.0, s.arrival_s - (time.perf_counter() - start)))
        answers: list[str] = []
        for k, turn in enumerate(s.turns):
            if k and turn.think_time_s > 0:
                await asyncio.sleep(turn.think_time_s)
            async with slots:
                sent = time.perf_counter() - start
                record, answer = await self.request(http, self.payload(s, k, answers))
            record.send_s, record.session, record.turn = sent, s.sid, k
            records.append(record)
            bar.update(1)
            if not record.ok:          # later turns need this answer: they are not sent
                records += not_sent(s, k, sent)
                bar.update(len(s.turns) - k - 1)
                return
            answers.append(answer)

    def payload(self, s: Session, k: int, answers: list[str]) -> dict:
        """Turn k of session s as the request body of the chosen API (streaming, always)."""
        c, turn = self.wl_cfg, s.turns[k]
        if self.api is Api.generate:
            return {"text": s.prompt(k, answers), "stream": True,
                    "sampling_params": {"max_new_tokens": turn.max_new_tokens, "temperature": c.temperature,
                                        "ignore_eos": c.ignore_eos}}
        body = {"model": self.model, "max_tokens": turn.max_new_tokens, "temperature": c.temperature,
                "ignore_eos": c.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
        if self.api is Api.chat:
            return {**body, "messages": s.messages(k, answers)}
        return {**body, "prompt": s.prompt(k, answers)}

    async def request(self, http: aiohttp.ClientSession, payload: dict) -> tuple[RequestRecord, str]:
        """One request, with its retries; never raises (except cancellation)."""
        t0 = time.perf_counter()
        deadline = t0 + self.timeout_s
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.retries += 1
                backoff = self._rng.uniform(0, min(RETRY_BACKOFF_MAX_S, RETRY_BACKOFF_BASE_S * 2 ** (attempt - 1)))
                await asyncio.sleep(min(max(backoff, result.retry_after_s), max(0.0, deadline - time.perf_counter())))
            left = deadline - time.perf_counter()
            try:
                result = await asyncio.wait_for(self._try(http, payload, t0), left) if left > 0 else None
            except TimeoutError:
                result = None
            if result is None:
                return RequestRecord(ok=False, error=f"timed out after {self.timeout_s:g}s "
                                                     f"({attempt + 1} tries)"), ""
            if result.record.ok or not result.retriable:
                break
        if not result.record.ok and attempt:
            result.record.error += f" (after {attempt + 1} tries)"
        return result.record, result.answer

    async def _try(self, http: aiohttp.ClientSession, payload: dict, t0: float) -> _Try:
        worker = self.base_url
        try:
            async with http.post(self.url, json=payload) as resp:
                worker = resp.headers.get(WORKER_HEADER, worker)
                if resp.status != 200:
                    body = (await resp.text())[:300]
                    retry_after = resp.headers.get("Retry-After", "")
                    return _Try(RequestRecord(ok=False, worker=worker, error=f"HTTP {resp.status}: {body}"),
                                retriable=resp.status in (408, 429) or resp.status >= 500,
                                retry_after_s=float(retry_after) if retry_after.isdigit() else 0.0)
                result = await self._read_stream(resp, _Stream(t0), worker)
                result.record.route_reason, result.record.estimated_cached = parse_route(
                    resp.headers.get(ROUTE_HEADER, ""))
                return result
        except (aiohttp.ClientError, ConnectionError) as e:
            return _Try(RequestRecord(ok=False, worker=worker, error=f"{type(e).__name__}: {e}"), retriable=True)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:   # the server speaks another API
            return _Try(RequestRecord(ok=False, worker=worker, error=f"bad stream event: {type(e).__name__}: {e}"),
                        retriable=False)

    async def _read_stream(self, resp: aiohttp.ClientResponse, st: _Stream, worker: str) -> _Try:
        """SSE `data:` events until `[DONE]`."""
        buf = b""
        async for chunk in resp.content.iter_any():
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
                if not data:
                    continue
                if data == b"[DONE]":
                    return _finish(st, time.perf_counter(), worker)
                obj = json.loads(data)
                if "error" in obj:
                    err = obj["error"]
                    message = err.get("message", err) if isinstance(err, dict) else err
                    return _Try(RequestRecord(ok=False, worker=worker, error=f"stream error: {message}"),
                                retriable=True)
                self._event(st, obj, time.perf_counter())
        return _Try(RequestRecord(ok=False, worker=worker, error="stream ended without [DONE]"), retriable=True)

    def _event(self, st: _Stream, obj: dict, t: float) -> None:
        if self.api is Api.generate:   # cumulative text (SGLang's default); a non-extending text is taken as a delta
            meta = obj.get("meta_info") or {}
            st.output(t, obj.get("text", ""), cumulative=True, tokens=meta.get("completion_tokens"))
            if meta:
                st.usage = {k: meta.get(k, 0) or 0 for k in ("prompt_tokens", "completion_tokens", "cached_tokens",
                                                            "kv_transfer_bytes", "kv_transfer_s")}  # (P/D's)
                if meta.get("engine_ttft_s") is not None:
                    st.usage["engine_ttft_s"] = float(meta["engine_ttft_s"])
            return
        for choice in obj.get("choices") or []:
            piece = choice.get("text") if self.api is Api.completions else (choice.get("delta") or {}).get("content")
            st.output(t, piece or "", cumulative=False)
        if usage := obj.get("usage"):
            st.usage = {"prompt_tokens": usage.get("prompt_tokens", 0),
                        "completion_tokens": usage.get("completion_tokens", 0),
                        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0}


def parse_route(value: str) -> tuple[str, int | None]:
    """(reason, estimated cached part) from a ROUTE_HEADER value; ("", None) when absent or not servelab's."""
    reason, *fields = [part.strip() for part in value.split(";")]
    found = dict(f.split("=", 1) for f in fields if "=" in f)
    try:
        return reason, int(found["estimate"]) if "estimate" in found else None
    except ValueError:
        return reason, None


def _finish(st: _Stream, t_end: float, worker: str) -> _Try:
    if st.usage is None and not st.chunks:
        return _Try(RequestRecord(ok=False, worker=worker, error="stream carried neither output nor usage"))
    usage = st.usage or {"prompt_tokens": 0, "completion_tokens": len(st.chunks), "cached_tokens": 0}
    e2e = t_end - st.t0
    return _Try(RequestRecord(ok=True, prompt_tokens=int(usage["prompt_tokens"]),
                              completion_tokens=int(usage["completion_tokens"]),
                              cached_tokens=int(usage["cached_tokens"]),
                              kv_transfer_bytes=int(usage.get("kv_transfer_bytes", 0)),
                              kv_transfer_s=float(usage.get("kv_transfer_s", 0.0)),
                              engine_ttft_s=usage.get("engine_ttft_s"),
                              ttft_s=st.chunks[0] - st.t0 if st.chunks else e2e, e2e_s=e2e, worker=worker,
                              itl_s=[b - a for a, b in zip(st.chunks, st.chunks[1:])]), st.text)


def play(base_url: str, sessions: list[Session], wl_cfg, progress: bool = True, *, request_timeout_s: float = 300.0,
         retries: int = 2) -> tuple[list[RequestRecord], float]:
    """Like `framework.load.inprocess.play`, over HTTP: (records, duration_s)."""
    client = LoadClient(base_url, wl_cfg, request_timeout_s=request_timeout_s, retries=retries, progress=progress)
    return client.play(sessions)
