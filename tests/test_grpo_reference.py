"""GRPO's reference policy on real engines (2 CPU engines, gloo) against one process written here
in plain torch: each row's log-probabilities from its own unpadded forward, the k3 KL and the
dapo aggregation token by token.

1. Full weights, under dp2 zero3, tp2 and dp2: the policy trains several SGD steps away from
   where it started; the reference's log-probabilities then equal those of a one-process frozen
   copy of the starting weights (and differ from the trained policy's), a reference forward
   leaves the policy's weights bit for bit as they were, the copy holds this rank's shard of
   each weight and nothing trains it, and the GRPO loss with beta > 0 and its gradients equal
   the one-process loss's. Saved with DCP and loaded in place into a reference built later (a
   resume), it is the start's again.
2. The planner's `MemoryBreakdown.reference` of `ModelSpec(frozen_copies=1)` is the copy's
   measured bytes under dp2 zero3 (one shard), tp2 and dp2 (whole).
3. LoRA: the reference is the base with the adapters off, holding nothing; its log-probabilities
   equal peft's own `disable_adapter()` in one process.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys

import cloudpickle
import pytest
import torch
from grpo_reference import kept, row_logps

cloudpickle.register_pickle_by_value(sys.modules[__name__])

CONFIG = dict(vocab_size=32, seq_len=24, n_layer=2, n_head=4, d_model=32, kernels="torch")
EOS, PAD, LENGTH, TEMPERATURE, BETA, LR, STEPS = 2, 0, 6, 0.7, 0.2, 0.5, 3
PROMPTS = [[3, 4, 5], [3, 4, 5], [7, 8, 9, 10, 11], [7, 8, 9, 10, 11]]  # two lengths: left padding
LORA = dict(r=4, lora_alpha=8, target_modules=["wq", "wv"], init_lora_weights=False)
# a learnable sequence (each token the previous plus 3) the policy trains on before the reference is asked
TOKENS = (torch.arange(4 * 13).view(4, 13) * 3 % 29 + 3)
FULL_LAYOUTS = ["dp2 zero3", "tp2", "dp2"]


def gpt(lora: bool = False) -> torch.nn.Module:
    from colab_par.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG))
    if lora:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    return model


def options():
    from colab_par.training.grpo import GrpoLossOptions

    return GrpoLossOptions(loss_type="dapo", beta=BETA, max_completion_length=LENGTH)


def fixed_rollout():
    """Completions with end tokens at several places (and none), advantages of both signs."""
    from colab_par.training.grpo import Rollout, completion_mask
    from colab_par.training.grpo.prompts import left_padded

    completions = torch.randint(3, CONFIG["vocab_size"], (len(PROMPTS), LENGTH),
                                generator=torch.Generator().manual_seed(1))
    for row, end in enumerate([2, None, 0, 4]):
        if end is not None:
            completions[row, end], completions[row, end + 1:] = EOS, PAD
    ids, mask = left_padded(PROMPTS, PAD)
    return Rollout(prompt_ids=ids, prompt_mask=mask, completion_ids=completions,
                   mask=completion_mask(completions, EOS), advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))


# ---- the one-process reference ------------------------------------------------------------------------
def one_process_loss(policy, ref: list[torch.Tensor], rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """(dapo with one iteration (ratio 1, its gradient through logp) plus beta * k3, token by token;
    the KL term's share of it)."""
    surrogate, kl, total = [], [], 0
    for prompt, completion, advantage, ref_row in zip(PROMPTS, rollout.completion_ids, rollout.advantages, ref):
        logps = row_logps(policy, prompt, completion, TEMPERATURE)
        for t in range(kept(completion)):
            ratio = torch.exp(logps[t] - logps[t].detach())
            gap = ref_row[t] - logps[t]
            surrogate.append(-ratio * advantage)
            kl.append(BETA * (torch.exp(gap) - gap - 1))
        total += kept(completion)
    kl_term = torch.stack(kl).sum() / total
    return torch.stack(surrogate).sum() / total + kl_term, kl_term


def largest_gap(got: torch.Tensor, expected: list[torch.Tensor]) -> float:
    """The largest difference over the completion tokens the loss counts (up to each end token)."""
    lengths = [kept(c) for c in fixed_rollout().completion_ids]
    return max((row[:n] - want[:n]).abs().max().item() for row, want, n in zip(got, expected, lengths))


def frozen_start_logps(lora: bool = False) -> list[torch.Tensor]:
    """The reference in one process: a frozen copy of the starting weights (LoRA: peft's base)."""
    model = gpt(lora)
    with torch.no_grad(), (model.disable_adapter() if lora else contextlib.nullcontext()):
        return [row_logps(model, p, c, TEMPERATURE) for p, c in zip(PROMPTS, fixed_rollout().completion_ids)]


# ---- engine side ------------------------------------------------------------------------------------
def local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_tensors(pm) -> list[torch.Tensor]:
    from colab_par.parallel.inference.state import bare_module

    return [local(p) for p in bare_module(pm.model).parameters()]


def engine_full_weights(layout: str, state: dict, rollout, folder: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from colab_par import parallelize
    from colab_par.parallel.inference.state import bare_module
    from colab_par.training.grpo.logprobs import RolloutLoss, loss_installed, policy_inputs, vocab_size
    from colab_par.training.grpo import GRPO, Completions
    from colab_par.training.grpo.reference import FrozenCopy, reference_policy

    model = gpt()
    model.load_state_dict(state)
    pm = parallelize(model, layout, optimizer_fn=lambda params: torch.optim.SGD(params, lr=LR))
    def loop() -> GRPO:
        return GRPO(pm, PROMPTS, lambda prompts, completions, **_: [0.0] * len(completions), group_size=2,
                    max_completion_length=LENGTH, steps=1, prompts_per_step=2, loss=options(),
                    completions=Completions(temperature=TEMPERATURE, eos_token_id=EOS, pad_token_id=PAD))

    grpo = loop()
    reference = grpo.reference  # the loop's own: built when it was, before the policy trained
    for _ in range(STEPS):  # the policy moves away from the weights the reference copied
        pm.train_step(TOKENS[:, :-1], TOKENS[:, 1:])
    with torch.no_grad():
        before = [t.clone() for t in local_tensors(pm)]
    ref_logps = reference.logps(pm, rollout, TEMPERATURE)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, local_tensors(pm)))
    rows = rollout.rows(pm.dp_size, pm.dp_rank)
    rows = dataclasses.replace(rows, ref_logps=reference.logps(pm, rows, TEMPERATURE))
    loss = RolloutLoss(rows, options(), TEMPERATURE, int(rollout.mask.sum()), pm.dp_size, vocab_size(pm.model))
    with loss_installed(pm, loss):
        value = pm.forward_backward_tensor(policy_inputs(pm.model, rows), local=True)
    grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
             for name, p in bare_module(pm.model).named_parameters()}
    copies = reference.state_dict()
    dcp.save({"reference": copies}, checkpoint_id=folder)  # as a checkpoint keeps it, then a resume:
    resumed = reference_policy(pm)  # a copy of the trained weights, until the saved reference loads into it
    dcp.load({"reference": resumed.state_dict()}, checkpoint_id=folder)
    grpo.save_checkpoint(folder + "-loop")  # the loop's own checkpoint keeps the copy ...
    again = loop()  # ... which a loop built now (copying the trained weights) gets back on resume
    again.resume(folder + "-loop")
    trained = pm.full_state_dict()
    resumed_by_loop = again.reference.logps(pm, rollout, TEMPERATURE)
    return {"loop_resumed_logps": resumed_by_loop,
            "row": grpo.train_on(rollout),  # the loop's own step with the KL term (last: it moves the policy)
            "ref_logps": ref_logps, "resumed_logps": resumed.logps(pm, rollout, TEMPERATURE),
            "unchanged": unchanged, "trained": trained, "loss": value.item(), "grads": grads,
            "nbytes": reference.nbytes, "is_copy": isinstance(reference, FrozenCopy),
            "local_bytes": sum(t.numel() * t.element_size() for t in before),
            "frozen": not any(t.requires_grad or t.grad is not None for t in copies.values()),
            "apart": not {local(c).data_ptr() for c in copies.values()} & {t.data_ptr() for t in local_tensors(pm)}}


