"""The one-process GRPO reference the layout tests compare against, written in plain torch from the
formulas (test_grpo_loop.py, test_grpo_layouts.py): each row's log-probabilities from its own
unpadded forward (no padding mask, no cache), the clipped surrogate and each loss type's
aggregation token by token, the k3 KL to peft's own `disable_adapter()` base, advantages from
group means and stds, and the rollouts' per-row seeded sampling (`reference_rollout`: row r's own
generator seeded (seed * 1_000_003 + r) mod 2**64, float32 logits / temperature, softmax, one
multinomial draw per row per step); and the engine side that runs the same numbers through `GRPO`
under a layout. Registered by value, so engines need not import this file.
"""
from __future__ import annotations

import math
import sys

import cloudpickle
import torch

cloudpickle.register_pickle_by_value(sys.modules[__name__])

CONFIG = dict(vocab_size=32, seq_len=24, n_layer=2, n_head=4, d_model=32, kernels="torch")
EOS, PAD, GROUP, LENGTH = 2, 0, 4, 6
EPS_LOW, EPS_HIGH, BETA, LR = 0.1, 0.3, 0.2, 0.5
PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
LORA = dict(r=4, lora_alpha=8, target_modules=["wq", "wv"], init_lora_weights=False)
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]


def gpt(lora: bool = False, layers: int = CONFIG["n_layer"]) -> torch.nn.Module:
    from colab_par.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**CONFIG, "n_layer": layers}))
    if lora:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    return model


def count_fives(prompts, completions, **_):
    return [float(sum(token in (5, 6, 7) for token in completion)) for completion in completions]


class GradRecorder(torch.optim.SGD):
    """SGD that keeps each parameter's whole gradient (gathered from its shards) before stepping."""

    def __init__(self, params):
        super().__init__(params, lr=LR)
        self.grads: dict[int, torch.Tensor] = {}

    def step(self, closure=None):
        from torch.distributed.tensor import DTensor

        self.grads = {id(p): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                      for group in self.param_groups for p in group["params"] if p.grad is not None}
        return super().step(closure)


# ---- the one-process reference ------------------------------------------------------------------------
def row_logps(model, prompt: list[int], completion: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    tokens = torch.cat([torch.tensor(prompt), completion])[None]
    logits = model(tokens)[0, len(prompt) - 1:len(prompt) - 1 + len(completion)].float() / temperature
    return logits.log_softmax(-1).gather(-1, completion[:, None])[:, 0]


def kept(completion: torch.Tensor) -> int:
    """Tokens up to and including the first EOS."""
    ends = (completion == EOS).nonzero()
    return int(ends[0]) + 1 if len(ends) else len(completion)


def reference_loss(logps, old, ref, advantages, lengths, loss_type: str, beta: float = 0.0,
                   ranks: int = 2) -> torch.Tensor:
    """The objective token by token (logps: a list of per-row tensors with gradient); bnpo is the
    mean over the `ranks` data-parallel ranks of each one's own token mean."""
    rows, total = len(logps), sum(lengths)
    terms = []
    for i in range(rows):
        row = []
        for t in range(lengths[i]):
            ratio = torch.exp(logps[i][t] - old[i][t])
            a = advantages[i]
            term = -torch.minimum(ratio * a, ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * a)
            if beta:
                gap = ref[i][t] - logps[i][t]
                term = term + beta * (torch.exp(gap) - gap - 1)
            row.append(term)
        terms.append(torch.stack(row).sum() if row else torch.zeros(()))
    if loss_type == "grpo":
        return sum(terms[i] / max(lengths[i], 1) for i in range(rows)) / rows
    if loss_type == "dr_grpo":
        return sum(terms) / (rows * LENGTH)
    if loss_type == "dapo":
        return sum(terms) / total
    share = rows // ranks
    pieces = [range(k * share, (k + 1) * share) for k in range(ranks)]
    return sum(sum(terms[i] for i in piece) / max(sum(lengths[i] for i in piece), 1) for piece in pieces) / ranks


def fixed_batch(layers: int = CONFIG["n_layer"]) -> dict:
    """Prompts of two lengths, completions with end tokens at several places (and none), advantages
    from fixed rewards, old log-probabilities the policy's moved by up to +-0.5."""
    generator = torch.Generator().manual_seed(1)
    prompts = [PROMPTS[0]] * GROUP + [PROMPTS[1]] * GROUP
    completions = torch.randint(3, CONFIG["vocab_size"], (len(prompts), LENGTH), generator=generator)
    for row, end in enumerate([2, None, 0, 5, 3, None, 1, 4]):
        if end is not None:
            completions[row, end], completions[row, end + 1:] = EOS, PAD
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 0.0, 0.0, 3.0, 1.0], dtype=torch.float64).view(-1, GROUP)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
    noise = (torch.rand(completions.shape, generator=generator) - 0.5).float()
    with torch.no_grad():
        old = torch.stack([row_logps(gpt(layers=layers), p, c) for p, c in zip(prompts, completions)]) + noise
    return {"prompts": prompts, "completions": completions, "advantages": advantages.float(), "old": old}


