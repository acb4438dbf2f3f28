"""Hugging Face weights in and out: `from_pretrained` / `save_pretrained` against transformers itself.

Directories are written by transformers' own `save_pretrained` from tiny random Llama / Qwen2 /
GPT-2 models (GPT-2's 67-token vocabulary split unevenly by tensor parallel), loaded on a real
2-engine cluster under ZeRO-3, tensor and pipeline parallel, and the
engines' logits are compared with transformers' own single-process model loaded from the same
directory. The other way round, a model trained on the engines is written by the kit and read back
by `transformers.AutoModelForCausalLM.from_pretrained`. Bad directories are refused before a
single weight is read, and saving is shown to stream: rank 0 never holds more than one shard.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import cloudpickle
import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from any_models import GPT2  # noqa: E402
from parity import HF_TOKENS, LLAMA_SIZES, SEED, batches, build_model  # noqa: E402

from colab_par.cluster import EngineError  # noqa: E402
from colab_par.hf_io import SafetensorsWeights, WeightsError  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

TOKENS = batches(LLAMA_SIZES["vocab_size"], LLAMA_SIZES["max_position_embeddings"], steps=1)[0][0]
LOAD_LAYOUTS = ["dp2 zero3", "tp2", "pp2"]
EXACT = dict(rtol=0.0, atol=1e-6)


# ---- directories written by transformers --------------------------------------------------------
def _config(kind: str, tied: bool = False, **changes) -> transformers.PretrainedConfig:
    if kind == "gpt2":  # GPT2LMHeadModel: Conv1D layers, a fused q|k|v, an odd vocabulary
        return transformers.GPT2Config(**{**GPT2, **changes}, **HF_TOKENS, tie_word_embeddings=tied)
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[kind]
    return config_class(**{**LLAMA_SIZES, **changes}, **HF_TOKENS, tie_word_embeddings=tied)


def _hf_dir(folder: Path, kind: str = "llama", tied: bool = False, shard: str | None = "30KB") -> Path:
    """A random model saved by transformers: sharded with an index (`shard`), or one file. GPT-2 is
    saved as released: its head tied to the embeddings."""
    tied = tied or kind == "gpt2"
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind, tied))
    options = {} if shard is None else {"max_shard_size": shard}
    model.save_pretrained(folder, **options)
    return folder


def _reference_logits(folder: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        return model(input_ids=TOKENS, use_cache=False).logits


def _listing(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in folder.iterdir()}


# ---- engine side ---------------------------------------------------------------------------------
def engine_logits(pm, tokens: torch.Tensor) -> torch.Tensor | None:
    """Logits of the parallel model on the ranks that have them (None elsewhere). Pipeline stages
    (one per rank) pass hidden states from rank to rank."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from colab_par.models.hf import causal_lm_logits

    with torch.no_grad():
        if pm.layout.pp == 1:
            logits = causal_lm_logits(pm.model, tokens, torch.arange(tokens.shape[1]))
            return logits.full_tensor() if isinstance(logits, DTensor) else logits
        stage, rank = pm.model_parts[0], dist.get_rank()
        hidden = tokens
        if pm.pp_rank > 0:
            # getattr: the attribute name "config" would make cloudpickle ship torch's config modules
            hidden = torch.empty(*tokens.shape, getattr(stage, "config").hidden_size)
            dist.recv(hidden, src=rank - 1)
        out = stage(hidden)
        if not pm.is_last_stage:
            dist.send(out.contiguous(), dst=rank + 1)
            return None
        return out


def load_and_score(path: str, layout: str) -> torch.Tensor | None:
    from colab_par.hf_io import from_pretrained

    return engine_logits(from_pretrained(path, layout), TOKENS)


def train_score_save(path: str, layout: str, out: str) -> torch.Tensor | None:
    """Load, train 3 steps, score, save: the trained model's logits."""
    from colab_par.hf_io import from_pretrained, save_pretrained

    pm = from_pretrained(path, layout)
    for x, y in batches(LLAMA_SIZES["vocab_size"], LLAMA_SIZES["max_position_embeddings"], steps=3):
        pm.train_step(x, y)
    logits = engine_logits(pm, TOKENS)
    save_pretrained(pm, out, max_shard_bytes=30_000)
    return logits


