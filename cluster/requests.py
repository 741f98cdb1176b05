"""The front door's requests: checked before anything is routed or held, and their results
as the caller gets them.

A request is checked here against everything a worker would check (the model's
vocabulary and context window, sampling, stop tokens, the tenant's name), so a bad one
is a ValueError that changes nothing anywhere in the mesh. What goes to the worker is the
typed `workers.api.GenerateRequest`; what comes back, a `GenerateOutput`, becomes the
caller's `GenerateResult` (its stats a plain dict, with the time to first token as the
caller saw it).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple

from cache_service.events import Namespace
from cache_service.protocol import Limits
from workers.api import DEFAULT_TIMEOUT_S, GenerateOutput, GenerateRequest
from workers.serving.config import SamplingParams
from workers.serving.models import model_shape
from workers.serving.requests import check_max_new_tokens, check_tokens, prompt_tokens


class GenerateResult(NamedTuple):
    token_ids: list[int]
    text: str  # the decoded tokens, special tokens (the end of sequence) left out
    stats: dict[str, Any]
    logits: list[float] | None = None  # the last prompt position's, when asked for
    # "stop": an end-of-sequence or stop token ended it (the last token); "length":
    # max_new_tokens reached; "out_of_pages": the worker's store could not grow it.
    finish_reason: str = "length"


class FrontRequest(NamedTuple):
    """A checked request: where its pages live (for routing) and what the worker gets."""

    namespace: Namespace
    body: GenerateRequest

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.body.tokens


def check_request(
    tokens: Sequence[Any],
    model: str,
    salt: str,
    max_new_tokens: int,
    sampling: SamplingParams,
    stop_token_ids: Sequence[int],
    reuse: bool,
    ignore_eos: bool,
    return_logits: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> FrontRequest:
    """A request checked against everything a worker would check, with an id of its own
    (by which the front door cancels it on its worker).

    Raises:
        ValueError: an empty prompt, token ids outside the vocabulary, max_new_tokens
            not an int >= 1 or past the context window, stop tokens outside the
            vocabulary, flags that are not bools, or a timeout that is not a positive
            number of seconds.
    """
    if not tokens:
        raise ValueError("empty prompt")
    shape = model_shape(model)
    checked = check_tokens(list(tokens), shape.vocab_size)
    check_max_new_tokens(max_new_tokens, len(checked), shape.context_tokens)
    stops = check_tokens(list(stop_token_ids), shape.vocab_size, "stop token")
    body = GenerateRequest(
        tokens=tuple(checked),
        max_new_tokens=max_new_tokens,
        salt=salt,
        reuse=reuse,
        sampling=sampling,
        stop_token_ids=tuple(stops),
        ignore_eos=ignore_eos,
        return_logits=return_logits,
        timeout_s=timeout_s,
        request_id=uuid.uuid4().hex,
    )
    return FrontRequest(Namespace(model, "", salt), body)


def check_tenant(tenant: str) -> None:
    """A tenant name the service can keep (its statistics show names).

    Raises:
        ValueError: a name longer than the wire takes.
    """
    size = len(tenant.encode("utf-8"))
    if size > Limits().max_str_len:
        raise ValueError(
            f"tenant name of {size} bytes; the service takes names of at most "
            f"{Limits().max_str_len}"
        )


def tokens_of(prompt: str | Sequence[int], tokenizer: Any, model: str) -> list[Any]:
    """A prompt's token ids: text through the model's tokenizer, ids as given.

    Raises:
        ValueError: text for a model without a tokenizer, or neither text nor ids.
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"model {model!r} has no tokenizer: pass token ids")
        return list(tokenizer.encode(prompt))
    return prompt_tokens(prompt)


def many_prompts(prompt: Any) -> bool:
    """Whether `prompt` is several prompts (a list of texts or of token-id lists) rather
    than one (a text, or one list of token ids)."""
    return (
        isinstance(prompt, list | tuple)
        and bool(prompt)
        and all(isinstance(p, str | list | tuple) for p in prompt)
    )


def result_of(output: GenerateOutput, start: float | None = None) -> GenerateResult:
    """A worker's output as the front door returns it. With `start` (when the caller
    asked), `ttft_client_s` is the time to first token as the caller saw it: routing,
    queueing and the worker's own time to first token (the worker's time after its first
    token, until it answered, taken off the caller's whole wait)."""
    stats = output.stats.as_dict()
    if start is not None:
        waited = time.perf_counter() - start
        stats["ttft_client_s"] = max(0.0, waited - (stats["total_s"] - stats["ttft_s"]))
    logits = None if output.logits is None else list(output.logits)
    return GenerateResult(list(output.token_ids), output.text, stats, logits, output.finish_reason)
