"""Wire formats: SGLang's native ``/generate`` and OpenAI's ``/v1/completions`` and ``/v1/chat/completions``.

Requests are strict pydantic v2 models (``"5"`` is not an int, ``"yes"`` is not a bool), validated straight from the
raw bytes. Top-level fields we do not use are ignored, as OpenAI clients send many (``user``, ``seed``...); unknown
*sampling* fields in the native API are rejected, so a ``top_k`` that would be silently dropped fails instead.
Responses and SSE chunks follow the two APIs, with ``usage.prompt_tokens_details.cached_tokens`` (OpenAI) and
``meta_info.cached_tokens`` (native) carrying the radix-cache hits.
"""
from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, SerializeAsAny

from framework.serving.http.chat_template import apply_chat_template
from framework.serving.http.errors import ApiError

if TYPE_CHECKING:
    from framework.engine.request import SamplingParams

FinishReason = Literal["stop", "length", "abort"]
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]  # OpenAI's, as vLLM and SGLang take
SSE_DONE = b"data: [DONE]\n\n"
DEFAULT_CHAT_MAX_TOKENS = 128  # = SamplingParams.max_new_tokens; OpenAI chat has no fixed default


def _sampling_params(**kw: Any) -> "SamplingParams":
    # imported on use: the engine package pulls in torch, which the router process never needs
    from framework.engine.request import SamplingParams
    return SamplingParams(**kw)


def _stop_list(v: Any) -> Any:
    """OpenAI allows ``stop`` as one string, a list, or null; normalise to a list before strict validation."""
    if v is None:
        return []
    return [v] if isinstance(v, str) else v


def _single_prompt(v: Any) -> Any:
    if isinstance(v, list):
        if len(v) != 1:
            raise ValueError(f"batched prompts are not supported (got a list of {len(v)}); send one string")
        return v[0]
    return v


