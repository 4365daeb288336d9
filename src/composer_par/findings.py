"""Findings, reports, and the catalog of rule codes.

Every rule has a stable code. Codes group by what they look at, in ranges kept as data
(:class:`CodeRange`): the core's are :data:`CORE_CODE_RANGES` (the mesh, the plan file,
trainer integrations, imported configs, scheduler jobs, and three areas any catalog may
use: plugins as a whole, the topology, the model); each plugin that keeps codes of its
own declares their range in its class attribute ``code_ranges`` (PP its ``CP6xx``).
docs/rules.md tabulates them all, and a test holds every catalog to its ranges.

The core's codes are :data:`CORE_RULES` (its checks live in :mod:`composer_par.rules`).
Each plugin brings its own catalog, the class attribute ``rules`` of its plugin class,
and adds findings through the validation hooks. A finding's severity, unless given, is
its rule's: the core's, else the catalog of the plugin whose hook made it, else any
known catalog's; a code no catalog has is an error. :data:`RULES` maps every code of
the core and the installed plugins.
"""

from __future__ import annotations

import contextvars
import difflib
import enum
import json
import re
import weakref
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import attrs


class Severity(enum.StrEnum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


@attrs.frozen
class Rule:
    """One rule code and what it means: the catalog entry behind every finding of it.

    ``title`` is its meaning in a line (the heading of its section in docs/rules.md),
    ``fix`` what usually resolves it, ``example`` a short plan file or Python snippet that
    triggers it. A plan-file example (text starting with ``[``) is complete: validating it
    alone reports the code. A rule that needs a model (or a plugin of the example's own)
    gives a Python example. The core's rules are :data:`CORE_RULES`; a plugin lists its
    own in its class attribute ``rules`` (see :class:`composer_par.plugin.Plugin`).
    """

    code: str
    severity: Severity = attrs.field(converter=Severity)
    title: str
    fix: str = ""
    example: str = ""

    def means_the_same_as(self, other: Rule) -> bool:
        """Same code, severity and meaning (fix and example may be worded differently)."""
        return (self.code, self.severity, self.title) == (other.code, other.severity,
                                                          other.title)

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "severity": self.severity.value, "title": self.title,
                "fix": self.fix, "example": self.example}


def _catalog(*rules: Rule) -> Mapping[str, Rule]:
    table: dict[str, Rule] = {}
    for rule in rules:
        if rule.code in table:
            raise ValueError(f"rule code {rule.code} is listed twice")
        table[rule.code] = rule
    return MappingProxyType(table)


_CODE = re.compile(r"([A-Z]+)(\d{3})")


@attrs.frozen
class CodeRange:
    """A run of rule codes: ``prefix`` followed by the three-digit numbers ``first`` to
    ``last``, and what the codes in it look at (``about``).

    A catalog (the core's, a plugin's) keeps its codes inside the ranges it declares, or
    inside a ``shared`` range: an area any catalog may add codes to, because every
    plugin's rules look at it (options and claims, the topology, the model). No two
    ranges overlap, so a new code's range says whose it is.
    """

    prefix: str = attrs.field(validator=attrs.validators.matches_re(r"[A-Z]+"))
    first: int = attrs.field(validator=attrs.validators.and_(
        attrs.validators.ge(0), attrs.validators.le(999)))
    last: int = attrs.field(validator=attrs.validators.le(999))
    about: str
    shared: bool = False

    @last.validator
    def _not_before_first(self, attribute: Any, value: int) -> None:
        if value < self.first:
            raise ValueError(f"last ({value}) must be >= first ({self.first})")

    def __contains__(self, code: object) -> bool:
        match = _CODE.fullmatch(code) if isinstance(code, str) else None
        return (match is not None and match[1] == self.prefix
                and self.first <= int(match[2]) <= self.last)

    def overlaps(self, other: CodeRange) -> bool:
        return (self.prefix == other.prefix and self.first <= other.last
                and other.first <= self.last)

    def __str__(self) -> str:
        """``CP4xx`` for a whole hundred (x01 to x99), else ``CP801-CP819``."""
        if self.first % 100 == 1 and self.last == self.first + 98:
            return f"{self.prefix}{self.first // 100}xx"
        return f"{self.prefix}{self.first:03d}-{self.prefix}{self.last:03d}"


