"""After DCP reads weights, only the tensors that are not the model's own memory are set
again: copying the model's tensors onto themselves is skipped, a state dict torch built
anew (copies) is still set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from composer_par import checkpoint as ck
from composer_par.checkpoint import weights
from composer_par.checkpoint.safetensors_io import save_file


def test_same_memory_only_for_views_of_the_same_elements() -> None:
    t = torch.arange(12.0).reshape(3, 4)
    assert weights._same_memory(t, t)
    assert weights._same_memory(t.detach(), t)
    assert weights._same_memory(t.view(3, 4), t)
    assert not weights._same_memory(t.clone(), t)
    assert not weights._same_memory(t[1:], t[:2])  # other elements
    assert not weights._same_memory(t.view(-1), t)  # another shape
    assert not weights._same_memory(t.t(), t.t().contiguous())
    assert not weights._same_memory(t.view(torch.int32), t)  # another dtype
    assert not weights._same_memory(t, None)


def _model_and_file(tmp_path: Path) -> tuple[nn.Module, dict[str, torch.Tensor], Path]:
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    stored = {k: torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}
    path = tmp_path / "w.safetensors"
    save_file(stored, path)
    return model, stored, path


def test_loaded_in_place_and_not_set_again(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint.state_dict as sd

    model, stored, path = _model_and_file(tmp_path)
    calls: list[list[str]] = []
    original = sd.set_model_state_dict

    def recording(m: nn.Module, state: dict[str, Any], **kwargs: Any) -> Any:
        calls.append(sorted(state))
        return original(m, state, **kwargs)

    monkeypatch.setattr(sd, "set_model_state_dict", recording)
    ck.load_safetensors(model, path)
    for name, value in model.state_dict().items():
        assert torch.equal(value, stored[name]), name
    assert calls == []  # DCP wrote into the model's own tensors


def test_a_state_dict_of_copies_is_still_set(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint.state_dict as sd

    model, stored, path = _model_and_file(tmp_path)
    original = sd.get_model_state_dict

    def copies(m: nn.Module, **kwargs: Any) -> dict[str, Any]:
        state: dict[str, Any] = dict(original(m, **kwargs))
        return {k: v.clone() for k, v in state.items()}

    monkeypatch.setattr(sd, "get_model_state_dict", copies)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    ck.load_safetensors(model, path)
    for name, value in model.state_dict().items():
        assert torch.equal(value, stored[name]), name