def _content_text(v: Any) -> Any:
    """Message content: a string, null, or a list of ``{"type": "text", "text": ...}`` parts (concatenated)."""
    if v is None:
        return ""
    if isinstance(v, list):
        texts = []
        for i, part in enumerate(v):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError(f"part {i} must be {{'type': 'text', 'text': <string>}}; only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    return v


StopList = Annotated[list[str], BeforeValidator(_stop_list)]
MaxTokens = Annotated[int, Field(ge=1)]
Temperature = Annotated[float, Field(ge=0.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


# ---------------------------------------------------------------- requests


class _Bootstrap(_Strict):
    """SGLang's prefill/decode pairing, added by a P/D router (sglang-router --pd-disaggregation) to the body it sends
    both halves: the prefill instance's host and bootstrap port, and the room both sides meet in. A mixed worker
    ignores them; a prefill or decode worker needs all three."""
    bootstrap_host: str | None = None
    bootstrap_port: Annotated[int, Field(ge=0, le=65535)] | None = None
    bootstrap_room: Annotated[int, Field(ge=0, lt=2**64)] | None = None

    def bootstrap(self) -> tuple[str, int, int] | None:
        """(host, port, room), None when the request carries none; ApiError when only some are given."""
        given = (self.bootstrap_host, self.bootstrap_port, self.bootstrap_room)
        if all(v is None for v in given):
            return None
        if any(v is None for v in given):
            raise ApiError(400, "bootstrap_host, bootstrap_port and bootstrap_room go together: give all three "
                                "(a P/D router adds them) or none", param="bootstrap_room")
        return given


class NativeSamplingParams(_Strict):
    model_config = ConfigDict(strict=True, extra="forbid")
    max_new_tokens: MaxTokens = 128
    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    ignore_eos: bool = False
    stop: StopList = []


class GenerateRequest(_Bootstrap):
    """SGLang native ``POST /generate``: one prompt string (batched lists are not supported)."""
    text: str
    sampling_params: NativeSamplingParams = NativeSamplingParams()
    stream: bool = False
    rid: str | None = None
    # SGLang's GenerateReqInput.data_parallel_rank: the DP group (under DP attention) that must serve the request,
    # for a router that addresses DP groups itself; None: the instance's DP controller picks
    data_parallel_rank: Annotated[int, Field(ge=0)] | None = None

    def to_sampling_params(self) -> SamplingParams:
        sp = self.sampling_params
        return _sampling_params(max_new_tokens=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p,
                              ignore_eos=sp.ignore_eos, stop=list(sp.stop))


class AbortRequest(_Strict):
    """SGLang's ``POST /abort_request``."""
    rid: str


class StreamOptions(_Strict):
    include_usage: bool = False


class _OpenAIRequest(_Bootstrap):
    model: str | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    stop: StopList = []
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    ignore_eos: bool = False  # SGLang's extension
    # as GenerateRequest's: sglang-router 0.3.2 --dp-aware puts the DP group it chose in the OpenAI bodies too
    data_parallel_rank: Annotated[int, Field(ge=0)] | None = None

    def _sampling(self, max_tokens: int) -> SamplingParams:
        return _sampling_params(max_new_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              ignore_eos=self.ignore_eos, stop=list(self.stop))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_OpenAIRequest):
    prompt: Annotated[str, BeforeValidator(_single_prompt)]
    max_tokens: MaxTokens = 16  # OpenAI's default for completions

    def to_sampling_params(self) -> SamplingParams:
        return self._sampling(self.max_tokens)


class ChatMessage(_Strict):
    role: Role
    content: Annotated[str, BeforeValidator(_content_text)] = ""


class ChatCompletionRequest(_OpenAIRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None  # OpenAI's newer name for max_tokens

    def to_sampling_params(self) -> SamplingParams:
        limit = self.max_completion_tokens or self.max_tokens or DEFAULT_CHAT_MAX_TOKENS
        return self._sampling(limit)

    def prompt_text(self) -> str:
        return apply_chat_template(self.messages)


# --------------------------------------------- routing views (the router validates only what it routes on)
#
# The router accepts every prompt shape SGLang's and vLLM's servers accept on the APIs it fronts, and routes on one
# key: the text, or for token ids one character per id (so the cache-aware tree works alike on both). A batch goes to
# one worker, routed on its first prompt. What a worker cannot serve (e.g. an image part for a text-only model) is
# the worker's to refuse.


def _is_token_ids(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(type(t) is int and t >= 0 for t in v)


def _token_key(ids: list[int]) -> str:
    return "".join(map(chr, (t % 0x110000 for t in ids)))  # one character per id (ids past Unicode's range wrap)


def _texts(v: Any) -> Any:
    if isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(t, str) for t in v)):
        return v
    raise ValueError("must be a string or a non-empty list of strings")


def _token_ids(v: Any) -> Any:
    if _is_token_ids(v) or (isinstance(v, list) and v and all(_is_token_ids(x) for x in v)):
        return v
    raise ValueError("must be a non-empty list of token ids (integers >= 0), or a non-empty list of such lists")


def _prompt(v: Any) -> Any:
    try:
        return _texts(v)
    except ValueError:
        pass
    try:
        return _token_ids(v)
    except ValueError:
        raise ValueError("must be a string, a list of strings, a list of token ids (integers >= 0) or a list of "
                         "such lists; none may be empty") from None


def _key(prompt: str | list) -> str:
    """The routing key of a validated prompt: a text, a batch (its first), token ids, or a batch of token ids."""
    if isinstance(prompt, str):
        return prompt
    first = prompt[0]
    if isinstance(first, str):
        return first
    return _token_key(first if isinstance(first, list) else prompt)


def _parts_text(v: Any) -> Any:
    """Message content for routing: a string, null, or content parts (any ``type``; the text parts' text counts)."""
    if v is None or isinstance(v, str):
        return v or ""
    if isinstance(v, list):
        texts = []
        for i, part in enumerate(v):
            if not (isinstance(part, dict) and isinstance(part.get("type"), str)):
                raise ValueError(f"part {i} must be an object with a string 'type'")
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"part {i} is a text part without a string 'text'")
                texts.append(part["text"])
        return "".join(texts)
    raise ValueError("must be a string, null, or a list of content parts")


class _RoutingView(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    stream: bool | None = False  # the router applies request_timeout_s (silence) to streams only; null: not one

    def token_ids(self) -> list[int] | None:
        """The routed prompt's token ids when the client sent ids (the first of a batch), else None."""
        prompt = getattr(self, "input_ids", None) or getattr(self, "prompt", None)
        if not isinstance(prompt, list) or isinstance(prompt[0], str):
            return None
        return prompt[0] if isinstance(prompt[0], list) else prompt


class GenerateRouting(_RoutingView):
    """SGLang's ``/generate``: ``text`` (one string or a batch) or ``input_ids`` (one list of ids or a batch)."""
    text: Annotated[str | list[str], PlainValidator(_texts)] | None = None
    input_ids: Annotated[list, PlainValidator(_token_ids)] | None = None

    def routing_text(self) -> str:
        if (self.text is None) == (self.input_ids is None):
            raise ApiError(400, "text: give exactly one of text and input_ids", param="text")
        return _key(self.text if self.text is not None else self.input_ids)


class CompletionRouting(_RoutingView):
    prompt: Annotated[str | list, PlainValidator(_prompt)]

    def routing_text(self) -> str:
        return _key(self.prompt)


class RoutedMessage(_RoutingView):
    role: Role
    content: Annotated[str, PlainValidator(_parts_text)] = ""


class ChatRouting(_RoutingView):
    messages: Annotated[list[RoutedMessage], Field(min_length=1)]

    def routing_text(self) -> str:
        return apply_chat_template(self.messages)


# ---------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class MetaInfo(BaseModel):
    """Native ``meta_info``; ``finish_reason`` is SGLang's dict (``{"type": "length", "length": 16}``), null mid-stream."""
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: dict | None = None
    # servelab's addition: seconds from the request's arrival at the engine to its first token, as the engine's
    # scheduler stamped it (null before it; engine_ttft_ms_mean's per request); the client's TTFT less this is the
    # time outside the engine (client, router, HTTP: experiments/sim_fidelity)
    engine_ttft_s: float | None = None


class PairedMetaInfo(MetaInfo):
    """A disaggregated request's ``meta_info`` (servelab's additions): what its KV transfer moved and how long the
    prefill side's writes took (the decode side's answer carries them)."""
    kv_transfer_bytes: int = 0
    kv_transfer_s: float = 0.0


class GenerateResponse(BaseModel):
    """Native response; when streaming, each SSE event is one of these with the *cumulative* text."""
    text: str
    meta_info: SerializeAsAny[MetaInfo]       # a PairedMetaInfo keeps its own fields


def native_finish_reason(reason: str | None, completion_tokens: int) -> dict | None:
    if reason is None:
        return None
    return {"type": reason, "length": completion_tokens} if reason == "length" else {"type": reason}


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    """Both the full response (``object="text_completion"``) and each streamed chunk (delta ``text``)."""
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def sse(model: BaseModel | None = None, *, data: bytes | None = None) -> bytes:
    """One server-sent event: ``data: {...}\\n\\n``; a chunk's ``usage`` is left out until the final usage chunk."""
    if data is None:
        data = model.model_dump_json(exclude={"usage"} if getattr(model, "usage", 0) is None else None).encode()
    return b"data: " + data + b"\n\n"
