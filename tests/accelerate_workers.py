"""Rank-side functions of tests/test_integration_accelerate.py: one plan trained through
the accelerate adapter (and the Hugging Face Trainer) and with the plain loop
(``plan.training_step`` + a torch optimizer), side by side on the same ranks.

accelerate and transformers import slowly: one launch runs every case of a test in
sequence on one process group. Each case builds its plan afresh (a plan is applied once)
and resets accelerate's process-wide state, as a new process would find it.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

from tests import hf_workers

STEPS = 5
LR = 0.05
MAX_NORM = 0.5  # small enough that clipping acts on every step
GLOBAL_BATCH = 8
SEED = 7


# -- plans and models -------------------------------------------------------------------


def make_plan(name: str) -> Any:
    from composer_par import FSDP2, HSDP, TP, MeshSpec, MetaInit, ParallelPlan

    init = MetaInit(seed=SEED)
    if name == "fsdp2_tp":
        return ParallelPlan(MeshSpec(dp_shard=2, tp=2)).use(FSDP2()).use(TP()).use(init)
    if name == "hsdp":
        return (ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=2)).use(HSDP()).use(FSDP2())
                .use(init))
    raise ValueError(name)


def build(kind: str) -> Any:
    """A model on meta: Hugging Face's LlamaForCausalLM from a tiny config, or the
    project's Llama."""
    import torch

    if kind == "hf":
        return hf_workers.build("llama")
    from composer_par.testing.tasks import LlamaTask

    with torch.device("meta"):
        return LlamaTask().build()


def global_batch(kind: str, step: int) -> Any:
    """The global batch of ``step``: token ids, the same on every rank."""
    if kind == "hf":
        return hf_workers.batch("llama", step, size=GLOBAL_BATCH)["input_ids"]
    from composer_par.testing.tasks import LlamaTask

    return LlamaTask(global_batch=GLOBAL_BATCH).batch(step)


def loss_of(kind: str, model: Any, ids: Any) -> Any:
    if kind == "hf":
        return model(input_ids=ids, labels=ids).loss
    from composer_par.models.llama import next_token_loss

    return next_token_loss(model(ids), ids)


def _loss_fn(kind: str) -> Any:
    """``loss_fn(outputs, targets)`` of plan.training_step for the model kind."""
    if kind == "hf":
        return lambda outputs, _ids: outputs.loss
    from composer_par.models.llama import next_token_loss

    return next_token_loss


class Rows:
    """The samples of every global batch, in order: accelerate's loader over them with
    the per-shard batch size hands shard ``index`` of ``count`` the ``index``-th chunk of
    each global batch (every ``count``-th batch from the ``index``-th)."""

    def __init__(self, kind: str, steps: int) -> None:
        import torch

        self.rows = torch.cat([global_batch(kind, s) for s in range(steps)])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Any:
        return self.rows[i]


def _fresh_accelerate_state() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _optimizer(name: str, params: Any) -> Any:
    import torch

    if name == "adamw":
        return torch.optim.AdamW(params, lr=LR / 10)
    return torch.optim.SGD(params, lr=LR)


# -- the two loops ------------------------------------------------------------------------


