"""Plans and rank-side functions of tests/test_float8.py: float8 (torchao, emulated on
CPU) under FSDP2, TP and EP on real gloo ranks."""

from __future__ import annotations

from typing import Any

from composer_par.testing.parity import ParityCase

LLAMA = "composer_par.testing.tasks:llama"
MOE = "tests.ep_workers:moe_llama_shared"
MIXTRAL = "tests.ep_workers:mixtral"

_MESH = {"tp": {"tp": 2}, "fsdp2": {"dp_shard": 2}, "fsdp2_tp": {"dp_shard": 2, "tp": 2},
         "fsdp2_ep": {"dp_shard": 2, "ep": 2}}
_PLUGINS = {"tp": ("tp",), "fsdp2": ("fsdp2",), "fsdp2_tp": ("fsdp2", "tp"),
            "fsdp2_ep": ("fsdp2", "ep")}


def plan(layout: str, recipe: str, *, ac: bool = False, compile_: bool = False,
         float8: str = "", fsdp2: str = "") -> str:
    """A plan file: ``layout``'s mesh and plugins, activation checkpointing if ``ac``,
    per-block compile (``aot_eager``: dynamo and AOTAutograd trace torchao's tensor
    subclasses, eager kernels) if ``compile_``, float8 with ``recipe`` (and the options
    ``float8`` gives), MetaInit."""
    lines = ["[mesh]", *(f"{k} = {v}" for k, v in _MESH[layout].items()), ""]
    names = list(_PLUGINS[layout]) + (["activation_checkpoint"] if ac else []) + (
        ["compile"] if compile_ else [])
    options = {"fsdp2": [fsdp2] if fsdp2 else [], "compile": ['backend = "aot_eager"']}
    for name in names:
        lines += ["[[plugins]]", f'name = "{name}"', *options.get(name, []), ""]
    lines += ["[[plugins]]", 'name = "float8"', f'recipe = "{recipe}"',
              *([float8] if float8 else []), "", "[[plugins]]", 'name = "meta_init"', ""]
    return "\n".join(lines)


def case(task: str, layout: str, recipe: str, world: int, *, ac: bool = False,
         steps: int = 3, **options: Any) -> ParityCase:
    # "accumulate": the reference runs each rank's micro-batch as that rank does, so the
    # per-tensor scales of activations and gradients (amaxes over a micro-batch) match.
    # The reference applies the plan's convert-stage plugins alone: float8, uncompiled.
    return ParityCase(task, plan(layout, recipe, ac=ac, **options), world, steps=steps,
                      lr=0.5 if task != LLAMA else 0.05, reference="accumulate")


# -- what the converted model looks like on a rank ---------------------------------------


def tp_styles(plan_text: str) -> dict[str, Any]:
    """The classes of the converted layers and of their weights' local tensors after
    apply, and the forward hooks TP installed (float8's styles or torch's)."""
    from composer_par.testing.parity import apply_to_built, build_plan
    from composer_par.testing.tasks import llama

    plan_ = build_plan(plan_text)
    model, _, _ = apply_to_built(llama, plan_)
    wq = model.get_submodule("layers.0.attention.wq")
    # distribute_module wraps each style's input function (a partial) in a lambda.
    hooks = [getattr(cell.cell_contents, "func", cell.cell_contents).__qualname__
             for h in wq._forward_pre_hooks.values() for cell in h.__closure__ or ()
             if callable(cell.cell_contents)]
    return {"layer": type(wq).__name__, "pre_hooks": hooks,
            "placements": [str(p) for p in wq.weight.placements]}


# -- collectives -----------------------------------------------------------------------


