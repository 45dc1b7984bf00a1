"""A prefill request aborted after it entered the prefill instance's scheduler, before its prefill finished (the
client left, or the router gave up on that half): its room ends at once, so the decode side frees the slots it
pre-allocated now, not at `engine.disaggregation_timeout_s`; and a decode half whose prefill half already failed or
left is answered at once too. Real one-rank instances in this process, paired over tcp and ZMQ on loopback; the
prefill instance's steps are held back by a gate (its rank loop keeps reading messages) so the abort lands in the
window between admission and the end of the prefill."""
from __future__ import annotations

import asyncio
import threading

import pytest

from framework.engine.request import SamplingParams
from framework.instance.client import open_engine
from pd_helpers import base_cfg, collect, counters, pairing_for, spec, wait_async

pytestmark = pytest.mark.long     # two one-rank instances per order: ~5 s here
TIMEOUT_S = 20.0                  # the decode side's own way out: far beyond what the test waits for
FAST_S = 2.0
LONG = SamplingParams(max_new_tokens=8, ignore_eos=True)


def gate_steps(client) -> threading.Event:
    """Hold the instance's steps back (nothing is computed) until the returned event is set."""
    engine, gate = client.local_engine, threading.Event()
    step = engine.step
    engine.step = lambda: step() if gate.is_set() else []
    return gate


@pytest.mark.parametrize("order", ["sglang", "distserve"])
def test_a_prefill_aborted_before_its_prefill_ends_frees_the_decode_slots_at_once(order):
    cfg = base_cfg()
    engine = {"disaggregation_transfer_backend": "tcp", "disaggregation_timeout_s": TIMEOUT_S,
              "disaggregation_order": order}
    pre_spec = spec(cfg, "prefill", **engine)
    prefill, decode = open_engine(pre_spec), open_engine(spec(cfg, "decode", **engine))
    disagg = prefill.local_engine.scheduler.disagg
    try:
        start_p, start_d = counters(prefill), counters(decode)
        gate = gate_steps(prefill)

        async def scenario():
            # 1. both halves; the prefill one is admitted (its destination came) but not prefilled; its client leaves
            pairing = pairing_for(pre_spec)
            pre = asyncio.create_task(collect(prefill, "left before its prefill " * 3, LONG, pairing))
            dec = asyncio.create_task(collect(decode, "left before its prefill " * 3, LONG, pairing))
            await wait_async(lambda: len(disagg.prefilling) == 1 and counters(decode)["kv_receiving"] == 1,
                             what="the prefill half admitted, the decode half's slots allocated")
            pre.cancel()
            await wait_async(lambda: counters(decode) == start_d, timeout=FAST_S, what="decode slots freed")
            with pytest.raises(RuntimeError, match="aborted before its prefill finished"):
                await dec
            await wait_async(lambda: counters(prefill) == start_p and not disagg.prefilling, timeout=FAST_S,
                             what="the prefill side back at its start")
            # 2. the prefill half leaves first (parked, or in the scheduler); its decode half comes later
            pairing = pairing_for(pre_spec)
            pre = asyncio.create_task(collect(prefill, "gone before the decode half", LONG, pairing))
            await wait_async(lambda: len(disagg.prefilling) + counters(prefill)["kv_bootstrapping"] == 1,
                             what="the prefill half queued")
            pre.cancel()
            await wait_async(lambda: counters(prefill) == start_p and not disagg.prefilling, timeout=FAST_S,
                             what="the prefill side back at its start")
            with pytest.raises(RuntimeError, match="gave up room .*: the prefill request was aborted"):
                await asyncio.wait_for(collect(decode, "gone before the decode half", LONG, pairing), FAST_S)
            gate.set()
            # 3. the instances still serve a pair afterwards
            pairing = pairing_for(pre_spec)
            _, (tokens, _) = await asyncio.gather(collect(prefill, "after the aborts", LONG, pairing),
                                                  collect(decode, "after the aborts", LONG, pairing))
            return tokens

        assert len(asyncio.run(scenario())) == LONG.max_new_tokens
        assert counters(decode) == start_d and counters(prefill) == start_p
    finally:
        prefill.close()
        decode.close()



