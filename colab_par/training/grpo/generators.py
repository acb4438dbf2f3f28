"""GRPO with generator engines apart from the trainer engines (the verl / torchforge shape): the
engine side. Each side is its own cluster and torch.distributed world; they talk over the bridge
(`bridge.py`). The notebook's `colab_par.cluster.generator_engines` starts `run_side` on every
engine of both clusters with the same GRPO settings, each side on its own ParallelModel: the
same `build(role) -> GRPO` (role "trainer" or "generator"), or a GRPO each side's cells made, by the
name of its engine variable (the same prompts, reward functions and settings; checked).

Step k (0-based) of a run from step s:
- generators: hold the weights after max(s, k - max_offpolicy_steps) steps (receiving newer
  versions from trainer rank 0 as they need them), sample and score rollout k exactly as the
  colocated loop does (`sample_rollout`, seed `seed + k`), and generator rank 0 sends it to every
  trainer rank. With `max_offpolicy_steps > 0` it carries the sampling policy's per-token
  log-probabilities (`forward_logps` on the generators' weights), so the importance ratio of the
  stale rollout is pi_theta / pi_sampler, the ratio PPO's clipped surrogate is defined with (TRL's
  old log-probabilities are likewise those of the weights that sampled, taken at generation time;
  verl recomputes `old_log_prob` on the trainer before the update, which off-policy measures the
  ratio from the current weights and leaves the staleness to a separate rollout importance
  correction). With 0 the trainer computes them itself, as colocated (the sampling weights are
  the trainer's own), so a synchronous run equals the colocated one. The bound is AReaL's
  `max_head_offpolicyness` (0: synchronous), PRIME-RL's `max_async_level`.
- trainers: receive rollout k, train on it (`GRPO.train_on`: every layout the colocated loop
  trains with), gather the new weights (`pm.full_state_dict`, the gather save/export use) and
  trainer rank 0 sends version k + 1 to every generator, only the tensors that train (the
  adapters under LoRA; all of the first version, so the generators start from the trainers'
  weights whatever they loaded), and only while a later rollout needs it.

Rows are the colocated loop's (`rollout_s` is the generators' sampling time) plus `staleness`
(steps between the sampling weights and the trained ones), `weights_sync_s` (gathering and posting
the new weights), `generator_wait_s` (generators waiting for weights before this rollout) and
`trainer_wait_s` (trainers waiting for this rollout).
"""
from __future__ import annotations

import dataclasses
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from colab_par.training.grpo.bridge import ROLLOUT, WEIGHTS, Bridge, BridgeLink, Message, Posted
from colab_par.training.grpo.logprobs import forward_logps
from colab_par.training.grpo.loop import GRPO
from colab_par.training.grpo.rewards import RewardScores, function_names
from colab_par.training.grpo.rollout import Rollout, sample_rollout

__all__ = ["ROLES", "run_side", "last_loop"]

ROLES = ("trainer", "generator")
_SETTINGS_KEY = "settings"
_last: GRPO | None = None


def last_loop() -> GRPO | None:
    """The GRPO this engine built in its last run (its policy, history and last rollout)."""
    return _last


def run_side(role: str, loop: str | Callable[[str], Any], link: BridgeLink, max_offpolicy_steps: int) -> dict[str, Any]:
    """One engine's part of a run (called on every engine of both clusters): join the bridge,
    take this side's GRPO (`loop`: the name of an engine variable holding it, or a function of
    the role that builds it), run its loop; the bridge is closed on the way out, whatever happens."""
    global _last
    rank = dist.get_rank() if dist.is_initialized() else 0
    bridge = Bridge(link, rank if role == "trainer" else link.generator_rank(rank))
    try:
        grpo = _last = _loop_of(role, loop)
        if role == "trainer":
            return _Trainers(grpo, bridge, max_offpolicy_steps).fit()
        return _Generators(grpo, bridge, max_offpolicy_steps).fit()
    except BaseException as error:
        # the traceback outlives this call (IPython keeps the last one): its frames' locals would
        # keep bridge operations, and with them the group's sockets, open
        traceback.clear_frames(error.__traceback__)
        raise
    finally:
        bridge.close()


def _loop_of(role: str, loop: str | Callable[[str], Any]) -> GRPO:
    if isinstance(loop, str):
        from IPython import get_ipython

        shell = get_ipython()
        namespace = shell.user_ns if shell is not None else {}
        if loop not in namespace:
            raise NameError(f"no engine variable {loop!r} on this {role} engine: make the GRPO there first (a "
                            f"cell the {role}s' cluster runs: {loop} = GRPO(pm, ...)), or pass a function "
                            "build(role) that returns it")
        grpo, made = namespace[loop], f"engine variable {loop!r}"
    else:
        grpo, made = loop(role), f"build({role!r})"
    if not isinstance(grpo, GRPO):
        raise TypeError(f"{made} is a {type(grpo).__name__} on a {role} engine; it must be a GRPO on that "
                        "engine's ParallelModel, e.g. GRPO(parallelize(model, 'dp1'), prompts, rewards, ...)")
    return grpo