def engine_lora(layout: str, state: dict, rollout) -> dict:
    from colab_par import parallelize
    from colab_par.training.grpo.reference import AdaptersOff, reference_policy

    model = gpt(lora=True)
    model.get_base_model().load_state_dict(state)
    pm = parallelize(model, layout, optimizer_fn=lambda params: torch.optim.SGD(params, lr=LR))
    reference = reference_policy(pm)
    return {"is_base": isinstance(reference, AdaptersOff), "nbytes": reference.nbytes,
            "ref_logps": reference.logps(pm, rollout, TEMPERATURE)}


@pytest.fixture(scope="module")
def full_weights(cluster2, tmp_path_factory) -> dict:
    """Each layout's engine results, run once for the tests that read them."""
    state, rollout = gpt().state_dict(), fixed_rollout()
    return {layout: cluster2.run(engine_full_weights, layout, state, rollout,
                                 str(tmp_path_factory.mktemp("reference") / layout.replace(" ", "_")))
            for layout in FULL_LAYOUTS}


@pytest.mark.parametrize("layout", FULL_LAYOUTS)
def test_full_weight_reference_is_the_start_while_the_policy_trains(full_weights, layout: str) -> None:
    results = full_weights[layout]
    rollout, expected = fixed_rollout(), frozen_start_logps()
    trained = gpt()
    trained.load_state_dict(results[0]["trained"])
    moved = max((results[0]["trained"][n] - v).abs().max().item() for n, v in gpt().state_dict().items())
    assert moved > 1e-2  # the policy trained away from its reference
    with torch.no_grad():
        now = [row_logps(trained, p, c, TEMPERATURE) for p, c in zip(PROMPTS, rollout.completion_ids)]
    for result in results:
        assert result["is_copy"] and result["unchanged"] and result["frozen"] and result["apart"]
        assert largest_gap(result["ref_logps"], expected) <= 1e-6
        assert largest_gap(result["ref_logps"], now) > 1e-2  # a reference of the trained weights fails
        assert torch.equal(result["resumed_logps"], result["ref_logps"])  # saved, loaded in place: the same
        assert torch.equal(result["loop_resumed_logps"], result["ref_logps"])  # GRPO.save_checkpoint / resume




