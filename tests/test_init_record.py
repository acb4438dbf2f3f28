"""The recorded meta-device init replays, tensor by tensor, exactly what a normal CPU build with
the same seed makes, and leaves the generator where that build leaves it (single process)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import any_models
from colab_par.parallel.init_record import UninitialisedError, record_build, record_reset
from parity import build_model

KINDS = ["gpt", "llama", "qwen2", *any_models.BUILDERS]
# The classifier draws its position table with torch.randn in __init__ and has no reset_parameters:
# on meta nothing can recover it, only its factory.
NEEDS_FACTORY = {"classifier": r"'pos'.*NotebookClassifier"}


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    return dict(named)


def _assert_replays_normal_build(factory, *, meta_model: bool) -> None:
    torch.manual_seed(11)
    reference = factory()
    after_reference = torch.rand(4)
    torch.manual_seed(11)
    if meta_model:
        with torch.device("meta"):
            model = factory()
        record = record_reset(model)
    else:
        model, record = record_build(factory)
    assert torch.equal(torch.rand(4), after_reference), "the generator must end where a normal build leaves it"
    expected = _state(reference)
    assert set(record.names) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(record.value(name), tensor), name
    assert all(t.is_meta for t in _state(model).values() if t.numel())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("meta_model", [False, True], ids=["factory", "meta-model"])
def test_replay_equals_the_normal_build(kind: str, meta_model: bool) -> None:
    if meta_model and kind in NEEDS_FACTORY:
        with pytest.raises(UninitialisedError, match=NEEDS_FACTORY[kind]):
            _assert_replays_normal_build(lambda: build_model(kind, None), meta_model=True)
        return
    _assert_replays_normal_build(lambda: build_model(kind, None), meta_model=meta_model)


class _Exotic(nn.Module):
    """Init through views and derived tensors: a zeroed padding row, trunc_normal_, orthogonal_
    (QR of a fresh random matrix copied in), a buffer computed from arange."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6, padding_idx=3)
        self.proj = nn.Linear(6, 6)
        nn.init.trunc_normal_(self.proj.weight, std=0.5)
        self.rot = nn.Parameter(torch.empty(6, 6))
        nn.init.orthogonal_(self.rot)
        self.register_buffer("freq", 1.0 / (1000 ** (torch.arange(0, 6, 2).float() / 6)), persistent=False)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight


def test_replay_follows_views_derived_tensors_and_ties() -> None:
    _assert_replays_normal_build(_Exotic, meta_model=False)


def test_a_meta_model_without_reset_parameters_is_refused_by_name() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.scale = Scale()

    with torch.device("meta"):
        model = Net()
    with pytest.raises(UninitialisedError, match=r"scale\.gain.*Scale.*reset_parameters.*factory"):
        record_reset(model)
    _assert_replays_normal_build(Net, meta_model=False)  # the factory path needs nothing more


def test_a_factory_leaving_a_tensor_uninitialised_is_refused() -> None:
    class Forgetful(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(3, 3))

    with pytest.raises(UninitialisedError, match=r"weight is allocated but never initialised.*Forgetful"):
        record_build(Forgetful)


def test_a_plain_tensor_attribute_is_refused_with_the_way_out() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.scale = torch.full((4,), 2.0)  # not registered: to_empty would leave it on meta

    with pytest.raises(UninitialisedError, match=r"scale is a tensor Scaled keeps as a plain attribute.*register_buffer"):
        record_build(Scaled)
