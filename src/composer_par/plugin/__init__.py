"""Everything a plugin author touches, in one import (placeholder; the guide follows)."""

from composer_par.blocks import Block, BlockSpec, clean_name, names_near
from composer_par.dtypes import DtypeError, dtype_name
from composer_par.findings import Finding, Report, Rule, Severity, did_you_mean
from composer_par.mesh import MeshSpec
from composer_par.plugin.base import (
    PROJECT,
    STAGES,
    Claim,
    Declaration,
    EstimateSettings,
    Plugin,
    Role,
    Stage,
    hookimpl,
    hookspec,
)
from composer_par.plugin.caller import HookCaller
from composer_par.plugin.comm import (
    COLLECTIVES,
    CommHook,
    CommSetup,
    GradBucket,
    GradReducer,
    InstalledCommHook,
    all_reduce_mean,
)
from composer_par.plugin.context import AppliedStep, ApplyContext
from composer_par.plugin.options import (
    OptionError,
    blocks_option,
    bool_option,
    dim_option,
    dtype_option,
    int_option,
    ordering_option,
)
from composer_par.plugin.view import PlanView
from composer_par.plugin.wrapping import (
    ALREADY_WRAPPED,
    already_wrapped,
    wrapped_block_findings,
)
from composer_par.topology import Topology

__all__ = [
    "ALREADY_WRAPPED",
    "COLLECTIVES",
    "PROJECT",
    "STAGES",
    "AppliedStep",
    "ApplyContext",
    "Block",
    "BlockSpec",
    "Claim",
    "CommHook",
    "CommSetup",
    "Declaration",
    "DtypeError",
    "EstimateSettings",
    "Finding",
    "GradBucket",
    "GradReducer",
    "HookCaller",
    "InstalledCommHook",
    "MeshSpec",
    "OptionError",
    "PlanView",
    "Plugin",
    "Report",
    "Role",
    "Rule",
    "Severity",
    "Stage",
    "Topology",
    "all_reduce_mean",
    "already_wrapped",
    "blocks_option",
    "bool_option",
    "clean_name",
    "did_you_mean",
    "dim_option",
    "dtype_name",
    "dtype_option",
    "hookimpl",
    "hookspec",
    "int_option",
    "names_near",
    "ordering_option",
    "wrapped_block_findings",
]
