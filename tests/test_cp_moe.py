"""Context parallelism on mixture-of-experts models, alone and beside expert
parallelism, at parity with one process: the losses (with the routers' load-balancing
loss) and every rank's parameters.

A load-balancing loss multiplies two averages over the tokens (the share of routed slots
each expert got, its mean router probability), so the loss of a whole sequence is not
the mean of its parts' losses: each cp rank routes its part of every sequence, and the
statistics are totalled over the cp ranks before they multiply. The experts under EP
and FSDP2 then take their gradients from the tokens of every cp rank too.
"""

from __future__ import annotations

import pytest

from composer_par.testing.parity import ParityCase, check_parity

WORKERS = "tests.cp_workers"


def cp_plan(mesh: str, *plugins: str) -> str:
    listed = "".join(f'[[plugins]]\nname = "{name}"\n\n' for name in plugins)
    return (f"[mesh]\n{mesh}\n\n{listed}"
            '[[plugins]]\nname = "cp"\n\n[[plugins]]\nname = "meta_init"\nseed = 7\n')


def _parity(plan: str, world: int, reference: str = "full") -> None:
    case = ParityCase(task=f"{WORKERS}:moe_llama", plan=plan, world_size=world, steps=3,
                      lr=0.5, reference=reference)
    result = check_parity(case)
    result.assert_close()
    assert result.losses[-1] < result.losses[0], result.losses


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_cp_on_the_moe_llama_matches_single_process() -> None:
    """cp 2: each rank routes half of every sequence; the load-balancing loss is that of
    the whole sequences."""
    _parity(cp_plan("cp = 2"), 2)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("mesh", "plugins"), [
    pytest.param("cp = 2\nep = 2", ("ep",), id="ep"),
    # FSDP2 shards the dense layers over cp x ep, the experts over cp.
    pytest.param("dp_shard = 1\ncp = 2\nep = 2", ("fsdp2", "ep"), id="fsdp2_ep"),
    # HSDP alone replicates the dense layers over cp x ep, the experts over cp.
    pytest.param("dp_replicate = 1\ncp = 2\nep = 2", ("hsdp", "ep"), id="hsdp_ep"),
])
def test_cp_beside_ep_matches_single_process(mesh: str, plugins: tuple[str, ...]) -> None:
    """cp 2 x ep 2: the ep ranks read different samples, the cp ranks parts of the same;
    the experts' gradients gather the tokens of all four ranks."""
    _parity(cp_plan(mesh, *plugins), 4, reference="accumulate")


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_cp_with_hugging_face_router_losses_matches_single_process(family: str) -> None:
    """cp 2 through plan.training_step with add_router_loss: the step's loss and the
    parameters those of transformers' own loss of whole sequences."""
    from composer_par.testing.distributed import run_ranks
    from composer_par.testing.parity import parity_result
    from tests import cp_workers

    case = ParityCase(task=f"{WORKERS}:hf_{family}_router", plan=cp_plan("cp = 2"),
                      world_size=2, steps=3, lr=0.1)
    ranks = run_ranks(cp_workers.train_router_loss_with_training_step, 2, args=(case,),
                      timeout=250)
    result = parity_result(case, ranks)
    result.assert_close()
    assert len(set(result.losses)) == len(result.losses), result.losses
