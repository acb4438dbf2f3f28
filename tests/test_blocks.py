"""Block discovery on models the kit did not write (no cluster: pure module inspection)."""
from __future__ import annotations

import pytest
from any_models import NoBlocksMLP, NotebookClassifier, NotebookCNN
from torch import nn

from colab_par.parallel.blocks import find_blocks


def _kinds(blocks) -> list[str]:
    return [type(block).__name__ for _, _, block in blocks]


def test_transformer_layers_in_a_module_list() -> None:
    assert _kinds(find_blocks(NotebookClassifier(layers=3))) == ["TransformerEncoderLayer"] * 3


def test_conv_layers_in_a_sequential_skip_parameterless_repeats() -> None:
    assert _kinds(find_blocks(NotebookCNN())) == ["Conv2d"] * 3  # the ReLUs hold nothing


def test_a_model_without_repeats_has_no_blocks() -> None:
    assert find_blocks(NoBlocksMLP()) == []


def test_blocks_never_nest() -> None:
    inner = lambda: nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))  # noqa: E731
    model = nn.Sequential(inner(), inner(), inner())
    assert _kinds(find_blocks(model)) == ["Sequential"] * 3


def test_gpt_and_hugging_face_decoders() -> None:
    from parity import build_model

    assert _kinds(find_blocks(build_model("gpt", 0))) == ["Block"] * 4
    pytest.importorskip("transformers")
    assert _kinds(find_blocks(build_model("llama", 0))) == ["LlamaDecoderLayer"] * 4


def test_bert_encoder_layers() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64)
    assert _kinds(find_blocks(transformers.BertForMaskedLM(config))) == ["BertLayer"] * 2


def test_user_named_blocks_by_class_or_name() -> None:
    model = NotebookClassifier()
    assert _kinds(find_blocks(model, [nn.Linear])) == ["Linear"] * 5  # 2 per layer + head
    assert _kinds(find_blocks(model, ["TransformerEncoderLayer"])) == ["TransformerEncoderLayer"] * 2


def test_unknown_block_name_is_refused_with_the_model_classes() -> None:
    with pytest.raises(ValueError, match="match no module of NotebookCNN.*Conv2d"):
        find_blocks(NotebookCNN(), ["ResBlock"])
