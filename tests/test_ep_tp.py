"""EP composed with TP on 4 ranks (ep 2 x tp 2), at parity with one process: losses with
the router's aux loss and every rank's full parameters.

The dense layers follow TP's plan (the MoE Llama's Llama names; Mixtral's own
transformers tp plan) with ``replicate_rest`` on, its default: the router's weight is a
replicated DTensor. EP runs first in the stage; TP leaves the experts modules it finds
already distributed as they are (Mixtral's tp plan would otherwise split their weights
and sum their outputs over tp, and replicate_rest would hand their forward DTensors).
"""

from __future__ import annotations

import pytest

from composer_par.testing.parity import ParityCase, check_parity
from tests.test_ep import ep_plan

EP_WORKERS = "tests.ep_workers"


def ep_tp_plan(ep_options: str = "") -> str:
    plan = ep_plan(2, plugins=ep_options + '\n[[plugins]]\nname = "tp"\n')
    return plan.replace("ep = 2", "ep = 2\ntp = 2")


def _parity(task: str, plan: str) -> None:
    case = ParityCase(task=task, plan=plan, world_size=4, steps=3, lr=0.5,
                      reference="accumulate")
    result = check_parity(case)
    result.assert_close()
    assert result.losses[-1] < result.losses[0], result.losses


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("task", ["moe_llama_shared", "mixtral"])
def test_ep_with_tp_and_its_replicated_rest_matches_single_process(task: str) -> None:
    """Experts whole on both tp ranks of their ep rank; attention split over tp."""
    _parity(f"{EP_WORKERS}:{task}", ep_tp_plan())


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_tp_before_ep_is_refused_naming_the_order() -> None:
    """TP first would have replicated the experts over tp: EP refuses them, saying to
    list ep first."""
    from composer_par.testing import RankFailure, run_ranks

    plan = ep_tp_plan()
    tp_first = plan.replace('[[plugins]]\nname = "ep"\n', "").replace(
        '[[plugins]]\nname = "tp"\n', '[[plugins]]\nname = "tp"\n\n[[plugins]]\nname = "ep"\n')
    assert tp_first.index('"tp"') < tp_first.index('"ep"')
    with pytest.raises(RankFailure, match="List ep before the other model-parallel plugins"):
        run_ranks("tests.ep_tp_workers:apply_plan", 4, args=(tp_first,), timeout=100)