def load_counting_reads(path: str, layout: str) -> tuple[str | None, int]:
    """from_pretrained's error (None if it loads) and how many weight reads happened before it."""
    from colab_par.hf_io import SafetensorsWeights, from_pretrained

    original, reads = SafetensorsWeights.read, []

    def counted(self, name, index=None):
        reads.append(name)
        return original(self, name, index)

    SafetensorsWeights.read = counted
    try:
        from_pretrained(path, layout)
        return None, len(reads)
    except Exception as error:  # noqa: BLE001 - the error is what the test inspects
        return f"{type(error).__name__}: {error}", len(reads)
    finally:
        SafetensorsWeights.read = original


def streamed_save(path: str, layout: str, out: str, limit: int) -> list[dict] | None:
    """Save while watching rank 0's writer: per shard file, the bytes handed to it, how many shard
    files already existed, and the bytes of every CPU tensor alive then that was not alive before
    the save began (what the save holds)."""
    import gc
    from unittest import mock

    import safetensors.torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from colab_par.hf_io import from_pretrained, save_pretrained

    def storages() -> dict[int, int]:
        found = {}
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and not isinstance(obj, DTensor) and not obj.is_meta:
                found[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
        return found

    pm = from_pretrained(path, layout)
    gc.collect()
    before = storages()
    writes = []
    real_save = safetensors.torch.save_file

    def watched(tensors, filename, metadata=None):
        held = sum(size for ptr, size in storages().items() if ptr not in before)
        writes.append({"bytes": sum(t.nbytes for t in tensors.values()), "held": held,
                       "largest": max(t.nbytes for t in tensors.values()),
                       "files_before": len(list(Path(filename).parent.glob("*.safetensors")))})
        real_save(tensors, filename, metadata)

    with mock.patch.object(safetensors.torch, "save_file", watched):
        save_pretrained(pm, out, max_shard_bytes=limit)
    return writes if dist.get_rank() == 0 else None


def failing_save(layout: str, out: str, fail_at: int) -> str:
    """A normally built Llama saved while rank 0's shard write number `fail_at` raises."""
    from unittest import mock

    import safetensors.torch
    import torch.distributed as dist

    from colab_par import parallelize
    from colab_par.hf_io import save_pretrained

    pm = parallelize(build_model("llama", SEED), layout)
    real_save, calls = safetensors.torch.save_file, []

    def disk_full(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == fail_at and dist.get_rank() == 0:
            raise OSError(28, "No space left on device")
        real_save(tensors, filename, metadata)

    with mock.patch.object(safetensors.torch, "save_file", disk_full):
        save_pretrained(pm, out, max_shard_bytes=30_000)
    return "saved"


def save_built(kind: str, layout: str, out: str, **options) -> str:
    from colab_par import parallelize
    from colab_par.hf_io import save_pretrained

    save_pretrained(parallelize(build_model(kind, SEED), layout), out, **options)
    return "saved"


def _the_logits(results: list) -> torch.Tensor:
    found = [r for r in results if r is not None]
    assert found, "no rank returned logits"
    for other in found[1:]:  # ranks that all have the logits (tp, dp) agree
        torch.testing.assert_close(other, found[0], **EXACT)
    return found[0]


def _error_lines(error: EngineError) -> set[str]:
    return {f"{name}: {value}" for _, name, value, _ in error.groups}


# ---- SafetensorsWeights alone (no cluster) ----------------------------------------------------------
def test_weights_read_whole_tensors_and_blocks_from_every_shard(tmp_path):
    folder = _hf_dir(tmp_path / "llama")
    assert len(list(folder.glob("model-*.safetensors"))) > 2
    state = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    with SafetensorsWeights(folder) as weights:
        assert set(weights.names()) == set(state)
        assert weights.check({k: (tuple(v.shape), v.dtype) for k, v in state.items()}) == []
        for name, tensor in state.items():
            torch.testing.assert_close(weights.read(name), tensor, rtol=0, atol=0)
        q = "model.layers.1.self_attn.q_proj.weight"
        block = (slice(8, 16), slice(3, 30))
        torch.testing.assert_close(weights.read(q, block), state[q][block], rtol=0, atol=0)


def test_weights_refuse_an_index_naming_a_missing_shard(tmp_path):
    folder = _hf_dir(tmp_path / "llama")
    lost = sorted(folder.glob("model-*.safetensors"))[1]
    lost.unlink()
    with pytest.raises(WeightsError, match=f"names 1 shard file.*{lost.name}.*fetch the missing shards"):
        SafetensorsWeights(folder)


def test_weights_check_names_the_tensor_and_both_shapes(tmp_path):
    folder = _hf_dir(tmp_path / "llama", shard=None)
    with torch.device("meta"):
        wider = transformers.AutoModelForCausalLM.from_config(_config("llama", intermediate_size=48))
        deeper = transformers.AutoModelForCausalLM.from_config(_config("llama", num_hidden_layers=6))
    with SafetensorsWeights(folder) as weights:
        with pytest.raises(WeightsError, match=r"model.layers.0.mlp.gate_proj.weight in .*model.safetensors "
                                               r"has shape \[64, 32\], but .* expects \[48, 32\]"):
            weights.check({k: (tuple(v.shape), v.dtype) for k, v in wider.state_dict().items()})
        with pytest.raises(WeightsError, match=r"lacks 18 tensor\(s\) the model needs: model.layers.4."):
            weights.check({k: (tuple(v.shape), v.dtype) for k, v in deeper.state_dict().items()})


# ---- from_pretrained on the cluster ------------------------------------------------------------------
@pytest.mark.parametrize("layout", LOAD_LAYOUTS)
@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_from_pretrained_matches_transformers(cluster2, tmp_path, kind, layout):
    folder = _hf_dir(tmp_path / kind, kind, shard="30KB" if kind == "llama" else None)
    logits = _the_logits(cluster2.run(load_and_score, str(folder), layout))
    torch.testing.assert_close(logits, _reference_logits(folder), **EXACT)


@pytest.mark.parametrize("layout", ["dp2 zero3", "tp2"])
def test_from_pretrained_of_a_tied_model_matches_transformers(cluster2, tmp_path, layout):
    """The file holds the embedding once; the head must be that same tensor, not a fresh init."""
    folder = _hf_dir(tmp_path / "tied", tied=True)
    assert "lm_head.weight" not in json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    logits = _the_logits(cluster2.run(load_and_score, str(folder), layout))
    torch.testing.assert_close(logits, _reference_logits(folder), **EXACT)


def test_bad_directories_are_refused_before_any_weight_is_read(cluster2, tmp_path):
    good = _hf_dir(tmp_path / "good")
    for error, reads in cluster2.run(load_counting_reads, str(good), "dp2 zero3"):
        assert error is None and reads > 0  # the control loads, reading weights

    missing = _hf_dir(tmp_path / "missing")
    lost = sorted(missing.glob("model-*.safetensors"))[-1]
    lost.unlink()
    reshaped = _hf_dir(tmp_path / "reshaped", shard=None)
    config = json.loads((reshaped / "config.json").read_text())
    (reshaped / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    opt = tmp_path / "opt"
    transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=64, hidden_size=32, word_embed_proj_dim=32, num_hidden_layers=2, ffn_dim=64,
        num_attention_heads=4, max_position_embeddings=16)).save_pretrained(opt)
    cases = [(missing, "dp2 zero3", f"WeightsError: {missing / 'model.safetensors.index.json'} names 1 "
                                    f"shard file(s) that are not in {missing}: {lost.name}"),
             (reshaped, "tp2", "WeightsError: model.layers.0.mlp.gate_proj.weight in "
                               f"{reshaped / 'model.safetensors'} has shape [64, 32], but the model "
                               f"built from {reshaped / 'config.json'} expects [48, 32]"),
             (opt, "tp2", "ValueError: OPTForCausalLM (model_type 'opt') has no tensor-parallel plan "
                          "(its config.base_model_tp_plan is empty), so layout 'tp2' cannot split it; "
                          "load it without tensor parallel (e.g. 'dp2 zero3' or 'pp2')")]
    for folder, layout, message in cases:
        before = _listing(folder)
        for error, reads in cluster2.run(load_counting_reads, str(folder), layout):
            assert error is not None and error.startswith(message), (error, message)
            assert reads == 0
        assert _listing(folder) == before


# ---- save_pretrained ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,layout", [("llama", "dp2 zero3"), ("llama", "tp2"), ("llama", "pp2"), ("llama", "dp2"),
                                         ("gpt2", "tp2"), ("gpt2", "pp2")])
