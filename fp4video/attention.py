"""``fp4_attention``: the user-facing FP4 attention op (validation, layouts, masks, backends)."""

from __future__ import annotations

import math
import numbers

import torch

from . import reference
from .reference import key_alive_from_mask
from .recipe import AttentionRecipe, get_recipe

__all__ = ["fp4_attention", "selection_for", "LAYOUTS", "BACKENDS"]

LAYOUTS = ("bhsd", "bshd")
BACKENDS = ("auto", "reference", "triton")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_inputs(q, k, v, layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    given = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}" if all(
        isinstance(t, torch.Tensor) for t in (q, k, v)) else ""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D ({'B, H, S, D' if layout == 'bhsd' else 'B, S, H, D'} "
                f"for layout={layout!r}), got shape {tuple(t.shape)}"
            )
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; fp4_attention takes float16, bfloat16 or float32")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    (b, h, sq, d), (bk, hk, sk, dk), (bv, hv, sv, dv) = q.shape, k.shape, v.shape
    if b != bk or b != bv:
        raise ValueError(f"batch sizes differ: q {b}, k {bk}, v {bv}")
    if h != hk or h != hv:
        raise ValueError(
            f"head counts differ: q {h}, k {hk}, v {hv} (grouped-query attention is not supported: "
            "repeat K/V heads first)"
        )
    if d != dk:
        raise ValueError(f"q and k head dims differ: {d} vs {dk}")
    if sk != sv:
        raise ValueError(f"k and v sequence lengths differ: {sk} vs {sv}")
    if min(sq, sk, d, dv) < 1:
        raise ValueError(f"empty input: {given} (layout {layout!r}: {'B, H, S, D' if layout == 'bhsd' else 'B, S, H, D'})")
    return q, k, v


def _check_mask(attn_mask, b, h, sq, sk, device):
    """Bool mask (True = attend), indexed (B, H, Sq, Sk) whatever the layout."""
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a bool tensor, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool:
        raise TypeError(
            f"attn_mask must be boolean (True = attend), got {attn_mask.dtype}; additive float masks "
            "are not accepted: pass `mask > -inf` for a 0/-inf mask"
        )
    if attn_mask.dim() != 4:
        raise ValueError(
            f"attn_mask must be 4-D and broadcastable to (B, H, Sq, Sk) = {(b, h, sq, sk)}, "
            f"got shape {tuple(attn_mask.shape)} (a key-padding mask is (B, 1, 1, Sk))"
        )
    if any(m not in (1, n) for m, n in zip(attn_mask.shape, (b, h, sq, sk))):
        raise ValueError(
            f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (B, H, Sq, Sk) = {(b, h, sq, sk)}"
        ) from None
    if attn_mask.device != device:
        raise ValueError(f"attn_mask is on {attn_mask.device}, q on {device}")
    return attn_mask


def _check_scale(scale, head_dim: int) -> float:
    """The softmax scale as a float: ``1/sqrt(D)`` for None; any real scalar (Python and numpy
    numbers, 0-d tensors, anything with ``__float__`` that is not complex or bool) that is positive
    and finite."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, torch.Tensor):
        if scale.dim() != 0:
            raise ValueError(f"scale must be a number or a 0-d tensor, got a tensor of shape {tuple(scale.shape)}")
        if scale.dtype == torch.bool or scale.is_complex():
            raise TypeError(f"scale must be a real number, got a 0-d {scale.dtype} tensor")
        value = float(scale.detach())
    else:
        kind = type(scale)
        if isinstance(scale, bool) or kind.__name__ in ("bool_", "bool") or isinstance(scale, complex) or (
                isinstance(scale, numbers.Complex) and not isinstance(scale, numbers.Real)) or \
                "complex" in kind.__name__ or not hasattr(kind, "__float__"):
            raise TypeError(f"scale must be a real number, got {kind.__name__} {scale!r}")
        try:
            value = float(scale)
        except (TypeError, ValueError, OverflowError) as e:
            raise TypeError(f"scale must be a real number, got {kind.__name__} {scale!r} ({e})") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return value


def _resolve_backend(backend, recipe, q, v, mask, sparse: bool = False) -> str:
    """``"triton"`` or ``"reference"``: where this call runs (the kernels' plan, :func:`.kernels.plan.plan`,
    says whether they can; a block-sparse call needs a loop that takes a selection)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return "reference"
    from .kernels.plan import plan

    kernel_plan = plan(recipe, q, v, mask)
    why = kernel_plan.sparse_reason if sparse else (None if kernel_plan.runnable else kernel_plan.reason)
    if backend == "triton":
        if why:
            raise NotImplementedError(f"backend='triton' cannot run this {'block-sparse ' if sparse else ''}call: {why}")
        return "triton"
    # "auto" never picks the CPU interpreter (a test tool, far slower than the reference)
    return "triton" if why is None and q.is_cuda else "reference"