@pytest.mark.parametrize("order", ["sglang", "distserve"])
def test_a_prefill_half_that_comes_after_its_rooms_want_timed_out_fails_at_once(order):
    """The decode instance asked for a room's KV and then died (it can send no cancel). The room's want times out on
    the prefill side. The prefill half that comes after that has no destination: it fails at once, not after parking
    (SGLang's order) or holding its KV (DistServe's) for a timeout of its own."""
    timeout_s = 1.5
    cfg = base_cfg()
    engine = {"disaggregation_transfer_backend": "tcp", "disaggregation_timeout_s": timeout_s,
              "disaggregation_order": order}
    pre_spec = spec(cfg, "prefill", **engine)
    prefill, decode = open_engine(pre_spec), open_engine(spec(cfg, "decode", **engine))
    try:
        start_p = counters(prefill)

        async def scenario():
            pairing = pairing_for(pre_spec)
            dec = asyncio.create_task(collect(decode, "a late prefill half", LONG, pairing))
            await wait_async(lambda: counters(decode)["kv_receiving"] == 1, what="the decode half's want sent")
            await asyncio.sleep(0.2)
            decode.close()                                   # dies waiting: no cancel reaches the prefill side
            await asyncio.gather(dec, return_exceptions=True)
            await asyncio.sleep(timeout_s + 0.5)             # the want times out on the prefill side
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(RuntimeError, match="timed out .* before this prefill request came"):
                await asyncio.wait_for(collect(prefill, "a late prefill half", LONG, pairing), timeout_s + FAST_S)
            late = loop.time() - t0
            assert late < timeout_s / 2, f"the late prefill half took {late:.2f} s to fail (timeout {timeout_s} s)"
            await wait_async(lambda: counters(prefill) == start_p, timeout=FAST_S, what="the prefill side at its start")

        asyncio.run(scenario())
    finally:
        prefill.close()
        decode.close()


def test_a_prefill_that_outlives_its_rooms_want_fails_when_it_ends():
    """SGLang's order: the want came and let the prefill half in (its room bound), then the decode instance died (no
    cancel comes) and the prefill stalled past the want's timeout. When the prefill ends, its KV has no destination:
    it fails then, not after holding this pool's KV for a timeout of its own. (With the decode side alive, its own
    timeout's cancel ends the room first.)"""
    timeout_s = 1.5
    cfg = base_cfg()
    engine = {"disaggregation_transfer_backend": "tcp", "disaggregation_timeout_s": timeout_s,
              "disaggregation_order": "sglang"}
    pre_spec = spec(cfg, "prefill", **engine)
    prefill, decode = open_engine(pre_spec), open_engine(spec(cfg, "decode", **engine))
    disagg = prefill.local_engine.scheduler.disagg
    try:
        start_p = counters(prefill)
        gate = gate_steps(prefill)

        async def scenario():
            pairing = pairing_for(pre_spec)
            pre = asyncio.create_task(collect(prefill, "a stalled prefill " * 3, LONG, pairing))
            dec = asyncio.create_task(collect(decode, "a stalled prefill " * 3, LONG, pairing))
            await wait_async(lambda: len(disagg.prefilling) == 1, what="the prefill half admitted (its room bound)")
            decode.close()                                   # dies waiting: no cancel reaches the prefill side
            await asyncio.gather(dec, return_exceptions=True)
            await asyncio.sleep(timeout_s + 0.5)             # the bound want times out on the prefill side
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            gate.set()                                       # the prefill runs now, past its room's want
            with pytest.raises(RuntimeError, match="timed out .* while this request prefilled"):
                await asyncio.wait_for(pre, timeout_s + FAST_S)
            late = loop.time() - t0
            assert late < timeout_s / 2, f"the stalled prefill took {late:.2f} s to fail (timeout {timeout_s} s)"
            await wait_async(lambda: counters(prefill) == start_p and not disagg.prefilling, timeout=FAST_S,
                             what="the prefill side back at its start")

        asyncio.run(scenario())
    finally:
        prefill.close()
        decode.close()
