"""The GRPO loop refuses what it cannot run before any work: built here on a stand-in for a
ParallelModel that has a layout, a model and adapters but nothing to generate or train with, so a
check that came after any work would fail with an AttributeError instead. One process, no cluster."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from colab_par.layout import Layout
from colab_par.models import GPT, GPTConfig
from colab_par.training.grpo import GRPO, Completions, GrpoLossOptions
from colab_par.training.grpo.prompts import PromptRows, left_padded

MODEL = GPT(GPTConfig(vocab_size=32, seq_len=16, n_layer=1, n_head=2, d_model=16, kernels="torch"))


def stand_in(layout: str = "dp2", adapters=None) -> SimpleNamespace:
    parsed = Layout.parse(layout)
    return SimpleNamespace(layout=parsed, model=MODEL, adapters=adapters, dp_size=parsed.dp)


def reward(completions, **_):
    return [0.0] * len(completions)


def build(pm=None, prompts=([1, 2], [3]), **changes):
    options = dict(group_size=2, max_completion_length=4, steps=1, completions=Completions(eos_token_id=2))
    return GRPO(stand_in() if pm is None else pm, list(prompts), reward, **{**options, **changes})


def test_a_valid_loop_is_built_without_touching_the_model():
    grpo = build(prompts_per_step=2)
    assert (grpo.plan.eos, grpo.plan.pad, grpo.loss.max_completion_length) == ([2], 2, 4)


@pytest.mark.parametrize("layout, named", [("dp2 cp2", "cp"), ("tp4 2d", "tp 2d")])
def test_layouts_it_cannot_train_are_refused_naming_the_supported_ones(layout, named):
    with pytest.raises(ValueError, match=rf"GRPO does not train under {named} yet.*Supported: dp, zero1/2/3.*"
                                         r"pp \(every schedule.*e\.g\. 'dp2 zero3'"):
        build(stand_in(layout))


@pytest.mark.parametrize("layout", ["pp2", "pp2 zbv v2", "tp2 sp", "dp2 tp2"])
def test_pipeline_and_sequence_parallel_layouts_are_accepted(layout):
    assert build(stand_in(layout), prompts_per_step=2).plan.group_size == 2


def test_completions_that_do_not_fill_the_pipeline_microbatches_are_refused():
    with pytest.raises(ValueError, match=r"= 4 completions do not split into 8 pipeline microbatches on each of 1 "
                                         r"data-parallel ranks; make it a multiple of 8"):
        build(stand_in("pp2 mb8"), prompts_per_step=2)


@pytest.mark.parametrize("changes, message", [
    (dict(group_size=1), r"group_size=1 must be a whole number >= 2 \(an advantage compares"),
    (dict(steps=0), "steps=0 must be a whole number >= 1"),
    (dict(iterations=1.5), "iterations=1.5 must be a whole number >= 1"),
    (dict(group_size=3), r"prompts_per_step \* group_size = 3 completions do not split over 2 "
                               "data-parallel ranks"),
    (dict(loss=GrpoLossOptions(max_completion_length=8)), "loss.max_completion_length=8 differs"),
    (dict(grad_clip=0), "grad_clip=0 must be a number > 0"),
    (dict(completions=Completions()), "GPT names no end-of-sequence token: pass Completions\\(eos_token_id="),
    (dict(prompts=[]), "prompts is empty"),
    (dict(prompts=[{"text": "1+1"}]), "prompt row 0 has columns \\['text'\\], none named 'input_ids'"),
])
def test_bad_settings_are_refused_with_what_to_do(changes, message):
    with pytest.raises(ValueError, match=message):
        build(**changes)


def test_sampling_and_rewards_are_checked_when_given():
    with pytest.raises(ValueError, match="temperature=0 must be a finite number > 0"):
        Completions(temperature=0)
    with pytest.raises(ValueError, match="scale_rewards='std' is not one of group, batch, none"):
        GrpoLossOptions(scale_rewards="std")
    with pytest.raises(TypeError, match="rewards=3"):
        GRPO(stand_in(), [[1]], 3, group_size=2, max_completion_length=2, steps=1)
    with pytest.raises(ValueError, match="reward weight nan"):
        GRPO(stand_in(), [[1]], {reward: float("nan")}, group_size=2, max_completion_length=2, steps=1,
             completions=Completions(eos_token_id=2))


def test_prompts_are_drawn_shuffled_per_pass_alike_for_a_given_seed_with_their_columns():
    rows = PromptRows([{"input_ids": [i, i + 1], "answer": str(i)} for i in range(5)])
    first, columns = rows.take(0, 3, seed=7)
    second, _ = rows.take(1, 3, seed=7)
    assert first == rows.take(0, 3, seed=7)[0] and columns["answer"] == [str(ids[0]) for ids in first]
    assert sorted(ids[0] for ids in first + second[:2]) == [0, 1, 2, 3, 4]  # one pass holds each prompt once
    ids, mask = left_padded([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[True] * 3, [False, False, True]]


@pytest.mark.parametrize("layout, message", [
    ("pp2", "GRPO under pipeline parallel trains colab_par's GPT.*LlamaForCausalLM's stages take token ids only"),
    ("tp2 sp", "GRPO under sequence parallel trains colab_par's GPT.*e\\.g\\. 'tp2'"),
])
def test_a_hugging_face_model_under_pp_or_sp_is_refused(layout, message):
    import transformers

    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, eos_token_id=2))
    pm = SimpleNamespace(**{**vars(stand_in(layout)), "model": llama})
    with pytest.raises(ValueError, match=message):
        build(pm, prompts_per_step=2)