class _Trainers:
    """The trainer engines' loop (module docstring)."""

    def __init__(self, grpo: GRPO, bridge: Bridge, staleness: int):
        self.grpo, self.bridge, self.staleness = grpo, bridge, staleness
        self.rank = grpo.rank
        self.start = grpo.step
        self.last_version = max(self.start, grpo.steps - 1 - staleness)  # the newest weights a rollout needs
        self.posted: dict[int, list[Posted]] = {}
        self.weights_bytes: dict[int, int] = {}
        self.trained = _trained_names(grpo.pm)

    def fit(self) -> dict[str, Any]:
        grpo = self.grpo
        if self.rank == 0:
            self.bridge.put(_SETTINGS_KEY, {**settings_of(grpo), "start": self.start})
        self._send_weights(self.start, everything=True)
        first = len(grpo.history)
        header = {"total_steps": grpo.steps, "layout": str(grpo.pm.layout),
                  "generators": self.bridge.link.generators, "max_offpolicy_steps": self.staleness}
        with grpo.live.fit(grpo.history, grpo.step, header, torch.device(grpo.pm.device)) as sinks:
            while grpo.step < grpo.steps:
                sinks.after_step(self._step(), grpo.step >= grpo.steps)
        self._wait_posted(up_to=self.last_version)
        if self.rank != 0:
            return {}
        return {"rows": grpo.history[first:], "weights_bytes": self.weights_bytes}

    def _step(self) -> dict[str, Any] | None:
        grpo, k = self.grpo, self.grpo.step
        started = time.perf_counter()
        message = self.bridge.receive(self.bridge.link.generator_rank(0), ROLLOUT, k)
        received = time.perf_counter()
        self._wait_posted(up_to=k - self.staleness)  # the generators took these before sampling rollout k
        info = message.info
        row = grpo.step_on(rollout_of(message), info["rollout_s"], staleness=k - info["version"],
                           generator_wait_s=info["generator_wait_s"], trainer_wait_s=received - started)
        trained = time.perf_counter()
        if k + 1 <= self.last_version:
            self._send_weights(k + 1, everything=False)
        if row is not None:
            row["weights_sync_s"] = time.perf_counter() - trained
        return row

    def _send_weights(self, version: int, everything: bool) -> None:
        """Gather the policy (every trainer rank takes part) and, on rank 0, post `version` to
        every generator: all tensors, or only those that train."""
        state = self.grpo.pm.full_state_dict()
        if self.rank != 0:
            return
        if not everything:
            state = {name: state[name] for name in self.trained}
        message = Message({"version": version}, state)
        self.weights_bytes[version] = message.tensor_bytes * self.bridge.link.generators
        self.posted[version] = [self.bridge.post(message, self.bridge.link.generator_rank(g), WEIGHTS, version)
                                for g in range(self.bridge.link.generators)]

    def _wait_posted(self, up_to: int) -> None:
        for version in sorted(v for v in self.posted if v <= up_to):
            for posted in self.posted.pop(version):
                posted.wait(self.bridge)


class _Generators:
    """The generator engines' loop (module docstring)."""

    def __init__(self, grpo: GRPO, bridge: Bridge, staleness: int):
        self.grpo, self.bridge, self.staleness = grpo, bridge, staleness
        self.rank = grpo.rank
        self.posted: dict[int, list[Posted]] = {}

    def fit(self) -> dict[str, Any]:
        grpo = self.grpo
        expected = self.bridge.get(_SETTINGS_KEY)
        check_same_settings(expected, settings_of(grpo))
        start = grpo.step = expected["start"]
        version = start
        self._load(version, check=True)
        for k in range(start, grpo.steps):
            waiting = time.perf_counter()
            while version < k - self.staleness:
                version += 1
                self._load(version, check=False)
                self._wait_posted(up_to=version - 1)  # the trainers received these before sending it
            sampling = time.perf_counter()
            prompts, columns = grpo.prompts.take(k, grpo.prompts_per_step, grpo.seed)
            rollout = grpo.last_rollout = sample_rollout(grpo.pm, grpo.plan, prompts, columns, grpo.seed + k)
            if self.staleness > 0:  # the sampling policy's log-probabilities (module docstring)
                old = forward_logps(grpo.pm, rollout.to(grpo.pm.device), grpo.plan.completions.temperature)
                rollout = grpo.last_rollout = _with_old_logps(rollout, old)
            grpo.step = k + 1
            if self.rank == 0:
                info = {"version": version, "rollout_s": time.perf_counter() - sampling,
                        "generator_wait_s": sampling - waiting}
                message = message_of(rollout, info)
                self.posted[k] = [self.bridge.post(message, trainer, ROLLOUT, k)
                                  for trainer in range(self.bridge.link.trainers)]
        self._wait_posted(up_to=grpo.steps)
        return {"rollouts": grpo.steps - start}

    def _load(self, version: int, check: bool) -> None:
        """Receive weights `version` from trainer rank 0 and load them into this side's policy."""
        message = self.bridge.receive(0, WEIGHTS, version)
        pm = self.grpo.pm
        for part in pm.model_parts:
            if check:
                _check_same_tensors(get_model_state_dict(part), message.tensors)
            set_model_state_dict(part, message.tensors, options=StateDictOptions(full_state_dict=True, strict=False))

    def _wait_posted(self, up_to: int) -> None:
        for step in sorted(s for s in self.posted if s <= up_to):
            for posted in self.posted.pop(step):
                posted.wait(self.bridge)


