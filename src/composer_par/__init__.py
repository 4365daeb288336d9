"""composer_par: compose PyTorch parallelism as plugins over a named device mesh.

    plan = ParallelPlan(MeshSpec(dp_shard=4)).use(FSDP2()).use(MetaInit(seed=0))
    model = plan.apply(model)

Importing this package does not import torch; applying a plan does.
"""

from composer_par.blocks import BlockSpec, find_blocks
from composer_par.findings import RULES, Finding, PlanError, Report, Severity
from composer_par.logging import configure_logging, get_logger
from composer_par.mesh import MeshError, MeshSpec
from composer_par.plan import Explanation, ParallelPlan
from composer_par.planfile import PlanFileError
from composer_par.plugin import Claim, Declaration, Plugin, Role, Stage, hookimpl
from composer_par.plugin.registry import Registry, RegistryError
from composer_par.plugins.activation_checkpoint import ActivationCheckpoint
from composer_par.plugins.compile import Compile
from composer_par.plugins.cp import CP
from composer_par.plugins.ep import EP
from composer_par.plugins.float8 import Float8
from composer_par.plugins.fsdp2 import FSDP2, MixedPrecision
from composer_par.plugins.ft import FaultTolerance
from composer_par.plugins.hsdp import HSDP
from composer_par.plugins.load_checkpoint import LoadCheckpoint
from composer_par.plugins.load_safetensors import LoadSafetensors
from composer_par.plugins.meta_init import MetaInit
from composer_par.plugins.offload import Offload
from composer_par.plugins.pp import PP
from composer_par.plugins.tp import TP
from composer_par.replicas import ReplicaDriftError, check_replicas
from composer_par.topology import Topology

__version__ = "0.1.0"

__all__ = [
    "CP",
    "EP",
    "FSDP2",
    "HSDP",
    "PP",
    "RULES",
    "TP",
    "ActivationCheckpoint",
    "BlockSpec",
    "Claim",
    "Compile",
    "Declaration",
    "Explanation",
    "FaultTolerance",
    "Finding",
    "Float8",
    "LoadCheckpoint",
    "LoadSafetensors",
    "MeshError",
    "MeshSpec",
    "MetaInit",
    "MixedPrecision",
    "Offload",
    "ParallelPlan",
    "PlanError",
    "PlanFileError",
    "Plugin",
    "Registry",
    "RegistryError",
    "ReplicaDriftError",
    "Report",
    "Role",
    "Severity",
    "Stage",
    "Topology",
    "check_replicas",
    "configure_logging",
    "find_blocks",
    "get_logger",
    "hookimpl",
]