def test_trained_model_goes_back_to_transformers(cluster2, tmp_path, kind, layout):
    """GPT-2 too: its odd vocabulary split unevenly by tp2 is written whole (67 rows), and its head,
    tied to the embeddings across pipeline stages, is written once."""
    folder, out = _hf_dir(tmp_path / kind, kind), tmp_path / "trained"
    trained = _the_logits(cluster2.run(train_score_save, str(folder), layout, str(out)))
    assert (trained - _reference_logits(folder)).abs().max() > 1e-3  # training moved the weights
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {p.name for p in shards}
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    tensors = {id(t): t for t in reloaded.state_dict(keep_vars=True).values()}  # a tied tensor once
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert reloaded.get_input_embeddings().weight.shape == (_config(kind).vocab_size, 32)
    torch.testing.assert_close(_reference_logits(out), trained, **EXACT)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left


def test_tied_model_is_written_once_and_reloads_tied(cluster2, tmp_path):
    folder, out = _hf_dir(tmp_path / "tied", tied=True), tmp_path / "trained"
    trained = _the_logits(cluster2.run(train_score_save, str(folder), "dp2 zero3", str(out)))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"] and "model.embed_tokens.weight" in index["weight_map"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    torch.testing.assert_close(_reference_logits(out), trained, **EXACT)


