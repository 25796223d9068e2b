"""Accuracy metrics of the FP4 attention papers: CosSim, relative L1, RMSE (against a reference)."""

from __future__ import annotations

import torch

__all__ = ["cossim", "row_cosine", "rel_l1", "rmse", "compare"]


def cossim(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Cosine similarity of the flattened tensors, in fp64."""
    a, b = x.double().flatten(), ref.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.double().reshape(-1, x.shape[-1])


def row_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of every output row (the last dim), fp64; rows that are zero in both
    count as 1 (equal), a zero row against a nonzero one as 0."""
    a, b = _rows(a), _rows(b)
    na, nb = a.norm(dim=-1), b.norm(dim=-1)
    cos = (a * b).sum(-1) / (na * nb).clamp(min=1e-300)
    return torch.where((na == 0) & (nb == 0), torch.ones_like(cos), cos)


def rel_l1(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Σ|x − ref| / Σ|ref|."""
    return float((x.double() - ref.double()).abs().sum() / ref.double().abs().sum().clamp_min(1e-300))


def rmse(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).pow(2).mean().sqrt())


def compare(x: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    return {"cossim": cossim(x, ref), "rel_l1": rel_l1(x, ref), "rmse": rmse(x, ref)}
