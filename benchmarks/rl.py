"""GRPO post-training on this machine: how fast the kit's rollouts are under ZeRO-3, how much of a
GRPO step is sampling, and a GRPO step of the kit against TRL's `GRPOTrainer` on the same work.

The model, on every arm: a tiny Hugging Face `LlamaForCausalLM` built from a config (4 layers,
hidden 256, vocabulary 256, float32, `torch.manual_seed(0)`; nothing downloaded) and a word-level
tokenizer built in memory (`tokenizers` WordLevel in a `PreTrainedTokenizerFast`: `<pad>`,
`<eos>`, the digits, `+`, `=` and filler words). Prompts: two-digit sums written a token a
character, "0 7 + 3 5 =" (6 tokens). Reward: the share of a completion's words that are digits.

(a) Rollout tokens/s (`--part rollout`): GRPO's rollout generation (`generate_rollout`: each row
    drawn from its own seeded generator) of `--rows` prompts, `--new` tokens each, sampled, no end
    token (every row runs the full length), timed on a running `Cluster`: "dp2 zero3" on 2 engines
    (each engine decodes its half of the rows, the halves all-gathered after, as colocated GRPO
    does; one torch thread each, the engines' default on 2 cores) against the same model
    unsharded in one process (a `Cluster(n=1)`, layout "dp1", all rows), once with one thread (an
    engine's share of the machine) and once with two (the whole machine). Arms alternate each
    round; tokens/s = rows x new / seconds of the slower rank (every rank ends holding all rows);
    median (min-max).
    Then a GRPO run under "dp2 zero3" (the step of (b)) gives each step's `rollout_s` and
    `train_s`: the share of the step spent generating.

(b) The peer (`--part peer`): one GRPO step, each arm a subprocess, rounds alternating the order:
    - kit: a `Cluster(n=2)`, `parallelize(model, "dp2")`, `GRPO(..., group_size=8,
      prompts_per_step=8, max_completion_length=16, loss="dapo", beta=0, iterations=1,
      grad_clip=1.0)`, AdamW (lr 1e-6, weight decay 0): per step every rank samples its 32 of
      the 64 completions, the token ids are all-gathered, every rank scores all 64 and trains on
      its 32 (one forward-backward, one optimizer step);
    - TRL: `torchrun --nproc-per-node 2` of `GRPOTrainer` (DDP over gloo, `use_cpu`, no vLLM,
      float32) with `num_generations=8`, `per_device_train_batch_size=32` (64 completions, 8
      prompts per step), `max_completion_length=16`, `loss_type="dapo"`, `beta=0`,
      `num_iterations=1`, `max_grad_norm=1.0`, the same lr (TRL's default optimizer: torch's fused
      AdamW, weight decay 0, a linear schedule): per step each process samples its own 32
      completions (4 prompts x 8), the rewards are gathered, and it trains on them.
    The kit's rows also give its seconds of sampling per step (`rollout_s`), printed beside.
    The end token stays on in both (the kit's GRPO needs one to end completions; TRL's could be
    suppressed, the kit's could not follow); with 64 rows sampled from
    a 256-token vocabulary some row always runs the full 16 tokens, so both decode 16 steps per
    rollout; each arm's mean completion length is printed beside its time. Seconds per step:
    `--steps` timed steps after `--warmup`, wall clock on each rank, the slower rank.

TRL lives in its own virtual environment, never the project's (the script skips the TRL arm,
saying so, when it is absent):

    python -m venv /work/trl_venv && /work/trl_venv/bin/pip install torch==2.13.0 trl==1.16.0 \
        transformers==5.24.0 peft==0.21.2 accelerate==1.15.0 datasets tokenizers==0.23.3

    python benchmarks/rl.py [--part all|rollout|peer] [--rounds 3] [--trl-python /work/trl_venv/bin/python]
    python benchmarks/rl.py --quick     # seconds: (a) with small sizes, one round, no TRL (tests/test_rl_benchmark.py)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRL_PYTHON = "/work/trl_venv/bin/python"
FILLERS = 242  # filler words: a 256-token vocabulary, so an end token is rare
MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=64)
GRPO_SHAPE = dict(group_size=8, prompts_per_step=8, max_completion_length=16)
LR = 1e-6


# ---- what every arm builds alike (imports inside: the TRL arm runs without colab_par) -------------------
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", *"0123456789+=", *(f"w{i}" for i in range(FILLERS))]
    core = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>")


def model(hidden: int = MODEL["hidden_size"], layers: int = MODEL["num_hidden_layers"]):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    words = tokenizer()
    config = LlamaConfig(vocab_size=len(words), **{**MODEL, "hidden_size": hidden, "num_hidden_layers": layers,
                                                   "intermediate_size": hidden * 688 // 256},
                         eos_token_id=words.eos_token_id, pad_token_id=words.pad_token_id, bos_token_id=None,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def prompt_texts(count: int = 200) -> list[str]:
    import random

    pairs = [(a, b) for a in range(50) for b in range(50)]
    random.Random(0).shuffle(pairs)
    return [" ".join(f"{a:02d}+{b:02d}=") for a, b in pairs[:count]]


def digit_share(prompts, completions, **_):
    """Reward: the share of the completion's words that are digits (TRL's and the kit's signature)."""
    return [sum(word.isdigit() for word in text.split()) / max(len(text.split()), 1) for text in completions]


