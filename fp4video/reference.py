"""Reference FP4 attention in PyTorch: exactly the numerics the fused kernels compute.

Everything here works on fp32 tensors in (B, H, S, D) layout; :func:`fp4video.fp4_attention`
validates user input, handles layouts and masks and calls in here.

Two stages, as in a fused kernel:

1. **Pre-pass** (:func:`prepare_qkv`), once per tensor: optional K smoothing (subtract the
   per-channel mean over the keys that are visible to at least one query), optional Hadamard
   rotation of Q and K over the (zero-padded) head dim, block quantization of Q and K along the
   head dim and of V along tokens. Keys masked for every query are zeroed first, so they cannot
   move a block scale: masked keys contribute nothing, not even through their neighbours' scales.
2. **Online softmax over key tiles** of :data:`KEY_TILE` keys (:func:`attention_tiled`): for
   tile j, ``s = scale · Q̂ K̂_jᵀ``, running max ``m``, ``P̃ = exp(s − m)``, P̃ quantized in blocks
   along keys, ``acc = α·acc + P̂ V̂_j`` and the row sum ``ℓ = α·ℓ + ΣP̃`` (or ``ΣP̂`` under PNQ).
   The output is ``acc / ℓ``; the LSE is ``m + log ℓ`` (natural log, of the scaled logits; with
   K smoothing plus :func:`smoothing_lse_shift`, so that it is the LSE of the unsmoothed logits).

:func:`attention_materialized` quantizes the whole ``P̃ = exp(S − rowmax S)`` at once instead:
it equals the tiled result exactly whenever every row's maximum lies in the first key tile
(then the running max never changes), and differs only in how P's rounding falls otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .formats import E2M1_MAX, E4M3_MAX, Format, e4m3_pow2_quantize_dequantize, nvfp4_tensor_scale, quantize_dequantize
from .recipe import AttentionRecipe, PScale, RowSum
from .rotation import hadamard_matrix, next_power_of_two

__all__ = [
    "KEY_TILE",
    "QUERY_CHUNK",
    "TWO_LEVEL_P_RANGE",
    "TWO_LEVEL_P_FLOOR",
    "key_alive_from_mask",
    "smoothing_mean",
    "nonfinite_heads",
    "poison_heads",
    "smoothing_lse_shift",
    "LOGIT_BOUND",
    "QK_RESCALE_EXP",
    "V_RESCALE_EXP",
    "input_ranges",
    "range_summary",
    "RangePlan",
    "SCALE_EXP",
    "plan_ranges",
    "rescale_inputs",
    "rescale_output",
    "prepare_qkv",
    "quantize_p",
    "attention_tiled",
    "attention_materialized",
]

#: Keys per online-softmax tile; a multiple of both FP4 blocks (32 and 16), so P's quantization
#: blocks never straddle tiles. The Triton kernels use the same tile for P.
KEY_TILE = 128
#: Queries processed at once by the reference (memory only: rows are independent).
QUERY_CHUNK = 4096
#: Two-level P scaling maps each row's tile maximum to 448 · 6, the top of E4M3 × E2M1.
TWO_LEVEL_P_RANGE = E4M3_MAX * E2M1_MAX
#: The smallest tile maximum the two-level pre-scale follows: a row whose largest P̃ in a tile lies
#: below 2^-64 (its logits > 44 nats under the running maximum) is scaled as if its maximum were
#: 2^-64, so ``448·6 / max`` stays finite (≤ 2^75.4) and so do the kernels' accumulator units.
#: Such a tile carries < 2^-64 of the row's weight; its small values flush to zero.
TWO_LEVEL_P_FLOOR = 2.0**-64


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def qk_padded_dim(head_dim: int, recipe: AttentionRecipe) -> int:
    """Head dim Q and K are zero-padded to: a power of two for the Hadamard rotation, a block
    multiple for FP4 blocks along D. Zero channels change no logit."""
    d = head_dim
    if recipe.hadamard:
        d = next_power_of_two(d)
    if recipe.qk_format is not None:
        d = _ceil_to(d, recipe.qk_format.block)
    return d


def key_alive_from_mask(mask: torch.Tensor | None, sk: int | None = None) -> torch.Tensor | None:
    """(B|1, H|1, Sk) bool: keys visible to at least one query; None when there is no mask. A mask
    broadcast over keys (last dim 1) gives a key dim of 1, or of ``sk`` when it is given."""
    if mask is None:
        return None
    alive = mask.any(dim=-2)
    return alive if sk is None else alive.expand(*alive.shape[:-1], sk)


def smoothing_mean(k: torch.Tensor, key_alive: torch.Tensor | None = None) -> torch.Tensor:
    """K's per-channel mean over the keys some query sees, (..., 1, D) fp32 (K smoothing: exact,
    since softmax ignores the per-row shift q·mean). ``k`` must already be zero at dead keys; any
    float dtype, summed in fp32 as read (no fp32 copy of K: for a bf16 K at Wan 720p that copy cost
    more than the mean)."""
    if key_alive is None:
        return k.mean(dim=-2, keepdim=True, dtype=torch.float32)
    alive = key_alive.to(torch.bool).unsqueeze(-1)
    # a key_alive broadcast over keys (key dim 1) counts every key it covers, not one
    alive = alive.expand(*alive.shape[:-2], k.shape[-2], 1)
    count = alive.sum(-2, keepdim=True, dtype=torch.float32).clamp(min=1)
    return k.sum(-2, keepdim=True, dtype=torch.float32) / count


def nonfinite_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    key_alive: torch.Tensor | None = None) -> torch.Tensor:
    """(B, H) bool: heads whose Q, or whose K or V at a live key, hold a NaN or ±Inf.

    The NaN/Inf policy of every method and backend: such a head's whole output and LSE are NaN
    (block scales, K's mean and the Hadamard rotation would spread a non-finite value through
    the head anyway, and a NaN is never turned into a finite, wrong number). Keys no query sees
    are ignored, as everywhere. ``key_alive``: (B|1, H|1, Sk) bool or None."""

    def bad(x, alive=None):
        f = ~torch.isfinite(x)
        if alive is not None:
            f = f & alive.to(torch.bool).unsqueeze(-1)
        return f.flatten(-2).any(-1)

    b, h = q.shape[0], q.shape[1]
    return (bad(q) | bad(k, key_alive) | bad(v, key_alive)).expand(b, h)


def poison_heads(out: torch.Tensor, lse: torch.Tensor, bad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` (B, H, Sq, Dv) and ``lse`` (B, H, Sq) set to NaN in place at the heads ``bad`` (B, H)."""
    out.masked_fill_(bad[..., None, None], float("nan"))
    lse.masked_fill_(bad[..., None], float("nan"))
    return out, lse


