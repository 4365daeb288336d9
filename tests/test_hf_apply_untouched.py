"""``apply`` leaves the model untouched on every failure validation can find: for each
error code of the rule catalog (the core's and every installed plugin's; the trainer
integrations' CP7xx, refused when a trainer is built, aside), a plan that
gives it is applied to a real Hugging Face model; ``apply`` raises PlanError naming the
code, and the model's parameters and buffers (the same tensors, bitwise the same values),
its module tree (the same modules, of the same types, with the same attributes and
hooks) and its attributes (``config``, ``_tp_plan``, ``_pp_plan``, ``_fsdp_plan``...)
are as they were. A code validation cannot give (a plan file's, a training step's) says
why instead; a new error code with neither fails the test.

Plans run over torch's fake process group of the world size they need (one process):
validation needs no peers, and a plan that got past it would run its stages there.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch.nn as nn  # noqa: E402

from composer_par import (  # noqa: E402
    FSDP2,
    HSDP,
    TP,
    ActivationCheckpoint,
    Compile,
    Float8,
    LoadCheckpoint,
    LoadSafetensors,
    MeshSpec,
    MetaInit,
    ParallelPlan,
    PlanError,
)
from composer_par.findings import Severity  # noqa: E402
from composer_par.plugin import Plugin, hookimpl  # noqa: E402
from composer_par.rules import catalogs  # noqa: E402
from composer_par.topology import Topology  # noqa: E402
from tests import hf_workers  # noqa: E402
from tests.comm_hook_workers import PlainAllReduce, PlainShardComms  # noqa: E402

World = Callable[[int], None]
Case = Callable[[Path, World], tuple[ParallelPlan, nn.Module]]
CASES: dict[str, Case] = {}

# Error codes no plan applied to a model can give, and why.
ELSEWHERE = {
    "CP501": "a plan file that cannot be read: there is no plan to apply",
    "CP502": "a plan file that is not TOML: there is no plan to apply",
    "CP503": "a plan file's unknown key: reading the file refuses it",
    "CP504": "a plan file's unknown plugin name: reading the file refuses it",
    "CP505": "a plan file's unknown plugin option: reading the file refuses it",
    "CP506": "a plan file's value of the wrong type: reading the file refuses it",
    "CP434": "a gradient's missing reduction, found by running a step (dry run, selfcheck)",
    "CP604": "a pipeline training step's batch, known only when the step runs",
    "CP612": "a stage's hidden state, known when the pipeline runs its first step",
    "CP901": "a source config composer-par import cannot read: no plan is made",
    "CP902": "a source config's value its own tool refuses: no plan is made",
    "CP913": "a source config whose layout needs a node count: no plan is made",
    "CP955": "an optimizer offload cannot stream: known when it is wrapped, after apply",
    **{code: "composer-par launch refuses to write the job: no plan is applied"
       for code in ("CP981", "CP982", "CP983", "CP984", "CP985")},
}

# The allocation a job got, as its launcher and scheduler say it (the cases of the check
# at the start of apply, CP306-CP309).
ALLOCATIONS = {
    "CP306": {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "COMPOSER_PAR_TOPOLOGY": "1x2"},
    "CP308": {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "3"},
    "CP309": {"SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
              "SLURM_PROCID": "1", "SLURM_NODEID": "0"},
}


def case(code: str) -> Callable[[Case], Case]:
    def register(fn: Case) -> Case:
        assert code not in CASES, code
        CASES[code] = fn
        return fn
    return register


def llama(**overrides: Any) -> nn.Module:
    return hf_workers.build("llama", meta=False, **overrides)


# -- plugins of the cases' own ------------------------------------------------------------


@attrs.frozen
class NeedsDataParallel(Plugin):
    name: ClassVar[str] = "needs_data_parallel"
    requires: ClassVar[frozenset[str]] = frozenset({"data_parallel"})


@attrs.frozen
class Misspelled(Plugin):
    name: ClassVar[str] = "misspelled"

    @hookimpl
    def composer_par_materialise(self, ctx: Any) -> None:  # no such hook
        raise AssertionError("never called")


@attrs.frozen
class OtherAllReduce(PlainAllReduce):
    name: ClassVar[str] = "other_all_reduce"


# -- the cases: mesh and topology ---------------------------------------------------------


@case("CP101")
def _cp101(tmp: Path, world: World) -> Any:
    world(4)
    return ParallelPlan(MeshSpec(dp_shard=8)).use(FSDP2()), llama()


@case("CP102")
def _cp102(tmp: Path, world: World) -> Any:
    world(8)
    topology = Topology(nodes=2, devices_per_node=8)
    return ParallelPlan(MeshSpec(dp_shard=8), topology=topology).use(FSDP2()), llama()


@case("CP201")
def _cp201(tmp: Path, world: World) -> Any:
    world(4)
    return ParallelPlan(MeshSpec(dp_shard=2, tp=2)).use(FSDP2()), llama()


@case("CP202")
def _cp202(tmp: Path, world: World) -> Any:
    world(2)
    return ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(HSDP(dim="dp_shard")), llama()


@case("CP203")
def _cp203(tmp: Path, world: World) -> Any:
    world(2)
    return ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2(dim="dp_shrad")), llama()


@case("CP204")
def _cp204(tmp: Path, world: World) -> Any:
    world(2)
    plan = ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(FSDP2(reshard_after_forward=True))
    return plan, llama()


@case("CP205")
def _cp205(tmp: Path, world: World) -> Any:
    world(2)
    plan = (ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2())
            .use(ActivationCheckpoint(after=("compile",)))
            .use(Compile(backend="eager", after=("activation_checkpoint",))))
    return plan, llama()


@case("CP206")
def _cp206(tmp: Path, world: World) -> Any:
    world(1)
    return ParallelPlan(MeshSpec()).use(NeedsDataParallel()), llama()


@case("CP207")
def _cp207(tmp: Path, world: World) -> Any:
    llama().save_pretrained(tmp, safe_serialization=True)
    world(2)
    plan = (ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(MetaInit())
            .use(LoadSafetensors(str(tmp))))
    return plan, hf_workers.build("llama")


@case("CP208")
def _cp208(tmp: Path, world: World) -> Any:
    world(2)
    plan = (ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2(blocks="model.layers"))
            .use(ActivationCheckpoint(blocks=["LlamaDecoderLayer"])))
    return plan, llama()


@case("CP210")
def _cp210(tmp: Path, world: World) -> Any:
    world(2)
    plan = ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(ActivationCheckpoint(every=3))
    return plan, llama()


@case("CP211")
def _cp211(tmp: Path, world: World) -> Any:
    world(2)
    return ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(Misspelled()), llama()


@case("CP218")
def _cp218(tmp: Path, world: World) -> Any:
    world(4)
    plan = (ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=2)).use(HSDP()).use(FSDP2())
            .use(PlainAllReduce(dim="dp_replicat")))
    return plan, llama()


@case("CP219")
def _cp219(tmp: Path, world: World) -> Any:
    world(4)
    plan = (ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=2)).use(HSDP()).use(FSDP2())
            .use(PlainAllReduce()).use(OtherAllReduce()))
    return plan, llama()


@case("CP220")
def _cp220(tmp: Path, world: World) -> Any:
    world(4)
    plan = (ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=2)).use(HSDP()).use(FSDP2())
            .use(PlainShardComms(dim="dp_replicate")))
    return plan, llama()


@case("CP301")
def _cp301(tmp: Path, world: World) -> Any:
    world(32)
    topology = Topology(nodes=4, devices_per_node=8)
    plan = (ParallelPlan(MeshSpec(dp_shard=8, dp_replicate=4), topology=topology).use(HSDP())
            .use(FSDP2()))
    return plan, llama()


@case("CP302")
def _cp302(tmp: Path, world: World) -> Any:
    world(16)
    topology = Topology(nodes=2, devices_per_node=8)
    plan = ParallelPlan(MeshSpec(tp=4, dp_shard=4), topology=topology).use(FSDP2()).use(TP())
    return plan, llama(num_key_value_heads=4)


@case("CP303")
def _cp303(tmp: Path, world: World) -> Any:
    world(8)
    return ParallelPlan(MeshSpec(dp_shard=8)).use(FSDP2(reshard_after_forward=3)), llama()


@case("CP304")
def _cp304(tmp: Path, world: World) -> Any:
    world(16)
    topology = Topology(nodes=4, devices_per_node=4)
    plan = (ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=8), topology=topology).use(HSDP())
            .use(FSDP2(reshard_after_forward=8)))
    return plan, llama()


# -- the cases: the model -----------------------------------------------------------------


@case("CP401")
def _cp401(tmp: Path, world: World) -> Any:
    world(2)
    model = llama()
    model._no_split_modules = ["NoSuchLayer"]
    return ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()), model


@case("CP402")
def _cp402(tmp: Path, world: World) -> Any:
    world(2)
    model = ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).apply(llama())
    return ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()), model  # applied again


# A Hugging Face model's _init_weights is its init rule for every module: MetaInit and
# the loaders can initialize them all unless the init_fn they are given cannot be found.
BAD_INIT_FN = "no_such_package.init:weights"


@case("CP404")
def _cp404(tmp: Path, world: World) -> Any:
    world(2)
    plan = ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(MetaInit(init_fn=BAD_INIT_FN))
    return plan, hf_workers.build("llama")


@case("CP405")
def _cp405(tmp: Path, world: World) -> Any:
    world(2)
    return ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()), hf_workers.build("llama")


@case("CP406")
def _cp406(tmp: Path, world: World) -> Any:
    world(4)
    return ParallelPlan(MeshSpec(tp=4)).use(TP()), llama(intermediate_size=130,
                                                          num_key_value_heads=4)


@case("CP407")
def _cp407(tmp: Path, world: World) -> Any:
    world(4)
    return ParallelPlan(MeshSpec(tp=4)).use(TP()), llama()  # 2 KV heads


@case("CP408")
def _cp408(tmp: Path, world: World) -> Any:
    world(2)
    plan = {**hf_workers.HANDWRITTEN, "model.layers.*.self_attn.q_projj": "colwise"}
    return ParallelPlan(MeshSpec(tp=2)).use(TP(plan=plan)), llama()


@case("CP409")
def _cp409(tmp: Path, world: World) -> Any:
    world(2)
    plan = {**hf_workers.HANDWRITTEN, "model.embed_tokens": "embedding_colwise"}
    return ParallelPlan(MeshSpec(tp=2)).use(TP(plan=plan)), hf_workers.build("gemma",
                                                                              meta=False)


@case("CP431")
def _cp431(tmp: Path, world: World) -> Any:
    world(2)
    return ParallelPlan(MeshSpec(tp=2)).use(TP()), hf_workers.build(
        "stablelm", meta=False, qk_layernorm=True)


@case("CP212")
def _cp212(tmp: Path, world: World) -> Any:
    world(2)
    plan = {**hf_workers.HANDWRITTEN, "model.layers.*.self_attn.o_proj": "rowwse"}
    return ParallelPlan(MeshSpec(tp=2)).use(TP(plan=plan)), llama()


@case("CP213")
def _cp213(tmp: Path, world: World) -> Any:
    world(2)
    plan = {**hf_workers.HANDWRITTEN, "model.layers.*.self_attn": {
        "style": "prepare_input", "input_layouts": ["shard(1)", "none"]}}
    return ParallelPlan(MeshSpec(tp=2)).use(TP(plan=plan)), llama()


@case("CP214")
def _cp214(tmp: Path, world: World) -> Any:
    world(2)
    tp = TP(plan=hf_workers.HANDWRITTEN, sequence_parallel=True)
    return ParallelPlan(MeshSpec(tp=2)).use(tp), llama()


@case("CP432")
def _cp432(tmp: Path, world: World) -> Any:
    world(2)
    # a latent-attention style on a model whose config has no qk_rope_head_dim
    plan = {**hf_workers.HANDWRITTEN, "model.layers.*.self_attn.k_proj": "mla_kv_a_proj"}
    return ParallelPlan(MeshSpec(tp=2)).use(TP(plan=plan)), llama()


@case("CP433")
def _cp433(tmp: Path, world: World) -> Any:
    world(2)
    model = llama()
    model._tp_plan = {**model._tp_plan, "model.layers.*.mlp.up_proj": "fancy_new_style"}
    return ParallelPlan(MeshSpec(tp=2)).use(TP()), model


@case("CP424")
def _cp424(tmp: Path, world: World) -> Any:
    world(2)
    plan = ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2(blocks=["BertEmbeddings", "BertLayer"]))
    return plan, hf_workers.build("bert", meta=False)


@case("CP428")
def _cp428(tmp: Path, world: World) -> Any:
    world(2)
    plan = ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2(reshard_units={"model.layers.9": False}))
    return plan, llama()


@case("CP429")
def _cp429(tmp: Path, world: World) -> Any:
    world(2)
    return ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2(units=["model.layers.1"])), llama()


@case("CP430")
def _cp430(tmp: Path, world: World) -> Any:
    world(2)
    fsdp = FSDP2(reshard_units={"model.layers.*": False, "*.1": True})
    return ParallelPlan(MeshSpec(dp_shard=2)).use(fsdp), llama()


# -- the cases: compile -------------------------------------------------------------------


@case("CP217")
def _cp217(tmp: Path, world: World) -> Any:
    world(2)
    plan = (ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2())
            .use(Compile(backend="aot_eager", mode="max-autotune")))
    return plan, llama()


@case("CP221")
def _cp221(tmp: Path, world: World) -> Any:
    world(4)
    plan = (ParallelPlan(MeshSpec(dp_shard=2, tp=2)).use(TP()).use(FSDP2())
            .use(Compile(backend="aot_eager")))
    return plan, llama()


@case("CP230")
def _cp230(tmp: Path, world: World) -> Any:
    # run on a torch release taken out of the checked ones (the test patches the list)
    world(2)
    return (ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2(gradient_divide_factor=1.0)),
            llama())


@case("CP306")
def _cp306(tmp: Path, world: World) -> Any:
    # a plan for one node of 2, started on 2 nodes of 1 (ALLOCATIONS)
    world(2)
    return ParallelPlan(MeshSpec(tp=2)).use(TP()), llama()


@case("CP308")
def _cp308(tmp: Path, world: World) -> Any:
    # torchrun's variables contradict each other (ALLOCATIONS)
    world(2)
    return ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()), llama()


@case("CP309")
def _cp309(tmp: Path, world: World) -> Any:
    # srun placed its tasks on the nodes round-robin (ALLOCATIONS)
    world(2)
    return ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()), llama()


@case("CP961")
def _cp961(tmp: Path, world: World) -> Any:
    world(2)
    # an intermediate size of 40 is no multiple of 16
    return (ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2())
            .use(Float8(modules=("model.layers.0.mlp.up_proj",))), llama(intermediate_size=40))


@case("CP962")
def _cp962(tmp: Path, world: World) -> Any:
    world(2)
    return (ParallelPlan(MeshSpec(dp_replicate=2)).use(HSDP()).use(Float8(all_gather="float8")),
            llama())


@case("CP963")
def _cp963(tmp: Path, world: World) -> Any:
    world(2)
    return (ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2())
            .use(Float8(recipe="rowwise", all_gather="float8")), llama())


@case("CP964")
def _cp964(tmp: Path, world: World) -> Any:
    world(2)
    return (ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(PlainShardComms())
            .use(Float8(all_gather="float8")), llama())


@case("CP966")
def _cp966(tmp: Path, world: World) -> Any:
    world(2)  # float8 matmuls in hardware asked for on CPU ranks
    return ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(Float8(emulate=False)), llama()


@case("CP967")
def _cp967(tmp: Path, world: World) -> Any:
    world(2)  # torchao as if it were not installed (the test patches the check)
    return ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(Float8()), llama()


@case("CP410")
def _cp410(tmp: Path, world: World) -> Any:
    world(2)
    return ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(Compile(backend="inductr")), llama()


@case("CP411")
def _cp411(tmp: Path, world: World) -> Any:
    world(2)
    model = llama()
    model.model.layers[0].compile(backend="eager")
    return ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(Compile(backend="eager")), model


@case("CP412")
def _cp412(tmp: Path, world: World) -> Any:
    world(2)
    return ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(Compile()), llama()


@case("CPC101")
def _cpc101(tmp: Path, world: World) -> Any:
    world(4)
    plan = ParallelPlan.from_toml('[mesh]\ndp_shard = 4\n\n[[plugins]]\nname = "fsdp2"\n\n'
                                  '[[plugins]]\nname = "compress"\nmethod = "powersgd"\n')
    return plan, llama()


# -- the cases: weights -------------------------------------------------------------------


def _saved(tmp: Path, change: Callable[[dict[str, Any]], dict[str, Any]]) -> str:
    """A llama's save_pretrained, its tensors rewritten by ``change``."""
    from safetensors.torch import load_file, save_file

    llama().save_pretrained(tmp, safe_serialization=True)
    file = tmp / "model.safetensors"
    save_file(change(load_file(str(file))), str(file), metadata={"format": "pt"})
    return str(tmp)