# ---- (a) rollouts on a running cluster -------------------------------------------------------------------
def rollout_seconds(layout: str, threads: int, rows: int, new: int, sizes: dict) -> float:
    """On an engine: seconds of one sampled `generate_rollout` of `rows` prompts x `new` tokens (the
    model built once per engine and layout, kept between calls; the first call warms up)."""
    import __main__

    import torch

    from colab_par import parallelize
    from colab_par.parallel.inference.generation import generate_rollout
    from colab_par.parallel.inference.sampling import Sampling

    torch.set_num_threads(threads)
    built = __main__.__dict__.setdefault("_rl_benchmark_models", {})
    if layout not in built:
        built[layout] = parallelize(model(**sizes), layout)
        rollout_seconds(layout, threads, 2, 2, sizes)
    pm, words = built[layout], tokenizer()
    prompts = words(prompt_texts()[:rows], return_tensors="pt").input_ids
    started = time.perf_counter()
    generate_rollout(pm, prompts, new, Sampling(do_sample=True), eos_token_id=[], pad_token_id=words.pad_token_id,
                     seed=1)
    return time.perf_counter() - started


def grpo_rows_on_engine(layout: str, steps: int, sizes: dict, shape: dict) -> list[dict]:
    """On an engine: a GRPO run (the kit's arm of (b)), every step's row."""
    import torch

    from colab_par import GRPO, Logs, parallelize
    from colab_par.training.grpo import Completions, GrpoLossOptions

    words = tokenizer()
    pm = parallelize(model(**sizes), layout,
                     optimizer_fn=lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.0))
    prompts = [words(text).input_ids for text in prompt_texts()]
    grpo = GRPO(pm, prompts, digit_share, steps=steps, grad_clip=1.0, logs=Logs(every=1), **shape,
                completions=Completions(decode=lambda ids: words.decode(ids, skip_special_tokens=True)),
                loss=GrpoLossOptions(loss_type="dapo", beta=0.0))
    return grpo.fit()


def rollout_part(args: argparse.Namespace, sizes: dict, shape: dict) -> None:
    from colab_par import Cluster

    arms = {"dp2 zero3, 2 engines x 1 thread": (2, "dp2 zero3", 1),
            "one process, 1 thread": (1, "dp1", 1), "one process, 2 threads": (1, "dp1", 2)}
    seconds: dict[str, list[float]] = {arm: [] for arm in arms}
    load = []
    with Cluster(n=2, backend="gloo") as two, Cluster(n=1, backend="gloo") as one:
        clusters = {2: two, 1: one}
        for round_ in range(args.rounds):
            for arm in (list(arms) if round_ % 2 == 0 else list(arms)[::-1]):
                engines, layout, threads = arms[arm]
                seconds[arm].append(max(clusters[engines].run(rollout_seconds, layout, threads, args.rows,
                                                              args.new, sizes)))
            load.append(os.getloadavg()[0])
        rows = [row for rank_rows in two.run(grpo_rows_on_engine, "dp2 zero3", args.warmup + args.steps,
                                             sizes, shape) for row in rank_rows[args.warmup:]]
    print(f"(a) rollouts: {describe(sizes)}; {args.rows} prompts x {args.new} sampled tokens, no end token; "
          f"{args.rounds} rounds, arms alternated; {machine()}, load average {min(load):.1f}-{max(load):.1f}")
    rate = {arm: [args.rows * args.new / s for s in values] for arm, values in seconds.items()}
    zero3 = statistics.median(rate[next(iter(arms))])
    print(f"{'arm':<34} | {'tokens/s median (min-max)':>26} | dp2 zero3 / arm")
    for arm, values in rate.items():
        print(f"{arm:<34} | {spread(values, '.0f'):>26} | {zero3 / statistics.median(values):.2f}")
    shares = [row["rollout_s"] / (row["rollout_s"] + row["train_s"]) for row in rows]
    steps = [row["rollout_s"] + row["train_s"] for row in rows]
    print(f"GRPO step under dp2 zero3 ({shape['prompts_per_step']} prompts x {shape['group_size']}, "
          f"{shape['max_completion_length']} tokens; {args.steps} steps after {args.warmup}, both ranks): "
          f"{spread(steps, '.3f')} s, generating {spread([100 * s for s in shares], '.0f')} %")


