"""How a healing group receives a live group's state: torchft's HTTP checkpoint transport,
read with torch's weights-only unpickler.

torchft's ``HTTPTransport`` serves the state a live group stages for the groups that
heal from it and fetches it on their side, but loads what it fetches with
``weights_only=False``: a full unpickle of whatever a peer sends. The subclass here keeps
torchft's server, staging and locking, refuses to stage anything but plain tensors,
numbers, strings and containers (the shard-local state of :mod:`.state`), and fetches
with ``weights_only=True``, so no code travels between groups.
"""

from __future__ import annotations

import urllib.request
from datetime import timedelta
from typing import Any

from composer_par.plugin import torch_private


def _plain_leaves(tree: Any, path: str = "state") -> None:
    """Raise TypeError naming the first leaf of ``tree`` that is no plain tensor or value."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(tree, dict):
        for key, value in tree.items():
            _plain_leaves(value, f"{path}[{key!r}]")
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            _plain_leaves(value, f"{path}[{i}]")
    elif isinstance(tree, DTensor) or (isinstance(tree, torch.Tensor)
                                       and type(tree) is not torch.Tensor
                                       and not isinstance(tree, torch.nn.Parameter)):
        raise TypeError(f"{path} is a {type(tree).__name__}: a healing group receives plain "
                        "tensors only (this rank's local parts)")
    elif not isinstance(tree, (torch.Tensor, int, float, str, bool, type(None))):
        raise TypeError(f"{path} is a {type(tree).__name__}: a healing group receives "
                        "tensors, numbers, strings and containers only")


def weights_only_transport(timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport, staging plain state and fetching it weights-only
    (made here so that torchft is imported only when a plan uses it)."""
    from torchft.checkpointing import HTTPTransport

    class WeightsOnlyHTTPTransport(HTTPTransport):  # type: ignore[misc]
        def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any,
                            timeout: timedelta) -> None:
            _plain_leaves(state_dict)
            super().send_checkpoint(dst_ranks, step, state_dict, timeout)

        def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                            timeout: timedelta) -> Any:
            url = torch_private.torchft_checkpoint_url(metadata, step)
            with urllib.request.urlopen(url, timeout=timeout.total_seconds()) as stream:
                return torch_private.streaming_load(stream)

    # One stream per checkpoint (no chunks): the URL recv_checkpoint fetches.
    return WeightsOnlyHTTPTransport(timeout=timeout, num_chunks=0)


__all__ = ["weights_only_transport"]