# The core's ranges; each plugin declares its own (Plugin.code_ranges). Free numbers between
# them are for new ranges.
CORE_CODE_RANGES: tuple[CodeRange, ...] = (
    CodeRange("CP", 101, 199, "the mesh and the world size"),
    CodeRange("CP", 201, 299, "plugins: claims, ordering, requirements, options, hooks",
              shared=True),
    CodeRange("CP", 301, 399, "the topology: which mesh dims cross nodes", shared=True),
    CodeRange("CP", 401, 499, "the model (model-aware pass)", shared=True),
    CodeRange("CP", 501, 599, "the plan file itself (the CLI exits 2)"),
    CodeRange("CP", 701, 709, "a plan inside Lightning Fabric or the Lightning Trainer"),
    CodeRange("CP", 711, 729, "a plan inside accelerate or the Hugging Face Trainer"),
    CodeRange("CP", 901, 949, "configs imported from other tools (composer-par import)"),
    CodeRange("CP", 981, 989, "a plan's job written for a scheduler (composer-par launch)"),
)

_E, _W = Severity.ERROR, Severity.WARNING

# The core's own codes: the mesh, the plugins as a whole, the topology, the model as a
# whole and the plan file. Each plugin's own codes live on the plugin (``rules``).
CORE_RULES: Mapping[str, Rule] = _catalog(
    Rule("CP101", _E, "mesh sizes do not multiply to the world size",
         "change the [mesh] sizes so their product equals the world size, or set one size "
         "to -1 to infer it",
         "[mesh]\ndp_shard = 8\n\n[topology]\nnodes = 1\ndevices_per_node = 4\n\n"
         "[[plugins]]\nname = \"fsdp2\"\n"),
    Rule("CP102", _E, "topology does not match the world size",
         "make nodes * devices_per_node equal the number of ranks (under torchrun, leave "
         "[topology] out)",
         "ParallelPlan(MeshSpec(dp_shard=8), topology=Topology(nodes=2, devices_per_node=8))"
         ".use(FSDP2()).validate(world_size=8)"),
    Rule("CP201", _E, "a mesh dim of size > 1 is owned by no plugin",
         "use a plugin that claims the dim, or set its size to 1",
         "[mesh]\ndp_shard = 4\ntp = 2\n\n[[plugins]]\nname = \"fsdp2\"\n"),
    Rule("CP202", _E, "a mesh dim is claimed by two plugins",
         "give each plugin its own mesh dim (option `dim`), or drop one plugin",
         "[mesh]\ndp_shard = 4\n\n[[plugins]]\nname = \"fsdp2\"\n\n[[plugins]]\n"
         "name = \"hsdp\"\ndim = \"dp_shard\"\n"),
    Rule("CP203", _E, "a plugin claims a mesh dim the mesh does not have",
         "set the plugin's `dim` to a dim of [mesh], or add the dim to [mesh]",
         "[mesh]\ndp_shard = 4\n\n[[plugins]]\nname = \"fsdp2\"\ndim = \"dp_shrad\"\n"),
    Rule("CP204", _E, "the same plugin is used twice",
         "use each plugin once; put all its options on one instance",
         "[mesh]\ndp_shard = 4\n\n[[plugins]]\nname = \"fsdp2\"\n\n[[plugins]]\n"
         "name = \"fsdp2\"\nreshard_after_forward = true\n"),
    Rule("CP205", _E, "plugins' after/before declarations form a cycle",
         "remove one of the after/before constraints in the cycle",
         "[mesh]\ndp_shard = 2\n\n[[plugins]]\nname = \"fsdp2\"\n\n[[plugins]]\n"
         "name = \"activation_checkpoint\"\nafter = [\"compile\"]\n\n[[plugins]]\n"
         "name = \"compile\"\nafter = [\"activation_checkpoint\"]\n"),
    Rule("CP206", _E, "a plugin's requirement is met by no plugin in the plan",
         "add a plugin that provides the capability (data_parallel: FSDP2 or HSDP; "
         "materialize: MetaInit or a loader), or drop the plugin that needs it",
         "class NeedsDP(Plugin):\n    name = \"needs_dp\"\n"
         "    requires = frozenset({\"data_parallel\"})\n\n"
         "ParallelPlan(MeshSpec()).use(NeedsDP()).validate()"),
    Rule("CP207", _E, "two plugins provide a single-provider stage",
         "keep one of them: MetaInit to initialize, or a loader to load weights",
         "[mesh]\ndp_shard = 2\n\n[[plugins]]\nname = \"fsdp2\"\n\n[[plugins]]\n"
         "name = \"meta_init\"\n\n[[plugins]]\nname = \"load_safetensors\"\n"
         "path = \"model/\"\n"),
    Rule("CP208", _E, "plugins disagree on where the blocks are",
         "give `blocks` on one plugin only, or the same value on each",
         "[mesh]\ndp_shard = 2\n\n[[plugins]]\nname = \"fsdp2\"\nblocks = \"layers\"\n\n"
         "[[plugins]]\nname = \"activation_checkpoint\"\nblocks = [\"Block\"]\n"),
    Rule("CP209", _W, "after/before names a plugin that is not in the plan",
         "correct the name, add that plugin, or remove it from after/before",
         "[mesh]\ndp_shard = 2\n\n[[plugins]]\nname = \"fsdp2\"\n\n[[plugins]]\n"
         "name = \"compile\"\nafter = [\"fsdp\"]\n"),
    Rule("CP210", _E, "a plugin option has an invalid value",
         "set the option to a value the message lists",
         "ParallelPlan(MeshSpec()).use(ActivationCheckpoint(every=3)).use(MetaInit())"
         ".validate(model_with_two_blocks)"),
    Rule("CP211", _E, "a plugin implements a hook that does not exist",
         "name the method after a hook in composer_par.plugin.hookspecs, with argument "
         "names from that hook's signature",
         "class MyLoader(Plugin):\n    name = \"my_loader\"\n\n    @hookimpl\n"
         "    def composer_par_materialise(self, ctx): ...  # British spelling"),
    Rule("CP218", _E, "a comm hook on a mesh dim no data-parallel plugin owns",
         "point the hook at a mesh dim a data-parallel plugin owns, or add that plugin",
         "class Compress(Plugin):\n    name = \"compress\"\n\n    @hookimpl\n"
         "    def composer_par_comm_hooks(self):\n"
         "        return [CommHook(\"dp_replicate\", all_reduce=make_reducer)]\n\n"
         "ParallelPlan(MeshSpec(dp_shard=4)).use(FSDP2()).use(Compress()).validate()"),
    Rule("CP219", _E, "two comm hooks on one mesh dim",
         "keep one comm-hook plugin per mesh dim",
         "ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=2)).use(HSDP()).use(FSDP2())"
         ".use(PlainAllReduce()).use(OtherAllReduce()).validate()  # both hook dp_replicate"),
    Rule("CP220", _E, "a comm hook customizes a collective its mesh dim does not run",
         "hook all_reduce on a replicate dim, all_gather / reduce_scatter on a shard dim",
         "class Compress(Plugin):\n    name = \"compress\"\n\n    @hookimpl\n"
         "    def composer_par_comm_hooks(self):\n"
         "        return [CommHook(\"dp_shard\", all_reduce=make_reducer)]\n\n"
         "ParallelPlan(MeshSpec(dp_shard=4)).use(FSDP2()).use(Compress()).validate()"),
    Rule("CP222", _W, "two plugins give one rule code different meanings",
         "read each such finding with the plugin it names; the plugins' authors should "
         "give their codes distinct prefixes",
         "class A(Plugin):\n    name = \"a\"\n"
         "    rules = (Rule(\"XYZ101\", \"error\", \"one meaning\"),)\n\n"
         "class B(Plugin):\n    name = \"b\"\n"
         "    rules = (Rule(\"XYZ101\", \"warning\", \"another meaning\"),)\n\n"
         "ParallelPlan(MeshSpec()).use(A()).use(B()).validate()"),
    Rule("CP301", _E, "reversed HSDP mesh: the shard dim crosses nodes",
         "swap the order of the shard and replicate dims in [mesh]",
         "[mesh]\ndp_shard = 8\ndp_replicate = 4\n\n[topology]\nnodes = 4\n"
         "devices_per_node = 8\n\n[[plugins]]\nname = \"hsdp\"\n\n[[plugins]]\n"
         "name = \"fsdp2\"\n"),
    Rule("CP302", _E, "the tensor-parallel dim crosses nodes",
         "make the tensor-parallel dim the innermost mesh dim (list it last), no larger "
         "than a node",
         "[mesh]\ntp = 4\ndp_shard = 4\n\n[topology]\nnodes = 2\ndevices_per_node = 8\n\n"
         "[[plugins]]\nname = \"fsdp2\"\n\n[[plugins]]\nname = \"tp\"\n"),
    Rule("CP305", _W, "the shard dim spans nodes",
         "shard inside a node and replicate across nodes (HSDP), or keep full sharding "
         "knowingly",
         "[mesh]\ndp_shard = 32\n\n[topology]\nnodes = 4\ndevices_per_node = 8\n\n"
         "[[plugins]]\nname = \"fsdp2\"\n"),
    # CP306-CP309: the allocation a job got, read at its start (composer_par.allocation).
    Rule("CP306", _E, "the job's layout is not the plan's and breaks it",
         "start the job on the plan's nodes x devices per node (composer-par launch "
         "writes such a job), or change [topology] and validate the plan for the layout "
         "the job has",
         "# [mesh] dp_shard = 4, tp = 8; [topology] nodes = 4, devices_per_node = 8\n"
         "sbatch --nodes=8 job.sbatch   # its torchrun runs --nproc-per-node=4 on each"),
    Rule("CP307", _W, "the job's layout is not the plan's, but the plan holds on it",
         "make [topology] say the layout the job has, or start the job on the plan's",
         "# [mesh] dp_replicate = 2, dp_shard = 8; [topology] nodes = 2, devices_per_node = 8\n"
         "torchrun --standalone --nproc-per-node=16 train.py plan.toml"),
    Rule("CP308", _E, "the launcher and the scheduler disagree on where the ranks run",
         "run one torchrun per node with the node's devices as --nproc-per-node, and the "
         "same number of processes on every node",
         "srun --ntasks-per-node=2 torchrun --nproc-per-node=4 train.py plan.toml"),
    Rule("CP309", _E, "SLURM placed the tasks on nodes round-robin",
         "distribute tasks in blocks (srun --distribution=block, the default)",
         "srun --ntasks-per-node=4 --distribution=cyclic python train.py plan.toml"),
    Rule("CP401", _E, "no blocks found in the model",
         "pass blocks= to the plugin: a module path like 'layers' or block class names "
         "like ['DecoderLayer']",
         "ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).validate(torch.nn.Linear(4, 4))"),
    Rule("CP402", _E, "parameters are already DTensors",
         "apply the plan to a freshly built model (ideally under torch.device('meta'))",
         "model = plan.apply(model)\nplan.apply(model)  # again"),
    Rule("CP403", _W, "the model is already materialized and large",
         "build the model under torch.device('meta') and use MetaInit or a loader",
         "model = build_model()  # 7B parameters, on CPU, on every rank\n"
         "ParallelPlan(MeshSpec(dp_shard=8)).use(FSDP2()).apply(model)"),
    Rule("CP405", _E, "the model has tensors on meta and no plugin materializes",
         "add MetaInit(seed=...) to initialize, or a loader to load weights",
         "with torch.device(\"meta\"):\n    model = build_model()\n"
         "ParallelPlan(MeshSpec(dp_shard=2)).use(FSDP2()).apply(model)"),
    Rule("CP434", _E, "a gradient gets no reduction over a mesh dim it needs one over, or "
         "one too many",
         "give the module named a style whose gradient handling matches what its forward "
         "computes on (e.g. \"replicate_grad_allreduce\" for a norm on split heads), or "
         "keep it out of the split",
         "composer-par validate plan.toml --model model:qwen3  # q_norm mapped to "
         "\"replicate\" beside split heads"),
    Rule("CP501", _E, "the plan file could not be read",
         "check the path, and that the file is UTF-8 TOML",
         "composer-par validate /nonexistent/plan.toml"),
    Rule("CP502", _E, "the plan file is not valid TOML",
         "fix the TOML syntax at the line shown",
         "[mesh\ndp_shard = 8\n"),
    Rule("CP503", _E, "unknown key or table in the plan file",
         "use one of the names the message lists",
         "[mesh]\ndp_shard = 8\n\n[topolgy]\nnodes = 1\n"),
    Rule("CP504", _E, "unknown plugin name",
         "install the plugin or fix the name (composer-par plugins lists what is installed)",
         "[mesh]\ndp_shard = 8\n\n[[plugins]]\nname = \"fsdp\"\n"),
    Rule("CP505", _E, "unknown plugin option",
         "use one of the options the fix lists",
         "[mesh]\ndp_shard = 8\n\n[[plugins]]\nname = \"fsdp2\"\n"
         "reshard_after_foward = true\n"),
    Rule("CP506", _E, "a value in the plan file has the wrong type or range",
         "give a value of the type and range the message states",
         "[mesh]\ndp_shard = 0\n"),
    # CP7xx: a trainer a plan runs inside (composer_par.integrations); found by the
    # adapters before anything is built.
    # -- Lightning Fabric and Trainer: CP701-CP709 --
    Rule("CP701", _E, "Lightning's precision over the plan's mixed precision",
         "keep one: precision=\"32-true\" with the plan's mixed_precision, or drop "
         "mixed_precision from the plan",
         "plan = ParallelPlan(MeshSpec(dp_shard=4)).use(FSDP2(mixed_precision=\"bfloat16\"))\n"
         "Fabric(strategy=FabricStrategy(plan), devices=4, precision=\"bf16-mixed\")"),
    Rule("CP702", _E, "the model is parallelized outside the plan",
         "drop parallelize_fn (or the parallelism in configure_model); let the strategy "
         "apply the plan to a plainly built model",
         "FabricStrategy(plan, parallelize_fn=my_parallelize)"),
    Rule("CP703", _E, "Lightning's mesh sizes disagree with the plan's mesh",
         "drop data_parallel_size and tensor_parallel_size: the plan's mesh is the "
         "strategy's mesh",
         "plan = ParallelPlan(MeshSpec(dp_shard=2, tp=2)).use(FSDP2()).use(TP())\n"
         "FabricStrategy(plan, data_parallel_size=4)"),
    Rule("CP704", _E, "Lightning's process count does not match the plan",
         "set devices x num_nodes to the plan's world size, or change the mesh sizes",
         "plan = ParallelPlan(MeshSpec(dp_replicate=2, dp_shard=2)).use(HSDP()).use(FSDP2())\n"
         "Fabric(strategy=FabricStrategy(plan), devices=2)"),
    Rule("CP705", _E, "a pipeline plan in the Lightning Trainer's loop",
         "train a pipeline plan with Fabric (its step through "
         "fabric.strategy.training_step) or with plan.training_step in a loop of your own",
         "plan = ParallelPlan(MeshSpec(pp=2)).use(PP()).use(MetaInit())\n"
         "Trainer(strategy=TrainerStrategy(plan), devices=2)"),
    Rule("CP706", _E, "a strategy setting the plan decides",
         "drop the setting: give the plan its timeout; export full weights with "
         "export_safetensors",
         "FabricStrategy(plan, save_distributed_checkpoint=False)"),
    Rule("CP707", _E, "LightningModule parameters outside the module the plan applies to",
         "move them into that submodule, or apply the plan to the whole LightningModule "
         "(TrainerStrategy(plan, module=\"\"))",
         "lit.scale = nn.Parameter(torch.ones(1))  # beside lit.model\n"
         "Trainer(strategy=TrainerStrategy(plan), devices=4).fit(lit)"),
    # -- accelerate and the Hugging Face Trainer: CP711-CP729 --
    Rule("CP711", _E, "the trainer's process count does not match the plan",
         "launch as many processes as the plan's mesh holds (on CPU: Accelerator(cpu=True), "
         "TrainingArguments(use_cpu=True))",
         "# under torchrun --nproc-per-node 2\n"
         "PlanAccelerator(ParallelPlan(MeshSpec(dp_shard=4)).use(FSDP2()))"),
    Rule("CP712", _E, "the trainer's own activation checkpointing",
         "turn it off and add ActivationCheckpoint() to the plan",
         "PlanTrainer(plan, model, TrainingArguments(\"out\", activation_checkpointing=True))"),
    Rule("CP713", _E, "the trainer's own torch.compile",
         "turn it off and add Compile() to the plan",
         "PlanAccelerator(plan, dynamo_backend=\"inductor\")"),
    Rule("CP714", _E, "the trainer would shard or wrap the model itself",
         "remove the FSDP / DeepSpeed / Megatron-LM / TP settings: the plan shards",
         "PlanAccelerator(plan, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))"),
    Rule("CP715", _E, "CPU-RAM-efficient loading under a plan",
         "turn it off; load with LoadSafetensors or initialize with MetaInit",
         "# FSDP_CPU_RAM_EFFICIENT_LOADING=true\nPlanAccelerator(plan)"),
    Rule("CP716", _E, "the trainer's context or sequence parallelism",
         "set cp_size and sp_size to 1; split sequences with the plan's "
         "TP(sequence_parallel=True) or CP plugin",
         "PlanAccelerator(plan, parallelism_config=ParallelismConfig(cp_size=2))"),
    Rule("CP717", _E, "the trainer's mixed precision under a plan",
         "set mixed_precision='no' and give FSDP2 a mixed_precision policy in the plan",
         "PlanAccelerator(plan, mixed_precision=\"bf16\")"),
    Rule("CP718", _E, "a pipeline plan in a trainer loop that cannot run a schedule",
         "train it with plan.training_step and a torch optimizer, or drop the pp plugin",
         "PlanAccelerator(ParallelPlan(MeshSpec(pp=2)).use(PP()).use(MetaInit()))"),
    Rule("CP719", _E, "batches dispatched from rank 0 instead of the plan's data shards",
         "leave dispatch_batches unset or False",
         "PlanAccelerator(plan, dataloader_config=DataLoaderConfiguration("
         "dispatch_batches=True))"),
    Rule("CP720", _E, "a plan that splits sequences in the Trainer, which feeds whole ones",
         "train it in a loop of your own that gives each rank its part of every sequence "
         "and its positions (docs/cp.md), or drop the plugin that splits them",
         "PlanTrainer(ParallelPlan(MeshSpec(cp=2)).use(CP()).use(MetaInit()), model, args)"),
    # CP9xx: configs imported from other tools (composer_par.migrate, composer-par import);
    # each names the source key and what the plan does instead.
    Rule("CP901", _E, "the config cannot be read as an accelerate or DeepSpeed config",
         "give an accelerate config YAML or a DeepSpeed JSON (composer-par import --from "
         "to say which)", "composer-par import notes.txt"),
    Rule("CP902", _E, "a setting has a value its tool does not accept",
         "give one of the values the message lists",
         "fsdp_config:\n  fsdp_sharding_strategy: FULLSHARD"),
    Rule("CP903", Severity.INFO, "a setting FSDP2 does without",
         "nothing to do: FSDP2 does what the setting asked for by itself",
         "fsdp_config:\n  fsdp_use_orig_params: true"),
    Rule("CP904", Severity.INFO, "a bucket or prefetch size: FSDP2 communicates per unit",
         "choose the FSDP2 units (blocks, units) to change the granularity",
         "{\"zero_optimization\": {\"stage\": 3, \"reduce_bucket_size\": 5e8}}"),
    Rule("CP905", _W, "wrapping by size or not at all: the plan shards by block",
         "name the block classes in the fsdp2 plugin's blocks option",
         "fsdp_config:\n  fsdp_auto_wrap_policy: SIZE_BASED_WRAP"),
    Rule("CP906", _W, "offloading the plan does differently (NVMe, optimizer state alone)",
         "check that host memory holds what the plan offloads to CPU, or leave offload out",
         "{\"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": {\"device\": "
         "\"nvme\"}}}"),
    Rule("CP907", _W, "fp16 loss scaling is left to the training loop",
         "scale the loss with ShardedGradScaler in the loop, or train in bf16",
         "mixed_precision: fp16"),
    Rule("CP908", _W, "a feature with no equal in composer_par",
         "leave it out, or add the plugin the message names",
         "fsdp_config:\n  fsdp_activation_checkpointing_offload: true"),
    Rule("CP909", Severity.INFO, "a setting of the launch or the training loop, not of a plan",
         "give it to the launcher (torchrun) or the training loop",
         "{\"gradient_clipping\": 1.0}"),
    Rule("CP910", _W, "weights loaded on one rank and broadcast",
         "build the model on meta; add load_safetensors (or meta_init)",
         "fsdp_config:\n  fsdp_cpu_ram_efficient_loading: true"),
    Rule("CP911", Severity.INFO, "checkpoints are composer_par's sharded layout",
         "save with composer_par.checkpoint; export full weights as safetensors",
         "fsdp_config:\n  fsdp_state_dict_type: FULL_STATE_DICT"),
    Rule("CP912", _W, "a setting the importer does not know",
         "check its spelling; the plan leaves it out",
         "fsdp_config:\n  fsdp_ofload_params: true"),
    Rule("CP913", _E, "the layout needs a node count the config does not give",
         "give the node count: composer-par import --nodes N",
         "composer-par import --fsdp \"hybrid_shard\" --fsdp-config '{\"version\": 1}'"),
    Rule("CP914", Severity.INFO, "an \"auto\" value is left to the trainer",
         "a loop setting: give it to the training loop (the Trainer's arguments); mixed "
         "precision: set fsdp2's mixed_precision", "{\"bf16\": {\"enabled\": \"auto\"}}"),
    Rule("CP915", Severity.INFO, "context parallelism done another way (exact attention "
         "either way)", "nothing to do; mode = \"allgather\" takes any head count",
         "parallelism_config:\n  parallelism_config_cp_size: 2\n"
         "  parallelism_config_cp_comm_strategy: alltoall"),
    Rule("CP917", Severity.INFO, "a setting its own tool does not read in this config",
         "nothing to do, or set what makes the tool read it",
         "distributed_type: MULTI_GPU\nfsdp_config:\n  fsdp_version: 2"),
    Rule("CP918", _W, "a per-module plan or layout of transformers the plan does its own way",
         "give the plugin's own option (tp plan table, ep expert_tp) when the default is "
         "not what you want", "DistributedConfig(tp_size=2, tp_plan={\"lm_head\": "
         "\"colwise\"})"),
    # CP981-CP989: writing a plan's job for a scheduler (composer_par.launch).
    Rule("CP981", _E, "the job's size is not known",
         "add [topology] to the plan, or pass --nodes and --devices-per-node",
         "composer-par launch plan.toml --slurm -- train.py plan.toml  # no [topology]"),
    Rule("CP982", _E, "GPUs per node differ from the plan's devices per node",
         "ask for as many GPUs per node as the plan has processes per node",
         "composer-par launch plan.toml --slurm --gpus-per-node 4 -- train.py plan.toml"
         "  # [topology] devices_per_node = 8"),
    Rule("CP983", _E, "a Kubernetes job without a container image",
         "pass --image with the image that holds the training script and composer-par",
         "composer-par launch plan.toml --kubernetes -- train.py plan.toml"),
    Rule("CP984", _E, "a multi-node torchrun launch without the first node's address",
         "pass --rdzv-host with the address of the node that hosts the rendezvous",
         "composer-par launch plan.toml --torchrun -- train.py plan.toml  # 2 nodes"),
    Rule("CP985", _E, "the job name is not one the scheduler accepts",
         "give --name lowercase letters, digits and '-', starting with a letter, at most "
         "63 characters",
         "composer-par launch plan.toml --kubernetes --image img --name My_Job -- train.py"),
)


# -- the plugins' catalogs -----------------------------------------------------------------

# Every class that lists rules of its own, as weak references: a plugin class defined and
# dropped (in a test, a notebook) takes its catalog with it.
_CATALOG_OWNERS: list[weakref.ref[type]] = []


def register_catalog(owner: type) -> None:
    """Make ``owner.rules`` known to finding severities and :data:`RULES`.

    :class:`composer_par.plugin.Plugin` calls it for every subclass it sees defined, so a
    plugin's codes are known as soon as its class is (no torch import needed).
    """
    rules = owner.__dict__.get("rules")
    if not rules:
        return
    for rule in rules:
        if not isinstance(rule, Rule):
            raise TypeError(f"{owner.__qualname__}.rules must hold Rule values; got {rule!r}")
    # attrs' slotted classes replace the class they decorate: the newer one stands for both.
    _CATALOG_OWNERS[:] = [
        ref for ref in _CATALOG_OWNERS
        if (cls := ref()) is not None
        and (cls.__module__, cls.__qualname__) != (owner.__module__, owner.__qualname__)
    ]
    _CATALOG_OWNERS.append(weakref.ref(owner))


def plugin_catalogs() -> list[tuple[type, tuple[Rule, ...]]]:
    """``(class, its rules)`` for every plugin class with rules of its own that exists now,
    in the order they were defined."""
    out: list[tuple[type, tuple[Rule, ...]]] = []
    alive: list[weakref.ref[type]] = []
    for ref in _CATALOG_OWNERS:
        owner = ref()
        if owner is None:
            continue
        alive.append(ref)
        out.append((owner, tuple(owner.__dict__.get("rules", ()))))
    _CATALOG_OWNERS[:] = alive
    return out


def _catalog_rule(owner: Any, code: str) -> Rule | None:
    for rule in getattr(owner, "rules", None) or ():
        if isinstance(rule, Rule) and rule.code == code:
            return rule
    return None


def rule_for(code: str, plugin: str | None = None) -> Rule | None:
    """The rule behind ``code``: the core's; else the catalog of the plugin whose hook is
    running now; else that of a plugin class named ``plugin``; else any known catalog's."""
    rule = CORE_RULES.get(code)
    if rule is not None:
        return rule
    current = CURRENT_PLUGIN.get()
    if current is not None:
        rule = _catalog_rule(current, code)
        if rule is not None:
            return rule
    catalogs = plugin_catalogs()
    if plugin:
        for owner, _ in catalogs:
            if getattr(owner, "name", None) == plugin:
                rule = _catalog_rule(owner, code)
                if rule is not None:
                    return rule
    for owner, _ in catalogs:
        rule = _catalog_rule(owner, code)
        if rule is not None:
            return rule
    return None


class KnownRules(Mapping[str, Rule]):
    """Every rule code of this environment, read-only and sorted by code: the core's and
    every installed plugin's (loaded through the entry-point registry on first use, once
    per process). Where two catalogs give one code different meanings, the core's wins,
    else the first installed (``composer-par rules`` reports it). A plugin class defined
    elsewhere (a test, a notebook) is not installed: its codes are not listed here, though
    its findings still take their severities from its catalog."""

    _cached: dict[str, Rule] | None = None

    def _table(self) -> dict[str, Rule]:
        if self._cached is None:
            from composer_par.rules import catalogs

            table: dict[str, Rule] = {}
            for _, rule in catalogs():
                table.setdefault(rule.code, rule)
            self._cached = dict(sorted(table.items()))
        return self._cached

    def __getitem__(self, code: str) -> Rule:
        return self._table()[code]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())

    def __contains__(self, code: object) -> bool:
        return code in self._table()

    def __repr__(self) -> str:
        return f"KnownRules({len(self)} codes)"


