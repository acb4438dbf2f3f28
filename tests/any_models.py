"""Models the kit did not write, as a user would define them in a notebook cell, with their batches.

Each kind has a builder, fixed global batches (a tuple `(images, labels)` or a dict with an
attention mask or labels) and a plain single-process loss written without the kit (for Hugging
Face models, the model's own loss computed by transformers), which the parity reference uses.
Engines get these by value (cloudpickle), as they would get notebook classes.
"""
from __future__ import annotations

import functools
import sys
from typing import Any

import cloudpickle
import torch
import torch.nn.functional as F
from torch import nn

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SEED = 1234
CLASSES = 5
VOCAB, SEQ = 64, 12


class NotebookCNN(nn.Module):
    """A small image classifier: three conv layers in a Sequential (the repeated blocks), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(),
                                      nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                                      nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(4 * 8 * 8, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).flatten(1))


class NotebookClassifier(nn.Module):
    """A transformer sequence classifier on torch's own encoder layers; padding masked out."""

    def __init__(self, d_model: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(0.02 * torch.randn(SEQ, d_model))
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d_model, 4, 64, dropout=0.0,
                                                               batch_first=True)
                                    for _ in range(layers))
        self.head = nn.Linear(d_model, CLASSES)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        for layer in self.layers:
            h = layer(h, src_key_padding_mask=attention_mask == 0)
        keep = attention_mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


class NoBlocksMLP(nn.Module):
    """No repeated blocks at all: sharded as one unit."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.out = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))


class TinyLM(nn.Module):
    """Notebook 01's language model: torch's encoder layers under a causal mask, token batches."""

    def __init__(self, vocab_size: int = VOCAB, d_model: int = 32, n_layer: int = 2, n_head: int = 4,
                 seq_len: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, n_head, 4 * d_model, dropout=0.0, batch_first=True,
                                       norm_first=True) for _ in range(n_layer))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        seq = tokens.shape[1]
        positions = torch.arange(seq, device=tokens.device) if positions is None else positions
        x = self.embed(tokens) + self.position(positions)
        causal = nn.Transformer.generate_square_subsequent_mask(seq, device=tokens.device)
        for block in self.blocks:
            x = block(x, src_mask=causal, is_causal=True)
        return self.head(self.norm(x))

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


TINYLM_TP_PLAN = {"blocks.*.linear1": "colwise", "blocks.*.linear2": "rowwise"}  # as notebook 01 shows
TOKEN_KINDS = {"tinylm"}  # trained on (tokens, targets) like the kit's own language models

BERT = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def bert(tied: bool = True) -> nn.Module:
    """Hugging Face BertForMaskedLM, tiny, no dropout (an encoder; its MLM head tied to the word
    embeddings, or not: pipeline stages cannot share a tied tensor)."""
    import transformers

    model = transformers.BertForMaskedLM(transformers.BertConfig(**BERT, tie_word_embeddings=tied))
    head = model.cls.predictions
    if not tied:  # transformers then leaves `bias` apart from the decoder's, unused: share it again
        head.bias = head.decoder.bias
    return model


# Hugging Face causal LMs trained on {"input_ids", "labels"} batches, scored by their own loss:
# kind "<family>-lm" -> (config, model) class names. GPT-2's model is not named *ForCausalLM and
# keeps its head tied to the embeddings, as released; the vocabulary is odd (tp splits it unevenly).
LM_VOCAB, LM_SEQ = 67, 16
CAUSAL_LMS = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
              "phi3": ("Phi3Config", "Phi3ForCausalLM"), "gpt2": ("GPT2Config", "GPT2LMHeadModel")}
DECODER = dict(vocab_size=LM_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=LM_SEQ, head_dim=8, tie_word_embeddings=False,
               attn_implementation="sdpa")
GPT2 = dict(vocab_size=LM_VOCAB, n_positions=LM_SEQ, n_embd=32, n_layer=4, n_head=4, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")


def causal_lm(family: str) -> nn.Module:
    """A tiny Hugging Face causal LM of `family`, no dropout, its special tokens in the vocabulary."""
    import transformers

    config_name, model_name = CAUSAL_LMS[family]
    sizes = GPT2 if family == "gpt2" else DECODER
    config = getattr(transformers, config_name)(**sizes, pad_token_id=None, bos_token_id=1, eos_token_id=2)
    return getattr(transformers, model_name)(config)


BUILDERS = {"cnn": NotebookCNN, "classifier": NotebookClassifier, "mlp": NoBlocksMLP, "bert": bert,
            "bert-untied": lambda: bert(tied=False), "tinylm": TinyLM}
LM_BUILDERS = {f"{family}-lm": functools.partial(causal_lm, family) for family in CAUSAL_LMS}
MODELS = {**BUILDERS, **LM_BUILDERS}  # every kind the parity suite trains


def build(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[kind]()


def make_batches(kind: str, steps: int, batch: int = 4) -> list[Any]:
    """Fixed global batches whose labels depend on the inputs (so there is something to learn)."""
    gen = torch.Generator().manual_seed(SEED)
    out = []
    for _ in range(steps):
        if kind == "cnn":
            images = torch.randn(batch, 1, 8, 8, generator=gen)
            out.append((images, (images.mean((1, 2, 3)) * 40).long().clamp(-2, 2) + 2))
        elif kind == "mlp":
            x = torch.randn(batch, 16, generator=gen)
            out.append((x, (x[:, 0] * 2).long().clamp(-2, 2) + 2))
        elif kind.endswith("-lm"):  # a learnable sequence, padded: labels -100 past each length
            start = torch.randint(0, LM_VOCAB, (batch, 1), generator=gen)
            ids = (start + 3 * torch.arange(LM_SEQ)) % LM_VOCAB
            ids = torch.where(torch.rand(ids.shape, generator=gen) < 0.2,
                              torch.randint(0, LM_VOCAB, ids.shape, generator=gen), ids)
            lengths = torch.randint(LM_SEQ // 2, LM_SEQ + 1, (batch, 1), generator=gen)
            out.append({"input_ids": ids, "labels": torch.where(torch.arange(LM_SEQ) < lengths, ids, -100)})
        elif kind.startswith("bert"):  # masked LM with padding: 15 % of the real tokens masked and predicted
            ids = (torch.randint(0, 8, (batch, 1), generator=gen) + 5 * torch.arange(SEQ)) % 60 + 4
            mask = (torch.arange(SEQ) < torch.randint(8, SEQ + 1, (batch, 1), generator=gen)).long()
            chosen = (torch.rand(ids.shape, generator=gen) < 0.15) & mask.bool()
            out.append({"input_ids": torch.where(chosen, 3, ids) * mask, "attention_mask": mask,
                        "labels": torch.where(chosen, ids, -100)})
        else:
            ids = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
            lengths = torch.randint(SEQ // 2, SEQ + 1, (batch, 1), generator=gen)
            mask = (torch.arange(SEQ) < lengths).long()
            out.append({"input_ids": ids * mask, "attention_mask": mask, "labels": ids[:, 0] % CLASSES})
    return out


def plain_loss(kind: str, model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss as a user writes it in a single process (no kit code)."""
    if kind.startswith("bert") or kind.endswith("-lm"):
        return model(**batch).loss  # transformers' own masked- or causal-LM loss, one process
    if isinstance(batch, dict):
        logits = model(batch["input_ids"], batch["attention_mask"])
        return F.cross_entropy(logits, batch["labels"])
    images, labels = batch
    return F.cross_entropy(model(images), labels)
