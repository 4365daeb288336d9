"""PowerSGD (Vogels et al., 2019): rank-``r`` gradient all-reduce with error feedback.

For each gradient matrix ``M`` (this rank's shard of a weight, ``rows x cols``), with the
error ``E`` this rank kept from the last step and ``Q`` (``cols x r``) from the last step
(or random, the same on every rank):

    M = grad + E                      (error feedback)
    P = M Q            -> all-reduce P (one collective for all matrices of the bucket)
    P = orthonormalize(P)             (Gram-Schmidt, fp32, identical on every rank)
    Q = M^T P          -> all-reduce Q, divide by the divisor
    grad = P Q^T                      (the same on every rank: ~ the mean of the M)
    E = M - P Q^T                     (what this rank still owes)

Vectors (biases, norms), tensors under ``min_compress_numel`` elements and matrices a
rank-``r`` factorization would not shrink at least 2x are all-reduced uncompressed, in
one flat collective per bucket. A ``256 x 256`` weight at rank 4 sends ``(256 + 256) * 4``
numbers instead of ``65536``: 32x fewer.

torch's own hooks are not used: ``batched_powerSGD_hook`` fails in ``_orthogonalize`` on
gloo/CPU, ``powerSGD_hook`` is a DDP comm hook (a ``GradBucket`` of DDP's C++ reducer),
and neither knows FSDP's flat per-module buffers.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from composer_par.plugin import GradBucket, all_reduce_mean

from composer_par_compress.estimate import compressible

EPS = 1e-8
DEPENDENT = 1e-4  # a column keeping less than this of its norm is in the others' span


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormalize the columns of ``p`` in place (modified Gram-Schmidt, fp32).

    A column that is (numerically) in the span of the previous ones becomes zero rather
    than noise, so a gradient of rank < r gives an exact, not a random, approximation.
    """
    for i in range(p.shape[1]):
        col = p[:, i]
        before = torch.linalg.vector_norm(col)
        for j in range(i):
            other = p[:, j]
            col.sub_(other * torch.dot(other, col))
        norm = torch.linalg.vector_norm(col)
        # What is left of a dependent column is rounding noise (~1e-7 of it in fp32).
        if norm > max(EPS, DEPENDENT * float(before)):
            col.div_(norm)
        else:
            col.zero_()
    return p


class PowerSGD:
    """A :class:`~composer_par.plugin.comm.GradReducer`; state is kept per bucket and parameter."""

    def __init__(self, *, rank: int = 4, min_compress_numel: int = 4096, start_step: int = 0,
                 error_feedback: bool = True, warm_start: bool = True, seed: int = 0) -> None:
        self.rank = rank
        self.min_compress_numel = min_compress_numel
        self.start_step = start_step
        self.error_feedback = error_feedback
        self.warm_start = warm_start
        self.seed = seed
        self.steps: dict[str, int] = {}
        self.errors: dict[tuple[str, str], torch.Tensor] = {}
        self.qs: dict[tuple[str, str], torch.Tensor] = {}

    def __call__(self, bucket: GradBucket) -> None:
        step = self.steps.get(bucket.key, 0)
        self.steps[bucket.key] = step + 1
        if bucket.group.size() == 1 or step < self.start_step or bucket.params is None:
            all_reduce_mean(bucket)
            return
        matrices = []
        plain = []
        for name, view in bucket.params:
            if compressible(tuple(view.shape), self.rank, self.min_compress_numel):
                matrices.append((name, view))
            else:
                plain.append(view)
        if plain:
            self._plain(plain, bucket)
        if matrices:
            self._compressed(matrices, bucket)

    def _plain(self, views: list[torch.Tensor], bucket: GradBucket) -> None:
        flat = torch.cat([v.reshape(-1) for v in views])
        dist.all_reduce(flat, group=bucket.group)
        flat.div_(bucket.divisor)
        offset = 0
        for view in views:
            view.copy_(flat[offset:offset + view.numel()].view_as(view))
            offset += view.numel()

    def _compressed(self, matrices: list[tuple[str, torch.Tensor]], bucket: GradBucket) -> None:
        ms, qs = [], []
        for name, view in matrices:
            key = (bucket.key, name)
            m = view.reshape(view.shape[0], -1).to(torch.float32, copy=True)
            if self.error_feedback and key in self.errors:
                m.add_(self.errors[key])
            q = self.qs.get(key) if self.warm_start else None
            if q is None:
                q = self._initial_q(key, m.shape[1]).to(m.device)
            ms.append(m)
            qs.append(q)
        ps = [m @ q for m, q in zip(ms, qs, strict=True)]
        p_flat = _reduce([p.reshape(-1) for p in ps], bucket.group)
        ps = _split(p_flat, ps)
        for p in ps:
            orthonormalize(p)
        qs = [m.t() @ p for m, p in zip(ms, ps, strict=True)]
        q_flat = _reduce([q.reshape(-1) for q in qs], bucket.group)
        q_flat.div_(bucket.divisor)
        qs = _split(q_flat, qs)
        for (name, view), m, p, q in zip(matrices, ms, ps, qs, strict=True):
            key = (bucket.key, name)
            approx = p @ q.t()
            if self.error_feedback:
                self.errors[key] = m.sub_(approx)
            if self.warm_start:
                self.qs[key] = q.clone()
            view.copy_(approx.view_as(view))

    def _initial_q(self, key: tuple[str, str], cols: int) -> torch.Tensor:
        # The same on every rank of the group: seeded by the option and the names only.
        seed = zlib.crc32(f"{self.seed}:{key[0]}:{key[1]}".encode())
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(cols, self.rank, generator=gen)


def _reduce(parts: list[torch.Tensor], group: dist.ProcessGroup) -> torch.Tensor:
    flat = torch.cat(parts)
    dist.all_reduce(flat, group=group)
    return flat


def _split(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        out.append(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return out
