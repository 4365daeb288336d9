"""A plan inside Hugging Face accelerate and the Hugging Face Trainer.

On 4 real gloo ranks, FSDP2 x TP (2 x 2) and HSDP x FSDP2 (2 x 2) train a small Hugging
Face LlamaForCausalLM (from config) and the project's Llama for 5 steps through the
adapter and through the plan's own loop (plan.training_step + a torch optimizer):
losses and every rank's full parameters must agree at the fp32 tolerance (they come out
bitwise equal: the same plan runs the same arithmetic). Checkpoints cross between
``accelerator.save_state`` and ``composer_par.checkpoint`` both ways, bitwise, and a
resumed run ends bitwise where the uninterrupted one does. One launch runs every case,
since accelerate and transformers take seconds to import in each rank.

Each conflict of the rule catalog (CP711-CP719) is refused before anything is built.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from composer_par.testing.distributed import run_ranks
from tests import accelerate_workers

# One worker runs the whole module, so its module-scoped (cached) launch runs once.
pytestmark = pytest.mark.xdist_group("accelerate")

RTOL, ATOL = 1.3e-6, 1e-5
PARITY = [("parity", kind, plan) for kind in ("hf", "llama") for plan in ("fsdp2_tp", "hsdp")]
CHECKPOINTS = [("checkpoint", "hf", "fsdp2_tp"), ("checkpoint", "llama", "hsdp")]
TRAINERS = [("trainer", "hf", "fsdp2_tp"), ("trainer", "hf", "hsdp")]
OTHERS = [("cpu_false", "-", "fsdp2_tp")]
METRICS = [("metrics", "llama", plan) for plan in ("fsdp2_tp", "hsdp")]
ITEMS = [("items", "hf", "fsdp2_tp")]


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, ...], list[dict[str, Any]]]:
    """Every case on one 4-rank launch: (case, kind, plan) -> each rank's result."""
    directory = str(tmp_path_factory.mktemp("accelerate"))
    cases = PARITY + CHECKPOINTS + TRAINERS + OTHERS + METRICS + ITEMS
    results = run_ranks(accelerate_workers.run_cases, 4, args=(cases, directory), timeout=600)
    by_case: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for rank_results in results:
        assert len(rank_results) == len(cases)
        for case, result in zip(cases, rank_results, strict=True):
            by_case.setdefault(case, []).append(result)
    return by_case


def _no_error(results: list[dict[str, Any]]) -> None:
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]


# -- parity --------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", PARITY, ids=lambda c: f"{c[1]}-{c[2]}")
def test_adapter_trains_as_the_plain_loop(launch: dict[tuple[str, ...], list[dict[str, Any]]],
                                          case: tuple[str, ...]) -> None:
    import torch

    results = launch[case]
    _no_error(results)
    plan = case[2]
    sizes = {"fsdp2_tp": (1, 2, 2), "hsdp": (2, 2, 1)}[plan]
    shards = {"fsdp2_tp": [(0, 2), (0, 2), (1, 2), (1, 2)],
              "hsdp": [(0, 4), (1, 4), (2, 4), (3, 4)]}[plan]
    for rank, result in enumerate(results):
        assert len(result["losses"]) == accelerate_workers.STEPS
        torch.testing.assert_close(torch.tensor(result["losses"], dtype=torch.float64),
                                   torch.tensor(result["plain_losses"], dtype=torch.float64),
                                   rtol=RTOL, atol=ATOL)
        name, diff = result["worst"]
        assert diff <= ATOL, f"rank {rank}: {name} differs by {diff}"
        # accelerate's config mirrors the plan and holds the plan's own mesh
        assert result["sizes"] == sizes
        assert result["mesh_is_plans"]
        assert result["num_processes"] == 4
        # ranks that differ only in tp read the same samples; accelerate's own split over
        # all processes would not (the control: with TP it hands ranks 1-3 other data)
        assert result["shard"] == shards[rank]
        assert result["own_split_differs"] == (plan == "fsdp2_tp" and rank > 0)
        # prepare adopted the plan's model unwrapped; the optimizer is accelerate's
        assert result["prepared_is_applied"]
        assert result["model_type"].startswith("FSDP")
        assert result["optimizer_wraps"] == "AcceleratedOptimizer"
    # the losses fall, the same on every rank
    assert len({tuple(r["losses"]) for r in results}) == 1


