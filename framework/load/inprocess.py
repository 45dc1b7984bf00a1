"""Play a workload straight into one engine in this process (no HTTP): arrivals, concurrency (requests in flight),
multi-turn dependencies and think time, with the same per-request records the HTTP load client produces."""
from __future__ import annotations

import heapq
import time

from tqdm import tqdm

from framework.engine.request import Req, SamplingParams
from framework.core.records import RequestRecord
from framework.contracts.workload import Session


def play(engine, sessions: list[Session], wl_cfg, progress: bool = True) -> tuple[list[RequestRecord], float]:
    """Returns (records, duration_s). `engine`: a synchronous face, add(req), step() and tokenizer
    (framework.instance.handle.SyncFace over any engine instance; a bare Engine has them too)."""
    total = sum(len(s.turns) for s in sessions)
    arrivals = list(sessions)                     # in arrival order
    ready: list[tuple[float, int, Session, int]] = []   # (due time, tiebreak, session, turn): FIFO once due
    answers: dict[str, list[str]] = {s.sid: [] for s in sessions}
    in_flight: dict[str, tuple[Session, int, Req, float, list[float]]] = {}   # + send time, output token times
    records: list[RequestRecord] = []
    limit, seq = wl_cfg.max_concurrency, 0
    bar = tqdm(total=total, desc="requests", disable=not progress, leave=False)
    start = time.perf_counter()
    while arrivals or ready or in_flight:
        now = time.perf_counter() - start
        while arrivals and arrivals[0].arrival_s <= now:
            s = arrivals.pop(0)
            heapq.heappush(ready, (s.arrival_s, seq := seq + 1, s, 0))
        while ready and ready[0][0] <= now and (limit <= 0 or len(in_flight) < limit):
            _, _, s, k = heapq.heappop(ready)
            turn = s.turns[k]
            params = SamplingParams(max_new_tokens=turn.max_new_tokens, temperature=wl_cfg.temperature,
                                    ignore_eos=wl_cfg.ignore_eos)
            req = Req(engine.tokenizer.encode(s.prompt(k, answers[s.sid])), params)
            try:
                engine.add(req)
                in_flight[req.rid] = (s, k, req, now, [])
            except ValueError as e:               # can never fit: fail this request, end its session
                records.append(RequestRecord(ok=False, prompt_tokens=len(req.prompt_ids), error=str(e), send_s=now,
                                             session=s.sid, turn=k))
                bar.update(len(s.turns) - k)
        out = engine.step()
        if out is None:
            waits = [t for t, *_ in ready[:1]] + ([arrivals[0].arrival_s] if arrivals else [])
            if not in_flight and waits:
                time.sleep(max(0.0, min(min(waits) - (time.perf_counter() - start), 0.05)))
            continue
        step_end = time.perf_counter()
        for req in out:
            entry = in_flight.get(req.rid)
            if entry is None:
                continue
            s, k, _, sent, token_times = entry
            token_times += [step_end] * (len(req.output_ids) - len(token_times))
            if not req.finished:
                continue
            del in_flight[req.rid]
            records.append(RequestRecord(ok=True, prompt_tokens=len(req.prompt_ids),
                                         completion_tokens=len(req.output_ids), cached_tokens=req.cached_tokens,
                                         ttft_s=req.first_token_time - req.arrival_time,
                                         e2e_s=req.finish_time - req.arrival_time, send_s=sent, session=s.sid, turn=k,
                                         itl_s=[b - a for a, b in zip(token_times, token_times[1:])]))
            answers[s.sid].append(engine.tokenizer.decode(req.output_ids))
            bar.update(1)
            if k + 1 < len(s.turns):
                heapq.heappush(ready, (step_end - start + s.turns[k + 1].think_time_s, seq := seq + 1, s, k + 1))
    bar.close()
    return records, time.perf_counter() - start
