"""Sharp inputs where FP4 attention breaks down, and a table of every method on them.

Video DiTs have what Gaussian test inputs lack: a few Q/K channels 10–100× larger than the rest,
attention sinks (a few keys every query attends to), sharp attention (large logits), and V tokens
far larger than the rest. :func:`make_inputs` builds each of them, alone or together, so that the
same inputs serve the accuracy table (``fp4video accuracy``), the property tests and the GPU
tests. Each distribution is a :class:`Sharpness`; :data:`DISTRIBUTIONS` names the table's.

:data:`CLIFFS` are inputs of the same kinds taken far past them, where methods stop working: a
K mean 10-100× the table's, temperature 100, V spikes 10^6 above the rest, and fp32 V entirely
in the subnormal range. The accuracy report shows them in a table of their own (:func:`cliff_table`),
so that the limits can say where each method stops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..metrics import row_cosine

__all__ = ["Sharpness", "DISTRIBUTIONS", "CLIFFS", "CLIFF_SIZE", "make_inputs", "row_cosine", "row_relative_error",
           "robustness_table", "cliff_table"]


@dataclass(frozen=True)
class Sharpness:
    """How far an input departs from i.i.d. Gaussians (each 0 / 1 means off).

    ``temperature``: Q multiplied by it (logits grow with it; 1 = unit-variance logits at
    scale 1/sqrt(D)); ``outlier_channels`` Q/K channels multiplied by ``outlier_factor``;
    ``sinks`` keys aligned with the mean query (``sink_strength`` × its direction), which every
    query attends to; ``k_mean`` / ``v_mean``: the std of a per-channel mean added to K / V;
    ``v_outlier_tokens`` V rows multiplied by ``v_outlier_factor``; ``v_scale``: all of V multiplied
    by it last, in fp32 (1e-39: V entirely subnormal)."""

    temperature: float = 1.0
    outlier_channels: int = 0
    outlier_factor: float = 30.0
    sinks: int = 0
    sink_strength: float = 20.0
    k_mean: float = 0.0
    v_mean: float = 0.0
    v_outlier_tokens: int = 0
    v_outlier_factor: float = 1e3
    v_scale: float = 1.0


#: The distributions of the robustness table: name -> Sharpness.
DISTRIBUTIONS = {
    "gaussian": Sharpness(),
    "sharp (t=4)": Sharpness(temperature=4.0),
    "outlier channels": Sharpness(outlier_channels=4, outlier_factor=30.0),
    "attention sinks": Sharpness(sinks=4, sink_strength=20.0),
    "K and V means": Sharpness(k_mean=2.6, v_mean=1.0),
    "V outlier tokens": Sharpness(v_outlier_tokens=4, v_outlier_factor=1e3),
    "all of them": Sharpness(temperature=2.0, outlier_channels=4, sinks=4, k_mean=2.6, v_mean=1.0,
                             v_outlier_tokens=4, v_outlier_factor=1e2),
}

#: Accuracy cliffs: the table's kinds of input far past its ranges (name -> Sharpness), run at
#: :data:`CLIFF_SIZE`. Not part of the main table (whose worst column the speed plot reads).
CLIFFS = {
    "K mean ×10": Sharpness(k_mean=26.0),
    "K mean ×100": Sharpness(k_mean=260.0),
    "sharp (t=100)": Sharpness(temperature=100.0),
    "V spikes ×1e6": Sharpness(v_outlier_tokens=4, v_outlier_factor=1e6),
    "V < 3e-39 (fp32)": Sharpness(v_scale=5e-40),
}
#: The cliff inputs' size (half the main table's queries and keys: the table stays cheap)
CLIFF_SIZE = {"sq": 128, "sk": 256}


def make_inputs(sharp: Sharpness, *, batch: int = 1, heads: int = 2, sq: int = 256, sk: int = 512,
                head_dim: int = 64, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu"):
    """(q, k, v) in (B, H, S, D) layout, drawn on the CPU in fp32 from ``seed`` (the same values on
    every device), then cast."""
    g = torch.Generator().manual_seed(seed)
    d = head_dim

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    q, k, v = randn(batch, heads, sq, d), randn(batch, heads, sk, d), randn(batch, heads, sk, d)
    if sharp.outlier_channels:
        ch = torch.randperm(d, generator=g)[: sharp.outlier_channels]
        q[..., ch] *= sharp.outlier_factor
        k[..., ch] *= sharp.outlier_factor
    if sharp.sinks:
        tok = torch.randperm(sk, generator=g)[: sharp.sinks]
        direction = q.mean(dim=2, keepdim=True)
        direction = direction / direction.norm(dim=-1, keepdim=True).clamp(min=1e-6)
        k[:, :, tok] = k[:, :, tok] + sharp.sink_strength * direction
    if sharp.k_mean:
        k = k + sharp.k_mean * randn(batch, heads, 1, d)
    if sharp.v_mean:
        v = v + sharp.v_mean * randn(batch, heads, 1, d)
    if sharp.v_outlier_tokens:
        tok = torch.randperm(sk, generator=g)[: sharp.v_outlier_tokens]
        v[:, :, tok] *= sharp.v_outlier_factor
    q = q * sharp.temperature
    if sharp.v_scale != 1.0:
        v = v * sharp.v_scale
    return tuple(t.to(dtype=dtype, device=device) for t in (q, k, v))


def row_relative_error(got: torch.Tensor, want: torch.Tensor, floor: float = 1e-6) -> torch.Tensor:
    """``||got - want|| / max(||want||, floor · largest ||want||)`` per row, fp64: a row the
    reference makes (nearly) zero is judged against the tensor's scale, not its own."""
    g, w = (x.double().reshape(-1, x.shape[-1]) for x in (got, want))
    nw = w.norm(dim=-1)
    return (g - w).norm(dim=-1) / torch.clamp(nw, min=floor * float(nw.max().clamp(min=1e-300)))


def robustness_table(methods, seed: int = 0, distributions=None, **size) -> dict:
    """{distribution: {method: {cossim, worst_row_cossim, rows_below_0.99, rel_l1}}} of the
    reference backend against fp64 attention on the same inputs (``size``: :func:`make_inputs`'s
    ``sq``, ``sk``, ...)."""
    from ..attention import fp4_attention
    from ..metrics import compare

    out = {}
    for name, sharp in (distributions or DISTRIBUTIONS).items():
        q, k, v = make_inputs(sharp, seed=seed, **size)
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
        row = {}
        for m in methods:
            got = fp4_attention(q, k, v, method=m, backend="reference")
            c = row_cosine(got, ref)
            row[m] = {**compare(got, ref), "worst_row_cossim": float(c.min()),
                      "rows_below_0.99": float((c < 0.99).double().mean())}
        out[name] = row
    return out


def cliff_table(methods, seed: int = 0) -> dict:
    """:func:`robustness_table` on :data:`CLIFFS` at :data:`CLIFF_SIZE`."""
    return robustness_table(methods, seed, CLIFFS, **CLIFF_SIZE)