# -- checkpoints ---------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", CHECKPOINTS, ids=lambda c: f"{c[1]}-{c[2]}")
def test_checkpoints_cross_the_adapter_bitwise(
        launch: dict[tuple[str, ...], list[dict[str, Any]]], case: tuple[str, ...]) -> None:
    results = launch[case]
    _no_error(results)
    for result in results:
        assert result["compared"] > 10  # model parameters and AdamW's two moments, step
        assert result["committed"]
        assert result["adapter_to_plain"] == []
        assert result["plain_to_adapter"] == []
        assert result["resume"] == []
        whole, resumed = result["resume_losses"]
        assert whole == resumed and len(whole) == 2
        assert result["extra"] == {"accelerate": {"step": 0, "schedulers": [], "custom": []}}


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_cp711_accelerate_seeing_another_process_count(
        launch: dict[tuple[str, ...], list[dict[str, Any]]]) -> None:
    results = launch[("cpu_false", "-", "fsdp2_tp")]
    _no_error(results)
    for result in results:
        assert result["codes"] == ["CP711"]
        assert "accelerate sees 1 process(es) and the process group has 4 ranks" in (
            result["message"])
        unapplied, foreign = result["refusals"]
        assert "Llama the plan has not applied: apply it first" in unapplied
        assert "no parameter of the plan's model" in foreign and "(4, 4)" in foreign


# -- the Hugging Face Trainer --------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", TRAINERS, ids=lambda c: c[2])
def test_trainer_with_a_plan_trains_as_the_plain_loop(
        launch: dict[tuple[str, ...], list[dict[str, Any]]], case: tuple[str, ...]) -> None:
    import torch

    results = launch[case]
    _no_error(results)
    ranks_per_shard = {"fsdp2_tp": 2, "hsdp": 1}[case[2]]
    for rank, result in enumerate(results):
        assert result["accelerator"] == "PlanAccelerator"
        assert result["tp_size"] == ranks_per_shard
        # the Trainer's logged losses (its token-count normalization over the plan's data
        # shards) and every full parameter equal the plain loop's
        assert len(result["losses"]) == accelerate_workers.STEPS
        torch.testing.assert_close(torch.tensor(result["losses"], dtype=torch.float64),
                                   torch.tensor(result["plain_losses"], dtype=torch.float64),
                                   rtol=RTOL, atol=ATOL)
        name, diff = result["worst"]
        assert diff <= ATOL, f"rank {rank}: {name} differs by {diff}"
        # checkpoint-3 is a composer_par checkpoint: loaded outside the Trainer it holds
        # the plain loop's weights after 3 steps; a resume from it ends where the
        # uninterrupted run ended, bitwise (model and optimizer)
        assert result["checkpoints"] == ["checkpoint-3", "checkpoint-5"]
        name, diff = result["checkpoint_vs_plain"]
        assert diff <= ATOL, f"rank {rank}: {name} differs by {diff}"
        assert result["checkpoint_extra"]["trainer"]["scheduler"]["last_epoch"] == 3
        name, diff = result["plain_into_trainer"]
        assert diff == 0.0, f"rank {rank}: {name} loaded into the Trainer differs by {diff}"
        assert result["resume"] == []
        assert result["resumed_steps"] == accelerate_workers.STEPS
        torch.testing.assert_close(torch.tensor(result["alone_losses"], dtype=torch.float64),
                                   torch.tensor(result["plain_losses"][:2], dtype=torch.float64),
                                   rtol=RTOL, atol=ATOL)
        # save_model outside a checkpoint: safetensors of the full weights, and the config
        name, diff = result["exported"]
        assert diff == 0.0, f"rank {rank}: exported {name} differs by {diff}"
        assert result["exported_config"]


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", METRICS, ids=lambda c: c[2])
def test_gather_for_metrics_returns_each_sample_once(
        launch: dict[tuple[str, ...], list[dict[str, Any]]], case: tuple[str, ...]) -> None:
    """Under TP two ranks read each data shard: every sample is gathered once all the
    same, in order, the last batch's padding dropped, with the loss one process computes."""
    import torch

    results = launch[case]
    _no_error(results)
    samples = list(range(accelerate_workers.EVAL_SAMPLES))
    reference = accelerate_workers.metrics_reference()
    for rank, result in enumerate(results):
        assert sorted(result["indices"]) == samples, f"rank {rank}: {result['indices']}"
        assert result["objects"] == result["indices"], f"rank {rank}"
        order = torch.tensor(result["indices"]).argsort()
        torch.testing.assert_close(result["losses"][order], reference,
                                   rtol=1e-5, atol=1e-5, msg=lambda m, r=rank: f"rank {r}: {m}")