def fixed_rollout(batch: dict):
    from colab_par.training.grpo import Rollout, completion_mask
    from colab_par.training.grpo.prompts import left_padded

    ids, mask = left_padded(batch["prompts"], PAD)
    return Rollout(prompt_ids=ids, prompt_mask=mask, completion_ids=batch["completions"],
                   mask=completion_mask(batch["completions"], EOS), advantages=batch["advantages"],
                   old_logps=batch["old"])


def reference_grads(batch: dict, loss_type: str, lora: bool, ranks: int = 2,
                    layers: int = CONFIG["n_layer"]) -> tuple[float, dict[str, torch.Tensor]]:
    model = gpt(lora, layers)
    pairs = list(zip(batch["prompts"], batch["completions"]))
    ref = None
    if lora:
        with torch.no_grad(), model.disable_adapter():
            ref = [row_logps(model, p, c) for p, c in pairs]
    logps = [row_logps(model, p, c) for p, c in pairs]
    lengths = [kept(c) for c in batch["completions"]]
    loss = reference_loss(logps, batch["old"], ref, batch["advantages"], lengths, loss_type, BETA if lora else 0.0,
                          ranks)
    loss.backward()
    prefix = "base_model.model." if lora else ""
    return loss.item(), {name.removeprefix(prefix): p.grad for name, p in model.named_parameters() if p.grad is not None}


# ---- engine side ------------------------------------------------------------------------------------
def engine_fixed_step(layout: str, state: dict, rollout, loss_types: list[str], lora: bool,
                      layers: int = CONFIG["n_layer"]) -> list:
    """Per loss type, the row of one `train_on(rollout)` and each parameter's whole gradient by name
    (under pipeline parallel, this rank's stages' parameters)."""
    from colab_par import parallelize
    from colab_par.parallel.inference.state import bare_module
    from colab_par.training.grpo import GRPO, Completions, GrpoLossOptions

    results = []
    for loss_type in loss_types:
        model = gpt(lora, layers)
        (model.get_base_model() if lora else model).load_state_dict(state)
        pm = parallelize(model, layout, optimizer_fn=GradRecorder)
        options = GrpoLossOptions(loss_type=loss_type, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
                                  beta=BETA if lora else 0.0, max_completion_length=LENGTH)
        grpo = GRPO(pm, PROMPTS, count_fives, group_size=GROUP, max_completion_length=LENGTH, steps=1,
                    prompts_per_step=2, completions=Completions(eos_token_id=EOS, pad_token_id=PAD), loss=options)
        row = grpo.train_on(rollout)
        names = {id(p): name for part in pm.model_parts for name, p in bare_module(part).named_parameters()}
        results.append((row, {names[key]: grad for key, grad in pm.optimizer.grads.items()}))
    return results


def assert_close_grads(got: dict, expected: dict) -> None:
    assert set(got) == set(expected) and expected
    for name, grad in expected.items():
        error = (got[name] - grad).norm() / grad.norm().clamp(min=1e-12)
        assert error < 1e-5 or (got[name] - grad).abs().max() < 1e-9, f"{name}: relative error {error:.2e}"
    total = math.sqrt(sum((got[n] - g).norm() ** 2 for n, g in expected.items()))
    assert total / math.sqrt(sum(g.norm() ** 2 for g in expected.values())) < 1e-6


# ---- a whole step ---------------------------------------------------------------------------------------
SEED, TEMPERATURE, ITERATIONS, PER_STEP = 5, 0.7, 2, 2
# AdamW divides by sqrt(v) + eps: with torch's eps 1e-8 a gradient of ~1e-9 (float32 rounding of a
# sum taken in another order) moves its weight by ~lr; eps 1e-3 bounds that to lr * 1e-6.
ADAMW = dict(lr=1e-2, eps=1e-3)


def optimizer_for(kind: str):
    """SGD at `LR`, or AdamW (`ADAMW`: what memory tiers step)."""
    if kind == "adamw":
        return lambda params: torch.optim.AdamW(params, **ADAMW)
    return lambda params: torch.optim.SGD(params, lr=LR)


