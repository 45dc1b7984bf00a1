"""The router's front door on real loopback servers: API keys, control-plane keys and their audit lines, request ids,
CORS, TLS with a certificate made here, admission control (a bounded queue with a timeout, refusals with
Retry-After and a JSON error), and a worker added at run time that takes no traffic before its health check passes.
The workers are small aiohttp stubs; the router is the real one on its own server."""
from __future__ import annotations

import asyncio
import datetime
import logging
import shutil
import ssl
import subprocess
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from framework.core.registry import ROUTING
from framework.serving.router.admission import Admission
from framework.serving.router.config import RouterServiceConfig
from framework.serving.router.service import start_router
from serving_helpers import serve, url_of, wait_until

pytestmark = pytest.mark.anyio
FAST = dict(health_check_interval_secs=0.05, retry_backoff_base_s=0.001, retry_backoff_max_s=0.01)
ADMIN, USER = "ops:Operations:admin:adm-secret", "viewer:Read only:user:usr-secret"


class Stub:
    """A worker: answers /generate with the request id it got; ``gate`` holds answers until set; ``healthy``."""

    def __init__(self, gated: bool = False):
        self.seen: list[web.Request] = []
        self.gate = asyncio.Event()
        if not gated:
            self.gate.set()
        self.healthy = True
        self.app = web.Application()
        self.app.router.add_post("/generate", self.generate)
        self.app.router.add_get("/health", self.health)

    async def generate(self, request: web.Request) -> web.Response:
        self.seen.append(request)
        await request.read()
        await self.gate.wait()
        return web.json_response({"text": "ok", "rid": request.headers.get("X-Request-Id")})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({}, status=200 if self.healthy else 503)


@asynccontextmanager
async def front(stubs, ssl_context=None, **cfg):
    workers = [await serve(s.app) for s in stubs]
    server = await start_router(ROUTING.get("round_robin")(), [url_of(w) for w in workers],
                                RouterServiceConfig(**{**FAST, **cfg}), port=0)
    try:
        conn = aiohttp.TCPConnector(ssl=ssl_context) if ssl_context else None
        async with aiohttp.ClientSession(server.url, connector=conn) as http:
            yield server.router, http, [url_of(w) for w in workers]
    finally:
        await server.cleanup()
        for w in workers:
            await w.close()


async def test_defaults_are_open_and_every_answer_carries_a_request_id():
    stub = Stub()
    async with front([stub]) as (router, http, _):
        async with http.post("/generate", json={"text": "hi"}) as r:
            rid = r.headers["X-Request-Id"]
            assert r.status == 200 and (await r.json())["rid"] == rid and len(rid) == 32
        async with http.post("/generate", json={"text": "hi"}, headers={"X-Trace-Id": "trace-7"}) as r:
            assert r.headers["X-Request-Id"] == "trace-7" and (await r.json())["rid"] == "trace-7"
        async with http.post("/nowhere", json={}) as r:  # an error answer too
            assert r.status == 404 and r.headers["X-Request-Id"] and "error" in await r.json()
        assert "Access-Control-Allow-Origin" not in r.headers


async def test_the_api_key_guards_the_data_plane_only():
    async with front([Stub()], api_key="data-key") as (router, http, _):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "data-key"}):
            async with http.post("/generate", json={"text": "hi"}, headers=headers) as r:
                assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
                assert r.headers["X-Request-Id"]
        async with http.post("/generate", json={"text": "hi"}, headers={"Authorization": "Bearer data-key"}) as r:
            assert r.status == 200
        async with http.get("/health") as r:
            assert r.status == 200
        async with http.post("/flush_cache") as r:  # no control keys: the control plane takes the API key
            assert r.status == 401 and r.headers["WWW-Authenticate"] == 'Bearer realm="control-plane"'
        assert router.stats.outcomes["/generate", "ok"] == 1


async def test_control_plane_keys_roles_and_audit_lines(caplog):
    stub, extra = Stub(), Stub()
    extra_server = await serve(extra.app)
    try:
        async with front([stub], api_key="data-key", control_plane_api_keys=[ADMIN, USER]) as (router, http, urls):
            caplog.set_level(logging.INFO, logger="servelab.router.audit")
            add = f"/add_worker?url={url_of(extra_server)}"
            async with http.post(add, headers={"Authorization": "Bearer data-key"}) as r:
                assert r.status == 401  # the data-plane key is not a control key
            async with http.post(add, headers={"Authorization": "Bearer usr-secret"}) as r:
                assert r.status == 403 and "admin" in (await r.json())["error"]["message"]
            async with http.get("/list_workers", headers={"Authorization": "Bearer usr-secret"}) as r:
                assert r.status == 200 and (await r.json())["urls"] == urls
            async with http.post(add, headers={"Authorization": "Bearer adm-secret", "X-Request-Id": "op-1"}) as r:
                assert r.status == 200 and (await r.json())["healthy"] is True
            async with http.post("/router_stats/reset") as r:
                assert r.status == 401
            assert url_of(extra_server) in router.workers
        lines = [rec.getMessage() for rec in caplog.records if rec.name == "servelab.router.audit"]
        assert len(lines) == 5, lines
        assert "principal=ops role=admin method=POST path=/add_worker" in lines[3] and "outcome=allowed" in lines[3]
        assert f"resource={url_of(extra_server)}" in lines[3] and "request_id=op-1" in lines[3]
        assert "outcome=denied" in lines[0] and "denied (role)" in lines[1] and "outcome=denied" in lines[4]
    finally:
        await extra_server.close()


