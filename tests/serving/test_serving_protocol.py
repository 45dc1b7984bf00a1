"""Request models -> the engine's SamplingParams, and the chat template's append-only rendering."""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from framework.engine.request import SamplingParams
from framework.serving import protocol as P
from framework.serving.chat_template import apply_chat_template
from framework.serving.errors import ApiError, parse_body


def test_each_api_maps_to_sampling_params():
    native = parse_body(P.GenerateRequest, b'{"text": "t", "sampling_params": {"max_new_tokens": 7, "top_p": 0.5,'
                                           b' "stop": "END", "ignore_eos": true}}')
    assert native.to_sampling_params() == SamplingParams(max_new_tokens=7, temperature=0.0, top_p=0.5,
                                                         ignore_eos=True, stop=["END"])
    comp = parse_body(P.CompletionRequest, b'{"prompt": ["only one"], "temperature": 0, "stop": ["a", "b"]}')
    assert comp.prompt == "only one"
    assert comp.to_sampling_params() == SamplingParams(max_new_tokens=16, temperature=0.0, stop=["a", "b"])
    chat = parse_body(P.ChatCompletionRequest, b'{"messages": [{"role": "user", "content": null}],'
                                               b' "max_tokens": 9, "max_completion_tokens": 3}')
    assert chat.to_sampling_params().max_new_tokens == 3  # the newer name wins
    assert chat.prompt_text() == "<|user|>\n<|assistant|>"
    assert parse_body(P.ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x"}]}'
                      ).to_sampling_params().max_new_tokens == P.DEFAULT_CHAT_MAX_TOKENS == SamplingParams().max_new_tokens


def test_router_views_accept_what_the_worker_accepts_and_reject_a_missing_text():
    body = b'{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], "max_tokens": 2}'
    assert parse_body(P.ChatRouting, body).routing_text() == parse_body(P.ChatCompletionRequest, body).prompt_text()
    with pytest.raises(ApiError) as err:
        parse_body(P.GenerateRouting, b'{"input_ids": [1, 2]}')
    assert err.value.status == 400 and err.value.message == "text: Field required"


messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]),
                                           "content": st.text(max_size=20)}), min_size=1, max_size=6)


@given(messages, st.text(max_size=20), messages)
def test_chat_template_is_append_only(history, reply, follow_up):
    """Turn k+1 renders to turn k's text + the reply + the new messages: multi-turn prompts share a prefix."""
    before = apply_chat_template(history)
    after = apply_chat_template([*history, {"role": "assistant", "content": reply}, *follow_up])
    assert after.startswith(before + reply)