def _loading(path: str, model: nn.Module | None = None, loader: type = LoadSafetensors) -> Any:
    plan = ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(loader(path))
    return plan, model if model is not None else hf_workers.build("llama")


@case("CP414")
def _cp414(tmp: Path, world: World) -> Any:
    path = _saved(tmp, lambda t: {k: v for k, v in t.items() if "layers.1.mlp" not in k})
    world(2)
    return _loading(path)


@case("CP415")
def _cp415(tmp: Path, world: World) -> Any:
    path = _saved(tmp, lambda t: {**t, "model.extra.weight": torch.ones(3)})
    world(2)
    return _loading(path)


@case("CP416")
def _cp416(tmp: Path, world: World) -> Any:
    path = _saved(tmp, lambda t: {**t, "lm_head.weight": torch.ones(3, 64)})
    world(2)
    return _loading(path)


@case("CP417")
def _cp417(tmp: Path, world: World) -> Any:
    llama().save_pretrained(tmp, safe_serialization=True)
    file = tmp / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    world(2)
    return _loading(str(tmp))


@case("CP418")
def _cp418(tmp: Path, world: World) -> Any:
    llama().save_pretrained(tmp, safe_serialization=True)
    world(2)  # the rotary tables are in no file; the init_fn that would compute them is not
    plan = (ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2())
            .use(LoadSafetensors(str(tmp), init_fn=BAD_INIT_FN)))
    return plan, hf_workers.build("llama")


