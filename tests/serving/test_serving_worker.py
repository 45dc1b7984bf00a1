"""The worker HTTP server over real loopback HTTP, in front of a real engine (tiny model, CPU, its own thread).

Oracles: the text equals greedy decoding on a separate engine built from the same seed (serving_helpers.greedy);
cached tokens come from the real radix cache; the scheduler's step counters say whether a request reached the engine
and whether a long one was cut short."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from framework.serving.http.chat_template import apply_chat_template
from framework.serving.worker import create_worker_app
from serving_helpers import (break_model, engine_client, engine_requests, engine_stats, greedy, greedy_text, iter_sse,
                             read_sse, serve, url_of, wait_until)

pytestmark = pytest.mark.anyio
GREEDY = {"temperature": 0, "ignore_eos": True}  # OpenAI's default temperature is 1: ask for greedy explicitly


@pytest.fixture(scope="module")
def engine():
    client = engine_client()
    yield client
    client.close()


async def _worker_over(client):
    await wait_until(lambda: engine_requests(client) == 0, what="the engine to finish the previous test's requests")
    assert await client.flush_cache()  # each test starts with an empty radix cache
    server = await serve(create_worker_app(client, model_name="tiny", client_max_size=4096))
    return server, aiohttp.ClientSession(url_of(server))


@pytest.fixture
async def worker(engine):
    server, http = await _worker_over(engine)
    async with http:
        yield engine, http
    await server.close()


@pytest.fixture
async def doomed_worker():
    """A worker over its own engine, for a test that crashes it."""
    client = engine_client()
    server, http = await _worker_over(client)
    async with http:
        yield client, http
    await server.close()
    client.close()


def native(text: str, n: int, **extra) -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": n, "ignore_eos": True}, **extra}


async def test_native_generate(worker):
    engine, http = worker
    async with http.post("/generate", json=native("hello world", 5, rid="r1")) as r:
        assert r.status == 200
        out = await r.json()
    assert out["text"] == greedy_text("hello world", 5)
    engine_ttft = out["meta_info"].pop("engine_ttft_s")     # servelab's: its arrival at the engine to its first token
    assert out["meta_info"] == {"id": "r1", "prompt_tokens": 11, "completion_tokens": 5, "cached_tokens": 0,
                                "finish_reason": {"type": "length", "length": 5}}
    assert 0 < engine_ttft < 60


async def test_completions_usage_reports_cached_tokens(worker):
    engine, http = worker
    await http.post("/v1/completions", json={"prompt": "shared prefix A", "max_tokens": 3, **GREEDY})
    async with http.post("/v1/completions", json={"model": "tiny", "prompt": "shared prefix B", "max_tokens": 4,
                                                  "stop": None, "user": "ignored", **GREEDY}) as r:
        out = await r.json()
    assert out["object"] == "text_completion" and out["model"] == "tiny"
    assert out["choices"][0]["text"] == greedy_text("shared prefix B", 4)
    assert out["choices"][0]["finish_reason"] == "length"
    # the radix cache holds the first prompt: the second one's shared prefix is served from it, token for byte
    assert out["usage"] == {"prompt_tokens": 15, "completion_tokens": 4, "total_tokens": 19,
                            "prompt_tokens_details": {"cached_tokens": len("shared prefix ")}}


async def test_chat_uses_the_chat_template(worker):
    engine, http = worker
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    async with http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, **GREEDY}) as r:
        out = await r.json()
    prompt = apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}])
    assert prompt == "<|system|>Be brief.\n<|user|>Hi there\n<|assistant|>"
    assert out["object"] == "chat.completion"
    # greedy output is a function of the exact prompt: the engine got the templated text, parts joined
    assert out["choices"][0]["message"] == {"role": "assistant", "content": greedy_text(prompt, 6)}
    assert out["usage"]["prompt_tokens"] == len(prompt)


def first_printable(prompt: str, n: int) -> int:
    """Index of the first printable ASCII byte in the greedy output (a stop string the tiny model will produce)."""
    return next(i for i, t in enumerate(greedy(prompt, n).output_ids) if 32 < t < 127 and i > 0)


async def test_stop_string_finishes_with_stop(worker):
    engine, http = worker
    k = first_printable("abc", 10)
    ids = greedy("abc", 10).output_ids
    stop = chr(ids[k])
    async with http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 10, "stop": stop, **GREEDY}) as r:
        out = await r.json()
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == k + 1  # the engine stopped at the token that completed the stop string
    assert out["choices"][0]["text"].startswith(engine.tokenizer.decode(ids[:k]))


async def test_stop_string_is_not_in_the_returned_text(worker):
    engine, http = worker
    k = first_printable("abc", 10)
    ids = greedy("abc", 10).output_ids
    body = {"prompt": "abc", "max_tokens": 10, "stop": chr(ids[k]), **GREEDY}
    async with http.post("/v1/completions", json=body) as r:
        assert (await r.json())["choices"][0]["text"] == engine.tokenizer.decode(ids[:k])


async def test_native_stream_sends_cumulative_text_then_done(worker):
    engine, http = worker
    async with http.post("/generate", json=native("stream me", 4, stream=True)) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = await read_sse(r)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [c["text"] for c in chunks]
    assert len(chunks) == 4 and all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # one event per token
    assert texts[-1] == greedy_text("stream me", 4)
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4]
    assert [c["meta_info"]["finish_reason"] for c in chunks] == [None, None, None, {"type": "length", "length": 4}]
    firsts = {c["meta_info"]["engine_ttft_s"] for c in chunks}     # set at the first token, the same ever after
    assert len(firsts) == 1 and 0 < firsts.pop() < 60


async def test_openai_streams_deltas_and_usage_chunk(worker):
    engine, http = worker
    body = {"prompt": "deltas", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}, **GREEDY}
    async with http.post("/v1/completions", json=body) as r:
        events = await read_sse(r)
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == b"[DONE]"
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == greedy_text("deltas", 3)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3

    chat = {"messages": [{"role": "user", "content": "yo"}], "max_tokens": 2, "stream": True, **GREEDY}
    async with http.post("/v1/chat/completions", json=chat) as r:
        chunks = [json.loads(e) for e in (await read_sse(r))[:-1]]
    assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("usage" not in c for c in chunks)
    prompt = apply_chat_template([{"role": "user", "content": "yo"}])
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == greedy_text(prompt, 2)


async def test_stream_chunks_arrive_as_generated(worker):
    engine, http = worker
    n, seen = 100, []
    async with http.post("/generate", json=native("slow", n, stream=True)) as r:
        async for event in iter_sse(r):
            if not seen:  # buffered output would arrive only after the engine had finished the request
                assert engine_requests(engine) == 1
            seen.append(event)
    assert len(seen) == n + 1 and json.loads(seen[0])["meta_info"]["completion_tokens"] == 1


@pytest.mark.parametrize("path,body,field", [
    ("/generate", b"{not json", "body: malformed JSON"),
    ("/generate", b"", "body: malformed JSON"),
    ("/generate", b"[1, 2]", "body: Input should be an object"),
    ("/generate", b'{"sampling_params": {}}', "text: Field required"),
    ("/generate", b'{"text": 42}', "text: Input should be a valid string"),
    ("/generate", b'{"text": "a", "sampling_params": {"max_new_tokens": "5"}}', "sampling_params.max_new_tokens"),
    ("/generate", b'{"text": "a", "sampling_params": {"top_p": 1.5}}', "sampling_params.top_p"),
    ("/generate", b'{"text": "a", "sampling_params": {"top_k": 5}}', "sampling_params.top_k: unsupported field"),
    ("/generate", b'{"text": "a", "stream": "yes"}', "stream: Input should be a valid boolean"),
    ("/v1/completions", b'{"max_tokens": 4}', "prompt: Field required"),
    ("/v1/completions", b'{"prompt": ["a", "b"]}', "prompt: batched prompts are not supported"),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": 0}', "max_tokens: Input should be greater than or equal"),
    ("/v1/completions", b'{"prompt": "a", "temperature": -1}', "temperature"),
    ("/v1/completions", b'{"prompt": "a", "n": 2}', "n: Input should be less than or equal to 1"),
    ("/v1/chat/completions", b'{"messages": []}', "messages: List should have at least 1 item"),
    ("/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "x"}]}', "messages.0.role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 7}]}', "messages.0.content"),
])
async def test_bad_bodies_get_400_naming_the_field(worker, path, body, field):
    engine, http = worker
    prefills = engine_stats(engine)["extend_steps"]
    async with http.post(path, data=body, headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert field in err["message"] and err["type"] == "invalid_request_error"
    async with http.post("/generate", json=native("still up", 2)) as r:
        assert r.status == 200 and (await r.json())["text"] == greedy_text("still up", 2)
    assert engine_stats(engine)["extend_steps"] == prefills + 1  # only "still up" was prefilled: nothing else arrived


async def test_routing_errors_are_json(worker):
    engine, http = worker
    async with http.get("/nope") as r:
        assert r.status == 404 and "no route GET /nope" in (await r.json())["error"]["message"]
    async with http.get("/generate") as r:
        assert r.status == 405
        assert "allowed: POST" in (await r.json())["error"]["message"] and r.headers["Allow"] == "POST"
    async with http.post("/generate", data=b'{"text": "' + b"x" * 5000 + b'"}') as r:
        assert r.status == 413
        err = (await r.json())["error"]
    assert "exceeds the limit of 4096 bytes" in err["message"] and err["type"] == "request_too_large_error"
    async with http.get("/health") as r:
        assert r.status == 200


async def test_engine_rejection_is_a_400(worker):
    engine, http = worker
    capacity = engine.local_engine.capacity
    async with http.post("/generate", json=native("x" * (capacity + 1), 1)) as r:  # can never fit the KV pool
        assert r.status == 400
        err = (await r.json())["error"]
    assert err["param"] == "text" and err["message"].startswith(f"text: prompt of {capacity + 1} tokens")
    assert f"capacity of {capacity}" in err["message"]
    async with http.post("/v1/completions", json={"prompt": "a", "max_tokens": capacity}) as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "prompt"
    async with http.post("/generate", json={"text": ""}) as r:
        assert r.status == 400 and (await r.json())["error"]["message"] == "text: the prompt is empty"
    async with http.post("/generate", json=native("x" * (capacity + 1), 1, stream=True)) as r:
        assert r.status == 400  # the stream had not started, so it is still a plain 4xx


@pytest.mark.long  # processes for ~5-10 s: CI's second command (README's default run is near 5 min)
async def test_engine_crash_is_a_500_or_an_error_event(doomed_worker):
    engine, http = doomed_worker
    body = {"prompt": "crash", "max_tokens": 400, "stream": True, **GREEDY}
    events = []
    async with http.post("/v1/completions", json=body) as r:
        assert r.status == 200
        async for event in iter_sse(r):
            events.append(event)
            if len(events) == 2:
                break_model(engine)  # the engine crashes while this stream is in flight
    *texts, last = [json.loads(e) for e in events]
    assert 2 <= len(texts) < 400 and engine.error is not None and engine.error.startswith("RuntimeError: ")
    assert greedy_text("crash", 400).startswith("".join(t["choices"][0]["text"] for t in texts))
    assert last["error"]["code"] == 500  # already streaming: the failure is an error event, not [DONE]
    assert last["error"]["message"] == f"engine failed: RuntimeError: engine is down: {engine.error}"
    async with http.post("/v1/completions", json={"prompt": "after", "max_tokens": 5}) as r:
        assert r.status == 500
        assert (await r.json())["error"]["message"] == f"engine failed: RuntimeError: engine is down: {engine.error}"
    async with http.get("/health") as r:
        assert r.status == 503 and await r.json() == {"status": "unhealthy", "error": engine.error}
    async with http.get("/metrics") as r:
        assert 'servelab_worker_requests_total{endpoint="completions",outcome="error"} 2.0' in await r.text()


async def test_metrics_info_models_and_flush(worker):
    engine, http = worker
    await http.post("/generate", json=native("abcdef", 3))
    await http.post("/generate", json=native("abcxyz", 2))
    async with http.get("/metrics") as r:
        text = await r.text()
    assert r.headers["Content-Type"].startswith("text/plain")
    assert 'servelab_worker_requests_total{endpoint="generate",outcome="length"} 2.0' in text
    assert "servelab_worker_prompt_tokens_total 12.0" in text
    assert "servelab_worker_completion_tokens_total 5.0" in text
    assert "servelab_worker_cached_tokens_total 3.0" in text  # "abc" from the radix cache
    assert 'servelab_worker_request_latency_seconds_count{endpoint="generate"} 2.0' in text

    async def engine_gauges_idle() -> bool:  # the local client's snapshot can lag the last response by one loop turn
        text = await (await http.get("/metrics")).text()
        return "servelab_worker_running_requests 0.0" in text and "servelab_worker_queued_requests 0.0" in text
    await wait_until(engine_gauges_idle, timeout=2, what="/metrics to show the engine idle")
    async with http.get("/get_server_info") as r:
        info = await r.json()
    assert info["model_name"] == "tiny" and info["http_in_flight"] == 0 and info["running_requests"] == 0
    assert info["kv_capacity_tokens_instance"] == engine.local_engine.capacity and info["cache_tokens"] > 0
    async with http.get("/v1/models") as r:
        assert [m["id"] for m in (await r.json())["data"]] == ["tiny"]

    busy = asyncio.create_task(http.post("/generate", json=native("busy", 700)))
    await wait_until(lambda: engine_requests(engine) == 1, what="the busy request to reach the engine")
    async with http.post("/flush_cache") as r:
        assert r.status == 409 and "in flight" in (await r.json())["error"]["message"]
    busy.cancel()  # the client gives up: the engine drops the request
    await wait_until(lambda: engine_requests(engine) == 0, what="the busy request to be aborted")
    async with http.post("/flush_cache") as r:
        assert r.status == 200 and engine.local_engine.scheduler.cache.total_size() == 0


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_aborts_the_engine_request(worker, stream):
    engine, http = worker
    n, decodes = 700, engine_stats(engine)["decode_steps"]
    body = native("long one", n, stream=stream)
    if stream:
        async with http.post("/generate", json=body) as r:
            await r.content.readany()  # got the first chunk, then hang up
    else:  # the client gives up while waiting for the whole answer
        pending = asyncio.create_task(http.post("/generate", json=body))
        await wait_until(lambda: engine_requests(engine) == 1, what="the request to reach the engine")
        pending.cancel()
    await wait_until(lambda: engine_requests(engine) == 0, what="the engine request to be aborted")
    assert engine_stats(engine)["decode_steps"] - decodes < n - 1  # it stopped before its last token
    async with http.get("/metrics") as r:
        assert "servelab_worker_http_in_flight 0.0" in await r.text()
