"""How generation chooses the next token from the logits: greedy, or a seeded draw.

The draw is defined here so that it can be reproduced exactly in one process: the float32 logits
are divided by `temperature`, cut to the `top_k` largest (ties with the k-th kept), cut to the
smallest set of most likely tokens whose probability reaches `top_p` (the most likely token always
stays), and one token per row is drawn from the softmax of what is left with
``torch.multinomial(probs, 1, generator=generator)``. The generator is generation's own, seeded from
its `seed`: the training RNG streams are never drawn from. Rollouts draw row by row instead
(`draw_rows`): row r of a call seeded s has its own generator (`row_generator`: seeded with
(s * 1_000_003 + r) mod 2**64, on the device), and each step draws ``torch.multinomial(probs[r:r+1],
1, generator=its generator)``, so a row's tokens depend neither on the other rows of the batch nor
on which rank decodes it. The log-probability of a drawn token
under that distribution is log_softmax(`scores`) at the token (`generate_with_logps`): without
top_k/top_p cuts the same quantity a training forward computes from logits / temperature.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Sampling", "row_generator", "ROW_SEED_STRIDE"]

ROW_SEED_STRIDE = 1_000_003  # row r of a call seeded s: seed (s * ROW_SEED_STRIDE + r) mod 2**64


@dataclass(frozen=True)
class Sampling:
    """Greedy (`do_sample=False`: the argmax) or sampled choice of the next token (module docstring)."""

    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.do_sample, bool):
            raise TypeError(f"do_sample={self.do_sample!r} must be True or False")
        given = [name for name in ("temperature", "top_k", "top_p") if getattr(self, name) is not None]
        if given and not self.do_sample:
            raise ValueError(f"{', '.join(given)} shape(s) sampling, but do_sample=False chooses the most "
                             "likely token; pass do_sample=True, or leave them out for greedy decoding")
        if self.temperature is not None and not (isinstance(self.temperature, (int, float))
                                                 and math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature={self.temperature!r} must be a finite number > 0 (e.g. 0.7); "
                             "for the most likely token use do_sample=False")
        if self.top_k is not None and (not isinstance(self.top_k, int) or isinstance(self.top_k, bool)
                                       or self.top_k < 1):
            raise ValueError(f"top_k={self.top_k!r} must be a whole number >= 1 (e.g. 50), or None for no cut")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r} must lie in (0, 1] (e.g. 0.9), or None for no cut")

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """(batch, vocab) logits -> (batch,) token ids."""
        return self.draw(self.scores(logits), generator)

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The float32 scores (batch, vocab) whose softmax the token is drawn from: the logits
        divided by the temperature, -inf outside the top_k / top_p cuts (greedy: the logits)."""
        scores = logits.float()
        if not self.do_sample:
            return scores
        if self.temperature is not None:
            scores = scores / self.temperature
        if self.top_k is not None and self.top_k < scores.shape[-1]:
            kth = scores.topk(self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, -math.inf)
        if self.top_p is not None and self.top_p < 1:
            ranked, order = scores.sort(dim=-1, descending=True)
            probs = ranked.softmax(dim=-1)
            above = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above each one
            beyond = above >= self.top_p
            scores = scores.masked_fill(beyond.scatter(-1, order, beyond), -math.inf)
        return scores

    def draw(self, scores: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """(batch,) token ids from `scores` (see `scores`): the argmax, or one seeded draw per row."""
        if not self.do_sample:
            return scores.argmax(dim=-1)
        return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(-1)

    def draw_rows(self, scores: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
        """(batch,) token ids from `scores`: the argmax, or row i drawn alone with `generators[i]`
        (module docstring), one multinomial per row."""
        if not self.do_sample:
            return scores.argmax(dim=-1)
        probs = scores.softmax(dim=-1)
        return torch.cat([torch.multinomial(row[None], 1, generator=generator)[0]
                          for row, generator in zip(probs, generators)])


def row_generator(seed: int, row: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of row `row` of a rollout seeded `seed` (module docstring)."""
    return torch.Generator(device=device).manual_seed((seed * ROW_SEED_STRIDE + row) % 2**64)