@case("CP414 (load_checkpoint)")
def _cp414_checkpoint(tmp: Path, world: World) -> Any:
    from composer_par import checkpoint

    checkpoint.save(tmp / "ckpt", llama(num_hidden_layers=1), step=0)  # one process
    world(2)
    return _loading(str(tmp / "ckpt"), loader=LoadCheckpoint)


@case("CP415 (load_checkpoint)")
def _cp415_checkpoint(tmp: Path, world: World) -> Any:
    from composer_par import checkpoint

    checkpoint.save(tmp / "ckpt", llama(num_hidden_layers=3), step=0)
    world(2)
    return _loading(str(tmp / "ckpt"), loader=LoadCheckpoint)


# -- the cases: pipelines -----------------------------------------------------------------


def _pp(world: World, size: int, **options: Any) -> ParallelPlan:
    from composer_par.plugins.pp import PP

    world(size)
    return ParallelPlan(MeshSpec(pp=size)).use(PP(**options))


@case("CP601")
def _cp601(tmp: Path, world: World) -> Any:
    return _pp(world, 2, schedule="1f1bb"), llama()


@case("CP602")
def _cp602(tmp: Path, world: World) -> Any:
    return _pp(world, 5), llama()  # 2 layers, the embedding and the head: 4 stages at most


