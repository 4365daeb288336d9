"""What can be wrong with a float8 plan: the rule catalog (:data:`RULES`, CP961-CP969)
and the checks, static (no torch) and model-aware."""

from __future__ import annotations

from typing import TYPE_CHECKING

from composer_par.plugin import Finding, Rule, Severity

if TYPE_CHECKING:
    from .selection import Choice

_FSDP_PLAN = ('[mesh]\ndp_shard = 2\n\n[[plugins]]\nname = "fsdp2"\n\n[[plugins]]\n'
              'name = "float8"\n')

RULES = (
    Rule("CP961", Severity.ERROR, "a layer float8 is asked to convert has a dim not "
         "divisible by 16",
         "leave the layer out of modules (float8 matmuls need every dim divisible by 16), "
         "or pad its features to a multiple of 16",
         'ParallelPlan(MeshSpec()).use(Float8(modules=("proj",))).use(MetaInit())'
         '.validate(model_whose_proj_is_Linear_20_to_30)'),
    Rule("CP962", Severity.ERROR, "float8 all-gather without FSDP2",
         "use FSDP2 (it shards the weights whose all-gather float8 shrinks), or set "
         "all_gather = \"auto\"",
         '[mesh]\ndp_replicate = 2\n\n[[plugins]]\nname = "hsdp"\n\n[[plugins]]\n'
         'name = "float8"\nall_gather = "float8"\n'),
    Rule("CP963", Severity.ERROR, "float8 all-gather with a recipe that scales weights per "
         "row",
         "use recipe = \"tensorwise\" for float8 all-gathers, or all_gather = \"auto\" (a "
         "rowwise recipe gathers its weights in high precision)",
         _FSDP_PLAN + 'recipe = "rowwise"\nall_gather = "float8"\n'),
    Rule("CP964", Severity.ERROR, "float8 all-gather with a custom all-gather comm hook",
         "set all_gather = \"high_precision\" on the float8 plugin, or drop the all-gather "
         "comm hook on the shard dim",
         "ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(Float8())"
         ".use(PluginHookingTheDpShardAllGather())"),
    Rule("CP965", Severity.WARNING, "float8 on CUDA without compile",
         "add the compile plugin: float8's casts and scales are separate kernels in eager "
         "mode, and run slower than bf16 without inductor fusing them",
         "ParallelPlan(MeshSpec(dp_shard=8)).use(FSDP2()).use(Float8()).use(MetaInit())"
         ".apply(model)  # on H100 ranks"),
    Rule("CP966", Severity.ERROR, "the device cannot run float8 matmuls",
         "run on NVIDIA SM89 or newer (Ada, Hopper, Blackwell) or AMD MI300, or set "
         "emulate = true (float8 numerics in high precision: slower than bf16, for tests)",
         "ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(Float8(emulate=False))"
         ".use(MetaInit()).apply(model)  # on ranks with CPUs or A100s"),
    Rule("CP967", Severity.ERROR, "float8 needs torchao, which is not installed",
         "pip install 'composer-par[float8]' (torchao >= 0.18)",
         "ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(Float8()).validate()"
         "  # with torchao not installed"),
    Rule("CP968", Severity.WARNING, "a modules pattern of float8 names no Linear layer",
         "correct the pattern (module paths, '*' for one path component, e.g. "
         "\"layers.*.attention.wq\"), or drop it",
         'ParallelPlan(MeshSpec()).use(Float8(modules=("layers.*.atention.*",)))'
         '.use(MetaInit()).validate(llama)'),
    Rule("CP969", Severity.INFO, "float8 leaves Linear layers in high precision",
         "nothing to fix: the message names each layer and why; convert_ends = true "
         "converts the model's first and last layers too, modules names layers to convert",
         "ParallelPlan(MeshSpec()).use(Float8()).use(MetaInit()).validate(llama)"),
)

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def gather_findings(recipe: str, all_gather: str, sharded: list[str],
                    hooked: list[str]) -> list[Finding]:
    """CP962, CP963, CP964: float8 all-gather asked where it cannot run. ``sharded``: the
    dims a data-parallel plugin shards over; ``hooked``: those with a custom all-gather."""
    out = []
    if all_gather == "float8" and recipe != "tensorwise":
        out.append(Finding(
            "CP963", f"all_gather = \"float8\" with recipe = {recipe!r}: torchao gathers "
            "only weights scaled per tensor in float8 (a row's scale needs the whole row, "
            "which a shard does not hold)",
            fix="use recipe = \"tensorwise\", or all_gather = \"auto\" to gather this "
            "recipe's weights in high precision"))
    if all_gather == "float8" and not sharded:
        out.append(Finding(
            "CP962", "all_gather = \"float8\", but no plugin of the plan shards the weights "
            "(FSDP2): there is no all-gather to run in float8",
            fix="add FSDP2, or set all_gather = \"auto\""))
    if all_gather != "high_precision" and recipe == "tensorwise" and hooked:
        out.append(Finding(
            "CP964", f"float8 all-gather over {', '.join(hooked)}, whose all-gather a comm "
            "hook replaces: the hook would be handed the weights' float8 bytes (uint8) and "
            "scales in place of their high-precision values",
            fix="set all_gather = \"high_precision\" on the float8 plugin, or drop the "
            "all-gather comm hook"))
    return out


def choice_findings(choice: Choice) -> list[Finding]:
    """CP961 (asked layers float8 cannot take), CP968 (patterns naming nothing) and
    CP969 (every layer left in high precision, with its reason)."""
    out = [Finding(
        "CP961", f"modules names {path} (in {fan_in} x out {fan_out}): float8 matmuls need "
        "every dim divisible by 16", fix=f"leave {path} out of modules, or pad its features "
        "to multiples of 16") for path, fan_in, fan_out in choice.misfits]
    out += [Finding("CP968", f"modules pattern {pattern!r} names no Linear layer of the model",
                    fix="correct it (module paths, '*' for one path component), or drop it")
            for pattern in choice.unmatched]
    if choice.left_out:
        listed = "; ".join(f"{path}: {why}" for path, why in choice.left_out)
        out.append(Finding(
            "CP969", f"{len(choice.converted)} Linear layer(s) convert to float8; "
            f"{len(choice.left_out)} stay in high precision: {listed}",
            fix="nothing to fix; convert_ends = true converts the model's first and last "
            "layers, modules names the layers to convert"))
    return out


def device_findings(device: object, hardware: bool, described: str, emulate: str | bool,
                    compiled: bool) -> list[Finding]:
    """CP966 (the non-emulated path where the device has no float8 matmuls) and CP965
    (float8 on CUDA in eager mode)."""
    kind = getattr(device, "type", str(device))
    real = emulate is False or (emulate == "auto" and kind == "cuda")
    if real and not hardware:
        return [Finding(
            "CP966", f"float8 matmuls in hardware on {described}: it has none (NVIDIA needs "
            "SM89 or newer, AMD MI300)",
            fix="run on SM89+ GPUs, or set emulate = true (float8 numerics computed in high "
            "precision: correct, slower than bf16)")]
    if kind == "cuda" and real and not compiled:
        return [Finding(
            "CP965", f"float8 on {described} without compile: in eager mode every cast, "
            "amax and scale is a kernel of its own, and the step runs slower than bf16",
            fix="add the compile plugin (per-block torch.compile fuses them)")]
    return []


__all__ = ["RECIPES", "RULES", "choice_findings", "device_findings", "gather_findings"]
