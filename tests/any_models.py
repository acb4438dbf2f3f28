"""Models the kit did not write, as a user would define them in a notebook cell, with their batches.

Each kind has a builder, fixed global batches (a tuple `(images, labels)` or a dict with an
attention mask) and a plain single-process loss written without the kit, which the parity
reference uses. Engines get these by value (cloudpickle), as they would get notebook classes.
"""
from __future__ import annotations

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


BUILDERS = {"cnn": NotebookCNN, "classifier": NotebookClassifier, "mlp": NoBlocksMLP, "bert": bert,
            "bert-untied": lambda: bert(tied=False), "tinylm": TinyLM}


def build(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return BUILDERS[kind]()


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
    if kind.startswith("bert"):
        return model(**batch).loss  # transformers' own masked-LM loss, one process
    if isinstance(batch, dict):
        logits = model(batch["input_ids"], batch["attention_mask"])
        return F.cross_entropy(logits, batch["labels"])
    images, labels = batch
    return F.cross_entropy(model(images), labels)
