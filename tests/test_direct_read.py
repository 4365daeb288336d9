"""Reading a stored chunk straight into its target (checkpoint.direct_read): the layout it
finds in a torch.save zip, the parts it reads (bitwise what torch.load and narrow give),
the ones it leaves to DCP, and the loads that go through it."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from composer_par.checkpoint import direct_read

PAD = 37  # bytes before the zip, as a chunk in the middle of a .distcp file has


def stored(tmp_path: Path, tensor: torch.Tensor, name: str = "c.bin") -> tuple[int, Any]:
    buffer = io.BytesIO()
    buffer.write(b"\xab" * PAD)
    torch.save(tensor, buffer)
    length = buffer.tell() - PAD
    buffer.write(b"\xcd" * 19)  # and bytes after it
    path = tmp_path / name
    path.write_bytes(buffer.getvalue())
    fd = os.open(path, os.O_RDONLY)
    return fd, direct_read.stored_tensor(fd, PAD, length)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.int64, torch.int8, torch.bool, torch.complex64,
                                   torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_dtype_reads_bitwise(tmp_path: Path, dtype: torch.dtype) -> None:
    tensor = (torch.randn(6, 5, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    fd, layout = stored(tmp_path, tensor)
    try:
        assert layout is not None and layout.dtype == dtype and layout.size == (6, 5)
        target = torch.empty(4, 5, dtype=dtype)
        version = target._version
        assert direct_read.read_into(fd, layout, (2, 0), (4, 5), target)
        assert torch.equal(target.view(torch.uint8), tensor[2:].view(torch.uint8))
        assert target._version > version  # as after the copy_ it stands in for
    finally:
        os.close(fd)


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), data=st.data(),
       transposed=st.booleans(), offset=st.integers(0, 7))
def test_any_part_reads_what_torch_load_gives_or_is_left_to_dcp(
        tmp_path_factory: pytest.TempPathFactory, shape: list[int], data: Any,
        transposed: bool, offset: int) -> None:
    """Random stored layouts (a view into a larger storage, transposed) and random parts:
    a part it reads equals torch.load's narrowed tensor bitwise; it declines exactly the
    parts that are not one contiguous run of the stored bytes."""
    numel = 1
    for n in shape:
        numel *= n
    base = torch.arange(numel + offset + 3, dtype=torch.float32)
    tensor = base[offset:offset + numel].view(shape)
    if transposed and len(shape) > 1:
        tensor = tensor.transpose(0, -1)
    starts = [data.draw(st.integers(0, n - 1)) for n in tensor.shape]
    lengths = [data.draw(st.integers(1, n - s)) for n, s in zip(tensor.shape, starts,
                                                                strict=True)]
    fd, layout = stored(tmp_path_factory.mktemp("part"), tensor)
    try:
        assert layout is not None
        expected = tensor
        for dim, (s, n) in enumerate(zip(starts, lengths, strict=True)):
            expected = expected.narrow(dim, s, n)
        target = torch.full(lengths, -1.0)
        read = direct_read.read_into(fd, layout, starts, lengths, target)
        assert read == expected.is_contiguous()
        if read:
            assert torch.equal(target, expected)
        else:
            assert torch.equal(target, torch.full(lengths, -1.0))  # nothing written
    finally:
        os.close(fd)


def test_targets_it_cannot_fill_are_left_untouched(tmp_path: Path) -> None:
    tensor = torch.arange(12.0).view(3, 4)
    fd, layout = stored(tmp_path, tensor)
    try:
        for target, offsets, lengths in [
            (torch.zeros(3, 4, dtype=torch.float64), (0, 0), (3, 4)),  # a dtype to convert
            (torch.zeros(4, 3).t(), (0, 0), (3, 4)),  # not contiguous
            (torch.zeros(3, 3), (0, 0), (3, 4)),  # the wrong shape
            (torch.zeros(2, 4), (2, 0), (2, 4)),  # past the stored tensor
            (torch.zeros(3, 4, device="meta"), (0, 0), (3, 4)),  # not on the CPU
        ]:
            before = target.clone() if target.device.type == "cpu" else None
            assert not direct_read.read_into(fd, layout, offsets, lengths, target)
            if before is not None:
                assert torch.equal(target, before)
    finally:
        os.close(fd)


@pytest.mark.parametrize("damage", ["end record", "directory", "pickle", "byteorder",
                                    "local header", "too short"])
def test_a_zip_it_does_not_recognise_is_left_to_dcp(tmp_path: Path, damage: str) -> None:
    """A damaged or unfamiliar zip gives None (DCP reads it, and reports its own error):
    never a layout that would read the wrong bytes."""
    tensor = torch.arange(64.0)
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    raw = bytearray(buffer.getvalue())
    if damage == "end record":
        raw[-22:-18] = b"XXXX"
    elif damage == "directory":
        at = raw.index(b"PK\x01\x02")
        raw[at:at + 4] = b"PK\x01\x09"
    elif damage == "pickle":
        at = raw.index(b"_rebuild_tensor_v2")
        raw[at:at + 18] = b"_rebuild_tensor_v9"
    elif damage == "byteorder":
        at = raw.index(b"little")
        raw[at:at + 6] = b"big\x00\x00\x00"
    elif damage == "local header":
        at = raw.index(b"PK\x03\x04", raw.index(b"data/0") - 40)
        raw[at:at + 4] = b"PK\x03\x09"
    path = tmp_path / "c.bin"
    path.write_bytes(bytes(raw))
    fd = os.open(path, os.O_RDONLY)
    try:
        length = 100 if damage == "too short" else len(raw)
        assert direct_read.stored_tensor(fd, 0, length) is None
    finally:
        os.close(fd)


def test_a_checkpoint_load_reads_every_tensor_directly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """checkpoint.load of a model and its optimizer: every stored tensor goes straight
    into its target (none through torch.load), and the state comes back bitwise."""
    from composer_par import checkpoint as ck

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model.register_buffer("scale", torch.randn(3, 5).to(torch.bfloat16))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    ck.save(tmp_path, model, optimizer, step=1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for value in model.state_dict().values():
            value.zero_()
    read: list[bool] = []
    real = direct_read.read_into

    def counted(*args: Any) -> bool:
        ok = real(*args)
        read.append(ok)
        return ok

    loads: list[Any] = []
    real_load = torch.load
    monkeypatch.setattr(direct_read, "read_into", counted)

    def counted_load(*args: Any, **kwargs: Any) -> Any:
        loads.append(args)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", counted_load)
    ck.load(tmp_path, model, optimizer)
    assert read and all(read)
    assert loads == []
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key