def smoothing_lse_shift(q: torch.Tensor, mean: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale · q·mean`` per query row, (B, H, Sq) fp32: what K smoothing takes off every logit of
    a row. Softmax ignores it, the log-sum-exp does not: adding it back gives the LSE of the
    unsmoothed logits, which is what merging partial results (ring attention) needs, since each
    key shard has its own mean. ``q``: (B, H, Sq, D) as given; ``mean``: (B|1, H|1, 1, D) from
    :func:`smoothing_mean`.

    The dot products are elementwise products summed pairwise in a fixed order (not a batched
    matmul, whose rounding depends on how many heads it is given), so a head's shift, and with it
    the LSE, is bit for bit the same in a batched call and in a call for that head alone."""
    return _fixed_order_sum(q.float() * mean.float()) * scale


def _fixed_order_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim as a pairwise tree of elementwise additions: the same order, and so
    the same rounding, for every row whatever the tensor's other dims."""
    while x.shape[-1] > 1:
        n = x.shape[-1]
        half = n // 2
        head = x[..., :half] + x[..., half : 2 * half]
        x = torch.cat([head, x[..., 2 * half :]], dim=-1) if n % 2 else head
    return x[..., 0]


# --- the range of the finite-output guarantee -----------------------------------------------------

#: The finite-output guarantee's bound on a head's logits (nats): ``scale · D · max|q| · max|k|``
#: (D: Q's head dim; maxima over the head's queries and live keys; it bounds every logit of the
#: head, ``|scale · q·k| <= scale · ‖q‖ · ‖k‖``). Finite inputs within it give finite outputs and LSEs on
#: every method and backend; a call beyond it raises instead of returning NaN or ±inf.
LOGIT_BOUND = 2.0**64
#: Q (K) whose largest magnitude reaches 2^56 is computed as Q · 2^-a (K · 2^-b) with the scale
#: times 2^(a+b): the logits are the same numbers (powers of two are exact), and the rotation,
#: the smoothing and the fp32 dot products keep their headroom (D · 2^112 < 2^128).
QK_RESCALE_EXP = 56
#: A head whose V reaches 2^64 in magnitude is computed on V · 2^-s (s per head) and its output
#: multiplied by 2^s: the output is a convex combination of V, so any finite V has a representable
#: result, but the unnormalized accumulator sums up to Sk such terms.
V_RESCALE_EXP = 64


def _head_amax(x: torch.Tensor, alive: torch.Tensor | None = None) -> torch.Tensor:
    """(B, H) fp32: the largest |x| of each head over its rows (those ``alive`` (B|1, H|1, S|1)
    says are live), one read of x and no copy of it."""
    a = torch.linalg.vector_norm(x, ord=math.inf, dim=-1).float()
    if alive is not None:
        a = torch.where(alive.to(torch.bool), a, 0.0)
    return a.amax(dim=-1).expand(x.shape[0], x.shape[1])


def input_ranges(q, k, v, key_alive: torch.Tensor | None = None, bad: torch.Tensor | None = None) -> torch.Tensor:
    """(B, H, 3) fp32 on the inputs' device: max|q|, max|k| and max|v| of each head, K and V over its
    live keys only (``key_alive`` (B|1, H|1, Sk) or None); 0 at the heads ``bad`` (B, H) (NaN/Inf:
    those become NaN by the NaN/Inf policy, whatever their range)."""
    alive = None if key_alive is None else key_alive.to(torch.bool).expand(q.shape[0], q.shape[1], k.shape[-2])
    r = torch.stack([_head_amax(q), _head_amax(k, alive), _head_amax(v, alive)], dim=-1)
    if bad is not None:
        r = r.masked_fill(bad[..., None], 0.0)
    return torch.nan_to_num(r, nan=0.0)


def range_summary(ranges: torch.Tensor, scale: float, head_dim: int) -> torch.Tensor:
    """(4,) fp64 on the device: the largest max|q|, max|k|, max|v| over heads, and the largest
    logit bound ``scale · D · max|q| · max|k|`` of a head (what :func:`plan_ranges` reads)."""
    r = ranges.double().flatten(0, -2)
    logit = r[:, 0] * r[:, 1] * (float(scale) * head_dim)
    return torch.cat([r.amax(dim=0), logit.amax().reshape(1)])


@dataclass(frozen=True)
class RangePlan:
    """The exact power-of-two rescaling a call needs (:func:`plan_ranges`): Q by 2^-q_shift, K by
    2^-k_shift (either may be negative: a scale-up) with the scale times 2^(q_shift + k_shift), or
    the scale replaced by 1 (``unit_scale``: Q or K is all zeros, so every logit is 0 whatever the
    scale); V per head when ``v_rescale``."""

    q_shift: int = 0
    k_shift: int = 0
    v_rescale: bool = False
    unit_scale: bool = False

    @property
    def needed(self) -> bool:
        return bool(self.q_shift or self.k_shift or self.v_rescale or self.unit_scale)


#: The scale the kernels are handed lies within 2^±SCALE_EXP after the plan (fp32 holds it, its
#: product with log2(e) and with every Q̂·K̂ᵀ the bound allows): a larger or smaller one is moved
#: into Q and K, exactly.
SCALE_EXP = 64


def _exp2_of(x: float) -> int:
    """The e with 2^(e-1) <= x < 2^e (x > 0)."""
    return math.frexp(x)[1]


def plan_ranges(summary, scale: float, dtype: torch.dtype = torch.float32) -> RangePlan:
    """Check :func:`range_summary`'s values (a sequence of four floats) against the finite-output
    guarantee and say what to rescale; raises ValueError beyond :data:`LOGIT_BOUND`. Q and K of
    ``dtype`` stay below 2^QK_RESCALE_EXP (fp16: 2^14) and the scale within 2^±SCALE_EXP: the logits'
    bound guarantees both can hold at once."""
    aq, ak, av, logit = (float(x) for x in summary)
    if not logit <= LOGIT_BOUND:
        raise ValueError(
            f"q, k and scale: a head's logits may reach scale·D·max|q|·max|k| = {logit:.3g} nats, beyond the "
            f"{LOGIT_BOUND:.3g} (2^64) within which fp4_attention returns finite results; rescale q or k, "
            f"or lower scale (max|q| = {aq:.3g}, max|k| = {ak:.3g}, scale = {float(scale):.3g})")
    v_rescale = av >= 2.0**V_RESCALE_EXP
    if not (aq > 0 and ak > 0):
        return RangePlan(0, 0, v_rescale, unit_scale=not 2.0**-SCALE_EXP <= float(scale) <= 2.0**SCALE_EXP)
    top = min(QK_RESCALE_EXP, _exp2_of(torch.finfo(dtype).max) - 2)
    eq, ek = _exp2_of(aq), _exp2_of(ak)
    qs, ks = max(0, eq - top), max(0, ek - top)
    es = _exp2_of(float(scale)) + qs + ks  # the scale handed on lies below 2^es
    if es > SCALE_EXP:  # scale Q and K up (into their headroom), the scale down
        need = es - SCALE_EXP
        for _ in range(2):
            if need > 0 and top - (eq - qs) >= top - (ek - ks):
                up = min(need, top - (eq - qs)); qs -= up; need -= up
            if need > 0:
                up = min(need, top - (ek - ks)); ks -= up; need -= up
    elif es < -SCALE_EXP + 1:  # scale Q and K down, the scale up
        need = -SCALE_EXP + 1 - es
        down = min(need, max(0, (eq - qs) - (ek - ks)))  # the larger first
        qs += down; need -= down
        down = min(need, max(0, (ek - ks) - (eq - qs)))
        ks += down; need -= down
        qs += (need + 1) // 2
        ks += need // 2
    return RangePlan(qs, ks, v_rescale)


def _v_shift(ranges: torch.Tensor) -> torch.Tensor:
    """(B, H) fp32 powers of two 2^s per head with max|v| · 2^-s < 2^V_RESCALE_EXP (1 where it already is)."""
    _, e = torch.frexp(ranges[..., 2].float())
    return torch.exp2((e - V_RESCALE_EXP).clamp(min=0).float())


def _times_pow2(x: torch.Tensor, e: int) -> torch.Tensor:
    """``x · 2^e``, exact, in two factors (a shift past 2^±127 has no fp32 factor of its own)."""
    return x * 2.0 ** (e // 2) * 2.0 ** (e - e // 2)


def rescale_inputs(q, k, v, ranges: torch.Tensor, plan: RangePlan, scale: float):
    """(q, k, v, scale, V's factor per head (B, H) or None) rescaled by ``plan``: exact, powers of
    two (values over 2^190 below their tensor's largest may flush to zero). New tensors where a
    factor applies; the caller's are never modified."""
    if plan.q_shift:
        q = _times_pow2(q, -plan.q_shift)
    if plan.k_shift:
        k = _times_pow2(k, -plan.k_shift)
    v_factor = None
    if plan.v_rescale:
        v_factor = _v_shift(ranges)
        v = v * (1.0 / v_factor).to(v.dtype)[..., None, None]
    scale = 1.0 if plan.unit_scale else math.ldexp(float(scale), plan.q_shift + plan.k_shift)
    return q, k, v, scale, v_factor


def rescale_output(out: torch.Tensor, v_factor: torch.Tensor | None) -> torch.Tensor:
    """``out`` (B, H, Sq, Dv) times V's factor per head, saturating at its dtype's largest value
    (FP4 rounding may step past it, as everywhere)."""
    if v_factor is None:
        return out
    big = torch.finfo(out.dtype).max
    return (out.float() * v_factor[..., None, None]).clamp(-big, big).to(out.dtype)


def prepare_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    recipe: AttentionRecipe,
    key_alive: torch.Tensor | None = None,
    key_tile: int = KEY_TILE,
):
    """The pre-pass. Inputs (B, H, S, D), any float dtype; never modified.

    ``key_alive``: bool (B, H, Sk) or broadcastable, False for keys no query can see.
    Returns fp32 ``(q̂, k̂, v̂)`` holding the dequantized values, with Q/K padded along D as
    :func:`qk_padded_dim` says and K/V zero-padded along tokens to a multiple of ``key_tile``.
    """
    qf, kf, vf = q.float(), k.float(), v.float()
    sk = kf.shape[-2]
    if key_alive is not None:
        alive = key_alive.to(torch.bool).unsqueeze(-1)
        kf = torch.where(alive, kf, 0.0)
        vf = torch.where(alive, vf, 0.0)
    if recipe.smooth_k:
        kf = kf - smoothing_mean(kf, key_alive)
        if key_alive is not None:
            kf = torch.where(alive, kf, 0.0)

    d = qf.shape[-1]
    dp = qk_padded_dim(d, recipe)
    if dp != d:
        qf = torch.nn.functional.pad(qf, (0, dp - d))
        kf = torch.nn.functional.pad(kf, (0, dp - d))
    if recipe.hadamard:
        h = hadamard_matrix(dp, device=qf.device)
        qf, kf = qf @ h, kf @ h
    skp = _ceil_to(sk, key_tile)  # (zero keys change no block scale, no tensor scale, no group scale)
    if skp != sk:
        kf = torch.nn.functional.pad(kf, (0, 0, 0, skp - sk))
        vf = torch.nn.functional.pad(vf, (0, 0, 0, skp - sk))
    if recipe.qk_format is Format.E4M3:  # Q per row, K per key tile
        qf = e4m3_pow2_quantize_dequantize(qf, dim=-1)
        kt = kf.reshape(*kf.shape[:-2], skp // key_tile, key_tile, kf.shape[-1])
        kf = e4m3_pow2_quantize_dequantize(kt, dim=(-2, -1)).reshape(kf.shape)
    elif recipe.qk_format is not None:
        qf = _quantize(qf, recipe.qk_format, recipe, dim=-1)
        kf = _quantize(kf, recipe.qk_format, recipe, dim=-1)
    if recipe.pv_format is Format.E4M3:  # per channel, over all keys
        vf = e4m3_pow2_quantize_dequantize(vf, dim=-2)
    elif recipe.pv_format is not None:
        vf = _quantize(vf, recipe.pv_format, recipe, dim=-2)
    return qf, kf, vf


def _quantize(x: torch.Tensor, fmt: Format, recipe: AttentionRecipe, dim: int) -> torch.Tensor:
    """Q, K or V (B, H, S, D) fp32 fake-quantized: MXFP4 with the recipe's scale rule, NVFP4 with
    one tensor scale per head (``recipe.tensor_scale``) from its largest magnitude."""
    if fmt is Format.MXFP4:
        return quantize_dequantize(x, fmt, scale_rule=recipe.scale_rule, dim=dim)
    g = nvfp4_tensor_scale(x.abs().amax(dim=(-2, -1), keepdim=True)) if recipe.tensor_scale else None
    return quantize_dequantize(x, fmt, dim=dim, global_scale=g)


def quantize_p(p: torch.Tensor, recipe: AttentionRecipe) -> torch.Tensor:
    """Quantize-dequantize softmax exponentials ``p >= 0`` in blocks along the last dim (E4M3:
    one power-of-two scale per row, :func:`fp4video.formats.e4m3_pow2_quantize_dequantize`).

    Two-level (SageAttention3): ``p2 = p · (448·6 / r)`` in FP32 with ``r = max(rowmax p,
    2^-64)`` (:data:`TWO_LEVEL_P_FLOOR`), E4M3 block scales on p2, dequantized as
    ``p̂2 · (r / (448·6))``; the row max is over ``p``'s last dim (one key tile in the online
    softmax). The floor keeps the pre-scale finite for tiles far below the running maximum.
    """
    fmt = recipe.pv_format
    if fmt is None:
        return p
    if fmt is Format.E4M3:  # FP8: one power-of-two scale per row (of this key tile)
        return e4m3_pow2_quantize_dequantize(p, dim=-1)
    if recipe.p_scale is PScale.TWO_LEVEL:
        r = p.amax(dim=-1, keepdim=True).clamp(min=TWO_LEVEL_P_FLOOR)
        p2 = quantize_dequantize(p * (TWO_LEVEL_P_RANGE / r), fmt, dim=-1)
        return p2 * (r / TWO_LEVEL_P_RANGE)
    rule = recipe.scale_rule if fmt is Format.MXFP4 else None
    return quantize_dequantize(p, fmt, scale_rule=rule, dim=-1)


def _bias_from_mask(mask: torch.Tensor | None, skp: int, sk: int, device: torch.device):
    """(.., Sq, Sk) bool mask (True = attend) padded to Skp keys with False."""
    if mask is None:
        if skp == sk:
            return None
        mask = torch.ones(1, 1, 1, sk, dtype=torch.bool, device=device)
    # a mask broadcast over keys is expanded to the real keys (a view), so that key tiles slice it
    # and the padding applies to the real keys
    mask = mask.expand(*mask.shape[:-1], sk)
    if skp != sk:
        mask = torch.nn.functional.pad(mask, (0, skp - sk), value=False)
    return mask


def attention_tiled(
    qh: torch.Tensor,
    kh: torch.Tensor,
    vh: torch.Tensor,
    *,
    scale: float,
    recipe: AttentionRecipe,
    mask: torch.Tensor | None = None,
    sk: int | None = None,
    key_tile: int = KEY_TILE,
    query_chunk: int = QUERY_CHUNK,
    key_tiles: torch.Tensor | None = None,
    query_tile: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax attention over prepared (:func:`prepare_qkv`) fp32 tensors.

    ``mask``: bool broadcastable to (B, H, Sq, Sk), True = attend; ``sk`` the real key count
    (keys beyond it are padding). Returns ``(out (B, H, Sq, Dv) fp32, lse (B, H, Sq) fp32)``;
    rows with no visible key give zeros and ``lse = -inf``.

    Block-sparse: ``key_tiles`` bool (B|1, H|1, ceil(Sq / query_tile), Skp / key_tile) says which
    key tiles each tile of ``query_tile`` query rows visits (True = visit). A tile a row does not
    visit contributes nothing to it: the running max, ℓ and acc stay as they are, exactly as a
    kernel that skips the tile leaves them, so the LSE is that of the visited keys and rows that
    visit no live key give zeros and ``-inf``. Tiles are visited in ascending order. With every
    tile visited the result is bit for bit the dense one.
    """
    skp = kh.shape[-2]
    sk = skp if sk is None else sk
    if skp % key_tile:
        raise ValueError(f"prepared K has {skp} keys, not a multiple of the key tile {key_tile}")
    mask = _bias_from_mask(mask, skp, sk, qh.device)
    sq = qh.shape[-2]
    visit = None if key_tiles is None else _visits_per_row(key_tiles, query_tile, sq, skp // key_tile, qh, kh)
    outs, lses = [], []
    for q0 in range(0, sq, query_chunk):
        qc = qh[..., q0 : q0 + query_chunk, :]
        mc = None if mask is None else mask[..., q0 : q0 + query_chunk, :] if mask.shape[-2] > 1 else mask
        vc = None if visit is None else visit[..., q0 : q0 + query_chunk, :]
        o, l_ = _tiled_chunk(qc, kh, vh, scale, recipe, mc, key_tile, vc)
        outs.append(o)
        lses.append(l_)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def _visits_per_row(key_tiles, query_tile, sq: int, n_key_tiles: int, qh, kh) -> torch.Tensor:
    """``key_tiles`` (B|1, H|1, n_q_tiles, n_key_tiles) checked and expanded to one row per query,
    (B|1, H|1, Sq, n_key_tiles) bool."""
    if not isinstance(key_tiles, torch.Tensor) or key_tiles.dtype != torch.bool:
        raise TypeError(f"key_tiles must be a bool tensor, got {getattr(key_tiles, 'dtype', type(key_tiles).__name__)}")
    if isinstance(query_tile, bool) or not isinstance(query_tile, int) or query_tile < 1:
        raise ValueError(f"query_tile must be a positive int when key_tiles is given, got {query_tile!r}")
    lead = torch.broadcast_shapes(qh.shape[:-2], kh.shape[:-2])
    want = (-(-sq // query_tile), n_key_tiles)
    if key_tiles.dim() != 4 or tuple(key_tiles.shape[-2:]) != want or any(
            n not in (1, m) for n, m in zip(key_tiles.shape[:2], lead)):
        raise ValueError(f"key_tiles has shape {tuple(key_tiles.shape)}, expected (B|1, H|1, {want[0]}, {want[1]}) "
                         f"for (B, H) = {tuple(lead)}, {sq} queries in tiles of {query_tile} and {n_key_tiles} key tiles")
    if key_tiles.device != qh.device:
        raise ValueError(f"key_tiles is on {key_tiles.device}, q on {qh.device}")
    return key_tiles.repeat_interleave(query_tile, dim=-2)[..., :sq, :]


def _tiled_chunk(q, k, v, scale, recipe, mask, key_tile, visit=None):
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    sq, dv = q.shape[-2], v.shape[-1]
    m = torch.full((*lead, sq), -math.inf, device=q.device)
    l_ = torch.zeros((*lead, sq), device=q.device)
    acc = torch.zeros((*lead, sq, dv), device=q.device)
    quantized_row_sum = recipe.row_sum is RowSum.QUANTIZED
    # key tiles some row of the chunk visits and those every row visits (one read-back per chunk): a
    # tile no row visits changes nothing (see attention_tiled) and is not computed
    if visit is not None:
        tiles = visit.reshape(-1, visit.shape[-1])
        wanted, everyone = tiles.any(dim=0).tolist(), tiles.all(dim=0).tolist()
    for j0 in range(0, k.shape[-2], key_tile):
        rows = None  # the rows visiting this tile, where some do not
        if visit is not None:
            if not wanted[j0 // key_tile]:
                continue
            rows = None if everyone[j0 // key_tile] else visit[..., j0 // key_tile]
        s = (q @ k[..., j0 : j0 + key_tile, :].transpose(-1, -2)) * scale
        if mask is not None:
            s = s.masked_fill(~mask[..., j0 : j0 + key_tile], -math.inf)
        if rows is not None:
            s = s.masked_fill(~rows.unsqueeze(-1), -math.inf)
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)  # rows with nothing visible yet
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe.unsqueeze(-1))
        p_hat = quantize_p(p, recipe) if rows is None else _quantize_rows(p, rows, recipe)
        l_ = alpha * l_ + (p_hat if quantized_row_sum else p).sum(dim=-1)
        acc = alpha.unsqueeze(-1) * acc + p_hat @ v[..., j0 : j0 + key_tile, :]
        m = m_new
    return _finish(acc, l_, m)


def _quantize_rows(p: torch.Tensor, rows: torch.Tensor, recipe: AttentionRecipe) -> torch.Tensor:
    """:func:`quantize_p` of ``p``'s rows where ``rows`` (broadcastable to p's rows) is True, zeros at the
    others (there ``p`` is all zeros, which quantize to zeros): each row is quantized on its own, so
    its values are those of a call on the whole tensor, and only the visited rows cost anything."""
    flat = p.reshape(-1, p.shape[-1])
    keep = rows.expand(p.shape[:-1]).reshape(-1).nonzero().squeeze(-1)
    out = torch.zeros_like(flat)
    out[keep] = quantize_p(flat[keep], recipe)
    return out.reshape(p.shape)


def _finish(acc, l_, m):
    live = l_ > 0
    out = torch.where(live.unsqueeze(-1), acc / torch.where(live, l_, 1.0).unsqueeze(-1), 0.0)
    lse = torch.where(live, m + torch.log(torch.where(live, l_, 1.0)), -math.inf)
    return out, lse


def attention_materialized(
    qh: torch.Tensor,
    kh: torch.Tensor,
    vh: torch.Tensor,
    *,
    scale: float,
    recipe: AttentionRecipe,
    mask: torch.Tensor | None = None,
    sk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole-P variant for tests: ``P̃ = exp(S − rowmax S)`` quantized at once (blocks along keys,
    two-level pre-scale over the whole row)."""
    skp = kh.shape[-2]
    mask = _bias_from_mask(mask, skp, skp if sk is None else sk, qh.device)
    s = (qh @ kh.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    m = s.amax(dim=-1)
    m_safe = torch.where(torch.isinf(m), 0.0, m)
    p = torch.exp(s - m_safe.unsqueeze(-1))
    p_hat = quantize_p(p, recipe)
    l_ = (p_hat if recipe.row_sum is RowSum.QUANTIZED else p).sum(-1)
    return _finish(p_hat @ vh, l_, m)
