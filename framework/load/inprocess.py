"""Play a workload straight into one engine in this process (no HTTP): arrivals, concurrency (requests in flight),
multi-turn dependencies and think time, with the same per-request records the HTTP load client produces."""
from __future__ import annotations

import time

from tqdm import tqdm

from framework.engine.request import Req, SamplingParams
from framework.core.records import RequestRecord
from framework.contracts.workload import Session
from framework.load.sessions import DueTurns, not_sent


def play(engine, sessions: list[Session], wl_cfg, progress: bool = True) -> tuple[list[RequestRecord], float]:
    """Returns (records, duration_s). `engine`: a synchronous face, add(req), step() and tokenizer
    (framework.instance.handle.SyncFace over any engine instance; a bare Engine has them too)."""
    total = sum(len(s.turns) for s in sessions)
    due = DueTurns(sessions, wl_cfg.max_concurrency)
    answers: dict[str, list[str]] = {s.sid: [] for s in sessions}
    in_flight: dict[str, tuple[Session, int, Req, float, list[float]]] = {}   # + send time, output token times
    records: list[RequestRecord] = []
    bar = tqdm(total=total, desc="requests", disable=not progress, leave=False)
    start = time.perf_counter()
    while due or in_flight:
        now = time.perf_counter() - start
        while (turn_due := due.pop(now, len(in_flight))) is not None:
            s, k = turn_due
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
                records += not_sent(s, k, now)
                bar.update(len(s.turns) - k)
        out = engine.step()
        if out is None:
            if not in_flight and (next_due := due.next_due()) is not None:
                time.sleep(max(0.0, min(next_due - (time.perf_counter() - start), 0.05)))
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
                                         engine_ttft_s=req.engine_ttft_s,
                                         e2e_s=req.finish_time - req.arrival_time, send_s=sent, session=s.sid, turn=k,
                                         itl_s=[b - a for a, b in zip(token_times, token_times[1:])]))
            answers[s.sid].append(engine.tokenizer.decode(req.output_ids))
            bar.update(1)
            if k + 1 < len(s.turns):
                due.add(step_end - start + s.turns[k + 1].think_time_s, s, k + 1)
    bar.close()
    return records, time.perf_counter() - start
