"""MXAttention (Yu et al., arXiv 2607.24377): UOS's Qmax = 7.25, the OCP overflow probability, PNQ's row sums,
and the sequential ablation, at op level.

The UOS objective (MXAttention §4.1 and App. C, reconstructed from the paper's equations): a
block whose maximum is normalized to ``x = M / 2^e`` has, per unit of ``M²``, the error
``D(x) = E(x) / x³`` with ``E(x) = ∫₀ˣ (t − Q(t))² dt`` (``Q`` = E2M1 rounding, saturating at 6).
With the log-periodic density ``g`` of the normalized maximum, ``J(q) = ∫_{q/2}^{q} D g dx`` and
``J'(q) = g(q)[D(q) − D(q/2)]``: the optimum solves ``Δ(q) = E(q) − 8E(q/2) = 0``, whose root
is ``q* = 29/4 = 7.25`` (the paper's Table 6 gives ``Δ = (48q² − 864q + 3983)/8`` for q > 10,
which :func:`delta` reproduces).
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from ..formats import E2M1_VALUES, UOS_QMAX, mx_exponent, quantize_dequantize
from ..metrics import compare
from ..recipe import METHODS, AttentionRecipe
from ..reference import quantize_p

PUBLISHED = {
    "qmax_star": 7.25,
    "ocp_overflow_probability": math.log2(8 / 7),  # ≈ 19.27 %
    "mean_row_sum_direct": 0.9266,  # Fig. 7(A), real Wan2.2/HunyuanVideo tensors
    "row_sum_components": {"zeroing": -0.0541, "saturation": -0.0190, "down": -0.0486, "up": 0.0483},
    # Table 4: share of per-block MSE optima (Wan2.2 Q, K, V) at 7.25
    "wan_mse_optimum_share_725": {"Q": 0.95, "K": 0.90, "V": 0.90},
}

QMAX_SWEEP = [round(6.0 + 0.05 * i, 2) for i in range(41)]  # 6.00 .. 8.00
ABLATION = ["mxattn", "mxattn-no-uos", "mxattn-no-pnq-uos", "mxfp4-ocp"]

# --- the data-free objective -------------------------------------------------------------------

# E2M1 rounding as intervals [lo, hi) -> value; ties go to the even code: 0.25->0, 0.75->1,
# 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4 (ties have measure zero in the integrals anyway).
_MIDPOINTS = [Fraction(1, 4), Fraction(3, 4), Fraction(5, 4), Fraction(7, 4), Fraction(5, 2), Fraction(7, 2), Fraction(5)]
_GRID = [Fraction(v).limit_denominator() for v in E2M1_VALUES]


def _segments():
    edges = [Fraction(0), *_MIDPOINTS, None]
    return [(edges[i], edges[i + 1], _GRID[i]) for i in range(8)]


def integrated_error(x) -> Fraction | float:
    """E(x) = ∫₀ˣ (t − Q(t))² dt, exact for Fraction input."""
    exact = isinstance(x, Fraction)
    total = Fraction(0) if exact else 0.0
    for lo, hi, val in _segments():
        top = x if hi is None else min(x, hi)
        if top <= lo:
            break
        lo_, top_, val_ = (lo, top, val) if exact else (float(lo), float(top), float(val))
        total += ((top_ - val_) ** 3 - (lo_ - val_) ** 3) / 3
    return total


def delta(q):
    """Δ(q) = E(q) − 8E(q/2): negative below q*, zero at q* = 29/4, positive above."""
    return integrated_error(q) - 8 * integrated_error(q / 2)


def qmax_from_delta() -> Fraction:
    """Root of Δ on (6, 8) by exact bisection down to 2^-40, then the nearest simple fraction."""
    lo, hi = Fraction(6), Fraction(8)
    assert delta(lo) < 0 < delta(hi)
    for _ in range(40):
        mid = (lo + hi) / 2
        if delta(mid) < 0:
            lo = mid
        else:
            hi = mid
    return ((lo + hi) / 2).limit_denominator(64)


def integrated_error_t(x: torch.Tensor) -> torch.Tensor:
    """Vectorized fp64 E(x), the same piecewise integral as :func:`integrated_error`."""
    x = x.double()
    total = torch.zeros_like(x)
    for lo, hi, val in _segments():
        lo, val = float(lo), float(val)
        top = x if hi is None else torch.clamp(x, max=float(hi))
        total += torch.where(x > lo, ((top - val) ** 3 - (lo - val) ** 3) / 3, 0.0)
    return total


def objective(q: float, density=None, n: int = 4000) -> float:
    """J(q) = ∫_{q/2}^{q} E(x)/x³ · g(x) dx (midpoint rule), g = H(log2 x) / (x ln 2)."""
    h = density or (lambda t: torch.ones_like(t))
    dx = (q / 2) / n
    x = q / 2 + (torch.arange(n, dtype=torch.float64) + 0.5) * dx
    g = h(torch.log2(x)) / (x * math.log(2))
    return float((integrated_error_t(x) / x**3 * g).sum() * dx)


#: Densities of the wrapped phase log2(x) mod 1: log-uniform and three non-uniform ones.
DENSITIES = {
    "log-uniform": lambda t: torch.ones_like(t),
    "1+0.5cos(2πt)": lambda t: 1 + 0.5 * torch.cos(2 * math.pi * t),
    "1+0.8sin(2πt)": lambda t: 1 + 0.8 * torch.sin(2 * math.pi * t),
    "1+0.6cos(4πt+1)": lambda t: 1 + 0.6 * torch.cos(4 * math.pi * t + 1),
}


def objective_minimizers(grid=None) -> dict:
    """argmin of J over q in [6, 8] (step 0.01) for each density, and the curves for plotting."""
    grid = grid or [6.0 + 0.01 * i for i in range(201)]
    result = {}
    for name, h in DENSITIES.items():
        vals = [objective(q, h) for q in grid]
        i = min(range(len(vals)), key=vals.__getitem__)
        result[name] = {"qmax": round(grid[i], 2), "curve": vals}
    return {"grid": grid, "densities": result}


# --- per-tensor MSE sweeps -------------------------------------------------------------------


def _open_uniform(shape, g: torch.Generator) -> torch.Tensor:
    """Uniform draws in the open interval (0, 1), in fp64: ``torch.rand``'s fp32 values are
    multiples of 2^-24 in [0, 1), and 0 comes up about once in 16 million draws (every few seeds
    over a sweep's 2 million), where an inverse CDF takes log(0). Shifting by half a step, exactly
    in fp64, puts every value strictly inside (2^-25 from either end) without changing the stream."""
    return torch.rand(shape, generator=g).double() + 2.0**-25


def random_operand(dist: str, g: torch.Generator, shape=(256, 1024)) -> torch.Tensor:
    """A finite fp32 tensor of ``dist`` for every seed (tails are bounded by the draws' resolution:
    Laplace by 24 ln 2 ≈ 16.6, Student-t by the smallest fp32 chi-square)."""
    if dist == "gaussian":
        return torch.randn(shape, generator=g)
    if dist == "laplace":
        u = _open_uniform(shape, g) - 0.5  # (-0.5, 0.5), never 0 or ±0.5
        return (-torch.sign(u) * torch.log1p(-2 * u.abs())).float()
    if dist == "student-t3":
        z = torch.randn(shape, generator=g)
        chi2 = torch.randn((3, *shape), generator=g).pow(2).sum(0)
        # three normals all 0 (or their squares underflowing) would divide by 0
        return z / torch.sqrt(chi2.clamp_min(torch.finfo(chi2.dtype).tiny) / 3)
    if dist == "uniform":
        return torch.rand(shape, generator=g) * 2 - 1
    if dist == "outlier-channels":  # activations with a few large channels, as in Q/K
        x = torch.randn(shape, generator=g)
        cols = torch.randperm(shape[-1], generator=g)[: shape[-1] // 64]
        x[:, cols] *= 10
        return x
    raise ValueError(f"unknown distribution {dist!r}")


SWEEP_DISTRIBUTIONS = ("gaussian", "laplace", "student-t3", "uniform", "outlier-channels")


def mse_sweep(seed: int = 0, tensors: int = 8, progress=None) -> dict:
    """For each distribution and tensor, the Qmax in 6.00..8.00 (step 0.05) with the lowest
    MXFP4 MSE under e = ceil(log2(amax / Qmax)), as the paper's per-block oracle (Table 4)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for dist in SWEEP_DISTRIBUTIONS:
        optima, curves = [], []
        for _ in range(tensors):
            x = random_operand(dist, g)
            mse = [float((quantize_dequantize(x, "mxfp4", scale_rule=q) - x).pow(2).mean()) for q in QMAX_SWEEP]
            optima.append(QMAX_SWEEP[min(range(len(mse)), key=mse.__getitem__)])
            curves.append(mse)
        mean_curve = [sum(c[i] for c in curves) / len(curves) for i in range(len(QMAX_SWEEP))]
        ref = mean_curve[QMAX_SWEEP.index(7.25)]
        out[dist] = {
            "optima": optima,
            "share_at_7.25": sum(o == 7.25 for o in optima) / len(optima),
            "share_7.20_to_7.30": sum(7.2 <= o <= 7.3 for o in optima) / len(optima),
            "pooled_optimum": QMAX_SWEEP[min(range(len(mean_curve)), key=mean_curve.__getitem__)],
            "relative_mse": [c / ref for c in mean_curve],
            "mse_ocp_over_uos": float(
                (quantize_dequantize(x, "mxfp4", scale_rule="ocp") - x).pow(2).mean()
                / (quantize_dequantize(x, "mxfp4", scale_rule="uos") - x).pow(2).mean()
            ),
        }
        if progress:
            progress(dist)
    return out


def ocp_overflow(seed: int = 0, blocks: int = 1 << 18) -> dict:
    """Share of blocks whose OCP-normalized maximum falls in [7, 8) (saturated to 6)."""
    g = torch.Generator().manual_seed(seed)
    log_uniform = torch.exp2(torch.rand(blocks, generator=g, dtype=torch.float64) * 20 - 10).float()
    gauss = torch.randn(blocks, 32, generator=g).abs().amax(-1)

    def share(amax):
        x = amax.double() / torch.ldexp(torch.ones_like(amax.double()), mx_exponent(amax, "ocp"))
        return float((x >= 7).double().mean())

    return {"analytic": math.log2(8 / 7), "log_uniform_maxima": share(log_uniform), "gaussian_blocks": share(gauss)}


# --- PNQ: row sums -------------------------------------------------------------------------------


def row_sum_stats(p: torch.Tensor, rule: str) -> dict:
    """Row sums of MXFP4-quantized normalized probabilities (direct) and their decomposition by
    the rounding outcome of each element; with PNQ the induced weights P̂/ΣP̂ sum to one."""
    recipe = AttentionRecipe(pv_format="mxfp4", scale_rule=rule)
    p = p.float()
    p_hat = quantize_p(p, recipe)
    sums = p_hat.double().sum(-1)
    d = (p_hat - p).double()
    zero = (p_hat == 0) & (p > 0)
    exp = mx_exponent(p.reshape(*p.shape[:-1], -1, 32).abs().amax(-1), rule)
    block_scale = torch.ldexp(torch.ones_like(p), exp.repeat_interleave(32, dim=-1))
    saturated = (p / block_scale) > 6
    rows = p.shape[0]
    comp = {
        "zeroing": float(d[zero].sum() / rows),
        "saturation": float(d[saturated & ~zero].sum() / rows),
        "down": float(d[(d < 0) & ~zero & ~saturated].sum() / rows),
        "up": float(d[d > 0].sum() / rows),
    }
    pnq = (p_hat.double() / sums.unsqueeze(-1)).sum(-1)
    return {
        "rule": rule,
        "mean_row_sum": float(sums.mean()),
        "share_under": float((sums < 1).double().mean()),
        "share_over": float((sums > 1).double().mean()),
        "components": comp,
        "pnq_max_abs_dev": float((pnq - 1).abs().max()),
        "row_sums": sums.float(),
    }


def pnq_experiment(seed: int = 0, n_keys: int = 4096, n_queries: int = 1024) -> dict:
    """Diffuse attention (Gaussian Q/K, normalized entropy ≈ 0.93) over 4096 keys."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_queries, 128, generator=g, dtype=torch.float64)
    k = torch.randn(n_keys, 128, generator=g, dtype=torch.float64)
    p = torch.softmax(q @ k.T / math.sqrt(128), -1)
    ent = float(-(p * p.log()).sum(-1).mean() / math.log(n_keys))
    return {"norm_entropy": ent, "ocp": row_sum_stats(p, "ocp"), "uos": row_sum_stats(p, "uos")}


# --- sequential ablation on inputs with outlier channels ------------------------------------------


def outlier_inputs(seed: int = 0, heads: int = 4, n: int = 1024, d: int = 128, outliers: int = 4):
    """(1, H, n, d) inputs shaped like trained attention: Q and K share a few large channels per
    head (K's with an offset), V has a per-channel mean; attention stays diffuse (entropy ≈ 0.9).
    V's mean is what makes a row-sum error visible: every row's output is scaled by it."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, n, d, generator=g)
    k = torch.randn(1, heads, n, d, generator=g)
    v = torch.randn(1, heads, n, d, generator=g) + 2 * torch.randn(1, heads, 1, d, generator=g)
    for h in range(heads):
        cols = torch.randperm(d, generator=g)[:outliers]
        q[0, h, :, cols] *= 5
        k[0, h, :, cols] = 0.5 * k[0, h, :, cols] + 3
    return q, k, v


def ablation(seed: int = 0, methods=ABLATION) -> dict:
    from ..attention import fp4_attention

    q, k, v = outlier_inputs(seed)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    p = torch.softmax(q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
    ent = float(-(p * p.clamp_min(1e-300).log()).sum(-1).mean() / math.log(p.shape[-1]))
    rows = {m: compare(fp4_attention(q, k, v, method=m, backend="reference"), ref) for m in methods}
    return {"norm_entropy": ent, "methods": rows, "recipes": {m: METHODS[m].describe() for m in methods}}


def run(seed: int = 0, progress=None) -> dict:
    step = progress or (lambda *_: None)
    out: dict = {}
    step("UOS: data-free objective")
    root = qmax_from_delta()
    mins = objective_minimizers()
    out["uos"] = {
        "qmax_star": float(root),
        "qmax_star_fraction": f"{root.numerator}/{root.denominator}",
        "delta_at_7.25": float(delta(Fraction(29, 4))),
        "delta_q12_matches_table6": float(delta(Fraction(12))) == (48 * 144 - 864 * 12 + 3983) / 8,
        "objective_minimizers": {k_: v_["qmax"] for k_, v_ in mins["densities"].items()},
        "ocp_overflow_probability": math.log2(8 / 7),
        "constant": UOS_QMAX,
    }
    out["_objective_curves"] = mins
    step("UOS: MSE sweeps")
    out["mse_sweep"] = mse_sweep(seed, progress=None)
    out["ocp_overflow"] = ocp_overflow(seed)
    step("PNQ: row sums")
    out["pnq"] = pnq_experiment(seed)
    step("sequential ablation")
    out["ablation"] = ablation(seed)
    return out