@pytest.mark.parametrize("layout", ["dp2 zero3", "pp2"])
def test_save_streams_one_shard_at_a_time(cluster2, tmp_path, layout):
    """Each shard file is written before the next one's tensors are gathered, and what rank 0 holds
    at each write is at most that one shard plus one tensor: gathering the whole model first would
    hold all of it (about 10 shards here)."""
    folder, limit = _hf_dir(tmp_path / "llama"), 16_000
    writes = cluster2.run(streamed_save, str(folder), layout, str(tmp_path / "out"), limit)[0]
    shards = sorted((tmp_path / "out").glob("model-*.safetensors"))
    total = sum(p.stat().st_size for p in shards)
    assert len(writes) == len(shards) >= 5 and total > 4 * limit
    for i, write in enumerate(writes):
        assert write["files_before"] == i
        assert write["bytes"] <= limit or write["bytes"] == write["largest"]
        assert write["held"] <= write["bytes"] + write["largest"], (i, write)


def test_save_refuses_what_it_cannot_write_and_leaves_nothing_behind(cluster2, tmp_path):
    gpt_out = tmp_path / "gpt"
    with pytest.raises(EngineError) as info:
        cluster2.run(save_built, "gpt", "dp2", str(gpt_out))
    assert all("save it with colab_par.save(pm, path)" in line for line in _error_lines(info.value)), info.value.groups
    assert not gpt_out.exists()

    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    with pytest.raises(EngineError) as info:
        cluster2.run(save_built, "llama", "dp2", str(kept))
    assert any(f"{kept} exists and is not empty; pass overwrite=True" in line for line in _error_lines(info.value))
    assert _listing(kept) == {"notes.txt": 4}
    cluster2.run(save_built, "llama", "dp2", str(kept), overwrite=True)
    assert "notes.txt" not in _listing(kept) and (kept / "config.json").is_file()

    failed = tmp_path / "failed"
    with pytest.raises(EngineError) as info:
        cluster2.run(failing_save, "dp2 zero3", str(failed), 2)
    assert all("No space left on device" in line for line in _error_lines(info.value))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]  # no half directory, no staging