def gathered_bytes(plan_text: str, steps: int) -> dict[str, Any]:
    """Train ``steps`` steps through ``plan.training_step``, counting every collective of
    each step (its forward, backward and the scale precompute): the all-gathers over
    dp_shard (bytes, dtypes) and the all-reduces over dp_shard; and the scales' state."""
    import torch
    import torch.distributed as dist
    from composer_par.plugins.float8.scales import scales_of

    from composer_par.models.llama import next_token_loss
    from composer_par.testing.comm_count import CommCounter
    from composer_par.testing.parity import apply_to_built, build_plan
    from composer_par.testing.tasks import llama

    plan_ = build_plan(plan_text)
    model, index, count = apply_to_built(llama, plan_)
    step = plan_.training_step(model, next_token_loss)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    mesh = plan_.mesh.resolve(dist.get_world_size())
    per_step = []
    for i in range(steps):
        batch = llama.batch(i).chunk(count)[index]
        with CommCounter() as counter:
            step.step(batch, batch)
        optimizer.step()
        optimizer.zero_grad()
        calls = [c for c in counter.calls if c.kind in ("all_gather", "all_reduce")]
        per_step.append({
            "all_gather": sum(c.payload_bytes for c in calls if c.kind == "all_gather"),
            "gather_dtypes": sorted({d for c in calls if c.kind == "all_gather"
                                     for d in c.dtypes}),
            "all_reduce": [c.payload_bytes for c in calls if c.kind == "all_reduce"
                           and c.group and len(c.group) == mesh.size("dp_shard")],
            "summary": counter.summary(mesh, dist.get_rank())})
    scales = scales_of(model)
    return {"steps": per_step, "weights": sum(len(s.weights) for s in scales),
            "refreshes": [s.refreshes for s in scales]}


# -- checkpoints ---------------------------------------------------------------------------


def checkpoint_round_trip(plan_text: str, directory: str) -> dict[str, Any]:
    """Train two steps, save through composer_par.checkpoint, load into a fresh model and
    optimizer, train one more step on both; export the weights to safetensors."""
    import torch

    from composer_par import checkpoint
    from composer_par.testing.parity import apply_to_built, build_plan, full_parameters
    from composer_par.testing.tasks import llama

    def fresh() -> tuple[Any, Any, int, int]:
        plan_ = build_plan(plan_text)
        model, index, count = apply_to_built(llama, plan_)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01), index, count

    def train(model: Any, optimizer: Any, step: int, index: int, count: int) -> float:
        batch = llama.batch(step).chunk(count)[index]
        loss = llama.loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss.detach())

    model, optimizer, index, count = fresh()
    for step in range(2):
        train(model, optimizer, step, index, count)
    saved = checkpoint.save(f"{directory}/run", model, optimizer, step=2)
    before = full_parameters(model)
    other, other_optimizer, _, _ = fresh()
    checkpoint.load(saved, other, other_optimizer)
    loaded = full_parameters(other)
    # The optimizer state too: the next step must be the same step on both.
    losses = (train(model, optimizer, 2, index, count),
              train(other, other_optimizer, 2, index, count))
    after = (full_parameters(model), full_parameters(other))
    exported = checkpoint.export_safetensors(other, f"{directory}/export")
    return {"same_loaded": all(torch.equal(before[n], loaded[n]) for n in before),
            "losses": losses,
            "same_after": all(torch.equal(after[0][n], after[1][n]) for n in after[0]),
            "exported": str(exported), "params": after[1]}


# -- a trainer adapter -----------------------------------------------------------------------


def accelerate_and_training_step(plan_text: str, steps: int) -> dict[str, Any]:
    """The same float8 plan trained through the accelerate adapter (the loop accelerate
    users write) and through ``plan.training_step``: each side's losses, whether the
    adapter told the plugins after every optimizer step (the scales pending a refresh),
    and how often each side computed its scales."""
    import torch
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, GradientState
    from composer_par.plugins.float8.scales import scales_of

    from composer_par.integrations.accelerate import prepare_accelerator
    from composer_par.models.llama import next_token_loss
    from composer_par.testing.parity import build_plan
    from composer_par.testing.tasks import llama

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    plan_ = build_plan(plan_text)
    with torch.device("meta"):
        built = llama.build()
    accelerator, model = prepare_accelerator(plan_, built)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    index, count = plan_.data_shard()
    told, losses = [], []
    for step in range(steps):
        batch = llama.batch(step).chunk(count)[index]
        loss = llama.loss(model, batch)
        accelerator.backward(loss)
        optimizer.step()
        told.append(all(s.pending for s in scales_of(model)))
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    adapter = {"losses": losses, "told": told,
               "refreshes": [s.refreshes for s in scales_of(model)]}
    plan_ = build_plan(plan_text)
    with torch.device("meta"):
        built = llama.build()
    model = plan_.apply(built)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    step_ = plan_.training_step(model, next_token_loss)
    losses = []
    for step in range(steps):
        batch = llama.batch(step).chunk(count)[index]
        losses.append(float(step_.step(batch, batch)))
        optimizer.step()
        optimizer.zero_grad()
    return {"adapter": adapter, "training_step": losses}