RULES: Mapping[str, Rule] = KnownRules()


# The plugin whose hook is running now (set by the plan's hook caller): a finding made
# without naming a plugin names this one.
CURRENT_PLUGIN: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "composer_par_current_plugin", default=None
)


@attrs.frozen
class Finding:
    """One validation result: what is wrong, which plugin it concerns, and the fix.

    Made inside a plugin's hook without ``plugin=``, it names that plugin.
    """

    code: str
    message: str
    fix: str = ""
    plugin: str | None = None
    # None means the rule's own severity (see rule_for); a code no catalog has: ERROR.
    severity: Severity = attrs.field(default=None)  # type: ignore[assignment]

    def __attrs_post_init__(self) -> None:
        if self.plugin is None:
            current = CURRENT_PLUGIN.get()
            if current is not None and getattr(current, "name", None):
                object.__setattr__(self, "plugin", current.name)
        if self.severity is None:
            rule = rule_for(self.code, self.plugin)
            object.__setattr__(self, "severity", rule.severity if rule else Severity.ERROR)
        elif not isinstance(self.severity, Severity):
            object.__setattr__(self, "severity", Severity(self.severity))

    @property
    def is_input_error(self) -> bool:
        """The plan file itself could not be understood (CLI exit code 2)."""
        return self.code.startswith("CP5")

    def format(self) -> str:
        where = f" [{self.plugin}]" if self.plugin else ""
        text = f"{self.severity.value.upper()} {self.code}{where}: {self.message}"
        if self.fix:
            text += f"\n    fix: {self.fix}"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "severity": self.severity.value,
            "code": self.code,
            "plugin": self.plugin,
            "message": self.message,
            "fix": self.fix,
        }