def test_plan_file_on_the_command_line(tmp_path: Any) -> None:
    import transformers

    from composer_par.integrations.hf_trainer import PlanArguments

    path = tmp_path / "plan.toml"
    path.write_text('[mesh]\ndp_shard = 2\ntp = 2\n\n[[plugins]]\nname = "fsdp2"\n\n'
                    '[[plugins]]\nname = "tp"\n', encoding="utf-8")
    parser = transformers.HfArgumentParser((PlanArguments, transformers.TrainingArguments))
    plan_args, training = parser.parse_args_into_dataclasses(
        ["--plan", str(path), "--output_dir", str(tmp_path / "out"), "--use_cpu", "true",
         "--report_to", "none"])
    plan = plan_args.load()
    assert [p.name for p in plan.plugins] == ["fsdp2", "tp"]
    assert plan.mesh.to_dict() == {"dp_shard": 2, "tp": 2}
    assert training.use_cpu
    with pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path)])  # --plan missing


def _trainer_refused(plan: Any, **arguments: Any) -> Any:
    import transformers

    from composer_par.integrations.errors import IntegrationError
    from composer_par.integrations.hf_trainer import PlanTrainer

    args = transformers.TrainingArguments(output_dir="unused", use_cpu=True, report_to="none",
                                          **arguments)
    model = accelerate_workers.build("hf")
    with pytest.raises(IntegrationError) as caught:
        PlanTrainer(plan, model=model, args=args)
    # nothing was built: the model is still on meta, the plan not applied
    assert not plan.applied
    assert all(p.is_meta for p in model.parameters())
    return caught.value


def test_trainer_refuses_what_overlaps_the_plan(clean_env: pytest.MonkeyPatch) -> None:
    from composer_par import ActivationCheckpoint, MeshSpec, ParallelPlan
    from composer_par.integrations.hf_trainer import trainer_findings

    error = _trainer_refused(_plan(ActivationCheckpoint()), activation_checkpointing=True)
    assert error.report.codes() == ["CP712"]
    assert "the plan checkpoints its blocks already" in str(error)
    assert error.trainer == "Trainer"
    assert _trainer_refused(_plan(), torch_compile=True).report.codes() == ["CP713"]
    assert _trainer_refused(_plan(), bf16=True).report.codes() == ["CP717"]
    assert _trainer_refused(_plan(), train_sampling_strategy="batch_rebalance"
                            ).report.codes() == ["CP719"]
    assert "CP711" in _trainer_refused(ParallelPlan(MeshSpec(dp_shard=4))).report.codes()

    class Args:  # the fields a TrainingArguments with fsdp set has, without a launch
        fsdp = ["full_shard"]
        fsdp_config = {"cpu_ram_efficient_loading": "true"}

    codes = [f.code for f in trainer_findings(_plan(), Args())]  # type: ignore[arg-type]
    assert codes == ["CP714", "CP715"]


def test_trainer_refuses_a_plan_that_splits_sequences(clean_env: pytest.MonkeyPatch) -> None:
    """The Trainer calls the model on whole sequences without positions, which a CP plan
    refuses at the first forward: the plan is refused before anything is built instead."""
    import transformers
    from composer_par.plugins.cp import CP

    from composer_par import MeshSpec, MetaInit, ParallelPlan
    from composer_par.integrations.hf_trainer import trainer_findings

    error = _trainer_refused(ParallelPlan(MeshSpec(cp=2)).use(CP()).use(MetaInit()))
    assert "CP720" in error.report.codes()  # with CP711: one process runs this test
    assert "the plan's cp plugin splits every sequence" in str(error)
    assert trainer_findings(ParallelPlan(MeshSpec(cp=1)).use(CP()).use(MetaInit()),
                            transformers.TrainingArguments("unused", use_cpu=True,
                                                           report_to="none"))[0].code == "CP720"
    assert trainer_findings(_plan(), transformers.TrainingArguments(
        "unused", use_cpu=True, report_to="none")) == []


# -- conflicts, refused before anything is built ------------------------------------------


def _plan(*extra: Any) -> Any:
    from composer_par import FSDP2, MeshSpec, MetaInit, ParallelPlan

    plan = ParallelPlan(MeshSpec(dp_shard=1)).use(FSDP2())
    for plugin in extra:
        plan.use(plugin)
    return plan.use(MetaInit())


