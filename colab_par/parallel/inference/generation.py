"""Generation from a ParallelModel: greedy or sampled continuations of prompts under every layout,
with a KV cache, leaving training state as it was (`inference.training_state_kept`).

What decodes, decided from what the model is (before any work):
- colab_par's GPT, through its `KVCache` path;
- a Hugging Face causal LM (its own loss is a causal LM's), through its own forward and its own
  `DynamicCache` (a pipeline stage's: `models/hf_cache.py`), with transformers' left-padding
  conventions (positions counted over real tokens, the 2D mask extended by each new token);
- any other token model whose last linear layer projects onto its input embedding's vocabulary
  (e.g. a notebook's own LM): it has no cache, so every step re-forwards all tokens (no padding).
Anything else is refused, naming what generation needs.

How the layouts decode. Every rank decodes the whole batch: data- and context-parallel ranks are
replicas (decoding is latency-bound, and FSDP needs every rank in every forward anyway), tensor-
parallel ranks share each forward as in training, and context-parallel ranks decode without the
sequence split (the cache path attends over the whole sequence itself). Pipeline stages hand their
activations on point to point (`pipeline/decode.py`), each keeping the cache of its own layers.
Sequence parallel needs a multiple of tp tokens per forward: prompts get extra left padding and
each step re-feeds the last tp tokens, whose cache slots are simply written again (the GPT only).
One rank (the first of the last stage) chooses the next tokens (`sampling.py`) and broadcasts
them: every rank returns the same tokens, runs the same number of steps and stops with the others
once every row has produced an end-of-sequence token. The 2d/2.5d/3d tensor grids (the GPT only)
split every activation by batch as well as by hidden: each rank's attention keeps the KV cache of
its batch rows and heads, and a batch the grid's batch split does not divide is padded with copies
of its last row, dropped from the logits. Refused: stages traced by torch's pipeline() (fixed
shapes).

Rollouts (`generate_rollout`) draw each row from its own seeded generator instead of the batch's
one, and under pure data parallel each rank decodes only its share of the rows, alone (no
chooser, no broadcast), the shares gathered after (`row_shards.py`).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from colab_par.parallel.inference.gathered import weights_gathered
from colab_par.parallel.inference.state import bare_module, training_state_kept
from colab_par.layout import tensor_grid
from colab_par.models.gpt import GPT, KVCache
from colab_par.models.hf import decode_keywords, is_hf_model, shifts_labels
from colab_par.parallel.pipeline.decode import StageChain
from colab_par.parallel.pipeline.stages import stage_owner
from colab_par.parallel.inference.row_shards import decoded_share, gathered_shares
from colab_par.parallel.inference.sampling import Sampling, row_generator

__all__ = ["generate", "generate_with_logps", "generate_rollout", "Generated"]


@dataclass(frozen=True)
class Generated:
    """What `generate_with_logps` returns: the `tokens` `generate` returns and, for each new token,
    its log-probability under the distribution it was drawn from (`logps`, float32, (batch, new
    tokens taken): log_softmax of `Sampling.scores`; 0 where a finished row continues with padding)."""

    tokens: torch.Tensor
    logps: torch.Tensor


def generate(pm: Any, input_ids: torch.Tensor, max_new_tokens: int, sampling: Sampling, *,
             eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
             attention_mask: torch.Tensor | None = None, seed: int = 0,
             use_cache: bool = True) -> torch.Tensor:
    """The prompts (batch, seq) (or one (seq,) prompt) followed by up to `max_new_tokens` new
    tokens, identical on every rank; call it on every rank with the same arguments.

    Prompts of different lengths are left-padded, with `attention_mask` 0 on the padding. After
    a row produces `eos_token_id` (an id or several; default: a Hugging Face model's own
    generation config's, as its `generate`; ``[]``: none) it continues with `pad_token_id`
    (default: the model's own, else the first eos id) and decoding stops when every row has;
    without eos it runs `max_new_tokens` steps. Sampling settings are only the ones given (a
    model's generation config does not add any); the draw uses a generator seeded with `seed`,
    never the training RNG. `use_cache=False` re-forwards every token at every step (to compare).
    Under zero3 (and params@disk) the weights come in once for the call (`gathered.py`).
    """
    return _generated(pm, input_ids, max_new_tokens, sampling, False, eos_token_id=eos_token_id,
                      pad_token_id=pad_token_id, attention_mask=attention_mask, seed=seed,
                      use_cache=use_cache).tokens


def generate_with_logps(pm: Any, input_ids: torch.Tensor, max_new_tokens: int, sampling: Sampling,
                        **keywords: Any) -> Generated:
    """`generate` (the same arguments, the same tokens) with each new token's sampling
    log-probability: what the rollout's trainer–generator mismatch compares the training forward
    with. The chooser rank keeps them and broadcasts them once at the end."""
    return _generated(pm, input_ids, max_new_tokens, sampling, True, **keywords)


def generate_rollout(pm: Any, input_ids: torch.Tensor, max_new_tokens: int, sampling: Sampling,
                     **keywords: Any) -> Generated:
    """`generate_with_logps` (the same arguments) for a rollout: row r draws from its own generator
    (`sampling.row_generator`: seeded with (seed * 1_000_003 + r) mod 2**64), so its completion
    depends neither on the other rows nor on the layout; greedy decoding is the argmax as ever.
    Under pure data parallel each rank decodes only its contiguous share of the rows (the rows
    `Rollout.rows` gives it to train on) with no per-token collective, and one all-gather after
    gives every rank the whole batch (`row_shards.py`); other layouts decode the whole batch on
    every rank with the same draws. Every rank returns the same tokens and log-probabilities."""
    return _generated(pm, input_ids, max_new_tokens, sampling, True, rows_seeded=True, **keywords)


def _generated(pm: Any, input_ids: torch.Tensor, max_new_tokens: int, sampling: Sampling, scored: bool, *,
               eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
               attention_mask: torch.Tensor | None = None, seed: int = 0, use_cache: bool = True,
               rows_seeded: bool = False) -> Generated:
    decoder, model = _decoder_class(pm), bare_module(pm.model_parts[0])
    vocab, limit = decoder.sizes(model)
    one_prompt = isinstance(input_ids, torch.Tensor) and input_ids.dim() == 1
    prompts, mask = _checked_prompts(input_ids, attention_mask, vocab, padded_ok=decoder.masks)
    own_eos, own_pad = decoder.special_ids(model)
    eos = _checked_ids("eos_token_id", own_eos if eos_token_id is None else eos_token_id, vocab)
    pad = _checked_ids("pad_token_id", own_pad if pad_token_id is None else pad_token_id, vocab)
    pad_id = pad[0] if pad else (eos[0] if eos else 0)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a whole number >= 1")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed={seed!r} must be an int")
    _check_positions(mask, max_new_tokens, limit)
    width = pm.layout.tp if pm.layout.sequence_parallel else 1
    if width > 1 and not use_cache:
        raise ValueError("under sequence parallel only the cached path feeds a multiple of tp tokens per "
                         "forward; use use_cache=True")
    share = decoded_share(pm, prompts.shape[0]) if rows_seeded else None
    prompts, mask = prompts.to(pm.device), mask.to(pm.device)
    with training_state_kept(pm), weights_gathered(pm), pm._autocast():
        chooser = _agreed_chooser(pm, prompts, mask, max_new_tokens, sampling, eos, pad_id, seed, use_cache,
                                  rows_seeded)
        mine = share if share is not None else slice(0, prompts.shape[0])
        run = _Run(decoder(pm, use_cache), sampling, _drawing(sampling, seed, rows_seeded, mine, pm.device),
                   None if share is not None else chooser, eos, pad_id, width, scored)
        tokens = run(prompts[mine], mask[mine], max_new_tokens)
        logps = run.logps(tokens.shape[0], tokens.shape[1] - prompts.shape[1])
        if share is not None:
            completions, logps = gathered_shares(pm, tokens[:, prompts.shape[1]:], logps, max_new_tokens, pad_id)
            tokens = torch.cat([prompts, completions], dim=1)
    tokens, logps = tokens.to(input_ids.device), logps.to(input_ids.device)
    return Generated(tokens[0], logps[0]) if one_prompt else Generated(tokens, logps)


def _drawing(sampling: Sampling, seed: int, rows_seeded: bool, rows: slice,
             device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """scores -> token ids: one generator seeded `seed` for the batch, or each row's own."""
    if rows_seeded:
        generators = ([row_generator(seed, row, device) for row in range(rows.start, rows.stop)]
                      if sampling.do_sample else [])
        return lambda scores: sampling.draw_rows(scores, generators)
    generator = torch.Generator(device=device).manual_seed(seed) if sampling.do_sample else None
    return lambda scores: sampling.draw(scores, generator)


class _Run:
    """The decode loop (see the module docstring): prefill, then one token per step. `chooser`:
    the rank that draws and broadcasts the tokens, or None where this rank decodes its rows alone."""

    def __init__(self, decoder: "_Decoder", sampling: Sampling, draw: Callable[[torch.Tensor], torch.Tensor],
                 chooser: int | None, eos: list[int], pad_id: int, width: int, scored: bool):
        self.decoder, self.sampling, self.draw = decoder, sampling, draw
        self.chooser, self.eos, self.pad_id, self.width = chooser, eos, pad_id, width
        self.scored, self.chosen_logps = scored, []

    def __call__(self, prompts: torch.Tensor, mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        batch, length = prompts.shape
        extra = -length % self.width  # sequence parallel: a multiple of tp tokens
        tokens = torch.cat([prompts.new_full((batch, extra), self.pad_id), prompts], dim=1)
        mask = torch.cat([mask.new_zeros(batch, extra), mask], dim=1)
        positions = (mask.long().cumsum(dim=-1) - 1).masked_fill(~mask, 0)
        self.decoder.start(torch.cat([mask, mask.new_ones(batch, max_new_tokens)], dim=1))
        finished = torch.zeros(batch, dtype=torch.bool, device=prompts.device)
        fed = tokens.shape[1]
        for _ in range(max_new_tokens):
            if not self.decoder.cached:
                fed = tokens.shape[1]
            start = tokens.shape[1] - fed
            logits = self.decoder.last_logits(tokens[:, start:], positions[:, start:], mask, start)
            chosen = self._choose(logits, batch, finished, prompts.device)
            if self.eos:
                chosen = chosen.masked_fill(finished, self.pad_id)
                finished |= torch.isin(chosen, torch.tensor(self.eos, device=chosen.device))
            tokens = torch.cat([tokens, chosen[:, None]], dim=1)
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
            positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
            if self.eos and bool(finished.all()):
                break
            fed = self.width
        return tokens[:, extra:]

    def _choose(self, logits: torch.Tensor | None, batch: int, finished: torch.Tensor,
                device: torch.device) -> torch.Tensor:
        alone = self.chooser is None
        if alone or dist.get_rank() == self.chooser:
            scores = self.sampling.scores(logits)
            chosen = self.draw(scores)
            if self.scored:
                logp = scores.log_softmax(dim=-1).gather(-1, chosen[:, None]).squeeze(-1)
                self.chosen_logps.append(logp.masked_fill(finished, 0.0))
        else:
            chosen = torch.empty(batch, dtype=torch.int64, device=device)
        if not alone:
            dist.broadcast(chosen, src=self.chooser)
        return chosen

    def logps(self, batch: int, steps: int) -> torch.Tensor:
        """The chosen tokens' log-probabilities (batch, steps), on every rank: one broadcast from the
        chooser after the loop (none when decoding alone; an empty tensor when not `scored`)."""
        if not self.scored:
            return torch.empty(batch, 0)
        if self.chooser is None:
            return torch.stack(self.chosen_logps, dim=1)
        device = self.decoder.pm.device
        logps = (torch.stack(self.chosen_logps, dim=1) if dist.get_rank() == self.chooser
                 else torch.empty(batch, steps, dtype=torch.float32, device=device))
        dist.broadcast(logps, src=self.chooser)
        return logps


# ---- the decoding models ----------------------------------------------------------------------------
class _Decoder:
    """This rank's model parts, called once per decode step; subclasses say how a part is called.
    `cached`: a step feeds only new tokens. `masks`: left padding is supported."""

    masks = True

    def __init__(self, pm: Any, use_cache: bool):
        self.pm, self.cached = pm, use_cache
        self.parts = [bare_module(part) for part in pm.model_parts]
        self.chain = (StageChain(self.parts, pm.layout, pm.mesh["pp"].get_group(), pm.device)
                      if pm.layout.pp > 1 else None)

    @staticmethod
    def sizes(model: nn.Module) -> tuple[int, int | None]:
        """(vocabulary size, how many positions the model has or None)."""
        raise NotImplementedError

    @staticmethod
    def special_ids(model: nn.Module) -> tuple[Any, Any]:
        """The model's own (end-of-sequence ids, padding id), None where it names none."""
        return None, None

    def start(self, keep: torch.Tensor) -> None:
        """A new generation: `keep` (batch, slots) marks the real tokens of every slot to come."""

    def before_step(self) -> None:
        """Called before every step's forward."""

    def call(self, part: nn.Module, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
             start: int) -> torch.Tensor:
        raise NotImplementedError

    def last_logits(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                    start: int) -> torch.Tensor | None:
        """The last position's logits (batch, vocab) where the last stage is, None elsewhere."""
        self.before_step()
        run: Callable[[nn.Module, torch.Tensor], torch.Tensor] = (
            lambda part, x: self.call(part, x, positions, mask, start))
        if self.chain is None:
            out = run(self.parts[0], tokens)
        else:
            out = self.chain(tokens, run)
        return None if out is None else out[:, -1]


class _GPTDecoder(_Decoder):
    @staticmethod
    def sizes(model: nn.Module) -> tuple[int, int | None]:
        return model.config.vocab_size, model.config.seq_len

    def start(self, keep: torch.Tensor) -> None:
        self.keep = keep
        self.cache = KVCache(keep)  # one for all of this rank's stages: keyed by attention module

    def before_step(self) -> None:
        if not self.cached:
            self.cache = KVCache(self.keep)  # re-forward: a cache that lives for one step

    def call(self, part: nn.Module, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
             start: int) -> torch.Tensor:
        self.cache.start = start
        return part(x, positions, cache=self.cache)


class _GridGPTDecoder(_GPTDecoder):
    """The GPT on a 2d/2.5d/3d tensor grid, whose layers split the batch into q·depth pieces
    (`tensor_grid.py`; per-row positions and the cache are split there too): the batch is padded to
    a multiple of them with copies of its last row, which the logits drop."""

    def __init__(self, pm: Any, use_cache: bool):
        super().__init__(pm, use_cache)
        side, depth = tensor_grid(pm.layout.tp, pm.layout.tp_mode, pm.layout.tp_depth)
        self.pieces = side * depth

    def start(self, keep: torch.Tensor) -> None:
        self.rows = keep.shape[0]
        super().start(self._padded(keep))

    def call(self, part: nn.Module, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
             start: int) -> torch.Tensor:
        if part.tok_embeddings is not None:  # tokens in (a later stage gets its grid pieces)
            x = self._padded(x)
        out = super().call(part, x, self._padded(positions), mask, start)
        return out[:self.rows] if part.output is not None else out

    def _padded(self, rows: torch.Tensor) -> torch.Tensor:
        extra = -rows.shape[0] % self.pieces
        return torch.cat([rows, rows[-1:].expand(extra, *rows.shape[1:])]) if extra else rows


class _HFDecoder(_Decoder):
    @staticmethod
    def sizes(model: nn.Module) -> tuple[int, int | None]:
        return model.config.vocab_size, getattr(model.config, "max_position_embeddings", None)

    @staticmethod
    def special_ids(model: nn.Module) -> tuple[Any, Any]:
        settings = getattr(model, "generation_config", None) or model.config
        return getattr(settings, "eos_token_id", None), getattr(settings, "pad_token_id", None)

    def start(self, keep: torch.Tensor) -> None:
        from colab_par.models.hf_cache import decoder_cache

        staged = self.chain is not None
        self.caches = {id(part): decoder_cache(part, part.pipeline_layers if staged else None)
                       for part in self.parts} if self.cached else {}

    def call(self, part: nn.Module, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
             start: int) -> torch.Tensor:
        padded = None if bool(mask.all()) else mask.long()  # as transformers: no mask without padding
        keywords = decode_keywords(part, padded, positions, self.caches.get(id(part)))
        out = part(input_ids=x, **keywords) if self.chain is None else part(x, **keywords)
        return getattr(out, "logits", out)


class _PlainDecoder(_Decoder):
    """A token model with no cache and no padding mask: every step re-forwards all tokens."""

    masks = False

    def __init__(self, pm: Any, use_cache: bool):
        super().__init__(pm, use_cache=False)

    @staticmethod
    def sizes(model: nn.Module) -> tuple[int, int | None]:
        return _projected_vocabulary(model), None

    def call(self, part: nn.Module, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
             start: int) -> torch.Tensor:
        out = part(x, positions[0]) if self.pm._takes_positions else part(x)
        if not isinstance(out, torch.Tensor) or out.dim() != 3 or out.shape[:2] != x.shape:
            raise ValueError(f"{type(part).__name__} returned {type(out).__name__}"
                             f"{tuple(out.shape) if isinstance(out, torch.Tensor) else ''} for tokens "
                             f"{tuple(x.shape)}; generate needs (batch, seq, vocab) logits")
        return out


def _decoder_class(pm: Any) -> type[_Decoder]:
    """What decodes this model (module docstring); refuses the rest before any work."""
    layout, model = pm.layout, bare_module(pm.model_parts[0])
    if getattr(model, "pipeline_io", None) is not None:
        raise ValueError(f"{type(model).__name__}'s pipeline stages were traced by torch's pipeline() with "
                         "fixed shapes, which a growing sequence cannot pass; generate under pp=1 (relayout)")
    name = type(model).__name__
    if isinstance(model, GPT):
        return _GridGPTDecoder if layout.tp_mode != "1d" else _GPTDecoder
    if layout.sequence_parallel:
        raise ValueError(f"generate under sequence parallel feeds tp tokens per step, which only colab_par's "
                         f"GPT cache takes; generate from {name} under a layout without 'sp'")
    if is_hf_model(model):
        if not shifts_labels(model):
            raise ValueError(f"generate continues text with a causal language model; {name}'s own loss is not "
                             "a causal LM's (it is a classifier, a masked LM or an encoder-decoder). Use a "
                             "...ForCausalLM model (or its own generate on one process)")
        return _HFDecoder
    if _projected_vocabulary(model) is None:
        raise ValueError(f"generate needs vocabulary logits: colab_par's GPT, a Hugging Face causal LM, or a "
                         f"token model whose last nn.Linear maps onto its first nn.Embedding's vocabulary; "
                         f"{name}'s output is none of these")
    return _PlainDecoder


def _projected_vocabulary(model: nn.Module) -> int | None:
    """The vocabulary of a token model whose last linear layer projects onto the rows of its
    first embedding (token ids in, logits over the same ids out); None for any other model."""
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not embeddings or not linears or linears[-1].out_features != embeddings[0].num_embeddings:
        return None
    return embeddings[0].num_embeddings


# ---- checks before any work ---------------------------------------------------------------------------
def _checked_prompts(input_ids: Any, attention_mask: Any, vocab: int, *,
                     padded_ok: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if (not isinstance(input_ids, torch.Tensor) or input_ids.dtype.is_floating_point
            or input_ids.dtype == torch.bool):
        raise TypeError(f"input_ids must be an integer tensor of token ids, (batch, seq) or (seq,), not "
                        f"{getattr(input_ids, 'dtype', type(input_ids).__name__)}")
    prompts = input_ids[None] if input_ids.dim() == 1 else input_ids
    if prompts.dim() != 2 or 0 in prompts.shape:
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}; give (batch, seq) or (seq,) token ids")
    prompts = prompts.long()
    if int(prompts.min()) < 0 or int(prompts.max()) >= vocab:
        raise ValueError(f"input_ids hold ids from {int(prompts.min())} to {int(prompts.max())}, outside the "
                         f"model's vocabulary 0..{vocab - 1}")
    if attention_mask is None:
        return prompts, torch.ones_like(prompts, dtype=torch.bool)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must be a tensor shaped like input_ids {tuple(input_ids.shape)}, "
                         f"not {getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
    mask = attention_mask[None] if attention_mask.dim() == 1 else attention_mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask holds values other than 0 and 1; give 1 for tokens, 0 for padding")
    mask = mask.bool()
    if bool((mask[:, 1:] < mask[:, :-1]).any()) or not bool(mask[:, -1].all()):
        raise ValueError("attention_mask must mark left padding (0s before each prompt's tokens, the last "
                         "column all 1s), as decoders generate after the last token; pad on the left "
                         "(a Hugging Face tokenizer with padding_side='left')")
    if not padded_ok and not bool(mask.all()):
        raise ValueError("this model takes no padding mask, so its prompts must all have one length; "
                         "generate them one by one")
    return prompts, mask


def _checked_ids(name: str, ids: int | Sequence[int] | None, vocab: int) -> list[int]:
    if ids is None:
        return []
    listed = [ids] if isinstance(ids, int) else list(ids) if isinstance(ids, (list, tuple)) else None
    if listed == [] and name == "eos_token_id":
        return []
    if not listed or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in listed):
        raise ValueError(f"{name}={ids!r} must be a token id (or, for eos, a list of ids) in 0..{vocab - 1}")
    if name == "pad_token_id" and len(listed) > 1:
        raise ValueError(f"pad_token_id={ids!r} must be one token id")
    return listed


def _check_positions(mask: torch.Tensor, max_new_tokens: int, limit: int | None) -> None:
    if limit is None:
        return
    longest = int(mask.sum(dim=1).max())
    if longest > limit:
        raise ValueError(f"a prompt has {longest} tokens, more than the model's {limit} positions; shorten "
                         f"the prompts to at most {limit} tokens")
    if longest + max_new_tokens > limit:
        raise ValueError(f"the longest prompt ({longest} tokens) plus max_new_tokens={max_new_tokens} exceeds "
                         f"the model's {limit} positions; use max_new_tokens <= {limit - longest}")


def _agreed_chooser(pm: Any, prompts: torch.Tensor, mask: torch.Tensor, *settings: Any) -> int:
    """The global rank that chooses the tokens (the first rank of the last pipeline stage), after
    checking that every rank was given the same prompts and settings (one collective)."""
    digest = hashlib.sha256(prompts.cpu().numpy().tobytes() + mask.cpu().numpy().tobytes()
                            + repr((tuple(prompts.shape), settings)).encode()).digest()
    mine = int.from_bytes(digest[:7], "big")
    owner = stage_owner(pm.layout, pm.layout.pp * pm.layout.virtual_stages - 1)
    chooses = pm.pp_rank == owner and pm.dp_rank == 0 and pm.cp_rank == 0 and pm.tp_rank == 0
    agreed = torch.tensor([mine, -mine, dist.get_rank() if chooses else -1], dtype=torch.int64,
                          device=pm.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    if int(agreed[0]) != -int(agreed[1]):
        raise ValueError("the ranks were given different prompts or generation settings; call generate with "
                         "the same arguments on every rank (e.g. build the prompts before any per-rank seed)")
    return int(agreed[2])
