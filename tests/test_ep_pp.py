"""Expert parallelism under a pipeline (EP x PP, and FSDP2 x PP x EP) trains as one
process does, with the MoE Llama's load-balancing loss made on every stage.

Each case trains with ``plan.training_step`` given the next-token loss alone: every
MoE block adds its load-balancing loss as a side gradient (composer_par.aux_loss), so a
stage without the loss function still trains its routers on it, and the step reports
``next-token + aux``. The reference is one process accumulating the same microbatches
(tests/ep_pp_workers.py says why); compared are the losses and every rank's full
parameters (its stages', experts gathered over ep), whose union must be the model's.
"""

from __future__ import annotations

from typing import Any

import pytest

from composer_par.testing.distributed import run_ranks
from composer_par.testing.parity import assert_every_rank, assert_params_close
from tests.ep_pp_workers import Case, reference, train_all

pytestmark = pytest.mark.distributed


def plan_toml(mesh: str, *plugins: str) -> str:
    tables = "\n".join(f"[[plugins]]\n{p}\n" for p in plugins)
    return f"[mesh]\n{mesh}\n\n{tables}\n[[plugins]]\nname = \"meta_init\"\nseed = 7\n"


def pp(schedule: str, extra: str = "") -> str:
    return f'name = "pp"\nschedule = "{schedule}"\nmicrobatches = 4{extra}'


EP, FSDP2 = 'name = "ep"', 'name = "fsdp2"'


def _held_part_close(reference: dict[str, Any]) -> Any:
    """A rank's check: the parameters it holds (its stages') equal the reference's."""
    return lambda params: assert_params_close(
        params, {k: v for k, v in reference.items() if k in params})


def check(cases: dict[str, Case]) -> None:
    """Run the cases (one world size) in one launch and compare each with its
    reference; the losses must fall (or, where they need not, move)."""
    world = {c.world_size for c in cases.values()}.pop()
    results = run_ranks(train_all, world, args=(list(cases.values()),), timeout=400)
    for i, (name, case) in enumerate(cases.items()):
        ranks: list[tuple[list[float], dict[str, Any]]] = [r[i] for r in results]
        shards = world // 2 if "pp =" in case.plan else world
        ref_losses, ref_params = reference(case, shards)
        losses = ranks[0][0]
        try:
            assert len(losses) == len(ref_losses)
            for ours, theirs in zip(losses, ref_losses, strict=True):
                assert abs(ours - theirs) <= 1e-5 + 1.3e-6 * abs(theirs), (losses, ref_losses)
            assert_every_rank([params for _, params in ranks], _held_part_close(ref_params))
            held = {name for _, params in ranks for name in params}
            assert held == set(ref_params), sorted(set(ref_params) ^ held)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None
        assert len(set(losses)) == len(losses), (name, losses)
        if case.task == "moe_llama":
            assert losses[-1] < losses[0], (name, losses)


@pytest.mark.timeout(400)
def test_ep_pp_on_four_ranks_matches_one_process() -> None:
    """pp(2) x ep(2): each stage's experts over its two ep ranks, which read different
    samples; the load-balancing loss of stage 0's blocks reaches its routers only as a
    side gradient. Also, without a pipeline, the same step accumulating microbatches
    (each aux loss's gradient scaled by 1/k)."""
    mesh = "pp = 2\nep = 2"
    check({
        "1F1B": Case("moe_llama", plan_toml(mesh, pp("1F1B"), EP), 4, 4),
        "GPipe": Case("moe_llama", plan_toml(mesh, pp("GPipe"), EP), 4, 4),
        "Interleaved1F1B, two stages per rank": Case(
            "moe_llama", plan_toml(mesh, pp("Interleaved1F1B", "\nstages_per_rank = 2"), EP),
            4, 4),
        # The recomputation runs in backward: the aux loss counted and given its
        # gradient once.
        "1F1B, full activation checkpointing": Case(
            "moe_llama", plan_toml(mesh, pp("1F1B"), EP,
                                   'name = "activation_checkpoint"\nmode = "full"'), 4, 4),
        # Selective checkpointing with FSDP2 over ep: a microbatch's forward finds the
        # experts' unit gathered by the last backward; FSDP2 keeps it gathered to the
        # recompute, which must run no op more often than the forward did.
        "1F1B, selective checkpointing, FSDP2 over ep": Case(
            "moe_llama", plan_toml("pp = 2\ndp_shard = 1\nep = 2", pp("1F1B"), FSDP2, EP,
                                   'name = "activation_checkpoint"\nmode = "selective"'),
            4, 4),
        # Split backward: torch's weight pass writes .grad itself, so FSDP2 (over ep
        # alone here) must average; EP's own gradient hooks would not run (CP606).
        "ZBVZeroBubble, FSDP2 over ep": Case(
            "moe_llama", plan_toml("pp = 2\ndp_shard = 1\nep = 2", pp("ZBVZeroBubble"),
                                   FSDP2, EP), 4, 4),
        "dp_shard(2) x ep(2), no pipeline, accumulate=2": Case(
            "moe_llama", plan_toml("dp_shard = 2\nep = 2", FSDP2, EP), 4, 2, accumulate=2),
    })


