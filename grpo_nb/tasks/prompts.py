"""A task row as the prompt the model sees: through its chat template when it has one.

Without a template (the tiny character model) the prompt is the plain text, so ``"003+006="``
stays eight tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def template_defaults(tokenizer: Any) -> dict[str, Any]:
    """``{"enable_thinking": False}`` when the chat template reads it (Qwen3), else ``{}``:
    a thinking block runs past a GRPO-sized ``max_tokens``, so nearly every completion would
    be cut before its answer and score 0."""
    template = getattr(tokenizer, "chat_template", None) or ""
    texts = template.values() if isinstance(template, Mapping) else [template]
    return {"enable_thinking": False} if any("enable_thinking" in str(t) for t in texts) else {}


def prompt_text(tokenizer: Any, row: Mapping[str, Any], *, add_generation_prompt: bool = True,
                chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The rendered prompt as text; ``chat_template_kwargs`` override :func:`template_defaults`."""
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
    """Token ids of :func:`prompt_text`; the template's special tokens are in the text, so no
    BOS or other special token is added on top."""
    text = prompt_text(tokenizer, row, add_generation_prompt=add_generation_prompt,
                       chat_template_kwargs=chat_template_kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))
