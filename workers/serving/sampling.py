"""Choosing the next token from a model's logits: greedy, or seeded sampling with
temperature, top-k and top-p (nucleus) filters.

Pure torch; the model runner calls a `Sampler` once per new token, with float32 logits
on the model's device. Each call costs one transfer from that device and no more: greedy
takes the argmax where the logits are and reads back the token; sampling copies the
logits to the CPU once and does the rest there.

Reproducibility across cache paths. The same prompt reaches the model with its prefix KV
computed here, read from this worker's own pages, or copied from a peer's; the logits
then agree to about 1e-5 but not bit for bit, and a seeded request must still give the
same tokens. `torch.multinomial` promises nothing about how it uses its generator (its
algorithm differs between devices and versions), so the guarantee is built here instead:
a `Sampler` draws exactly one uniform number u in [0, 1) per token and picks the token
whose interval of the cumulative distribution, laid out in token id order, holds u:

    probabilities (filtered, token id order)   | a  |   b   | c |      d      |
    cumulative                                 0   .2      .5  .6             1
    u = 0.55                                                 ^ picks c

A small change in the logits moves the interval edges by about as much, so it changes
the token only when u falls that close to an edge. The filters' own edges (the k-th
logit, the token where the cumulative probability reaches top_p) are hard cutoffs: a
near-tie exactly there can still flip a token in or out, which is rare.
"""

from __future__ import annotations

import math
import secrets

import torch

from workers.serving.config import SEED_BOUND, SamplingParams

__all__ = ["SEED_BOUND", "Sampler", "SamplingParams"]


class Sampler:
    """Picks one request's tokens, one call per token, from a generator of its own.

    Greedy params take the argmax and never touch the generator. Otherwise each call
    draws exactly one float64 from the generator, whatever the filters keep, so the
    n-th token always uses the n-th draw.
    """

    def __init__(self, params: SamplingParams | None = None):
        """
        Args:
            params: how to pick; greedy when None.

        Raises:
            ValueError: `params` is not a `SamplingParams`.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        self.params = params
        # The seed actually used, so a request that asked for a random one can be replayed.
        self.seed = params.seed if params.seed is not None else secrets.randbelow(SEED_BOUND)
        # On the CPU whatever device the model runs on: the same seed then gives the same
        # draws on every worker.
        self.generator = torch.Generator(device="cpu").manual_seed(self.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        """The next token.

        Args:
            logits: `(vocab,)` scores for the next token, any float dtype and device.
                -inf marks a token that must not be chosen.

        Returns:
            The chosen token id.

        Raises:
            ValueError: `logits` is not 1-D and non-empty, holds a NaN, or (when sampling)
                has no finite entry.
        """
        if logits.dim() != 1 or logits.numel() == 0:
            raise ValueError(f"logits must be (vocab,), got shape {tuple(logits.shape)}")
        if self.params.greedy:
            # On the logits' own device, and one transfer: the argmax, or -1 when a NaN
            # makes it meaningless (argmax takes NaN for the largest value).
            found = torch.where(torch.isnan(logits).any(), -1, torch.argmax(logits))
            token = int(found)
            if token < 0:
                raise ValueError("logits hold NaN")
            return token
        # The one transfer of a sampled token: the logits to the CPU, where the draw is.
        x = logits.detach().to("cpu", torch.float64)
        if torch.isnan(x).any():
            raise ValueError("logits hold NaN")
        u = float(torch.rand((), generator=self.generator, dtype=torch.float64))
        probs = filtered_probs(x, self.params)
        return pick(probs, u)


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampling (non-greedy) `params` draws from, after its filters.

    Args:
        logits: `(vocab,)` scores.
        params: with temperature > 0.

    Returns:
        `(vocab,)` float64 on the CPU: the softmax of logits / temperature with the
        tokens outside top-k and top-p set to 0, renormalised to sum to 1.

    Raises:
        ValueError: no entry of `logits` is finite (nothing to sample from).
    """
    assert not params.greedy, "greedy params have no distribution to draw from"
    # float64 on the CPU: the cumulative sums below then carry ~1e-16 rounding, far under
    # the ~1e-5 noise between cache paths, and are the same on every device.
    x = logits.detach().to("cpu", torch.float64) / params.temperature  # (vocab,)
    if not torch.isfinite(x).any():
        raise ValueError("logits have no finite entry: no token can be sampled")
    if 0 < params.top_k < x.numel():
        # A threshold, not topk's indices: ties with the k-th logit are all kept, so the
        # kept set does not depend on how topk breaks ties.
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, -math.inf)
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1:
        # Stable sort: equal probabilities stay in token id order, so the cut is
        # reproducible. A token is kept when the tokens before it sum to less than top_p;
        # the most probable one always is.
        order = torch.sort(probs, descending=True, stable=True).indices
        before = torch.cumsum(probs[order], dim=0) - probs[order]  # exclusive prefix sums
        probs = probs.clone()
        probs[order[before >= params.top_p]] = 0.0
        probs /= probs.sum()
    return probs


def pick(probs: torch.Tensor, u: float) -> int:
    """The token whose interval of the cumulative distribution (in token id order) holds u.

    Args:
        probs: `(vocab,)` non-negative, summing to about 1.
        u: in [0, 1).

    Returns:
        A token id with a non-zero probability.
    """
    cdf = torch.cumsum(probs, dim=0)  # (vocab,), non-decreasing
    # Scaled by the total so rounding in the sum never leaves u past the last interval.
    target = torch.tensor(u * float(cdf[-1]), dtype=cdf.dtype)
    token = int(torch.searchsorted(cdf, target, right=True))  # first cdf entry > target
    if token >= cdf.numel():  # only if u * total rounded up to the total itself
        token = int(torch.nonzero(probs).max())
    return token
