"""The option helpers of composer_par.plugin, and the one dtype-name table every part of
the project reads (plugin options, plan files, the estimator, the compress plugin)."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import pytest

from composer_par import FSDP2, MixedPrecision, ParallelPlan, PlanFileError
from composer_par.dtypes import ALIASES, BYTES, CANONICAL, DtypeError, accepted_names, dtype_name
from composer_par.estimate import EstimateError, Workload
from composer_par.estimate import dtype_name as estimate_dtype_name
from composer_par.plugin import (
    OptionError,
    Plugin,
    bool_option,
    dtype_option,
    int_option,
)


@attrs.frozen
class Options(Plugin):
    name: ClassVar[str] = "options"

    depth: int = int_option(2, low=1, high=8)
    floor: int = int_option(0, low=0)
    ceiling: int = int_option(0, high=10)
    anything: int = int_option(5)
    on: bool = bool_option(True)
    dtype: str | None = dtype_option()
    fallback: str | None = dtype_option("fp32")


# -- bounded ints ---------------------------------------------------------------------------


def test_int_option_keeps_ints_in_range() -> None:
    assert Options(depth=8, floor=10**12, ceiling=-3, anything=-7).depth == 8
    for value, message in [(0, "depth must be an int in [1, 8]; got 0"),
                           (9, "depth must be an int in [1, 8]; got 9"),
                           (True, "depth must be an int in [1, 8]; got True"),
                           (2.0, "depth must be an int in [1, 8]; got 2.0"),
                           ("2", "depth must be an int in [1, 8]; got '2'")]:
        with pytest.raises(OptionError) as info:
            Options(depth=value)
        assert str(info.value) == message
    with pytest.raises(OptionError, match="floor must be an int >= 0; got -1"):
        Options(floor=-1)
    with pytest.raises(OptionError, match="ceiling must be an int <= 10; got 11"):
        Options(ceiling=11)
    with pytest.raises(OptionError, match="anything must be an int; got None"):
        Options(anything=None)  # type: ignore[arg-type]


def test_option_errors_are_type_and_value_errors() -> None:
    # attrs' own validators raise either; callers catching one or the other keep working
    assert issubclass(OptionError, TypeError) and issubclass(OptionError, ValueError)


# -- bools ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, 1, "true", "yes", "", None, 1.0])
def test_bool_option_refuses_what_is_not_a_bool(bad: Any) -> None:
    with pytest.raises(OptionError) as info:
        Options(on=bad)
    assert str(info.value) == f"on must be true or false; got {bad!r}"


def test_bool_option_takes_bools() -> None:
    assert Options(on=False).on is False and Options().on is True


def test_a_plan_file_value_of_the_wrong_type_names_the_option() -> None:
    text = '[mesh]\ndp_shard = 2\n[[plugins]]\nname = "compile"\nfullgraph = 1\n'
    with pytest.raises(PlanFileError) as info:
        ParallelPlan.from_toml(text)
    (finding,) = info.value.report.findings
    assert finding.code == "CP506" and "fullgraph must be true or false; got 1" in finding.message


# -- dtype names ---------------------------------------------------------------------------


def test_dtype_option_stores_the_canonical_name() -> None:
    assert Options(dtype="BF16").dtype == "bfloat16"
    assert Options().fallback == "float32" and Options().dtype is None
    with pytest.raises(OptionError) as info:
        Options(dtype="int8")
    assert str(info.value).startswith("dtype: dtype must be one of")
    with pytest.raises(OptionError, match="fallback: dtype must be one of"):
        Options(fallback=3)  # type: ignore[arg-type]


def test_the_table_is_closed() -> None:
    assert set(ALIASES.values()) <= set(CANONICAL) == set(BYTES)
    assert set(accepted_names()) == {*CANONICAL, *ALIASES}
    for bad in ("int8", "fp8", "bfloat", "", "torch.int32", None, 16):
        with pytest.raises(DtypeError, match="dtype must be one of"):
            dtype_name(bad)


def _spellings() -> list[str]:
    """Every accepted name as written, in upper case, capitalized, and torch-prefixed."""
    out = []
    for name in accepted_names():
        out += [name, name.upper(), name.capitalize(), f"torch.{name}" if name in CANONICAL
                else name.swapcase()]
    return out


def _readers() -> dict[str, Any]:
    """Every place that reads a dtype name, as a function of the name."""

    def plan_file(name: str) -> str:
        text = ('[mesh]\ndp_shard = 2\n[[plugins]]\nname = "fsdp2"\n'
                f'[plugins.mixed_precision]\nparam_dtype = "{name}"\n')
        plugin = ParallelPlan.from_toml(text).plugins[0]
        assert isinstance(plugin, FSDP2) and plugin.mixed_precision is not None
        return str(plugin.mixed_precision.param_dtype)

    return {
        "composer_par.dtypes": dtype_name,
        "estimate": estimate_dtype_name,
        "the estimate's workload": lambda n: Workload(seq=1, dtype=n).dtype,
        "FSDP2 mixed precision": lambda n: MixedPrecision(reduce_dtype=n).reduce_dtype,
        "FSDP2's mixed_precision shorthand": lambda n: FSDP2(
            mixed_precision=n).mixed_precision.param_dtype,  # type: ignore[union-attr]
        "a plugin's dtype_option": lambda n: Options(dtype=n).dtype,
        "a plan file": plan_file,
    }


@pytest.mark.parametrize("spelling", _spellings())
def test_every_alias_is_accepted_everywhere_case_insensitively(spelling: str) -> None:
    expected = dtype_name(spelling)
    assert expected in CANONICAL
    for where, read in _readers().items():
        assert read(spelling) == expected, where


@pytest.mark.parametrize("bad", ["int8", "FP8", "bf15"])
def test_every_reader_refuses_the_same_names(bad: str) -> None:
    for where, read in _readers().items():
        with pytest.raises((DtypeError, EstimateError, OptionError, PlanFileError)) as info:
            read(bad)
        text = str(info.value)
        if isinstance(info.value, PlanFileError):
            text = info.value.report.format()
        assert "dtype must be one of" in text, where


def test_the_torch_dtypes_are_accepted_and_named_as_torch_names_them() -> None:
    import torch

    for name in CANONICAL:
        assert dtype_name(getattr(torch, name)) == name
        assert MixedPrecision(param_dtype=getattr(torch, name)).param_dtype == name
        assert getattr(torch, name).itemsize == BYTES[name]


def test_the_compress_plugin_reads_its_methods_through_the_table() -> None:
    compress = pytest.importorskip("composer_par_compress")
    for spelling in ("bf16", "BF16", "bfloat16", "torch.bfloat16", "BFloat16"):
        assert compress.Compress(method=spelling).method == "bf16"
    for spelling in ("fp16", "half", "HALF", "float16", "torch.float16"):
        assert compress.Compress(method=spelling).method == "fp16"
    with pytest.raises(ValueError, match="method must be one of"):
        compress.Compress(method="fp32")  # a dtype, but no compression method
