"""Streams and chats at the front door: tokens handed over as the worker decodes them,
and conversations turned into prompts by the model's chat template.

A stream is a Ray streaming generator on the worker (`Worker.stream` yields each token
as it is sampled, then the whole output), run and failed over by the front door's
dispatcher (`cluster.dispatch`); `TokenStream` turns its tokens into text pieces, and
keeps the whole result for when the stream ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from workers.api import GenerateOutput, StreamItem


class StreamChunk(NamedTuple):
    """One decoded token and the text it adds to the output. The text is empty while a
    character spans several tokens (it comes whole with the token that completes it) and
    for special tokens such as the end of sequence."""

    token_id: int
    text: str


class TokenStream:
    """The tokens of one generation as they are decoded; iterate it once.

    `result` is the GenerateResult (finish reason, stats) once the iteration ended, None
    before. Leaving the loop early, `close()`, leaving a `with` block or dropping the
    stream cancels the generation on its worker, which frees its pages within a pass or
    two (pages it had published stay cached).

    Args:
        items: the worker's stream items (`Dispatcher.stream`).
        tokenizer: turns tokens into text (None: text pieces are empty).
        to_result: a worker's output as the caller gets it.
    """

    def __init__(
        self,
        items: Iterator[StreamItem],
        tokenizer: Any,
        to_result: Callable[[GenerateOutput], Any],
    ):
        self._items = items
        self._tokenizer = tokenizer
        self._to_result = to_result
        self._started = False
        self.result: Any = None

    def __iter__(self) -> Iterator[StreamChunk]:
        if self._started:
            raise RuntimeError("a TokenStream is iterated once")
        self._started = True
        text = _Detokenizer(self._tokenizer)
        try:
            for item in self._items:
                if item.last:
                    self.result = self._to_result(item.output)
                    return
                yield StreamChunk(item.token_id, text.add(item.token_id))
        finally:
            self.close()

    def close(self) -> None:
        """Stop the generation if it has not ended (idempotent)."""
        items = self.__dict__.pop("_items", None)
        if items is not None and hasattr(items, "close"):
            items.close()

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # An interpreter shutting down may have lost Ray already: nothing to cancel then.
        with contextlib.suppress(Exception):
            self.close()


class _Detokenizer:
    """Text pieces for tokens decoded one at a time: each piece is what the token adds
    to the decoded whole, held back while the whole ends inside a character."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._tokens: list[int] = []
        self._emitted = ""

    def add(self, token: int) -> str:
        if self._tokenizer is None:
            return ""
        self._tokens.append(token)
        whole = self._tokenizer.decode(self._tokens, skip_special_tokens=True)
        if whole.endswith("\ufffd") or not whole.startswith(self._emitted):
            return ""  # a character still incomplete (or a merge that rewrote the tail)
        piece, self._emitted = whole[len(self._emitted) :], whole
        return piece


# The roles the chat templates of the mesh's models (SmolLM2's ChatML) give a meaning;
# any other would be written into the prompt as if it were one (a "root" turn).
CHAT_ROLES = ("system", "user", "assistant")


def chat_prompt(tokenizer: Any, messages: Sequence[dict[str, str]], model: str) -> list[int]:
    """The prompt tokens of a conversation under the model's chat template, with the
    assistant's turn opened.

    Raises:
        ValueError: messages that are not a non-empty list of {"role": one of CHAT_ROLES,
            "content": str} mappings, or a model without a tokenizer or chat template.
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} mappings")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise ValueError(
                f"message {i} must be a mapping with exactly 'role' and 'content', got {message!r}"
            )
        for key in ("role", "content"):
            if not isinstance(message[key], str):
                raise ValueError(f"message {i} {key} must be a str, got {message[key]!r}")
        if message["role"] not in CHAT_ROLES:
            raise ValueError(
                f"message {i} has role {message['role']!r}; the chat template takes "
                f"{', '.join(CHAT_ROLES)}"
            )
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"model {model!r} has no chat template: pass a prompt to generate()")
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=True, tokenize=False
    )
    # The template writes the special tokens itself; the tokenizer must not add more.
    return list(tokenizer.encode(text, add_special_tokens=False))
