"""The one chat template: OpenAI-style messages -> the prompt text the engine sees.

Both the worker (to build the prompt) and the router (to route a chat request by its text) call ``apply_chat_template``,
so a cache-aware router sees exactly the characters the worker's radix cache will see.

Format, one line group per message, then the generation prompt::

    <|system|>You are terse.
    <|user|>Hi
    <|assistant|>Hello!
    <|user|>Bye
    <|assistant|>

i.e. ``"<|{role}|>{content}\\n"`` per message followed by ``"<|assistant|>"``. The rendering is append-only: turn k+1 of
a conversation renders to turn k's text + the assistant's reply + the new messages, so multi-turn requests share
a growing prefix (what cache-aware routing and the radix cache exploit).
"""
from __future__ import annotations

from typing import Iterable, Mapping

ROLES = ("system", "user", "assistant", "tool")
GENERATION_PROMPT = "<|assistant|>"


def render_message(role: str, content: str) -> str:
    return f"<|{role}|>{content}\n"


def apply_chat_template(messages: Iterable[Mapping[str, str] | object], add_generation_prompt: bool = True) -> str:
    """Render messages (dicts or objects with ``role`` and ``content`` strings) to one prompt string."""
    parts = []
    for m in messages:
        role = m["role"] if isinstance(m, Mapping) else m.role
        content = m["content"] if isinstance(m, Mapping) else m.content
        parts.append(render_message(role, content or ""))
    if add_generation_prompt:
        parts.append(GENERATION_PROMPT)
    return "".join(parts)