async def test_a_worker_added_at_run_time_takes_traffic_only_once_healthy():
    first, late = Stub(), Stub()
    late.healthy = False
    late_server = await serve(late.app)
    try:
        async with front([first]) as (router, http, _):
            async with http.post(f"/add_worker?url={url_of(late_server)}") as r:
                assert r.status == 200 and (await r.json())["healthy"] is False
            for _ in range(4):
                async with http.post("/generate", json={"text": "hi"}) as r:
                    assert r.status == 200
            assert len(first.seen) == 4 and late.seen == []
            late.healthy = True
            await wait_until(lambda: router.workers[url_of(late_server)].healthy, what="the health check to pass")
            for _ in range(4):
                async with http.post("/generate", json={"text": "hi"}) as r:
                    assert r.status == 200
            assert len(late.seen) == 2
    finally:
        await late_server.close()


async def test_cors_for_listed_origins_only():
    async with front([Stub()], cors_allowed_origins=["http://app.example"]) as (router, http, _):
        pre = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST"}
        async with http.options("/generate", headers=pre) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "http://app.example"
            assert "POST" in r.headers["Access-Control-Allow-Methods"]
        async with http.post("/generate", json={"text": "hi"}, headers={"Origin": "http://app.example"}) as r:
            assert r.headers["Access-Control-Allow-Origin"] == "http://app.example"
        async with http.post("/generate", json={"text": "hi"}, headers={"Origin": "http://evil.example"}) as r:
            assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers


def self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key (PEM): with ``cryptography`` when installed, else the openssl CLI."""
    try:
        import cryptography  # noqa: F401
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl CLI is here to make a certificate")
        cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
        return str(cert), str(key)
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


async def test_tls_with_a_self_signed_certificate(tmp_path):
    cert, key = self_signed(tmp_path)
    trust = ssl.create_default_context(cafile=cert)
    async with front([Stub()], ssl_context=trust, tls_cert_path=cert, tls_key_path=key) as (router, http, _):
        assert str(http._base_url).startswith("https://")
        async with http.post("/generate", json={"text": "hi"}) as r:
            assert r.status == 200 and (await r.json())["text"] == "ok"
        with pytest.raises(aiohttp.ClientError):  # a client that does not trust it does not connect
            async with aiohttp.ClientSession() as plain:
                await plain.post(str(http._base_url) + "/generate", json={"text": "hi"})


async def test_admission_queue_full_is_429_and_a_queue_timeout_408_with_retry_after():
    stub = Stub(gated=True)
    async with front([stub], max_concurrent_requests=2, queue_size=1, queue_timeout_secs=0.5,
                     rate_limit_tokens_per_second=0.1) as (router, http, _):
        admitted = [asyncio.create_task(http.post("/generate", json={"text": "hi"})) for _ in range(2)]
        await wait_until(lambda: len(stub.seen) == 2, what="two requests at the worker")
        queued = asyncio.create_task(http.post("/generate", json={"text": "hi"}))
        await wait_until(lambda: len(router.admission.waiting) == 1, what="one request in the queue")
        async with http.post("/generate", json={"text": "hi"}) as r:
            body = await r.json()
            assert r.status == 429 and r.headers["Retry-After"] == "10" and body["error"]["type"] == "rate_limit_error"
        t0 = asyncio.get_running_loop().time()
        r = await queued
        assert r.status == 408 and "router.queue_timeout_secs" in (await r.json())["error"]["message"]
        assert 0.4 < asyncio.get_running_loop().time() - t0 < 1.0 and r.headers["Retry-After"]
        stub.gate.set()
        assert [(await a).status for a in admitted] == [200, 200]
        async with http.post("/generate", json={"text": "hi"}) as r:  # tokens came back with the answers
            assert r.status == 200
        assert router.admission.stats() == {"enabled": True, "in_flight": 0, "queued_now": 0, "admitted": 3,
                                            "queued": 1, "rejected_queue_full": 1, "queue_timeouts": 1}
        assert router.stats.outcomes["/generate", "not_admitted"] == 2


async def test_a_queued_request_is_admitted_when_a_token_comes_back():
    adm = Admission(1, 4, 5.0, rate=0.01)
    await adm.admit()
    waiting = asyncio.create_task(adm.admit())
    await asyncio.sleep(0.01)
    assert not waiting.done() and len(adm.waiting) == 1
    adm.release()
    await asyncio.wait_for(waiting, 1.0)
    assert adm.in_flight == 1 and adm.counts["admitted"] == 2


async def test_the_server_answers_in_order_and_closes_idle_connections():
    """Raw HTTP/1.1 on the router's own server: two pipelined requests answered in order on one connection, a
    malformed one refused with a JSON 400, and a connection left idle closed after the keep-alive time."""
    from framework.serving.router.server import start_server

    async def echo(req, conn):
        conn.send_json(200, {"path": req.path, "body": req.body.decode()})

    server = await start_server(echo, "127.0.0.1", 0, 1024, keepalive_s=0.2)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n1"
                     b"POST /b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n22\r\n0\r\n\r\n")
        answers = (await reader.readuntil(b'"}')) + (await reader.readuntil(b'"}'))
        assert answers.index(b'"path":"/a","body":"1"') < answers.index(b'"path":"/b","body":"22"')
        assert await asyncio.wait_for(reader.read(), 2.0) == b""  # idle past keepalive_s: closed by the server
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"NOT HTTP\r\n\r\n")
        bad = await asyncio.wait_for(reader.read(), 2.0)
        assert bad.startswith(b"HTTP/1.1 400") and b'"type":"invalid_request_error"' in bad
    finally:
        server.close()
        await server.wait_closed()
