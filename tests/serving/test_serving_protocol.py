"""Request models -> the engine's SamplingParams, and the chat template's append-only rendering."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, strategies as st

from framework.engine.request import SamplingParams
from framework.serving.http import protocol as P
from framework.serving.http.chat_template import apply_chat_template
from framework.serving.http.errors import ApiError, parse_body


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
    for missing in (b'{}', b'{"text": null}', b'{"text": "a", "input_ids": [1]}'):
        with pytest.raises(ApiError) as err:
            parse_body(P.GenerateRouting, missing).routing_text()
        assert err.value.status == 400 and err.value.message == "text: give exactly one of text and input_ids"


@pytest.mark.parametrize("view, body, key", [
    # SGLang's /generate: a text, a batch of texts (routed on its first), token ids, a batch of token ids
    (P.GenerateRouting, {"text": "hello"}, "hello"),
    (P.GenerateRouting, {"text": ["first", "second"], "rid": ["a", "b"]}, "first"),
    (P.GenerateRouting, {"input_ids": [104, 105, 0x1F600]}, "hi\U0001F600"),
    (P.GenerateRouting, {"input_ids": [[104, 105], [7]]}, "hi"),
    # OpenAI completions as vLLM and SGLang take them: text, batch, token ids, batch of token ids
    (P.CompletionRouting, {"prompt": "p"}, "p"),
    (P.CompletionRouting, {"prompt": ["p", "q"]}, "p"),
    (P.CompletionRouting, {"prompt": [1, 2]}, "\x01\x02"),
    (P.CompletionRouting, {"prompt": [[1, 2], [3]]}, "\x01\x02"),
    (P.CompletionRouting, {"prompt": "p", "stream": None}, "p"),  # OpenAI's optional fields may be null
    # chat: the developer role, content parts of any type (the text parts are the key), null content
    (P.ChatRouting, {"messages": [{"role": "developer", "content": "d"},
                                  {"role": "user", "content": [{"type": "text", "text": "look: "},
                                                               {"type": "image_url", "image_url": {"url": "x"}},
                                                               {"type": "text", "text": "this"}]},
                                  {"role": "assistant", "content": None, "tool_calls": []}]},
     "<|developer|>d\n<|user|>look: this\n<|assistant|>\n<|assistant|>"),
])
def test_router_views_take_every_shape_sglang_and_vllm_take(view, body, key):
    assert parse_body(view, json.dumps(body).encode()).routing_text() == key


@pytest.mark.parametrize("view, body, param", [
    (P.GenerateRouting, {"text": 5}, "text"), (P.GenerateRouting, {"text": []}, "text"),
    (P.GenerateRouting, {"input_ids": [1, -2]}, "input_ids"), (P.GenerateRouting, {"input_ids": [[1], []]}, "input_ids"),
    (P.GenerateRouting, {"input_ids": [1.5]}, "input_ids"), (P.GenerateRouting, {"input_ids": [True]}, "input_ids"),
    (P.CompletionRouting, {"prompt": []}, "prompt"), (P.CompletionRouting, {"prompt": [1, "a"]}, "prompt"),
    (P.CompletionRouting, {"prompt": {"text": "a"}}, "prompt"), (P.CompletionRouting, {}, "prompt"),
    (P.ChatRouting, {"messages": []}, "messages"), (P.ChatRouting, {"messages": [{"role": "robot"}]}, "messages.0.role"),
    (P.ChatRouting, {"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages.0.content"),
    (P.ChatRouting, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content"),
    (P.ChatRouting, {"messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
])
def test_router_views_name_the_bad_field(view, body, param):
    with pytest.raises(ApiError) as err:
        parse_body(view, json.dumps(body).encode()).routing_text()
    assert err.value.status == 400 and err.value.param == param and err.value.message.startswith(param + ": ")


messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]),
                                           "content": st.text(max_size=20)}), min_size=1, max_size=6)


@given(messages, st.text(max_size=20), messages)
def test_chat_template_is_append_only(history, reply, follow_up):
    """Turn k+1 renders to turn k's text + the reply + the new messages: multi-turn prompts share a prefix."""
    before = apply_chat_template(history)
    after = apply_chat_template([*history, {"role": "assistant", "content": reply}, *follow_up])
    assert after.startswith(before + reply)
