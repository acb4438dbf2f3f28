"""Does GRPO teach? Held-out accuracy on notebook 09's toy task before and after GRPO, for the
colocated loop and for generator engines apart from the trainers.

The task (as notebook 09): two-digit sums "ab+cd=" with operands 0-49, answer two digits and a
full stop, one token per character; 200 of the 2,500 sums held out. The kit's GPT (2 layers, width
64) pre-trained 750 steps under dp2 (AdamW, lr 3e-3) on the answers; then, from those same
weights, GRPO (rewards: exact answer 1.0, right digits 0.5; 16 prompts x 8 completions a step, up
to 3 tokens, temperature 1, dapo, AdamW lr 3e-4) for `--steps` steps in each arm:
- colocated: the 2 trainer engines generate and train ("dp2 zero3");
- apart, max_offpolicy_steps m: the same 2 trainers ("dp2 zero3") and one generator engine
  ("dp1", its weights sent by the trainers), rollouts sampled up to m steps behind.
Accuracy: greedy answers on the held-out sums, exactly right.

    python benchmarks/rl_accuracy.py [--steps 200]
"""
from __future__ import annotations

import argparse
import functools
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from colab_par import Cluster, Generators  # noqa: E402

CHARS = "0123456789+=."
PAD, EOS, VOCAB = len(CHARS), CHARS.index("."), len(CHARS) + 1
CONFIG = dict(vocab_size=VOCAB, seq_len=16, n_layer=2, n_head=4, d_model=64, kernels="torch")


def encode(text: str) -> list[int]:
    return [CHARS.index(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(CHARS[i] for i in ids if i < len(CHARS))


def question(a: int, b: int) -> str:
    return f"{a:02d}+{b:02d}="


def answer_of(a: int, b: int) -> str:
    return f"{a + b:02d}"


SUMS = [(a, b) for a in range(50) for b in range(50)]
random.Random(0).shuffle(SUMS)
HELD_OUT, SEEN = SUMS[:200], SUMS[200:]


def correct(prompts, completions, answer, **_):
    return [float(text == want) for text, want in zip(completions, answer)]


def digits(prompts, completions, answer, **_):
    return [sum(x == y for x, y in zip(text, want)) / len(want) for text, want in zip(completions, answer)]


def accuracy(pm) -> float:
    prompts = torch.tensor([encode(question(a, b)) for a, b in HELD_OUT])
    written = pm.generate(prompts, max_new_tokens=3, eos_token_id=EOS, pad_token_id=PAD)
    answers = [decode(row[prompts.shape[1]:].tolist()).split(".")[0] for row in written]
    return sum(got == answer_of(a, b) for got, (a, b) in zip(answers, HELD_OUT)) / len(HELD_OUT)


def model(state: dict | None = None):
    from colab_par.models import GPT, GPTConfig

    torch.manual_seed(0)
    built = GPT(GPTConfig(**CONFIG))
    if state is not None:
        built.load_state_dict(state)
    return built


def pretrained() -> dict:
    """On each trainer engine: 750 steps under dp2; the whole weights."""
    from torch.utils.data import TensorDataset

    import colab_par

    lines = torch.tensor([encode(question(a, b) + answer_of(a, b) + ".") for a, b in SEEN])
    targets = lines[:, 1:].clone()
    targets[:, :5] = -100
    pm = colab_par.parallelize(model(), "dp2", optimizer_fn=lambda params: torch.optim.AdamW(params, lr=3e-3))
    colab_par.Trainer(pm, TensorDataset(lines[:, :-1], targets), batch_size=32, steps=750,
                      logs=colab_par.Logs(every=50, telemetry=False)).fit()
    return pm.full_state_dict()


def grpo_from(state: dict, steps: int, role: str = "trainer"):
    """The GRPO of every arm, from the pre-trained weights (a generator's come from the trainers);
    kept as `grpo` in the engine's namespace, to measure it afterwards."""
    from IPython import get_ipython

    import colab_par
    from colab_par import GRPO, Completions, GrpoLossOptions, Logs

    layout = "dp1" if role == "generator" else "dp2 zero3"
    pm = colab_par.parallelize(model(state if role != "generator" else None), layout,
                               optimizer_fn=lambda params: torch.optim.AdamW(params, lr=3e-4))
    prompts = [{"input_ids": encode(question(a, b)), "answer": answer_of(a, b)} for a, b in SEEN]
    grpo = GRPO(pm, prompts, {correct: 1.0, digits: 0.5}, group_size=8, max_completion_length=3, steps=steps,
                prompts_per_step=16, seed=0, logs=Logs(every=10, telemetry=False), loss=GrpoLossOptions(loss_type="dapo"),
                completions=Completions(temperature=1.0, eos_token_id=EOS, pad_token_id=PAD,
                                        decode=lambda ids: decode(ids).rstrip(".")))
    get_ipython().user_ns["grpo"] = grpo
    return grpo


def colocated(state: dict, steps: int) -> tuple[float, float, float]:
    grpo = grpo_from(state, steps)
    before = accuracy(grpo.pm)
    started = time.perf_counter()
    grpo.fit()
    return before, accuracy(grpo.pm), time.perf_counter() - started


def measured() -> float:
    from IPython import get_ipython

    return accuracy(get_ipython().user_ns["grpo"].pm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    options = dict(backend="gloo", timeout=300.0, dashboard=False)
    trainers, generator = Cluster(n=2, **options), Cluster(n=1, **options)
    try:
        trainers.start()
        generator.start()
        state = trainers.run(pretrained)[0]
        before, after, seconds = trainers.run(colocated, state, args.steps)[0]
        table = [("colocated (dp2 zero3)", before, after, seconds)]
        for staleness in (0, 1):
            started = time.perf_counter()
            Generators(generator, max_offpolicy_steps=staleness).fit(
                trainers, functools.partial(grpo_from, state, args.steps))
            seconds = time.perf_counter() - started
            table.append((f"apart, max_offpolicy_steps {staleness}", before, trainers.run(measured)[0], seconds))
    finally:
        generator.stop()
        trainers.stop()
    print(f"held-out accuracy on two-digit sums, {len(HELD_OUT)} sums, GRPO {args.steps} steps from the same "
          "pre-trained weights")
    print(f"{'arm':34} {'before':>8} {'after':>8} {'GRPO s':>8}")
    for name, first, last, took in table:
        print(f"{name:34} {100 * first:>7.1f}% {100 * last:>7.1f}% {took:>8.1f}")


if __name__ == "__main__":
    main()