# ---- what travels ------------------------------------------------------------------------------------
def message_of(rollout: Rollout, info: dict[str, Any]) -> Message:
    """A sampled rollout as a bridge message: its tensors, its reward scores, and `info`."""
    tensors = {field.name: value for field in dataclasses.fields(rollout)
               if isinstance(value := getattr(rollout, field.name), torch.Tensor)}
    scores = rollout.scores
    tensors.update({"scores.per_function": scores.per_function, "scores.total": scores.total})
    return Message({**info, "names": scores.names, "means": scores.means, "stds": scores.stds,
                    "zero_std_fraction": rollout.zero_std_fraction}, tensors)


def rollout_of(message: Message) -> Rollout:
    info, tensors = message.info, message.tensors
    scores = RewardScores(names=tuple(info["names"]), per_function=tensors["scores.per_function"],
                          total=tensors["scores.total"], means=info["means"], stds=info["stds"])
    fields = {field.name: tensors[field.name] for field in dataclasses.fields(Rollout) if field.name in tensors}
    return Rollout(**fields, scores=scores, zero_std_fraction=info["zero_std_fraction"])


def _with_old_logps(rollout: Rollout, old: torch.Tensor) -> Rollout:
    return dataclasses.replace(rollout, old_logps=old.detach().cpu())


def _trained_names(pm: Any) -> list[str]:
    """The full state dict's names of the tensors that train (the adapters under LoRA)."""
    names = [name for part in pm.model_parts  # torch's own filter: the names full_state_dict uses
             for name in get_model_state_dict(part, options=StateDictOptions(ignore_frozen_params=True))]
    if not names:
        raise ValueError("the policy has no parameter that trains (requires_grad): nothing to send to the "
                         "generators; train full weights or LoRA adapters")
    return names


# ---- both sides run the same loop ------------------------------------------------------------------------
def settings_of(grpo: GRPO) -> dict[str, Any]:
    """What must be equal on both sides for the generators to sample the trainers' rollouts."""
    plan, sampling = grpo.plan, grpo.plan.completions
    return {"steps": grpo.steps, "prompts_per_step": grpo.prompts_per_step, "seed": grpo.seed,
            "prompts": len(grpo.prompts), "group_size": plan.group_size,
            "max_completion_length": plan.max_completion_length, "temperature": sampling.temperature,
            "top_k": sampling.top_k, "top_p": sampling.top_p, "eos": plan.eos, "pad": plan.pad,
            "mask_truncated": plan.mask_truncated, "scale_rewards": plan.scale_rewards,
            "reward functions": function_names(plan.functions), "weights": plan.weights}


def check_same_settings(trainers: dict[str, Any], generators: dict[str, Any]) -> None:
    differ = [name for name in generators if trainers.get(name) != generators[name]]
    if differ:
        listed = ", ".join(f"{name} {generators[name]!r} (trainers: {trainers.get(name)!r})" for name in differ)
        raise ValueError(f"the generators' GRPO differs from the trainers' in {listed}: build(role) must give "
                         "both sides the same prompts, reward functions and settings (only the "
                         "ParallelModel differs)")


def _check_same_tensors(own: dict[str, Any], received: dict[str, torch.Tensor]) -> None:
    missing, extra = sorted(set(own) - set(received)), sorted(set(received) - set(own))
    shapes = [name for name in set(own) & set(received) if tuple(own[name].shape) != tuple(received[name].shape)]
    if missing or extra or shapes:
        name = (missing or extra or shapes)[0]
        why = ("the trainers' policy lacks it" if missing else "the generators' policy lacks it" if extra else
               f"shape {list(received[name].shape)} on the trainers, {list(own[name].shape)} here")
        raise ValueError(f"the generators' model is not the trainers': {name}: {why}. build('generator') must "
                         "build the same model (architecture and adapters), only its layout may differ")