def _findings(value: Iterable[Finding]) -> tuple[Finding, ...]:
    # A typed converter: with a bare ``tuple`` mypy cannot see what Report() takes.
    return tuple(value)


@attrs.frozen
class Report:
    """All findings of one validation, errors first."""

    findings: tuple[Finding, ...] = attrs.field(converter=_findings, factory=tuple)

    @classmethod
    def of(cls, findings: Iterable[Finding]) -> Report:
        order = {Severity.ERROR: 0, Severity.WARNING: 1, Severity.INFO: 2}
        return cls(sorted(findings, key=lambda f: (order[f.severity], f.code)))

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity is Severity.ERROR)

    @property
    def warnings(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity is Severity.WARNING)

    @property
    def ok(self) -> bool:
        return not self.errors

    def codes(self) -> list[str]:
        return [f.code for f in self.findings]

    def exit_code(self) -> int:
        """The CLI's: 2 the input was unreadable, 1 errors, 0 clean or warnings only."""
        if any(f.is_input_error for f in self.findings):
            return 2
        return 1 if self.errors else 0

    def format(self) -> str:
        if not self.findings:
            return "plan is valid: no findings"
        lines = [f.format() for f in self.findings]
        lines.append(
            f"{len(self.errors)} error(s), {len(self.warnings)} warning(s), "
            f"{len(self.findings) - len(self.errors) - len(self.warnings)} info"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "findings": [f.to_dict() for f in self.findings]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __add__(self, other: Report) -> Report:
        return Report.of((*self.findings, *other.findings))


class PlanError(Exception):
    """``apply()`` refused: the plan has errors. ``.report`` carries every finding."""

    def __init__(self, report: Report) -> None:
        self.report = report
        super().__init__("the plan has errors; nothing was applied\n" + report.format())


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'dp_shard'?)`` or an empty string."""
    if not isinstance(word, str):  # e.g. dim = 0 from a plan file: nothing is close
        return ""
    close = difflib.get_close_matches(word, [c for c in choices if isinstance(c, str)], n=1,
                                      cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
