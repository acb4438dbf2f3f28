"""GRPO post-training's pure parts (no cluster, no model): what the RL loop on a ParallelModel
computes once it has completions, each as TRL's `GRPOTrainer` defines it.

  options.py     GrpoLossOptions: loss type, clip epsilons, KL weight, truncation, length budget
  objective.py   grpo_loss (clipped surrogate, k3 KL, the grpo/bnpo/dr_grpo/dapo aggregations and
                 their diagnostics), completion_mask, token_entropy
  advantages.py  group_advantages: rewards against their prompt's group, and the zero-std share
  rewards.py     score_completions: plain Python reward functions, weighted, with errors that name
                 the function and the row

The loop on a ParallelModel (colocated: the engines that train also generate):
  loop.py        GRPO: each step a rollout, its log-probabilities, `iterations` optimizer steps, a row
  rollout.py     Completions (sampling and decoding), Rollout, sample_rollout: generate, score, advantages
  logprobs.py    per-token log-probabilities from the policy's forward (every layout, pipeline
                 stages included); the GRPO loss as the model's batch loss while a rollout trains
  reference.py   the KL term's reference: LoRA's base (adapters off), or a frozen sharded copy of
                 the full weights GRPO started from
  mismatch.py    the trainer-generator mismatch of the sampled tokens' log-probabilities
  samples.py     a few prompts with their best and worst completions, for the dashboard's table
  prompts.py     PromptRows: lists or Datasets of prompts, drawn seeded and alike on every rank

Generator engines apart from the trainers (each side its own cluster and world; the notebook's
controller is `colab_par.cluster.generator_engines.Generators`):
  generators.py  each side's loop: generators sample and score rollouts from weights at most
                 `max_offpolicy_steps` behind, trainers train on them and send the new weights
  bridge.py      the point-to-point link between the two worlds (a gloo group over a TCPStore)
(its rows reach the dashboard, TensorBoard and loggers through `training/live_rows.py`, as the
Trainer's do)
"""
from colab_par.training.grpo.advantages import SCALE_REWARDS, GroupAdvantages, group_advantages
from colab_par.training.grpo.objective import GrpoLoss, completion_mask, grpo_loss, token_entropy
from colab_par.training.grpo.options import LOSS_TYPES, GrpoLossOptions
from colab_par.training.grpo.rewards import RewardFunction, RewardFunctionError, RewardScores, score_completions
from colab_par.training.grpo.rollout import Completions, Rollout
from colab_par.training.grpo.loop import GRPO

__all__ = ["GrpoLossOptions", "LOSS_TYPES", "GrpoLoss", "grpo_loss", "completion_mask", "token_entropy",
           "GroupAdvantages", "group_advantages", "SCALE_REWARDS", "RewardFunction", "RewardFunctionError",
           "RewardScores", "score_completions", "GRPO", "Completions", "Rollout"]
