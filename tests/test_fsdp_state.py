"""The torch-private FSDP accesses are gated on the torch releases they were checked on."""

from __future__ import annotations

import pytest
import torch

from composer_par.plugin.fsdp_state import (
    CHECKED_TORCH,
    UncheckedTorchError,
    check_torch,
    torch_release,
)


def test_installed_torch_is_one_the_private_accesses_were_checked_on() -> None:
    # Fails loudly on a torch upgrade: re-check composer_par/plugin/fsdp_state.py's reads
    # and writes of FSDP internals against the new torch, then add it to CHECKED_TORCH.
    assert torch_release(torch.__version__) in CHECKED_TORCH, (
        f"torch {torch.__version__} is not in CHECKED_TORCH {CHECKED_TORCH}: re-check "
        "composer_par.plugin.fsdp_state against it"
    )
    check_torch()


@pytest.mark.parametrize("version", ["2.14.0", "3.0.0+cu130", "2.12.1"])
def test_an_unchecked_torch_is_refused_with_the_module_to_recheck(version: str) -> None:
    with pytest.raises(UncheckedTorchError, match=r"composer_par\.plugin\.fsdp_state"):
        check_torch(version)


def test_release_parsing() -> None:
    assert torch_release("2.13.0+cpu") == (2, 13)
    assert torch_release("2.13.0a0+git1234") == (2, 13)
    assert torch_release("2.13") == (2, 13)