def _refused(plan: Any, **kwargs: Any) -> Any:
    from composer_par.integrations.accelerate import PlanAccelerator
    from composer_par.integrations.errors import IntegrationError

    with pytest.raises(IntegrationError) as caught:
        PlanAccelerator(plan, **kwargs)
    return caught.value


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING",
                 "ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_MIXED_PRECISION",
                 "ACCELERATE_USE_DEEPSPEED", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_cp711_process_count(clean_env: pytest.MonkeyPatch) -> None:
    from composer_par import FSDP2, MeshSpec, ParallelPlan

    clean_env.setenv("WORLD_SIZE", "2")
    error = _refused(ParallelPlan(MeshSpec(dp_shard=4)).use(FSDP2()))
    assert "CP711" in error.report.codes()
    assert "runs 2 process(es)" in str(error) and "dp_shard(4) = 4 != world_size(2)" in str(error)
    assert error.trainer == "accelerate"


def test_cp712_activation_checkpointing(clean_env: pytest.MonkeyPatch) -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin

    from composer_par import ActivationCheckpoint
    from composer_par.integrations.accelerate import accelerate_findings

    fsdp = FullyShardedDataParallelPlugin(fsdp_version=2, activation_checkpointing=True)
    error = _refused(_plan(ActivationCheckpoint()), fsdp_plugin=fsdp)
    assert {"CP712", "CP714"} <= set(error.report.codes())
    found = [f for f in accelerate_findings(_plan(), {"fsdp_plugin": fsdp}) if f.code == "CP712"]
    assert len(found) == 1 and "outside the apply order" in found[0].message
    assert "ActivationCheckpoint()" in found[0].fix


def test_cp713_compile(clean_env: pytest.MonkeyPatch) -> None:
    error = _refused(_plan(), dynamo_backend="inductor")
    assert error.report.codes() == ["CP713"]
    assert "backend inductor" in str(error) and "Compile()" in str(error)
    clean_env.setenv("ACCELERATE_DYNAMO_BACKEND", "eager")
    assert _refused(_plan()).report.codes() == ["CP713"]