@case("CP603")
def _cp603(tmp: Path, world: World) -> Any:
    return _pp(world, 4, schedule="1F1B", microbatches=2), llama(num_hidden_layers=4)


@case("CP605")
def _cp605(tmp: Path, world: World) -> Any:
    return _pp(world, 2, schedule="ZBVZeroBubble", stages_per_rank=1), llama()


@case("CP606")
def _cp606(tmp: Path, world: World) -> Any:
    plan = _pp(world, 2, schedule="ZBVZeroBubble").use(Compile(backend="aot_eager"))
    return plan, llama(num_hidden_layers=4)


@case("CP613")
def _cp613(tmp: Path, world: World) -> Any:
    return _pp(world, 2, schedule="1F1B", overlap=True), llama()  # no overlapped actions


@case("CP608")
def _cp608(tmp: Path, world: World) -> Any:
    split = [["model.embed_tokens", "model.layers.0"], ["model.layers.1", "model.norm"]]
    return _pp(world, 2, split=split), llama()  # lm_head in no stage


@case("CP609")
def _cp609(tmp: Path, world: World) -> Any:
    return _pp(world, 2), hf_workers.build("gemma", meta=False)  # embedding tied to the head


@case("CP610")
def _cp610(tmp: Path, world: World) -> Any:
    model = llama()
    model.scale = nn.Parameter(torch.ones(1))
    return _pp(world, 2), model