# ---- (b) the kit against TRL, each arm a subprocess --------------------------------------------------------
def kit_arm(out: str, steps: int, warmup: int) -> None:
    """Subprocess: the kit's GRPO under dp2 on a fresh Cluster(n=2); seconds per timed step."""
    from colab_par import Cluster

    with Cluster(n=2, backend="gloo") as cluster:
        results = cluster.run(timed_kit_steps, steps, warmup)
    Path(out).write_text(json.dumps({"per_step": max(r["per_step"] for r in results),
                                     "length": results[0]["length"],
                                     "generating": max(r["generating"] for r in results)}))


def timed_kit_steps(steps: int, warmup: int) -> dict:
    import torch

    from colab_par import GRPO, Logs, parallelize
    from colab_par.training.grpo import Completions, GrpoLossOptions

    words = tokenizer()
    pm = parallelize(model(), "dp2", optimizer_fn=lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.0))
    grpo = GRPO(pm, [words(text).input_ids for text in prompt_texts()], digit_share, steps=warmup, grad_clip=1.0,
                completions=Completions(decode=lambda ids: words.decode(ids, skip_special_tokens=True)),
                loss=GrpoLossOptions(loss_type="dapo", beta=0.0), logs=Logs(every=1), **GRPO_SHAPE)
    grpo.fit()
    grpo.steps = warmup + steps
    started = time.perf_counter()
    rows = grpo.fit()
    return {"per_step": (time.perf_counter() - started) / steps,
            "length": statistics.mean(row["completion_length"] for row in rows),
            "generating": statistics.mean(row["rollout_s"] for row in rows)}


def trl_arm(out: str, steps: int, warmup: int) -> None:
    """A torchrun rank: TRL's GRPOTrainer on the same model, prompts, reward and settings."""
    here = Path(__file__).resolve().parent  # benchmarks/kernels.py would shadow HF's `kernels` package
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != here]
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    datasets.disable_progress_bars()
    ends: list[float] = []
    lengths: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    prompts = prompt_texts()
    config = GRPOConfig(output_dir=tempfile.mkdtemp(), max_steps=warmup + steps, learning_rate=LR, weight_decay=0.0,
                        max_grad_norm=1.0, per_device_train_batch_size=GRPO_SHAPE["group_size"] * GRPO_SHAPE[
                            "prompts_per_step"] // 2, num_generations=GRPO_SHAPE["group_size"],
                        max_completion_length=GRPO_SHAPE["max_completion_length"], loss_type="dapo", beta=0.0,
                        num_iterations=1, use_vllm=False, use_cpu=True, bf16=False, logging_steps=1,
                        report_to="none", save_strategy="no", disable_tqdm=True, seed=0)
    trainer = GRPOTrainer(model=model(), reward_funcs=digit_share, args=config, processing_class=tokenizer(),
                          train_dataset=datasets.Dataset.from_dict({"prompt": prompts}), callbacks=[Clock()])
    trainer.train()
    rank = int(os.environ.get("RANK", 0))
    Path(f"{out}.{rank}").write_text(json.dumps({"per_step": (ends[-1] - ends[warmup - 1]) / steps,
                                                 "length": statistics.mean(lengths[warmup:] or [0.0])}))
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


