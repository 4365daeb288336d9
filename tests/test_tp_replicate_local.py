"""TP's replicate style (``replicate_rest``: the norms no entry splits, without sequence
parallelism) runs a module given local inputs on its parameters' local values: every tp
rank holds the same inputs, so each computes the same values and the same full gradient,
what DTensor would compute from the inputs wrapped as replicated, without its dispatch on
every op (the training parity of these plans is tests/test_tp.py's and the model
matrix's). The parameters stay DTensors outside the forward, their gradients replicated;
on a sequence-parallel stream the norms take DTensor inputs and their own style."""

from __future__ import annotations

import pytest

from composer_par.testing.distributed import run_ranks


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_replicated_norms_run_on_local_values_with_replicated_gradients() -> None:
    for result in run_ranks("tests.tp_replicate_workers:replicated_norms", 2, args=(False,),
                            timeout=100):
        assert result["during"], result
        assert set(result["during"].values()) == {"Tensor"}, result["during"]
        assert set(result["after"].values()) == {"DTensor"}, result["after"]
        assert all(g == ["Replicate"] for g in result["grads"].values()), result["grads"]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_sequence_parallel_norms_keep_dtensor_weights() -> None:
    for result in run_ranks("tests.tp_replicate_workers:replicated_norms", 2, args=(True,),
                            timeout=100):
        # sequence_parallel style: the weight stays a DTensor in forward
        assert set(result["during"].values()) == {"DTensor"}, result["during"]
