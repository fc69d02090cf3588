"""A task row as the prompt the model sees: its chat template when it has one, else the plain
text (so the tiny character model's ``"003+006="`` stays eight tokens).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def template_defaults(tokenizer: Any) -> dict[str, Any]:
    """``{"enable_thinking": False}`` when the template reads it (Qwen3): a thinking block runs
    past a GRPO-sized ``max_tokens``, cutting nearly every answer off."""
    template = getattr(tokenizer, "chat_template", None) or ""
    texts = template.values() if isinstance(template, Mapping) else [template]
    return {"enable_thinking": False} if any("enable_thinking" in str(t) for t in texts) else {}


def prompt_text(tokenizer: Any, row: Mapping[str, Any], *, add_generation_prompt: bool = True,
                chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The rendered prompt as text; ``chat_template_kwargs`` override :func:`template_defaults`."""
    messages = row.get("messages")
    if messages and has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
            **{**template_defaults(tokenizer), **dict(chat_template_kwargs or {})},
        )
    if messages:  # no template: the turns' text, so a system prompt still reaches the model
        return "\n\n".join(str(m["content"]) for m in messages)
    return str(row["prompt"])


def prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """A rendered prompt's token ids: its template's special tokens are in the text already."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def render_prompt(tokenizer: Any, row: Mapping[str, Any], *, add_generation_prompt: bool = True,
                  chat_template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids of :func:`prompt_text`."""
    return prompt_ids(tokenizer, prompt_text(tokenizer, row, chat_template_kwargs=chat_template_kwargs,
                                             add_generation_prompt=add_generation_prompt))