def run_arm(arm: str, args: argparse.Namespace, folder: str) -> dict:
    out = str(Path(folder, arm))
    common = [__file__, "--arm", arm, "--out", out, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if arm == "kit":
        subprocess.run([sys.executable, *common], check=True, capture_output=True)
        return json.loads(Path(out).read_text())
    results = [Path(f"{out}.{rank}") for rank in range(2)]
    for path in results:  # the last round's
        path.unlink(missing_ok=True)
    torchrun([args.trl_python, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517",
              *common], results, folder)
    ranks = [json.loads(path.read_text()) for path in results]
    return {"per_step": max(r["per_step"] for r in ranks), "length": ranks[0]["length"]}


def torchrun(command: list[str], results: list[Path], folder: str, grace_s: float = 30.0) -> None:
    """Run the TRL arm's torchrun until it exits, or until `grace_s` after every rank wrote its
    result: a rank once hung in gloo's teardown (`destroy_process_group`) after writing it, so
    then the whole process group is stopped and the results kept. Fails on an exit without them."""
    with open(Path(folder, "torchrun.log"), "w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
        written = None
        while process.poll() is None:
            if written is None and all(path.exists() for path in results):
                written = time.monotonic()
            if written is not None and time.monotonic() - written > grace_s:
                os.killpg(process.pid, 9)
                process.wait()
                print(f"(the TRL ranks hung after writing their results; stopped after {grace_s:.0f} s)")
                return
            time.sleep(0.5)
        if process.returncode != 0 or not all(path.exists() for path in results):
            log.seek(0)
            raise RuntimeError(f"TRL's torchrun exited {process.returncode}:\n{log.read()[-3000:]}")


def peer_part(args: argparse.Namespace) -> None:
    arms = ["kit", "trl"]
    if not Path(args.trl_python).exists():
        print(f"(b) TRL arm skipped: no TRL environment at {args.trl_python} (make it as this script's "
              "docstring says, or pass --trl-python)")
        arms = ["kit"]
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    load = []
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.rounds):
            for arm in (arms if round_ % 2 == 0 else arms[::-1]):
                results[arm].append(run_arm(arm, args, folder))
                load.append(os.getloadavg()[0])
    print(f"(b) one GRPO step, {describe({})}; {GRPO_SHAPE['prompts_per_step']} prompts x "
          f"{GRPO_SHAPE['group_size']} completions, {GRPO_SHAPE['max_completion_length']} tokens, dapo, beta 0, "
          f"1 iteration; {args.steps} steps after {args.warmup}; {args.rounds} rounds, arms alternated; "
          f"{machine()}, load average {min(load):.1f}-{max(load):.1f}")
    print(f"{'arm':<42} | {'s/step median (min-max)':>24} | mean completion length | generating s/step")
    names = {"kit": "colab_par GRPO, dp2 (2 engines)", "trl": "TRL GRPOTrainer, DDP (torchrun, 2 ranks)"}
    for arm in arms:
        seconds = [r["per_step"] for r in results[arm]]
        length = statistics.mean(r["length"] for r in results[arm])
        generating = (f"{statistics.median(r['generating'] for r in results[arm]):.3f}" if arm == "kit"
                      else "not split out")
        print(f"{names[arm]:<42} | {spread(seconds, '.3f'):>24} | {length:>22.2f} | {generating}")
    if "trl" in results:
        ratio = statistics.median(r["per_step"] for r in results["kit"]) / statistics.median(
            r["per_step"] for r in results["trl"])
        print(f"kit / TRL step time (medians): {ratio:.2f} (goal <= 1.0)")


# ---- shared printing -------------------------------------------------------------------------------------
def spread(values: list[float], form: str) -> str:
    return f"{statistics.median(values):{form}} ({min(values):{form}}-{max(values):{form}})"


def describe(sizes: dict) -> str:
    hidden, layers = sizes.get("hidden", MODEL["hidden_size"]), sizes.get("layers", MODEL["num_hidden_layers"])
    return f"LlamaForCausalLM {layers} layers, hidden {hidden}, vocabulary {FILLERS + 14}, float32"


def machine() -> str:
    return f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), torch threads as stated"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "rollout", "peer"), default="all")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--trl-python", default=TRL_PYTHON)
    parser.add_argument("--quick", action="store_true", help="(a) with a small model and batch, one round, no TRL")
    parser.add_argument("--arm", choices=("kit", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        (kit_arm if args.arm == "kit" else trl_arm)(args.out, args.steps, args.warmup)
        return
    if args.quick:
        args.rounds, args.rows, args.new, args.steps, args.warmup = 1, 8, 4, 2, 1
        rollout_part(args, dict(hidden=64, layers=2), dict(group_size=4, prompts_per_step=2, max_completion_length=4))
        return
    if args.part in ("all", "rollout"):
        rollout_part(args, {}, GRPO_SHAPE)
    if args.part in ("all", "peer"):
        peer_part(args)


if __name__ == "__main__":
    main()