@pytest.mark.parametrize("layout", FULL_LAYOUTS)
def test_grpo_loss_with_kl_to_the_frozen_copy_equals_one_process(full_weights, layout: str) -> None:
    results = full_weights[layout]
    policy = gpt()
    policy.load_state_dict(results[0]["trained"])
    loss, kl_term = one_process_loss(policy, frozen_start_logps(), fixed_rollout())
    loss.backward()
    assert kl_term.item() > 1e-3  # far above the tolerance: a loss without the KL term fails
    for result in results:
        assert result["loss"] == pytest.approx(loss.item(), rel=1e-6, abs=1e-7)
        assert result["row"]["loss"] == pytest.approx(loss.item(), rel=1e-6, abs=1e-7)  # through GRPO.train_on
        assert result["row"]["kl"] > 0
        for name, p in policy.named_parameters():
            error = (result["grads"][name] - p.grad).norm() / p.grad.norm().clamp(min=1e-12)
            assert error < 1e-5, f"{layout} {name}: relative error {error:.2e}"


def test_the_copy_holds_this_ranks_shard_as_the_planner_counts(full_weights) -> None:
    from colab_par.models import GPTConfig
    from colab_par.planning.flops import ModelSpec
    from colab_par.planning.layout_estimate import estimate

    whole = sum(t.numel() * t.element_size() for t in gpt().parameters())
    spec = dataclasses.replace(ModelSpec.of(GPTConfig(**CONFIG)), frozen_copies=1)
    for layout in FULL_LAYOUTS:
        predicted = estimate(spec, layout, device="cpu", global_batch=4, seq_len=12).memory
        without = estimate(dataclasses.replace(spec, frozen_copies=0), layout, device="cpu", global_batch=4,
                           seq_len=12).memory
        assert predicted.total - without.total == predicted.reference and without.reference == 0
        for result in full_weights[layout]:
            assert result["nbytes"] == result["local_bytes"] == predicted.reference, layout
    assert {r["nbytes"] for r in full_weights["dp2 zero3"]} == {whole // 2}  # one shard of each weight
    assert {r["nbytes"] for r in full_weights["dp2"]} == {whole}  # replicated: the whole weights
    tp = [result["nbytes"] for result in full_weights["tp2"]]
    assert max(tp) < whole < sum(tp)  # tp splits the matrices; the norms stay whole on each rank


def test_lora_reference_is_the_base_without_adapters(cluster2) -> None:
    state = gpt(lora=True).get_base_model().state_dict()
    results = cluster2.run(engine_lora, "dp2 zero3", state, fixed_rollout())
    expected, adapted_model, rollout = frozen_start_logps(lora=True), gpt(lora=True), fixed_rollout()
    with torch.no_grad():
        adapted = [row_logps(adapted_model, p, c, TEMPERATURE) for p, c in zip(PROMPTS, rollout.completion_ids)]
    for result in results:
        assert result["is_base"] and result["nbytes"] == 0
        assert largest_gap(result["ref_logps"], expected) <= 1e-6
        assert largest_gap(result["ref_logps"], adapted) > 1e-2  # the adapters were really off


def test_frozen_copies_must_be_a_whole_number() -> None:
    from colab_par.planning.flops import ModelSpec
    from colab_par.models import GPTConfig

    with pytest.raises(ValueError, match="frozen_copies=-1 must be a whole number"):
        dataclasses.replace(ModelSpec.of(GPTConfig(**CONFIG)), frozen_copies=-1)
