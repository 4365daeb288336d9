"""MetaInit refuses to leave a parameter uninitialized: a module its initializer does not
write (a custom module inside a Hugging Face model, whose ``_init_weights`` knows only
transformers' own classes) would otherwise train from whatever memory ``to_empty`` left."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from composer_par import MeshSpec, MetaInit, ParallelPlan
from composer_par.plugin.initialize import UninitializedError


class Scale(nn.Module):
    """A learnable per-channel scale with no init of its own."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.empty(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def test_a_custom_module_in_a_hugging_face_model_is_reported_not_left_as_garbage() -> None:
    pytest.importorskip("transformers")
    from tests import hf_workers

    model = hf_workers.build("llama")  # on meta
    with torch.device("meta"):
        model.model.layers[0].post_scale = Scale(8)
    with pytest.raises(UninitializedError) as caught:
        ParallelPlan(MeshSpec()).use(MetaInit(seed=1)).apply(model)
    message = str(caught.value)
    assert caught.value.names == ["model.layers.0.post_scale.gain"], message
    assert "Scale by LlamaForCausalLM._init_weights" in message
    assert "init_fn" in message and "reset_parameters" in message


def test_an_init_fn_that_covers_the_module_trains_from_written_values() -> None:
    pytest.importorskip("transformers")
    from tests import hf_workers

    model = hf_workers.build("llama")
    with torch.device("meta"):
        model.model.layers[0].post_scale = Scale(8)
    hf_init = model._init_weights

    def init(module: nn.Module) -> None:
        if isinstance(module, Scale):
            nn.init.ones_(module.gain)
        else:
            hf_init(module)

    ParallelPlan(MeshSpec()).use(MetaInit(seed=1, init_fn=init)).apply(model)
    assert torch.equal(model.model.layers[0].post_scale.gain, torch.ones(8))
    assert all(not torch.isnan(p).any() for p in model.parameters())


def test_a_reset_parameters_that_skips_a_parameter_is_reported() -> None:
    class HalfInit(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(4, 4))
            self.bias = nn.Parameter(torch.empty(4))

        def reset_parameters(self) -> None:
            nn.init.zeros_(self.weight)  # the bias is forgotten

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), HalfInit())
    expected = r"1\.bias.*HalfInit by HalfInit\.reset_parameters"
    with pytest.raises(UninitializedError, match=expected):
        ParallelPlan(MeshSpec()).use(MetaInit()).apply(model)


def test_an_initializer_that_registers_new_parameters_has_initialized_them() -> None:
    class Replaces(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(3))

        def reset_parameters(self) -> None:
            self.weight = nn.Parameter(torch.full((3,), 2.0))

    with torch.device("meta"):
        model = nn.Sequential(Replaces())
    ParallelPlan(MeshSpec()).use(MetaInit()).apply(model)
    assert torch.equal(model[0].weight, torch.full((3,), 2.0))


@pytest.mark.parametrize("dtype", [
    torch.float64, torch.float32, torch.bfloat16, torch.float16,
    torch.float8_e4m3fn, torch.float8_e5m2,
    torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu,
])
def test_the_sentinel_tells_a_written_first_element_from_an_unwritten_one(dtype) -> None:
    from composer_par.plugin.initialize.unwritten import plant_sentinel, sentinel_intact

    for written in (torch.ones(3), torch.zeros(3), torch.full((3,), -2.0)):
        tensor = torch.zeros(3, dtype=dtype)
        mark = plant_sentinel(tensor)
        assert mark is not None
        assert sentinel_intact(mark), f"{dtype}: the planted NaN reads as written"
        tensor[1:].copy_(written[1:])  # not the first element: still unwritten
        assert sentinel_intact(mark)
        tensor.copy_(written)
        assert not sentinel_intact(mark), f"{dtype}: {written[0].item()} reads as unwritten"


def test_a_dtype_without_a_nan_goes_unwatched_instead_of_failing() -> None:
    from composer_par.plugin.initialize.unwritten import plant_sentinel

    assert plant_sentinel(torch.zeros(2, dtype=torch.float4_e2m1fn_x2)) is None
    assert plant_sentinel(torch.zeros(2, dtype=torch.int64)) is None
    assert plant_sentinel(torch.zeros(0)) is None


def test_a_parameter_added_to_one_torch_layer_is_reported() -> None:
    # torch.nn's own reset_parameters writes what its class registers, not a parameter
    # set on one instance later.
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
        model[2].scale = nn.Parameter(torch.empty(4))
    with pytest.raises(UninitializedError, match=r"2\.scale.*Linear by Linear\.reset_parameters"):
        ParallelPlan(MeshSpec()).use(MetaInit()).apply(model)


def test_a_subclass_of_a_torch_layer_with_a_parameter_of_its_own_is_reported() -> None:
    class GatedLinear(nn.Linear):
        def __init__(self) -> None:
            super().__init__(4, 4)
            self.gate = nn.Parameter(torch.empty(4))  # nn.Linear.reset_parameters skips it

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), GatedLinear(), GatedLinear())
    with pytest.raises(UninitializedError) as caught:
        ParallelPlan(MeshSpec()).use(MetaInit()).apply(model)
    assert caught.value.names == ["1.gate", "2.gate"]


def test_a_torch_layer_is_reported_when_torch_nn_init_is_replaced(monkeypatch) -> None:
    # transformers' no_init_weights swaps torch.nn.init's functions for no-ops: then a
    # torch layer's reset_parameters writes nothing, and the sentinel must tell.
    def skip(*args, **kwargs):
        return args[0] if args else None

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    monkeypatch.setattr(nn.init, "kaiming_uniform_", skip)
    with pytest.raises(UninitializedError) as caught:
        ParallelPlan(MeshSpec()).use(MetaInit()).apply(model)
    assert caught.value.names == ["0.weight"]  # the bias is drawn by uniform_, intact
