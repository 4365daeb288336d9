"""Loss parallelism: the loss computed on vocabulary-sharded logits, and its local value."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Compute the loss (and call ``backward``) on vocabulary-sharded logits.

    With ``TP(loss_parallel=True)`` the output head returns a DTensor sharded on its last
    tensor dim; ``F.cross_entropy`` on it must run inside this context, and so must the
    ``backward()`` of that loss::

        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()

    Without a DTensor the context changes nothing, so the same code runs on one process.
    """
    from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

    with torch_loss_parallel():
        yield


def local_loss(loss: Any) -> Any:
    """A loss computed under :func:`loss_parallel` is a replicated DTensor; its local value
    (the full loss on every rank) as a plain tensor, e.g. for logging or all_reduce."""
    from torch.distributed.tensor import DTensor

    return loss.to_local() if isinstance(loss, DTensor) else loss
