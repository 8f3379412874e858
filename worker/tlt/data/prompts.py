"""Prompt rendering: a dataset row's prompt -> chat messages (with the spec's system prompt) -> the tokenizer's chat
template -> token ids, with the over-long prompts filtered out.

    rendered = render_examples(train_rows, tokenizer, system_prompt, max_prompt_length)
    rendered[0].ids   # token ids ending with the assistant turn's opening, ready for generation

A string prompt becomes [system?, user]; a chat prompt is used as given, with the system prompt prepended only when
the chat has none.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from worker.tlt.data.dataset import Example
from worker.tlt.model.tokenizer import TokenizerLike

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RenderedPrompt:
    example: Example
    text: str  # the chat-templated prompt
    ids: tuple[int, ...]  # its tokens


def to_messages(prompt: str | list[dict[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = list(prompt)
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


def render(example: Example, tokenizer: TokenizerLike, system_prompt: str | None) -> RenderedPrompt:
    text = tokenizer.apply_chat_template(to_messages(example.prompt, system_prompt), add_generation_prompt=True)
    return RenderedPrompt(example, text, tuple(tokenizer.encode(text, add_special_tokens=False)))


def render_examples(
    rows: list[Example], tokenizer: TokenizerLike, system_prompt: str | None, max_prompt_length: int
) -> list[RenderedPrompt]:
    """Rendered rows, skipping those longer than max_prompt_length tokens (logged with a count)."""
    out = [render(r, tokenizer, system_prompt) for r in rows]
    kept = [r for r in out if len(r.ids) <= max_prompt_length]
    if len(kept) < len(out):
        log.info("skipped %d of %d prompts longer than %d tokens", len(out) - len(kept), len(out), max_prompt_length)
    return kept