@pytest.mark.timeout(400)
def test_hugging_face_router_losses_under_ep_pp_match_one_process() -> None:
    """transformers' router loss pools every layer's routing: with add_router_loss the
    statistics travel from stage to stage beside the hidden state, and the step trains
    on transformers' own loss. Mixtral and Qwen3-MoE under pp(2) x ep(2); Mixtral under
    ep(4) without a pipeline, through the same step."""
    mesh = "pp = 2\nep = 2"
    check({
        "Mixtral, 1F1B": Case("mixtral", plan_toml(mesh, pp("1F1B"), EP), 4, 4, lr=0.1),
        "Qwen3-MoE, GPipe": Case("qwen3_moe", plan_toml(mesh, pp("GPipe"), EP), 4, 4,
                                 lr=0.1),
        "Mixtral, ep(4), no pipeline": Case("mixtral", plan_toml("ep = 4", EP), 4, 1, lr=0.1),
    })


@pytest.mark.timeout(300)
def test_fsdp2_pp_ep_on_eight_ranks_matches_one_process() -> None:
    """pp(2) x dp_shard(2) x ep(2): FSDP2 shards each stage's dense layers over
    dp_shard x ep and its experts over dp_shard, and reduces once per step."""
    check({"FSDP2 x PP x EP, 1F1B": Case(
        "moe_llama", plan_toml("pp = 2\ndp_shard = 2\nep = 2", pp("1F1B"), FSDP2, EP), 8, 4)})


@pytest.mark.parametrize(("task", "router", "lr"), [
    ("moe_llama", "layers.0.moe.router.weight", 0.5),
    ("mixtral", "model.layers.0.mlp.gate.weight", 0.1),
])
def test_the_aux_loss_changes_training_enough_to_be_seen(task: str, router: str,
                                                         lr: float) -> None:
    """Not vacuous: dropping the load-balancing loss moves the reference's router on
    stage 0, far from the loss function, beyond the tolerance the cases are held to."""
    case = Case(task, plan_toml("pp = 2\nep = 2", pp("1F1B"), EP), 4, 4, lr=lr)
    _, with_aux = reference(case, 2)
    _, without = reference(case, 2, with_aux=False)
    assert float((with_aux[router] - without[router]).abs().max()) > 1e-4


@pytest.mark.parametrize(("mesh", "plugins", "refused"), [
    ({"pp": 2, "ep": 2}, ("ep",), True),
    ({"pp": 2, "dp_shard": 1, "ep": 2}, ("fsdp2", "ep"), False),
])
def test_split_backward_without_data_parallelism_is_refused(
        mesh: dict[str, int], plugins: tuple[str, ...], refused: bool) -> None:
    """ZBVZeroBubble writes weight gradients itself: EP's gradient hooks (its averaging
    over ep without FSDP2 or HSDP) would never run, so the plan refuses (CP606); with
    FSDP2 it is at parity (the case above)."""
    from composer_par import EP, FSDP2, PP, MeshSpec, MetaInit, ParallelPlan

    plan = ParallelPlan(MeshSpec(**mesh)).use(PP(schedule="ZBVZeroBubble"))
    for name in plugins:
        plan.use({"ep": EP(), "fsdp2": FSDP2()}[name])
    report = plan.use(MetaInit()).validate(world_size=4)
    codes = [f.code for f in report.findings]
    assert codes == (["CP606"] if refused else []), report.format()
    if refused:
        assert "gradient hooks of the ep plugin" in report.findings[0].message
        assert "add fsdp2" in report.findings[0].fix
