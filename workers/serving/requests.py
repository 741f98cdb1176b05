"""Checks of a generation request's arguments, shared by the front door and the worker.

Both check: the front door so that a bad request holds nothing anywhere in the mesh (no
routing, no pages), the worker because it is an API of its own (a vLLM-style engine may
call it directly). Each failure is a ValueError naming the value and the bound.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence


def prompt_tokens(prompt: object) -> list[object]:
    """A prompt given as token ids, as a list (checked by `check_tokens`).

    Raises:
        ValueError: the prompt is neither text nor a sequence of ids.
    """
    if hasattr(prompt, "tolist") and not isinstance(prompt, str):
        prompt = prompt.tolist()  # a numpy array or a torch tensor of ids
    if isinstance(prompt, str | bytes) or not isinstance(prompt, Sequence):
        raise ValueError(
            f"a prompt is text or a sequence of token ids, got {type(prompt).__name__}"
        )
    return list(prompt)


def check_tokens(tokens: Sequence[object], vocab_size: int, what: str = "token id") -> list[int]:
    """The token ids as ints, each in [0, vocab_size).

    Raises:
        ValueError: an id that is not an int (bools included) or lies outside the vocabulary.
    """
    # The usual case, checked in C: plain ints (bools are not: their type is bool), in range.
    if tokens and set(map(type, tokens)) == {int} and min(tokens) >= 0 and max(tokens) < vocab_size:
        return list(tokens)
    out = []  # otherwise one by one, to name the first bad id (numpy integers pass)
    for i, token in enumerate(tokens):
        # numpy integers are Integral too; bools are ints to Python but never token ids
        if not isinstance(token, numbers.Integral) or isinstance(token, bool):
            raise ValueError(f"{what} {i} is {token!r}, not an int")
        value = int(token)
        if not 0 <= value < vocab_size:
            raise ValueError(
                f"{what} {value} (position {i}) outside the model's vocabulary [0, {vocab_size})"
            )
        out.append(value)
    return out


def check_max_new_tokens(max_new_tokens: object, prompt_tokens: int, context_tokens: int) -> None:
    """`max_new_tokens` is an int >= 1, and the prompt plus that many tokens fit the
    model's context window.

    Raises:
        ValueError: with the numbers.
    """
    if type(max_new_tokens) is not int:
        raise ValueError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if prompt_tokens + max_new_tokens > context_tokens:
        raise ValueError(
            f"{prompt_tokens} prompt tokens + max_new_tokens {max_new_tokens} exceed the "
            f"model's context window of {context_tokens} tokens"
        )