@case("CP611")
def _cp611(tmp: Path, world: World) -> Any:
    from tests.test_pp_layer_config import NamedLayers, qwen2_sliding

    model = qwen2_sliding(4)
    model.model = NamedLayers(model.model)  # its layers keyed by name, not number
    return _pp(world, 2), model


# -- the cases: expert and context parallelism, offload -----------------------------------


@case("CP801")
def _cp801(tmp: Path, world: World) -> Any:
    from composer_par import EP

    world(8)  # mixtral's 4 experts among 8 ep ranks
    return ParallelPlan(MeshSpec(ep=8)).use(EP()), hf_workers.build("mixtral", meta=False)


@case("CP802")
def _cp802(tmp: Path, world: World) -> Any:
    from composer_par import EP

    world(2)
    return ParallelPlan(MeshSpec(ep=2)).use(EP()), llama()  # a dense model


@case("CP805")
def _cp805(tmp: Path, world: World) -> Any:
    from composer_par import EP

    world(4)  # each expert's 33 columns over tp(2)
    return (ParallelPlan(MeshSpec(ep=2, tp=2)).use(EP(expert_tp=True)).use(TP()),
            hf_workers.build("mixtral", meta=False, intermediate_size=33))


@case("CP806")
def _cp806(tmp: Path, world: World) -> Any:
    from composer_par import EP

    world(2)  # expert_tp names a tp dim the mesh lacks
    return (ParallelPlan(MeshSpec(ep=2)).use(EP(expert_tp=True)),
            hf_workers.build("mixtral", meta=False))


