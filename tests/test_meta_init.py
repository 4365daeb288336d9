"""MetaInit: bitwise the same weights on any layout and world size for one seed."""

from __future__ import annotations

import pytest
import torch

from composer_par import FSDP2, MeshError, MeshSpec, MetaInit, ParallelPlan, PlanError, Topology
from composer_par.testing.distributed import run_ranks
from composer_par.testing.parity import full_parameters
from composer_par.testing.tasks import llama
from tests.meta_init_workers import materialize


def single_process(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    with torch.device("meta"):
        model = llama.build()
    model = ParallelPlan(MeshSpec()).use(MetaInit(seed=seed)).apply(model)
    return full_parameters(model), dict(model.named_buffers())


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"


def test_an_init_fn_that_names_nothing_installed_is_found_without_a_model() -> None:
    """Model-less validation looks the package up without importing it: CP224, a warning;
    with the model the string is imported: CP404, and nothing is touched."""
    plan = ParallelPlan(MeshSpec()).use(MetaInit(init_fn="no_such_package_anywhere:init"))
    (finding,) = plan.validate().findings
    assert finding.code == "CP224" and "no_such_package_anywhere" in finding.message
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(2, 3))
    assert sorted(plan.validate(model).codes()) == ["CP224", "CP404"]
    with pytest.raises(PlanError):
        plan.apply(model)
    assert all(p.is_meta for p in model.parameters())
    # a string that is no 'module:function' at all: the same two findings
    malformed = ParallelPlan(MeshSpec()).use(MetaInit(init_fn=":init"))
    assert "is not 'package.module:function'" in malformed.validate().findings[0].message
    assert sorted(malformed.validate(model).codes()) == ["CP224", "CP404"]


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 4])
def test_same_weights_on_1_2_and_4_ranks(world: int) -> None:
    reference, ref_buffers = single_process(seed=3)
    results = run_ranks(materialize, world, args=({"dp_shard": world}, 3), timeout=120)
    assert [r["rank"] for r in results] == list(range(world))
    for result in results:  # every rank's view, each rank's buffers its own
        assert_bitwise(result["params"], reference)
        assert_bitwise(result["buffers"], ref_buffers)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_sharded_scratch_takes_each_parameters_dtype_not_the_default() -> None:
    """A sharded parameter is initialized in a full-size scratch tensor: under a default
    dtype the model does not use, the scratch must still be the parameter's own (float64
    scratch would draw other random numbers)."""
    reference, _ = single_process(seed=4)
    results = run_ranks(materialize, 2, args=({"dp_shard": 2}, 4, "float64"), timeout=120)
    for result in results:
        assert {p.dtype for p in result["params"].values()} == {torch.float32}
        assert_bitwise(result["params"], reference)


def test_non_persistent_rope_buffer_is_recomputed() -> None:
    _, buffers = single_process(seed=0)
    eager = llama.build()  # built on CPU: the table computed in __init__
    for name, table in eager.named_buffers():
        assert torch.equal(buffers[name], table), name
        assert torch.isfinite(table).all()


def test_seed_changes_weights_and_is_reproducible() -> None:
    a, _ = single_process(seed=1)
    b, _ = single_process(seed=1)
    c, _ = single_process(seed=2)
    assert_bitwise(a, b)
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])


def test_init_does_not_disturb_the_callers_rng() -> None:
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    single_process(seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_each_module_gets_its_own_stream() -> None:
    # Same-shaped modules must not start from the same numbers.
    params, _ = single_process(seed=0)
    assert not torch.equal(params["layers.0.attention.wq.weight"],
                           params["layers.1.attention.wq.weight"])


def test_user_init_fn_is_called_children_first() -> None:
    seen: list[str] = []

    def init(module: torch.nn.Module) -> None:
        seen.append(type(module).__name__)
        for p in module.parameters(recurse=False):
            torch.nn.init.constant_(p, 0.5)

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    ParallelPlan(MeshSpec()).use(MetaInit(init_fn=init)).apply(model)
    assert seen == ["Linear", "Linear"]
    assert all(bool((p == 0.5).all()) for p in model.parameters())


class NoInit(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(3))


def test_module_without_init_is_refused_before_anything_changes() -> None:
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(2, 3), NoInit())
    with pytest.raises(PlanError) as err:
        ParallelPlan(MeshSpec()).use(MetaInit()).apply(model)
    assert err.value.report.codes() == ["CP404"]
    assert "1 (NoInit)" in str(err.value) and "reset_parameters" in str(err.value)
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_rank_holds_one_modules_full_parameters_at_a_time() -> None:
    result = run_ranks(materialize, 2, args=({"dp_shard": 2}, 0), timeout=90)[0]
    with torch.device("meta"):
        model = llama.build()
    largest = max(
        sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
        for m in model.modules()
    )
    assert result["peak"] == largest


