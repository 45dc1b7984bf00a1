"""The async HTTP load client: plays a workload's sessions against a base URL (the router, one worker, or any server
that speaks SGLang's native API) with streaming `POST /generate`, and returns the same per-request records as the
in-process driver (`framework.workload.inprocess.play`).

Timing per request, from the first byte sent: TTFT at the first event that carries text, e2e at the end of the
stream; TPOT follows from both and the completion tokens. Token counts (prompt, completion, cached) come from the
final event's `meta_info`, i.e. from the worker that served it. A request never raises: a failure becomes a record
with `ok=False` and the error. A request that failed in a way another try may fix (a connection error, a 408/429/5xx,
a stream that broke before it finished) is sent again up to `retries` times, after a backoff with full jitter (or
the server's Retry-After, when longer); the router then picks a worker again, so a request whose worker died
mid-stream completes elsewhere. Every try of a request shares one `request_timeout_s`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

from framework.metrics import RequestRecord
from framework.workload.base import Session, Turn

WORKER_HEADER = "X-Servelab-Worker"    # set by servelab's router: which worker answered
RETRY_BACKOFF_BASE_S, RETRY_BACKOFF_MAX_S = 0.2, 2.0   # retry k waits U(0, min(max, base * 2**(k-1)))


@dataclass
class _Try:
    record: RequestRecord
    answer: str = ""
    retriable: bool = False
    retry_after_s: float = 0.0        # the server's Retry-After (429/503)


class LoadClient:
    def __init__(self, base_url: str, wl_cfg, *, request_timeout_s: float = 300.0, retries: int = 2,
                 progress: bool = False):
        if request_timeout_s <= 0 or retries < 0:
            raise ValueError(f"request_timeout_s must be > 0 and retries >= 0, got {request_timeout_s}, {retries}")
        self.url = base_url.rstrip("/") + "/generate"
        self.base_url = base_url.rstrip("/")
        self.wl_cfg, self.timeout_s, self.max_retries, self.progress = wl_cfg, request_timeout_s, retries, progress
        self.retries = 0                  # tries beyond the first, over the whole run
        self._rng = random.Random(0)      # backoff jitter: retries of many clients do not arrive in step
        self.records: list[RequestRecord] = []   # filled as requests finish (a test can watch progress)

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
            start = time.perf_counter()
            await asyncio.gather(*(self._session(http, s, start, slots, records, bar) for s in sessions))
            duration = time.perf_counter() - start
        bar.close()
        return records, duration

    async def _session(self, http, s: Session, start: float, slots, records: list, bar) -> None:
        await asyncio.sleep(max(0.0, s.arrival_s - (time.perf_counter() - start)))
        async with slots:
            answers: list[str] = []
            for k, turn in enumerate(s.turns):
                if k and turn.think_time_s > 0:
                    await asyncio.sleep(turn.think_time_s)
                record, answer = await self.request(http, s.prompt(k, answers), turn)
                records.append(record)
                bar.update(1)
                if not record.ok:          # later turns need this answer: they are not sent
                    for _ in s.turns[k + 1:]:
                        records.append(RequestRecord(ok=False, error=f"not sent: turn {k} of {s.sid} failed"))
                        bar.update(1)
                    return
                answers.append(answer)

    async def request(self, http: aiohttp.ClientSession, prompt: str, turn: Turn) -> tuple[RequestRecord, str]:
        """One request, with its retries; never raises (except cancellation)."""
        payload = {"text": prompt, "stream": True,
                   "sampling_params": {"max_new_tokens": turn.max_new_tokens, "temperature": self.wl_cfg.temperature,
                                       "ignore_eos": self.wl_cfg.ignore_eos}}
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
                return await self._read_stream(resp, t0, worker)
        except (aiohttp.ClientError, ConnectionError) as e:
            return _Try(RequestRecord(ok=False, worker=worker, error=f"{type(e).__name__}: {e}"), retriable=True)
        except ValueError as e:          # an event that is not JSON: the server speaks something else
            return _Try(RequestRecord(ok=False, worker=worker, error=f"bad stream event: {e}"), retriable=False)

    @staticmethod
    async def _read_stream(resp: aiohttp.ClientResponse, t0: float, worker: str) -> _Try:
        """SSE `data:` events until `[DONE]`. Native events carry the cumulative text (SGLang's default); an event
        whose text does not extend what came before is taken as a delta (servers that stream increments)."""
        text, meta, ttft, buf = "", None, None, b""
        async for chunk in resp.content.iter_any():
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
                if not data:
                    continue
                if data == b"[DONE]":
                    return _finish(text, meta, ttft, time.perf_counter() - t0, worker)
                obj = json.loads(data)
                if "error" in obj:
                    err = obj["error"]
                    message = err.get("message", err) if isinstance(err, dict) else err
                    return _Try(RequestRecord(ok=False, worker=worker, error=f"stream error: {message}"),
                                retriable=True)
                piece = obj.get("text", "")
                text = piece if piece.startswith(text) else text + piece
                if ttft is None and text:
                    ttft = time.perf_counter() - t0
                meta = obj.get("meta_info") or meta
        return _Try(RequestRecord(ok=False, worker=worker, error="stream ended without [DONE]"), retriable=True)


def _finish(text: str, meta: dict | None, ttft: float | None, e2e: float, worker: str) -> _Try:
    if meta is None:
        return _Try(RequestRecord(ok=False, worker=worker, error="stream had no meta_info"), retriable=False)
    return _Try(RequestRecord(ok=True, prompt_tokens=int(meta.get("prompt_tokens", 0)),
                              completion_tokens=int(meta.get("completion_tokens", 0)),
                              cached_tokens=int(meta.get("cached_tokens", 0) or 0),
                              ttft_s=ttft if ttft is not None else e2e, e2e_s=e2e, worker=worker), text)


def play(base_url: str, sessions: list[Session], wl_cfg, progress: bool = True, *, request_timeout_s: float = 300.0,
         retries: int = 2) -> tuple[list[RequestRecord], float]:
    """Like `framework.workload.inprocess.play`, over HTTP: (records, duration_s)."""
    client = LoadClient(base_url, wl_cfg, request_timeout_s=request_timeout_s, retries=retries, progress=progress)
    return client.play(sessions)