def plain_loop(kind: str, plan_name: str, steps: int = STEPS, optim: str = "sgd"
               ) -> tuple[Any, Any, list[float]]:
    """The plan trained with its own loop: ``plan.training_step`` and a torch optimizer."""
    plan = make_plan(plan_name)
    model = plan.apply(build(kind))
    model.train()
    optimizer = _optimizer(optim, model.parameters())
    step = plan.training_step(model, _loss_fn(kind))
    index, count = plan.data_shard()
    losses = []
    for s in range(steps):
        ids = global_batch(kind, s).chunk(count)[index]
        if kind == "hf":
            loss = step.step((), ids, input_ids=ids, labels=ids)
        else:
            loss = step.step(ids, ids)
        step.clip_grad_norm_(MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return model, optimizer, losses


def adapter_loop(kind: str, plan_name: str, steps: int = STEPS, optim: str = "sgd",
                 skip: int = 0, state: str | None = None, save: str | None = None
                 ) -> tuple[Any, Any, list[float], Any]:
    """The same plan through the accelerate adapter, the loop as accelerate users write
    it. ``state`` loads a checkpoint before training; ``save`` saves one after; ``skip``
    batches already trained are skipped."""
    import torch
    import torch.distributed as dist

    from composer_par.integrations.accelerate import prepare_accelerator

    _fresh_accelerate_state()
    plan = make_plan(plan_name)
    accelerator, model = prepare_accelerator(plan, build(kind))
    model.train()
    optimizer = _optimizer(optim, model.parameters())
    _, count = plan.data_shard()
    loader = torch.utils.data.DataLoader(Rows(kind, STEPS), batch_size=GLOBAL_BATCH // count)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if state is not None:
        accelerator.load_state(state)
    if skip:
        loader = accelerator.skip_first_batches(loader, skip)
    losses = []
    for s, ids in enumerate(loader):
        if s >= steps:
            break
        loss = loss_of(kind, model, ids)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    if save is not None:
        accelerator.save_state(save)
    return model, optimizer, losses, accelerator


# -- comparisons --------------------------------------------------------------------------


def _full(model: Any) -> dict[str, Any]:
    from composer_par.testing.parity import full_parameters

    return full_parameters(model)


def _largest_difference(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, float]:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    worst = ("", 0.0)
    for name in a:
        diff = float((a[name] - b[name]).abs().max())
        if diff > worst[1] or not worst[0]:
            worst = (name, diff)
    return worst


def _local_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """Every rank's own tensors of the model and the optimizer state, by name."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    inner = getattr(optimizer, "optimizer", optimizer)
    msd, osd = get_state_dict(model, inner)
    out = {}
    for name, value in msd.items():
        out[f"model.{name}"] = value
    for name, entry in osd["state"].items():
        for key, value in entry.items():
            out[f"optim.{name}.{key}"] = value
    return {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in out.items() if isinstance(v, torch.Tensor)}


def _bitwise(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Names whose tensors differ in any bit (or are missing on one side)."""
    import torch

    differ = sorted(set(a) ^ set(b))
    differ += [k for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]
    return differ


# -- rank-side cases ---------------------------------------------------------------------


def parity_case(kind: str, plan_name: str) -> dict[str, Any]:
    """Losses and every rank's full parameters after STEPS steps, adapter vs plain loop;
    also what accelerate was told about the layout."""
    import torch.distributed as dist

    plain, _, plain_losses = plain_loop(kind, plan_name)
    plain_params = _full(plain)
    model, optimizer, losses, accelerator = adapter_loop(kind, plan_name)
    params = _full(model)
    config = accelerator.parallelism_config
    index, count = accelerator.plan.data_shard()
    # The control: accelerate's own split over all processes would give this rank
    import torch
    from accelerate.data_loader import prepare_data_loader

    own = prepare_data_loader(
        torch.utils.data.DataLoader(Rows(kind, STEPS), batch_size=GLOBAL_BATCH // count),
        put_on_device=False, num_processes=dist.get_world_size(),
        process_index=dist.get_rank())
    first = next(iter(own))
    return {
        "rank": dist.get_rank(), "kind": kind, "plan": plan_name,
        "losses": losses, "plain_losses": plain_losses,
        "worst": _largest_difference(params, plain_params),
        "bitwise": not _bitwise(params, plain_params),
        "sizes": (config.dp_replicate_size, config.dp_shard_size, config.tp_size),
        "mesh_is_plans": accelerator.torch_device_mesh is accelerator.plan._device_mesh,
        "mesh_names": tuple(accelerator.torch_device_mesh.mesh_dim_names),
        "shard": (index, count), "num_processes": accelerator.num_processes,
        "optimizer_wraps": type(optimizer).__name__,
        "model_type": type(model).__name__,
        "prepared_is_applied": model is accelerator._plan_models[0],
        "own_split_differs": not torch.equal(first, global_batch(kind, 0).chunk(count)[index]),
    }


def checkpoint_case(kind: str, plan_name: str, directory: str) -> dict[str, Any]:
    """save_state loads with composer_par.checkpoint.load outside accelerate, and
    checkpoint.save loads with load_state, bitwise (model and AdamW state); a run resumed
    through the adapter ends bitwise where the uninterrupted run ends."""
    from composer_par import checkpoint

    out: dict[str, Any] = {"kind": kind, "plan": plan_name}
    first = os.path.join(directory, f"{kind}-{plan_name}-adapter")
    # 1. through the adapter for 3 steps, save_state; load outside, bitwise
    model, optimizer, _, _ = adapter_loop(kind, plan_name, steps=3, optim="adamw", save=first)
    saved = _local_state(model, optimizer)
    plain, plain_opt, _ = plain_loop(kind, plan_name, steps=1, optim="adamw")
    info = checkpoint.load(first, plain, plain_opt)
    out["adapter_to_plain"] = _bitwise(saved, _local_state(plain, plain_opt))
    out["compared"] = len(saved)
    out["extra"] = info.extra
    out["committed"] = checkpoint.is_committed(info.path)
    # 2. the plain loop's checkpoint.save into load_state, bitwise
    second = os.path.join(directory, f"{kind}-{plan_name}-plain")
    plain, plain_opt, _ = plain_loop(kind, plan_name, steps=2, optim="adamw")
    checkpoint.save(second, plain, plain_opt, plan=make_plan(plan_name))
    expected = _local_state(plain, plain_opt)
    model, optimizer, _, _ = adapter_loop(kind, plan_name, steps=0, optim="adamw",
                                          state=second)
    out["plain_to_adapter"] = _bitwise(expected, _local_state(model, optimizer))
    # 3. resume: 3 steps, save, a fresh accelerator loads and trains 2 more
    whole, whole_opt, whole_losses, _ = adapter_loop(kind, plan_name, steps=5, optim="adamw")
    resumed, resumed_opt, tail, _ = adapter_loop(kind, plan_name, steps=2, optim="adamw",
                                                 skip=3, state=first)
    out["resume"] = _bitwise(_local_state(whole, whole_opt), _local_state(resumed, resumed_opt))
    out["resume_losses"] = (whole_losses[3:], tail)
    return out


# -- evaluation ---------------------------------------------------------------------------

EVAL_SAMPLES = 9  # with 2 per shard and batch: the last global batch is short, then padded


class Indexed:
    """``(index, row)`` of the first ``EVAL_SAMPLES`` rows of :class:`Rows`."""

    def __init__(self, kind: str) -> None:
        self.rows = Rows(kind, 2).rows[:EVAL_SAMPLES]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Any:
        return i, self.rows[i]


def _per_sample_loss(logits: Any, ids: Any) -> Any:
    import torch.nn.functional as F

    flat = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                           ids[:, 1:].reshape(-1), reduction="none")
    return flat.view(ids.shape[0], -1).mean(dim=1)


def metrics_case(plan_name: str) -> dict[str, Any]:
    """Evaluation through the adapter: each batch's sample indices and per-sample losses
    gathered with ``gather_for_metrics`` (tensors, and the indices as objects too)."""
    import torch

    from composer_par.integrations.accelerate import prepare_accelerator

    _fresh_accelerate_state()
    plan = make_plan(plan_name)
    accelerator, model = prepare_accelerator(plan, build("llama"))
    model.eval()
    loader = accelerator.prepare(torch.utils.data.DataLoader(Indexed("llama"), batch_size=2))
    indices: list[int] = []
    objects: list[int] = []
    losses: list[Any] = []
    with torch.no_grad():
        for index, ids in loader:
            indices += accelerator.gather_for_metrics(index).tolist()
            objects += accelerator.gather_for_metrics(index.tolist(), use_gather_object=True)
            losses.append(accelerator.gather_for_metrics(_per_sample_loss(model(ids), ids)))
    return {"case": "metrics", "indices": indices, "objects": objects,
            "losses": torch.cat(losses)}


def metrics_reference() -> Any:
    """Every sample's loss of :func:`metrics_case`, from the plan's initial weights in
    one process (MetaInit is layout invariant)."""
    import torch

    from composer_par import MeshSpec, MetaInit, ParallelPlan

    model = ParallelPlan(MeshSpec()).use(MetaInit(seed=SEED)).apply(build("llama"))
    rows = Indexed("llama").rows
    with torch.no_grad():
        return _per_sample_loss(model(rows), rows)


def run_cases(cases: list[tuple[str, ...]], directory: str | None = None
              ) -> list[dict[str, Any]]:
    """Each (case, kind, plan) on this rank, in order; an error is returned, not raised,
    so that one failing case does not hide the others."""
    results = []
    for case, kind, plan_name in cases:
        try:
            if case == "parity":
                results.append(parity_case(kind, plan_name))
            elif case == "checkpoint":
                assert directory is not None
                results.append(checkpoint_case(kind, plan_name, directory))
            elif case == "cpu_false":
                results.append(cpu_false_case(plan_name))
            elif case == "trainer":
                results.append(trainer_case(kind, plan_name, directory or "."))
            elif case == "metrics":
                results.append(metrics_case(plan_name))
            elif case == "items":
                results.append(items_case(plan_name, directory or "."))
            else:
                raise ValueError(case)
        except Exception:
            results.append({"case": case, "kind": kind, "plan": plan_name,
                            "error": traceback.format_exc()[-4000:]})
    return results


def cpu_false_case(plan_name: str) -> dict[str, Any]:
    """On CPU ranks, an Accelerator told cpu=False sees one process (no backend): the
    adapter refuses it (CP711) once accelerate's state says so."""
    import torch

    from composer_par.integrations.accelerate import PlanAccelerator
    from composer_par.integrations.errors import IntegrationError

    out: dict[str, Any] = {"case": "cpu_false", "codes": []}
    _fresh_accelerate_state()
    try:
        PlanAccelerator(make_plan(plan_name), cpu=False)
    except IntegrationError as exc:
        out.update(codes=sorted(exc.report.codes()), message=str(exc))
    _fresh_accelerate_state()
    # prepare takes only the plan's model, and an optimizer on its parameters
    accelerator = PlanAccelerator(make_plan(plan_name))
    model = accelerator.apply(build("llama"))
    refusals = []
    other = torch.nn.Linear(4, 4)
    for args in ((build("llama"),), (model, torch.optim.SGD(other.parameters(), lr=0.1))):
        try:
            accelerator.prepare(*args)
        except ValueError as exc:
            refusals.append(str(exc))
    out["refusals"] = refusals
    _fresh_accelerate_state()
    return out


class DictRows(Rows):
    """The same samples as the Trainer's dataset: ``input_ids`` and ``labels``."""

    def __getitem__(self, i: int) -> Any:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class Losses:
    """A Trainer callback keeping every logged training loss."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def __call__(self) -> Any:
        import transformers

        owner = self

        class Keep(transformers.TrainerCallback):  # type: ignore[misc]
            def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
                       **kwargs: Any) -> None:
                if logs and "loss" in logs:
                    owner.losses.append(float(logs["loss"]))

        return Keep()


def _trainer(plan_name: str, directory: str, steps: int, save_steps: int | None = None,
             **arguments: Any) -> tuple[Any, Losses]:
    import torch
    import transformers

    from composer_par.integrations.hf_trainer import PlanTrainer

    _fresh_accelerate_state()
    plan = make_plan(plan_name)
    _, count = plan.data_shard(0, 4)
    args = transformers.TrainingArguments(
        output_dir=directory, use_cpu=True, max_steps=steps,
        per_device_train_batch_size=GLOBAL_BATCH // count, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=MAX_NORM, train_sampling_strategy="sequential", logging_steps=1,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        report_to="none", disable_tqdm=True, seed=SEED, dataloader_num_workers=0,
        **arguments)
    losses = Losses()
    trainer = PlanTrainer(plan, model=build("hf"), args=args,
                          train_dataset=DictRows("hf", STEPS),
                          optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": LR}),
                          callbacks=[losses()])
    return trainer, losses


def _read_safetensors(directory: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(directory, name)))
    return {k: v.float() for k, v in tensors.items()}


def trainer_case(kind: str, plan_name: str, directory: str) -> dict[str, Any]:
    """The Hugging Face Trainer with a plan, 5 steps, against the plain loop; its
    checkpoint-3 loads with composer_par.checkpoint.load outside it (and the plain loop's
    checkpoint into a Trainer's model), and a Trainer resumed from it ends bitwise where
    the uninterrupted Trainer ends."""
    import torch.distributed as dist

    from composer_par import checkpoint

    assert kind == "hf"
    plain, _, plain_losses = plain_loop("hf", plan_name)
    plain_params = _full(plain)
    out_dir = os.path.join(directory, f"trainer-{plan_name}")
    trainer, losses = _trainer(plan_name, out_dir, STEPS, save_steps=3)
    trainer.train()
    params = _full(trainer.model)
    result: dict[str, Any] = {
        "rank": dist.get_rank(), "losses": losses.losses, "plain_losses": plain_losses,
        "worst": _largest_difference(params, plain_params),
        "accelerator": type(trainer.accelerator).__name__,
        "tp_size": trainer.get_tp_size(),
        "checkpoints": sorted(os.listdir(out_dir)),
    }
    # checkpoint-3 outside the Trainer: the plain loop's 3 steps, bitwise
    three, _, _ = plain_loop("hf", plan_name, steps=3)
    fresh, _, _ = plain_loop("hf", plan_name, steps=0)
    # (the model alone: the Trainer's optimizer has its own parameter groups)
    info = checkpoint.load(os.path.join(out_dir, "checkpoint-3"), fresh)
    result["checkpoint_vs_plain"] = _largest_difference(_full(fresh), _full(three))
    result["checkpoint_extra"] = info.extra
    # and the other way: the plain loop's checkpoint.save loaded into a Trainer's model
    # (applied when the Trainer was made), bitwise
    from_plain = os.path.join(directory, f"plain-{plan_name}")
    checkpoint.save(from_plain, three, step=3)
    into, _ = _trainer(plan_name, out_dir + "-from-plain", STEPS)
    checkpoint.load(from_plain, into.model)
    result["plain_into_trainer"] = _largest_difference(_full(into.model), _full(three))
    # resume from checkpoint-3: ends where the uninterrupted Trainer ended
    final = _local_state(trainer.model, trainer.optimizer)
    resumed, _ = _trainer(plan_name, out_dir + "-resumed", STEPS)
    resumed.train(resume_from_checkpoint=os.path.join(out_dir, "checkpoint-3"))
    result["resume"] = _bitwise(final, _local_state(resumed.model, resumed.optimizer))
    result["resumed_steps"] = resumed.state.global_step
    # tokens counted on each rank alone (average_tokens_across_devices=False): the same
    # losses
    alone, alone_losses = _trainer(plan_name, out_dir + "-alone", 2,
                                   average_tokens_across_devices=False)
    alone.train()
    result["alone_losses"] = alone_losses.losses
    # save_model: Hugging Face safetensors, each rank writing its parts, and the config
    exported = os.path.join(out_dir, "exported")
    trainer.save_model(exported)
    dist.barrier()
    result["exported"] = _largest_difference(_read_safetensors(exported), _full(trainer.model))
    result["exported_config"] = os.path.isfile(os.path.join(exported, "config.json"))
    _fresh_accelerate_state()
    return result


# -- labels ignored unevenly --------------------------------------------------------------

ITEM_STEPS = 3


def masked_labels(ids: Any, step: int) -> Any:
    """``ids`` as labels with a different number of leading places ignored (-100) in each
    sample, by its place in the global batch and the step: the data shards' batches hold
    unevenly many labelled tokens."""
    labels = ids.clone()
    for row in range(ids.shape[0]):
        labels[row, : (row + step) * 3 % (ids.shape[1] - 2)] = -100
    return labels


class MaskedRows(Rows):
    """The Trainer's samples with :func:`masked_labels`."""

    def __init__(self) -> None:
        import torch

        self.rows = torch.cat([global_batch("hf", s) for s in range(ITEM_STEPS)])
        self.labels = torch.cat([masked_labels(global_batch("hf", s), s)
                                 for s in range(ITEM_STEPS)])

    def __getitem__(self, i: int) -> Any:
        return {"input_ids": self.rows[i], "labels": self.labels[i]}


def _masked_loop(plan_name: str, items: bool) -> tuple[Any, list[float]]:
    """The plain loop on :class:`MaskedRows`: with ``items``, the summed loss over the
    labelled tokens of the global batch; without, the model's own loss, each data
    shard's mean."""
    from composer_par.item_mean import cross_entropy_sum, labelled_tokens

    plan = make_plan(plan_name)
    model = plan.apply(build("hf"))
    model.train()
    optimizer = _optimizer("sgd", model.parameters())
    if items:
        step = plan.training_step(
            model, lambda out, labels: cross_entropy_sum(out.logits[:, :-1], labels[:, 1:]),
            items=lambda labels: labelled_tokens(labels[:, 1:]))
    else:
        step = plan.training_step(model, lambda out, _labels: out.loss)
    index, count = plan.data_shard()
    losses = []
    for s in range(ITEM_STEPS):
        ids = global_batch("hf", s)
        labels = masked_labels(ids, s).chunk(count)[index]
        ids = ids.chunk(count)[index]
        kwargs = {} if items else {"labels": labels}
        losses.append(float(step.step((), labels, input_ids=ids, **kwargs)))
        step.clip_grad_norm_(MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    return model, losses


def items_case(plan_name: str, directory: str) -> dict[str, Any]:
    """The Trainer (its loss over the items of the global batch, transformers'
    ``num_items_in_batch``) and the plain loop with ``items`` on unevenly labelled
    batches, and the plain loop with each shard's mean beside them."""
    trainer, losses = _trainer(plan_name, os.path.join(directory, f"items-{plan_name}"),
                               ITEM_STEPS)
    trainer.train_dataset = MaskedRows()
    trainer.train()
    theirs = _full(trainer.model)
    _fresh_accelerate_state()
    with_items, item_losses = _masked_loop(plan_name, items=True)
    shard_mean, _ = _masked_loop(plan_name, items=False)
    ours = _full(with_items)
    return {"losses": losses.losses, "item_losses": item_losses,
            "trainer_vs_items": _largest_difference(theirs, ours),
            "shard_mean_vs_items": _largest_difference(_full(shard_mean), ours)}