def _cp(world: World, size: int = 2, **options: Any) -> ParallelPlan:
    from composer_par import CP

    world(size)
    return ParallelPlan(MeshSpec(cp=size)).use(CP(**options))


@case("CP821")
def _cp821(tmp: Path, world: World) -> Any:
    return _cp(world, 2, seq_len=30), llama()


@case("CP822")
def _cp822(tmp: Path, world: World) -> Any:
    return _cp(world, 4, mode="alltoall"), llama()  # 2 KV heads


@case("CP823")
def _cp823(tmp: Path, world: World) -> Any:
    model = llama(attn_implementation="eager")
    model.config._attn_implementation = "eager"
    return _cp(world), model


@case("CP826")
def _cp826(tmp: Path, world: World) -> Any:
    if torch.cuda.is_available():
        pytest.skip("CP826 is what a rank without CUDA gives")
    return _cp(world, mode="ring"), llama()


@case("CP827")
def _cp827(tmp: Path, world: World) -> Any:
    model = hf_workers.build("mixtral", meta=False, output_router_logits=True)
    model.config._attn_implementation = "sdpa"
    return _cp(world), model  # its router loss would be of each rank's part


@case("CP824")
def _cp824(tmp: Path, world: World) -> Any:
    model = hf_workers.build("bert", meta=False)
    model.config._attn_implementation = "sdpa"
    return _cp(world), model  # bidirectional attention