def test_cp714_accelerates_own_sharding(clean_env: pytest.MonkeyPatch) -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin

    error = _refused(_plan(), fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    assert error.report.codes() == ["CP714"]
    assert "an FSDP plugin" in str(error)
    clean_env.setenv("ACCELERATE_USE_FSDP", "true")
    assert _refused(_plan()).report.codes() == ["CP714"]


def test_cp715_cpu_ram_efficient_loading(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
    error = _refused(_plan())
    assert error.report.codes() == ["CP715"]
    assert "tensor-parallel ranks the wrong parts" in str(error)


def test_cp716_context_parallel(clean_env: pytest.MonkeyPatch) -> None:
    from accelerate import ParallelismConfig

    error = _refused(_plan(), parallelism_config=ParallelismConfig(cp_size=2))
    assert "CP716" in error.report.codes()
    assert "context parallelism" in str(error)


def test_cp717_mixed_precision(clean_env: pytest.MonkeyPatch) -> None:
    from composer_par import FSDP2, MeshSpec, MetaInit, ParallelPlan
    from composer_par.integrations.accelerate import accelerate_findings

    error = _refused(_plan(), mixed_precision="bf16")
    assert error.report.codes() == ["CP717"]
    plan = (ParallelPlan(MeshSpec(dp_shard=1))
            .use(FSDP2(mixed_precision={"param_dtype": "bfloat16"})).use(MetaInit()))
    (finding,) = accelerate_findings(plan, {"mixed_precision": "fp16"})
    assert finding.code == "CP717" and "FSDP2 sets its own mixed precision" in finding.message
    assert accelerate_findings(plan, {"mixed_precision": "no"}) == []


def test_cp718_pipeline_plan(clean_env: pytest.MonkeyPatch) -> None:
    from composer_par.plugins.pp import PP

    from composer_par import MeshSpec, MetaInit, ParallelPlan

    clean_env.setenv("WORLD_SIZE", "2")
    error = _refused(ParallelPlan(MeshSpec(pp=2)).use(PP()).use(MetaInit()))
    assert "CP718" in error.report.codes()
    assert "plan.training_step" in str(error)


def test_cp719_dispatch_batches(clean_env: pytest.MonkeyPatch) -> None:
    from accelerate import DataLoaderConfiguration

    error = _refused(_plan(), dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    assert error.report.codes() == ["CP719"]


def test_parallelism_config_mirrors_the_plan() -> None:
    from composer_par import FSDP2, HSDP, TP, MeshSpec, ParallelPlan
    from composer_par.integrations.accelerate import mirrored_sizes, parallelism_config

    # tp outermost, and HSDP x TP without sharding (ParallelismConfig's constructor
    # refuses that layout)
    plan = ParallelPlan(MeshSpec(tp=2, dp_replicate=2)).use(HSDP()).use(TP())
    assert mirrored_sizes(plan, 4) == {"dp_replicate_size": 2, "dp_shard_size": 1, "tp_size": 2}
    mesh = object()
    config = parallelism_config(plan, 4, mesh)
    assert (config.dp_replicate_size, config.dp_shard_size, config.tp_size) == (2, 1, 2)
    assert config.total_size == 4 and config.device_mesh is mesh
    hsdp = ParallelPlan(MeshSpec(dp_replicate=-1, dp_shard=2)).use(HSDP()).use(FSDP2())
    assert mirrored_sizes(hsdp, 8) == {"dp_replicate_size": 4, "dp_shard_size": 2, "tp_size": 1}


def test_a_clean_setting_refuses_nothing(clean_env: pytest.MonkeyPatch) -> None:
    from accelerate import DataLoaderConfiguration

    from composer_par.integrations.accelerate import accelerate_findings, plan_findings

    plan = _plan()
    assert plan_findings(plan, 1, "accelerate") == []
    assert accelerate_findings(plan, {"mixed_precision": "no", "dynamo_backend": "no",
                                      "dataloader_config": DataLoaderConfiguration()}) == []


def test_import_composer_par_and_the_adapters_imports_no_trainer() -> None:
    import subprocess

    # the adapters' modules too: accelerate and transformers come with the first
    # accelerator or trainer made, and lightning never
    code = ("import sys, composer_par, composer_par.integrations, "
            "composer_par.integrations.accelerate, composer_par.integrations.hf_trainer; "
            "print(sorted(m for m in ('accelerate', 'transformers', 'lightning') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.stdout.strip() == "[]"


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_the_example_trains_with_a_plan_file_under_torchrun(tmp_path: Any) -> None:
    import subprocess
    from pathlib import Path

    from composer_par import checkpoint

    plan = tmp_path / "plan.toml"
    plan.write_text('[mesh]\ndp_shard = 1\ntp = 2\n\n[[plugins]]\nname = "fsdp2"\n\n'
                    '[[plugins]]\nname = "tp"\n', encoding="utf-8")
    example = Path(__file__).parent.parent / "examples" / "hf_trainer_plan.py"
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(example), "--plan", str(plan), "--output_dir", str(out), "--max_steps", "3",
         "--save_steps", "2", "--use_cpu", "true", "--report_to", "none", "--hidden_size", "64",
         "--layers", "2", "--seq_len", "16", "--samples", "64", "--disable_tqdm", "true"],
        capture_output=True, text=True, cwd=tmp_path, timeout=280)
    assert result.returncode == 0, result.stderr[-4000:]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-3"]
    assert checkpoint.is_committed(checkpoint.latest(out / "checkpoint-3"))
    assert "'train_loss'" in result.stdout + result.stderr


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_trainer_and_the_item_mean_step_agree_on_unevenly_labelled_batches(
        launch: dict[tuple[str, ...], list[dict[str, Any]]]) -> None:
    """transformers' Trainer divides each rank's summed loss by the labelled tokens
    counted over every process (``num_items_in_batch``) and multiplies it by the process
    count. Under FSDP2 x TP the tp ranks count the same tokens twice, and data
    parallelism averages over dp only, so the two factors cancel: the Trainer trains as
    ``plan.training_step(..., items=...)`` does. Each shard's own mean trains
    otherwise."""
    import torch

    results = launch[ITEMS[0]]
    _no_error(results)
    for rank, result in enumerate(results):
        torch.testing.assert_close(torch.tensor(result["losses"]),
                                   torch.tensor(result["item_losses"]), rtol=RTOL, atol=ATOL)
        name, diff = result["trainer_vs_items"]
        assert diff <= ATOL, f"rank {rank}: {name} differs by {diff}"
        name, diff = result["shard_mean_vs_items"]
        assert diff > 10 * ATOL, f"rank {rank}: each shard's mean trained as the item mean"
