"""Turning a task row into the prompt the model sees: its chat template when it has one.

A row carries ``prompt`` (the user's text) and usually ``messages`` (the chat: an optional
system turn, then the user turn). With a chat template (Qwen's
``<|im_start|>user\\n…<|im_end|>\\n<|im_start|>assistant\\n``) the messages go through it;
without one (the tiny character model) the prompt is the plain text, so ``"003+006="`` stays
eight tokens.

Template arguments default to :func:`template_defaults` (thinking off where the template knows
``enable_thinking``, as Qwen3's does); the caller's ``chat_template_kwargs`` override them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def template_defaults(tokenizer: Any) -> dict[str, Any]:
    """The template arguments used unless the caller sets them: ``{"enable_thinking": False}``
    when the chat template reads ``enable_thinking`` (Qwen3), else none.

    Why thinking off: a Qwen3 thinking block runs to hundreds or thousands of tokens, so at a
    GRPO-sized ``max_tokens`` nearly every completion is cut before its answer and scores 0.
    """
    template = getattr(tokenizer, "chat_template", None) or ""
    texts = template.values() if isinstance(template, Mapping) else [template]
    return {"enable_thinking": False} if any("enable_thinking" in str(t) for t in texts) else {}


def prompt_text(tokenizer: Any, row: Mapping[str, Any], *, add_generation_prompt: bool = True,
                chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The rendered prompt as text (what :func:`render_prompt` tokenizes; show it to users).

    ``chat_template_kwargs`` go to the template over :func:`template_defaults` (pass
    ``{"enable_thinking": True}`` to keep Qwen3's thinking on).
    """
    messages = row.get("messages")
    if messages and has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
            **{**template_defaults(tokenizer), **dict(chat_template_kwargs or {})},
        )
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}")
        return text
    if messages:  # no template: the turns' text, so a system prompt still reaches the model
        return "\n\n".join(str(m["content"]) for m in messages)
    return str(row["prompt"])


def render_prompt(tokenizer: Any, row: Mapping[str, Any], *, add_generation_prompt: bool = True,
                  chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids of a row's prompt: through the chat template when the tokenizer has one.

    The template's special tokens (``<|im_start|>``…) are in the text, and the tokenizer maps
    them to their ids; no BOS or other special token is added on top.
    """
    text = prompt_text(tokenizer, row, add_generation_prompt=add_generation_prompt,
                       chat_template_kwargs=chat_template_kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))