def engine_whole_step(layout: str, state: dict, optimizer: str = "sgd", lora: bool = False) -> dict:
    import torch.distributed as dist

    from colab_par import parallelize
    from colab_par.training.grpo import GRPO, Completions, GrpoLossOptions

    torch.manual_seed(dist.get_rank())  # nothing may depend on a rank's own generator
    model = gpt(lora)
    (model.get_base_model() if lora else model).load_state_dict(state)
    pm = parallelize(model, layout, optimizer_fn=optimizer_for(optimizer))
    grpo = GRPO(pm, PROMPTS, count_fives, group_size=GROUP, max_completion_length=LENGTH, steps=1,
                prompts_per_step=PER_STEP, iterations=ITERATIONS, seed=SEED,
                completions=Completions(temperature=TEMPERATURE, eos_token_id=EOS, pad_token_id=PAD),
                loss=GrpoLossOptions(loss_type="dapo", epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
                                     beta=BETA if lora else 0.0))
    row = grpo.fit()[0]
    return {"row": row, "completions": grpo.last_rollout.completion_ids, "state": pm.full_state_dict()}


def reference_rollout(model, prompts: list[list[int]], seed: int, temperature: float = TEMPERATURE,
                      greedy: bool = False, eos: int = EOS) -> tuple[torch.Tensor, torch.Tensor]:
    """A rollout's sampling in one process, from its definition: row r has its own generator seeded
    (seed * 1_000_003 + r) mod 2**64; at each step every row's whole sequence is re-forwarded alone
    (unpadded, no cache), its float32 last logits / temperature give the softmax one multinomial
    draw is taken from with that generator (greedy: the argmax); a row that has produced `eos`
    continues with PAD (log-probability 0); it stops when every row has ended, or after LENGTH.
    Returns (completions, each token's log-probability under the distribution it was drawn from)."""
    generators = [torch.Generator().manual_seed((seed * 1_000_003 + r) % 2**64) for r in range(len(prompts))]
    rows, done = [list(p) for p in prompts], [False] * len(prompts)
    logps: list[list[float]] = [[] for _ in prompts]
    with torch.no_grad():
        for _ in range(LENGTH):
            for r, row in enumerate(rows):
                scores = model(torch.tensor(row)[None])[0, -1].float() / temperature
                token = (int(scores.argmax()) if greedy else
                         int(torch.multinomial(scores.softmax(-1)[None], 1, generator=generators[r])[0, 0]))
                row.append(PAD if done[r] else token)
                logps[r].append(0.0 if done[r] else float(scores.log_softmax(-1)[token]))
                done[r] = done[r] or token == eos
            if all(done):
                break
    completions = torch.tensor([row[len(p):] for row, p in zip(rows, prompts)])
    return completions, torch.tensor(logps, dtype=torch.float32)


def reference_whole_step(optimizer: str = "sgd", lora: bool = False) -> dict:
    """The step in one process: prompts by the documented shuffle, sampling, rewards, advantages,
    the sampling policy's log-probabilities, two optimizer steps of the dapo loss (with LoRA plus
    the KL term to peft's own base without the adapters). `state`: the model's (LoRA: peft's names)."""
    model = gpt(lora)
    order = torch.randperm(len(PROMPTS), generator=torch.Generator().manual_seed(SEED)).tolist()
    prompts = [PROMPTS[i] for i in order[:PER_STEP] for _ in range(GROUP)]
    completions, _ = reference_rollout(model, prompts, SEED)
    lengths = [kept(c) for c in completions]
    rewards = torch.tensor(count_fives(prompts, [c[:n].tolist() for c, n in zip(completions, lengths)]),
                           dtype=torch.float64).view(-1, GROUP)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
    pairs = list(zip(prompts, completions))
    with torch.no_grad():
        old = [row_logps(model, p, c, TEMPERATURE) for p, c in pairs]
        ref = None
        if lora:
            with model.disable_adapter():
                ref = [row_logps(model, p, c, TEMPERATURE) for p, c in pairs]
    step, losses = optimizer_for(optimizer)([p for p in model.parameters() if p.requires_grad]), []
    for _ in range(ITERATIONS):
        logps = [row_logps(model, p, c, TEMPERATURE) for p, c in pairs]
        loss = reference_loss(logps, old, ref, advantages.float(), lengths, "dapo", BETA if lora else 0.0)
        loss.backward()
        step.step()
        step.zero_grad()
        losses.append(loss.item())
    return {"completions": completions, "rewards": rewards, "loss": sum(losses) / ITERATIONS,
            "state": model.state_dict()}