def selection_for(sparsity, q: torch.Tensor, k: torch.Tensor, *, layout: str = "bhsd",
                  attn_mask: torch.Tensor | None = None, scale: float | None = None, backend: str = "auto",
                  method: str | AttentionRecipe = "mxattn"):
    """The :class:`~fp4video.sparse.BlockSelection` ``fp4_attention`` would use for ``sparsity`` on
    this call (the same checks and, where the kernels run it, their pooling of Q and K): pass it as
    ``sparsity`` to run the call on it, and read its density."""
    recipe = get_recipe(method)
    qb, kb, vb = _check_inputs(q, k, k, layout)  # (V plays no part in a selection: K stands in for it)
    b, h, sq, d = qb.shape
    mask = _check_mask(attn_mask, b, h, sq, kb.shape[-2], q.device)
    scale = _check_scale(scale, d)
    return _resolve_selection(sparsity, qb, kb, mask, scale, _resolve_backend(backend, recipe, qb, vb, mask, sparse=True))


def _resolve_selection(sparsity, q, k, mask, scale, path):
    """The selection of ``sparsity`` for (B, H, S, D) ``q``, ``k``, Q and K pooled by the kernels
    where they run the call (``path``)."""
    from .sparse import covering_rows, resolve_sparsity, row_block_mass, row_shares, tile_pool

    if path == "triton":
        from .kernels.covering import covering_rows
        from .kernels.pooling import tile_pool
        from .kernels.row_mass import row_block_mass, row_shares
    with torch.no_grad():
        return resolve_sparsity(sparsity, q, k, scale=scale, attn_mask=mask, pool=tile_pool, row_mass=row_block_mass,
                                placement=covering_rows, shares=row_shares)


def _sparse_key_tiles(sparsity, q, k, mask, scale, path):
    """None for a dense call; for a block-sparse one, ``(bitmap per KEY_TILE keys, query_tile)`` of its
    selection (computed on q's device, nothing read back; a dynamic one reads Q and K through the
    kernels' pooling where they run the call)."""
    if sparsity is None:
        return None
    sel = _resolve_selection(sparsity, q, k, mask, scale, path)
    if sel.key_tile % reference.KEY_TILE:
        raise ValueError(f"sparsity: the selection's key tile {sel.key_tile} is not a multiple of the loops' key "
                         f"tile {reference.KEY_TILE}")
    sel = sel.for_tiles(sel.query_tile, reference.KEY_TILE)
    return sel.tiles, sel.query_tile