def _offload(world: World, **options: Any) -> ParallelPlan:
    from composer_par import Offload

    world(2)
    return ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(Offload(**options))


@case("CP951")
def _cp951(tmp: Path, world: World) -> Any:
    return _offload(world), llama()  # optimizer state to NVMe, no path


@case("CP952")
def _cp952(tmp: Path, world: World) -> Any:
    return _offload(world, path=str(tmp / "missing")), llama()


@case("CP953")
def _cp953(tmp: Path, world: World) -> Any:
    return _offload(world, path="/proc/sys"), llama()  # root ignores modes; /proc does not


@case("CP954")
def _cp954(tmp: Path, world: World) -> Any:
    return _offload(world, optimizer="cpu", path=str(tmp)), llama()


# -- what "untouched" compares ------------------------------------------------------------

_SIMPLE = (bool, int, float, str, type(None))
_MODEL_ATTRIBUTES = ("_tp_plan", "_pp_plan", "_fsdp_plan", "_ep_plan", "_no_split_modules",
                     "_tied_weights_keys", "supports_gradient_checkpointing")


def _value(tensor: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return ("dtensor", tuple(map(str, tensor.placements)), _value(tensor.to_local()))
    if tensor.is_meta:
        return ("meta",)
    return tensor.detach().clone()


def snapshot(model: nn.Module) -> dict[str, Any]:
    """What the model is: each tensor under each name (the object, its type, dtype,
    shape, device, requires_grad, and values), each module (object, type, its instance
    attributes: simple ones by value, the rest by identity, hooks by count), the config
    and the Hugging Face plans."""
    tensors = {}
    for kind, named in (("p", model.named_parameters(remove_duplicate=False)),
                        ("b", model.named_buffers(remove_duplicate=False))):
        for name, t in named:
            tensors[f"{kind}:{name}"] = (id(t), type(t), t.dtype, tuple(t.shape), str(t.device),
                                         t.requires_grad, _value(t))
    modules = {}
    for name, module in model.named_modules(remove_duplicate=False):
        attributes = {}
        for key, value in vars(module).items():
            if isinstance(value, _SIMPLE):
                attributes[key] = value
            elif isinstance(value, dict) and "hook" in key:
                attributes[key] = ("hooks", len(value))
            elif key not in ("_parameters", "_buffers", "_modules"):
                attributes[key] = ("object", id(value), type(value))
        modules[name] = (id(module), type(module), attributes,
                         sorted(module._parameters), sorted(module._buffers),
                         sorted(module._modules), module._non_persistent_buffers_set.copy())
    config = getattr(model, "config", None)
    return {"tensors": tensors, "modules": modules,
            "config": config.to_dict() if config is not None else None,
            "attributes": {a: copy.deepcopy(getattr(model, a, None)) for a in _MODEL_ATTRIBUTES},
            "class": type(model)}


def differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    out = []
    for part in ("class", "config", "attributes"):
        if before[part] != after[part]:
            out.append(f"{part}: {before[part]} became {after[part]}")
    for part in ("tensors", "modules"):
        if sorted(before[part]) != sorted(after[part]):
            out.append(f"{part}: names {sorted(set(before[part]) ^ set(after[part]))[:5]} "
                       "came or went")
            continue
        for name, was in before[part].items():
            now = after[part][name]
            if not _same(was, now):
                out.append(f"{part} {name}: {str(was)[:200]} became {str(now)[:200]}")
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


# -- the tests ----------------------------------------------------------------------------


# -- the cases: fault-tolerant replica groups (ft) -----------------------------------------


def _ft(world: World, mesh: MeshSpec, hsdp: bool = True, **options: Any) -> ParallelPlan:
    from composer_par.plugins.ft import FaultTolerance

    world(2)  # one replica group's launch: the dims other than dp_replicate
    plan = ParallelPlan(mesh).use(HSDP()) if hsdp else ParallelPlan(mesh)
    return plan.use(FSDP2()).use(FaultTolerance(**options))


@case("CP971")
def _cp971(tmp: Path, world: World) -> Any:
    return _ft(world, MeshSpec(dp_shard=2, dp_replicate=2)), llama()


@case("CP972")
def _cp972(tmp: Path, world: World) -> Any:
    return _ft(world, MeshSpec(dp_replicate=2, dp_shard=2), hsdp=False), llama()


@case("CP973")
def _cp973(tmp: Path, world: World) -> Any:
    return _ft(world, MeshSpec(dp_replicate=2, dp_shard=-1)), llama()


@case("CP974")
def _cp974(tmp: Path, world: World) -> Any:
    return _ft(world, MeshSpec(dp_replicate=2, dp_shard=2), min_replicas=3), llama()


@case("CP975")
def _cp975(tmp: Path, world: World) -> Any:
    return _ft(world, MeshSpec(dp_replicate=2, dp_shard=2), group=2), llama()


@case("CP976")
def _cp976(tmp: Path, world: World) -> Any:
    return _ft(world, MeshSpec(dp_replicate=2, dp_shard=2), method="ddp", sync_every=8), llama()


def _error_codes() -> set[str]:
    """The catalog's error codes, but the trainer integrations' (CP7xx: Lightning's and
    Accelerate's strategies refuse their own settings when they are built, before a plan
    is applied)."""
    return {rule.code for _, rule in catalogs()
            if rule.severity is Severity.ERROR and not rule.code.startswith("CP7")}


def _code(name: str) -> str:
    return name.split(" ")[0]


@pytest.fixture(autouse=True)
def _outside_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def test_every_error_code_has_a_case_or_says_why_not() -> None:
    covered = {_code(name) for name in CASES}
    assert not covered & set(ELSEWHERE)
    assert covered | set(ELSEWHERE) == _error_codes(), (
        f"no case: {sorted(_error_codes() - covered - set(ELSEWHERE))}; "
        f"not error codes: {sorted((covered | set(ELSEWHERE)) - _error_codes())}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_refused_apply_leaves_the_model_untouched(name: str, tmp_path: Path,
                                                     fake_world: World,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    code = _code(name)
    for variable, value in ALLOCATIONS.get(code, {}).items():
        monkeypatch.setenv(variable, value)
    if code == "CP967":
        from composer_par.plugins.float8 import torchao_api

        monkeypatch.setattr(torchao_api, "installed", lambda: False)
    if code == "CP230":
        # the installed torch as if it were a release FSDP2's internals were not checked on
        from composer_par.plugin import torch_private

        monkeypatch.setattr(torch_private, "CHECKED_TORCH", ((2, 12),))
        monkeypatch.delenv(torch_private.UNCHECKED_ENV, raising=False)
    if code == "CP412":
        # inductor's C++ compiler, as if none were installed (its own setting)
        from torch._inductor import config

        with config.patch({"cpp.cxx": (None, "no-such-c++-compiler")}):
            _refused_untouched(code, *CASES[name](tmp_path, fake_world))
        return
    _refused_untouched(code, *CASES[name](tmp_path, fake_world))


def _refused_untouched(code: str, plan: ParallelPlan, model: nn.Module) -> None:
    before = snapshot(model)
    grad = torch.is_grad_enabled()
    with pytest.raises(PlanError) as err:
        plan.apply(model)
    assert code in err.value.report.codes(), err.value.report.format()
    found = differences(before, snapshot(model))
    assert not found, "\n".join(found)
    assert torch.is_grad_enabled() == grad


def test_the_comparison_sees_an_apply_that_succeeds(fake_world: World) -> None:
    # What the cases would see had their plans got past validation.
    fake_world(2)
    model = llama()
    before = snapshot(model)
    plan = ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).use(ActivationCheckpoint())
    plan.apply(model)
    found = differences(before, snapshot(model))
    assert found[0].startswith("class: ")  # FSDP2's subclass of the model's class
    assert any(f.startswith("tensors p:model.layers.0.mlp.up_proj.weight") for f in found)
    assert any(f.startswith("modules model.layers.1.self_attn.v_proj") for f in found)