def test_fsdp2_without_process_group_says_how_to_launch() -> None:
    with torch.device("meta"):
        model = llama.build()
    plan = ParallelPlan(MeshSpec(dp_shard=2), topology=Topology(nodes=1, devices_per_node=2))
    plan.use(FSDP2()).use(MetaInit())
    with pytest.raises(MeshError, match="torchrun"):
        plan.apply(model)


class TiedHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.out = torch.nn.Linear(4, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(x))


def test_tied_weights_stay_tied() -> None:
    # to_empty gives each registration its own new tensor; MetaInit ties them again.
    with torch.device("meta"):
        model = TiedHead()
    applied = ParallelPlan(MeshSpec()).use(MetaInit(seed=0)).apply(model)
    assert applied is model
    assert model.out.weight is model.emb.weight
    assert len(list(model.parameters())) == 1


def test_initializer_lookup_follows_what_the_module_would_call() -> None:
    """A module's own reset_parameters, one set on an instance, a staticmethod and a
    _reset_parameters are each what calling the method would do; a class without one
    has no initializer."""
    import torch.nn as nn

    from composer_par.plugin.initialize import initializer

    calls: list[str] = []

    class Plain(nn.Module):
        def reset_parameters(self) -> None:
            calls.append(f"plain {id(self)}")

    class Static(nn.Module):
        @staticmethod
        def reset_parameters() -> None:
            calls.append("static")

    class Private(nn.Module):
        def _reset_parameters(self) -> None:
            calls.append("private")

    a, b, shadowed = Plain(), Plain(), Plain()
    shadowed.reset_parameters = lambda: calls.append("instance")  # type: ignore[method-assign]
    root = nn.Sequential(a, b, shadowed, Static(), Private(), nn.ReLU())
    pick = initializer(root)
    for module in (a, b, shadowed, root[3], root[4]):
        init = pick(module)
        assert init is not None
        init(module)
    assert calls == [f"plain {id(a)}", f"plain {id(b)}", "instance", "static", "private"]
    assert pick(root[5]) is None


def test_modules_without_initializer_are_found_as_a_module_by_module_lookup_would() -> None:
    """without_initializer gives the modules owning tensors that initializer finds
    nothing for: an instance's own attribute, a class without an initializer and a
    module owning nothing each get their own answer."""
    import torch.nn as nn

    from composer_par.plugin.initialize import initializer, without_initializer

    class Bare(nn.Module):  # no initializer
        def __init__(self, owns: bool) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(2)) if owns else None

    class Static(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(2))

        @staticmethod
        def reset_parameters() -> None:
            pass

    given, unset = Bare(owns=True), nn.Linear(2, 2)
    given.reset_parameters = lambda: None  # type: ignore[attr-defined]
    unset.reset_parameters = None  # type: ignore[assignment, method-assign]
    lacking = Bare(owns=True)
    root = nn.Sequential(nn.Linear(2, 2), lacking, Bare(owns=False), given, unset, Static())
    modules = list(root.named_modules())
    pick = initializer(root)
    expected = [m for _, m in modules if pick(m) is None and (
        any(p is not None for p in m._parameters.values()) or m._buffers)]
    assert expected == [lacking, unset]
    assert without_initializer(root, [m for _, m in modules]) == expected
    assert without_initializer(root, [m for _, m in modules],
                               init_fn=lambda module: None) == []
    others = [nn.Linear(2, 2), Bare(owns=True), Bare(owns=False), Static(), nn.Linear(1, 1)]
    assert without_initializer(nn.Sequential(*others), others) == [others[1]]