def fp4_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    method: str | AttentionRecipe = "mxattn",
    layout: str = "bhsd",
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    sparsity=None,
):
    """Scaled dot-product attention with FP4 (MXFP4 / NVFP4) numerics.

    Args:
        q, k, v: ``(B, H, S, D)`` for ``layout="bhsd"``, ``(B, S, H, D)`` (diffusers) for
            ``"bshd"``; float16, bfloat16 or float32, one dtype and device. ``Sq`` and ``Sk``
            may differ (cross-attention); K/V must have as many heads as Q. Any head dim works:
            Q/K are zero-padded internally to the quantization block (and to a power of two for
            the Hadamard rotation), which changes no logit. V's head dim may differ from Q's.
        method: a name from :data:`fp4video.METHODS` or an :class:`AttentionRecipe`.
        attn_mask: bool, True = attend, broadcastable to ``(B, H, Sq, Sk)`` in every layout
            (a key-padding mask is ``(B, 1, 1, Sk)``). Masked keys contribute nothing; rows that
            see no key return zeros (and ``lse = -inf``).
        scale: softmax scale, default ``1/sqrt(D)``: any positive finite real scalar (Python or
            numpy number, 0-d tensor, anything with ``__float__`` that is neither bool nor complex).
        return_lse: also return the natural-log log-sum-exp of the scaled logits, as computed
            (with PNQ, of the quantized exponentials), fp32, ``(B, H, Sq)`` for bhsd and
            ``(B, Sq, H)`` for bshd.
        backend: ``"reference"`` (PyTorch, CPU or GPU), ``"triton"`` (fused kernels; error when
            they cannot run the call) or ``"auto"`` (Triton when it can, else the reference).
        sparsity: None (dense), or block-sparse attention (:mod:`fp4video.sparse`): a
            :class:`~fp4video.sparse.BlockSelection` (its bitmap is indexed (B, H, query tile, key
            tile) whatever the layout) or a rule computing one from this call's Q, K, scale and
            mask (:class:`~fp4video.sparse.DynamicSparsity`, :class:`~fp4video.sparse.StaticSparsity`):
            the method's numerics over the selected key tiles only, the LSE that of the visited keys.
            The loops of :data:`fp4video.kernels.plan.SPARSE_LOOPS` run it on the GPU; elsewhere
            ``"auto"`` runs the reference and ``"triton"`` raises NotImplementedError.

    Returns:
        the output in q's dtype and layout, and with ``return_lse`` the LSE.

    Finite inputs give a finite output and LSE (``-inf`` for rows that see no key) on every method
    and backend as long as each head's ``scale · D · max|q| · max|k|`` (max over its queries and
    live keys; a bound on its logits) is at most :data:`fp4video.reference.LOGIT_BOUND` (2^64);
    beyond it the call raises ValueError. Q, K and V of any finite magnitude within that are
    computed through exact power-of-two rescaling; outputs saturate at the dtype's largest value.
    NaN/Inf inputs make their head NaN (:func:`fp4video.reference.nonfinite_heads`).
    """
    recipe = get_recipe(method)
    qb, kb, vb = _check_inputs(q, k, v, layout)
    b, h, sq, d = qb.shape
    sk = kb.shape[-2]
    mask = _check_mask(attn_mask, b, h, sq, sk, q.device)
    scale = _check_scale(scale, d)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")

    path = _resolve_backend(backend, recipe, qb, vb, mask, sparse=sparsity is not None)
    key_tiles = _sparse_key_tiles(sparsity, qb, kb, mask, scale, path)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    with torch.no_grad():
        if path == "triton":  # the fp4video::attention custom op (torch.compile and CUDA graphs see one op)
            from .kernels.dispatch import attention, key_padding

            out, lse = attention(qb, kb, vb, key_padding(mask, b, sk), recipe.to_spec(), scale,
                                 *(key_tiles or (None,)))
        else:
            out, lse = _reference(qb, kb, vb, recipe, mask, scale, key_tiles)
    if grad:  # inference-only: a backward through the op raises instead of returning zeros
        out, lse = _NoBackward.apply(out, lse, q, k, v)

    if out.dtype != q.dtype:  # saturating, as the kernels store: FP4 rounding may step past the dtype's range
        big = torch.finfo(q.dtype).max
        out = out.clamp(-big, big).to(q.dtype)
    if layout == "bshd":
        out, lse = out.transpose(1, 2), lse.transpose(1, 2)
    return (out, lse) if return_lse else out


class _NoBackward(torch.autograd.Function):
    """Passes (out, lse) through, attached to q, k, v; its backward raises."""

    @staticmethod
    def forward(ctx, out, lse, q, k, v):
        return out.view_as(out), lse.view_as(lse)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            "fp4_attention is inference-only: FP4 rounding has no useful gradient and fp4video "
            "implements no backward. Run the model under torch.no_grad() / torch.inference_mode(), "
            "or use method='fp16' through diffusers' own attention (fp4video.uninstall) to train"
        )


def _reference(q, k, v, recipe, mask, scale, key_tiles=None):
    """``key_tiles``: None (dense) or (bitmap (B|1, H|1, n_query_tiles, Skp / KEY_TILE), query_tile)."""
    sk = k.shape[-2]
    key_alive = key_alive_from_mask(mask, sk)
    bad = reference.nonfinite_heads(q, k, v, key_alive)
    if bad.any():  # computed on zeros there, then NaN (the NaN/Inf policy)
        q, k, v = (torch.where(torch.isfinite(t), t, 0.0) for t in (q, k, v))
        out, lse = _reference(q, k, v, recipe, mask, scale, key_tiles)
        return reference.poison_heads(out, lse, bad)
    # the finite-output guarantee: raises beyond the logit bound, rescales by powers of two within it
    ranges = reference.input_ranges(q, k, v, key_alive)
    plan = reference.plan_ranges(reference.range_summary(ranges, scale, q.shape[-1]).tolist(), scale, q.dtype)
    v_factor = None
    if plan.needed:
        q, k, v, scale, v_factor = reference.rescale_inputs(q, k, v, ranges, plan, scale)
    qh, kh, vh = reference.prepare_qkv(q, k, v, recipe, key_alive=key_alive)
    tiles, query_tile = (None, None) if key_tiles is None else key_tiles
    out, lse = reference.attention_tiled(qh, kh, vh, scale=scale, recipe=recipe, mask=mask, sk=sk,
                                         key_tiles=tiles, query_tile=query_tile)
    if recipe.smooth_k:  # the LSE of the unsmoothed logits
        kz = k.float() if key_alive is None else torch.where(key_alive.unsqueeze(-1), k.float(), 0.0)
        lse = lse + reference.smoothing_lse_shift(q, reference.smoothing_mean(kz, key_alive), scale)
    return reference.rescale_output(out, v_factor), lse
