"""FP4 attention through ``tl.dot_scaled``: packed E2M1 operands with E8M0 block scales (MXFP4)
or E4M3 block scales of 16 (NVFP4: ``nvfp4``, ``sage3``, ``sage3-hpnq``); P·V in the same format,
or in E4M3 (the FP8-P·V methods). This module launches the loop; its kernels are one module per
variant, over the shared Triton math of :mod:`.scaled_math`:

- :mod:`.loop_scaled_sm100`: datacenter Blackwell, K̂ / V̂ᵀ by TMA, warp-specialized (``plan.tma``);
- :mod:`.loop_scaled_sm120`: consumer Blackwell's FP4-P·V methods, K̂ in the quad key order
  (``plan.key_order == "quad"``);
- :mod:`.loop_scaled_pointer`: pointer loads in key order — Hopper and older and the interpreter
  (where Triton emulates ``dot_scaled``), sm_120's FP8-P·V methods, sm_100 without TMA.

Each variant takes a block-sparse call's key tiles (``visit``: :class:`.operands.KeyTileLists`; the
SPARSE constexpr): a program visits its query tile's listed tiles in ascending order, each tile's
codes, scales and scale chunk at its listed start, the partial last tile masked; sm_100's loop stays
warp-specialized, the tile's index loaded at the top of each iteration.

On Blackwell (sm_100 / sm_120) Triton lowers ``tl.dot_scaled(.., "e2m1", .., "e2m1")`` to the
native FP4 MMAs (``tcgen05.mma … kind::mxf4`` / ``mma.sync … kind::mxf4nvf4``; the tests
compile these kernels for those targets offline and check). Every MXFP4
block of the method maps onto the MMA's own scale blocks: Q and K blocks of 32 along the head
dim (the QKᵀ reduction), P blocks of 32 keys per row and V blocks of 32 tokens per channel (the
PV reduction). No e4m3 window applies: every block carries its own E8M0 scale.

NVFP4 (``kind::mxf4nvf4 … block16`` / ``scale_vec::4X … ue4m3``): Q, K blocks of 16 along the head
dim, P blocks of 16 keys, V blocks of 16 tokens, each with its E4M3 scale; the heads' power-of-two
tensor scales multiply the logits' and the output's units. P is quantized with the arithmetic of
the bf16 NVFP4 loop (:func:`.loop_nvfp4.nv_quantize_p`: the same block scales, two-level row
factors and reciprocals, so the same codes), in natural key order: a block is 16 consecutive
columns, as the MMA's scale blocks are.

On Hopper and older, Triton emulates ``dot_scaled`` (operands upcast to bf16), so the e4m3 kernel
of :mod:`.loop_e4m3` and the NVFP4 loops are the fast paths there; this one still runs and matches
the reference.
"""

from __future__ import annotations

import torch
import triton

from fp4video.formats import Format, ScaleRule
from fp4video.recipe import AttentionRecipe, PScale, RowSum
from fp4video.reference import KEY_TILE, TWO_LEVEL_P_RANGE

from . import loop_scaled_pointer, loop_scaled_sm100, loop_scaled_sm120
from .fp4_math import FMT_E4M3, FMT_MXFP4, FMT_NVFP4
from .launch import LoopLaunch
from .operands import KeyTileLists, PackedOperands
from .plan import WS_MAJORS, Plan, pointer_loop_reason
from .tiles import LOG2E, key_mask, outputs, sparse_rows


#: Shared memory (bytes), compiled offline (Triton 3.9, head dim 128, masked, 8 warps): the same at 1-3
#: stages, the FP8-P·V form's (the most: ``sage3-pv8``; the FP4-P forms 32768)
SHARED_MEMORY = {"sm_100": {1: 37888, 2: 37888, 3: 37888}, "sm_120": {1: 33792, 2: 33792, 3: 33792}}
LAUNCH = LoopLaunch(128, 8, 2, shared_memory=SHARED_MEMORY, reason="not tuned on a Blackwell GPU")
#: The warp-specialized loop of sm_100 (K̂ / V̂ᵀ codes and block scales by TMA), compiled offline
#: (Triton 3.9, head dim 128, masked): the most shared memory any method of the format takes
TMA_SHARED_MEMORY = {"mx": {"sm_100": {1: 27928, 2: 45320, 3: 62792}},
                     "nv": {"sm_100": {1: 31096, 2: 49512, 3: 68008}},
                     "pv8": {"sm_100": {1: 38840, 2: 64440, 3: 90088}}}  # FP8 P·V: the larger of the two methods
#: Per format, offline (Triton 3.9): 8 softmax warps, with which no partition's loop spills (at 4 the
#: two-level P state of ``sage3-hpnq`` and the FP8-P·V methods' softmax spill;
#: ``python -m fp4video.kernels.report`` counts both, ``tests/test_offline_compile.py`` checks them).
#: The FP8-P·V methods' accumulator is single-buffered in tensor memory (double, with S's two buffers
#: and P̂ for the MMA, it needs 576 of the 512 columns and Triton compiles the kernel to a trap). The
#: block maxima's exp2 is :func:`.scaled_math.block_exp2`'s, which keeps the tile's logits in the softmax
#: partition; K̂'s and V̂ᵀ's block scales come by TMA in :func:`scale_chunks`'s layout, to tensor
#: memory by ``tcgen05.cp`` (SC_TMA), so the MMA partition is one warp (by pointer loads it takes
#: four, storing the scales from registers)
TMA_LAUNCH = {
    "mx": LoopLaunch(128, 8, 2, shared_memory=TMA_SHARED_MEMORY["mx"],
                     reason="not tuned on a Blackwell GPU: 8 softmax warps, 2 stages"),
    "nv": LoopLaunch(128, 8, 2, shared_memory=TMA_SHARED_MEMORY["nv"],
                     reason="not tuned on a Blackwell GPU: 8 softmax warps, 2 stages"),
    "mx-pv8": LoopLaunch(128, 8, 2, shared_memory=TMA_SHARED_MEMORY["pv8"],
                         reason="not tuned on a Blackwell GPU: 8 softmax warps, 2 stages"),
    "nv-pv8": LoopLaunch(128, 8, 2, shared_memory=TMA_SHARED_MEMORY["pv8"],
                         reason="not tuned on a Blackwell GPU: 8 softmax warps, 2 stages"),
}


def tma_launch_key(nv: bool, pv8: bool) -> str:
    """The :data:`TMA_LAUNCH` entry of a method: its Q·K format, and FP8 P·V apart."""
    return ("nv" if nv else "mx") + ("-pv8" if pv8 else "")


#: one chunk of :func:`scale_chunks`: 32 × 16 bytes, a 32-row × 128-bit piece of tensor memory's scale
#: layout for each of the 4 row groups of 32 (the unit ``tcgen05.cp`` copies), laid out as two rows of
#: 256 bytes (a TMA box's dimensions are at most 256)
SCALE_CHUNK = (2, 256)


def scale_chunks_fit(d: int, qb: int, dv_pad: int, pv8: bool) -> bool:
    """Whether :func:`scale_chunks` can lay out this loop's scales: K̂'s D / qb scales a key, and
    (FP4 P·V) V̂ᵀ's padded channels, in whole chunks (a multiple of 4 scales a row, of 128 rows)."""
    return (d // qb) % 4 == 0 and (pv8 or dv_pad % KEY_TILE == 0)


def scale_chunks(tiles: torch.Tensor) -> torch.Tensor:
    """Block scales ``tiles`` (N, R, C) — N tiles of R rows (a multiple of 128) and C scales a row
    (a multiple of 4) — in the layout Blackwell's tensor memory takes them in: (N, R·C/256, 256),
    tile n's bytes contiguous, scale (r, c) with r = 128·g + 32·j + i and c = 4·u + w at
    ((g·C/4 + u)·32 + i)·16 + 4·j + w. :func:`.loop_scaled_sm100.chunk_scales` reads a tile back as (R, C)."""
    n, r, c = tiles.shape
    if r % 128 or c % 4:
        raise ValueError(f"scale tiles need a multiple of 128 rows and of 4 scales a row, got {r} × {c}")
    x = tiles.reshape(n, r // 128, 4, 32, c // 4, 4).permute(0, 1, 4, 3, 2, 5)
    return x.reshape(n, r * c // SCALE_CHUNK[1], SCALE_CHUNK[1])


def _key_tile_scales(scales: torch.Tensor, tiles: int, fill: int) -> torch.Tensor:
    """K̂'s scales (B, H, SK, C), keys padded with ``fill`` to ``tiles`` whole key tiles, as
    :func:`scale_chunks`'s (B·H·tiles, 128, C) input."""
    b, h, sk, c = scales.shape
    padded = scales.new_full((b, h, tiles * KEY_TILE, c), fill)
    padded[:, :, :sk] = scales
    return padded.reshape(b * h * tiles, KEY_TILE, c)


def _channel_tile_scales(scales: torch.Tensor, tiles: int) -> torch.Tensor:
    """V̂ᵀ's scales (B, H, Dv_pad, tiles · C): each key tile's (Dv_pad, C), as (B·H·tiles, Dv_pad, C)."""
    b, h, dvp, n = scales.shape
    c = n // tiles
    return scales.reshape(b, h, dvp, tiles, c).permute(0, 1, 3, 2, 4).reshape(b * h * tiles, dvp, c)


def chunked_scales(nv: bool, pv8: bool, d: int, qb: int, sk_pad: int, k4, ks, v4t, vs):
    """K̂'s block scales and (FP4 P·V) V̂ᵀ's in :func:`scale_chunks`'s layout, one chunk run a key
    tile (``sk_pad`` / 128 a head): (k_chunks, v_chunks or None), uint8 (NVFP4: viewed as E4M3),
    from :func:`.prepass.prepass_packed`'s tensors (NVFP4: the scale bytes after the codes of each
    row; keys past SK padded with scale bytes of 0, MXFP4 with 127, 2^0: masked like any key past SK).
    A copy of 1/16 (MXFP4) or 1/8 (NVFP4) of K̂'s and V̂ᵀ's bytes, per call."""
    tiles = sk_pad // KEY_TILE
    k_scales = k4[..., d // 2:d // 2 + d // qb] if nv else ks
    k_chunks = scale_chunks(_key_tile_scales(k_scales, tiles, 0 if nv else 127))
    v_chunks = None
    if not pv8:
        v_scales = v4t[..., sk_pad // 2:sk_pad // 2 + sk_pad // qb] if nv else vs[..., :sk_pad // qb]
        v_chunks = scale_chunks(_channel_tile_scales(v_scales, tiles))
    if nv:
        k_chunks = k_chunks.view(torch.float8_e4m3fn)
        v_chunks = None if v_chunks is None else v_chunks.view(torch.float8_e4m3fn)
    return k_chunks, v_chunks


def _scale_descriptor(chunks: torch.Tensor):
    """A TMA descriptor over :func:`chunked_scales`'s chunks, one box a key tile."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(chunks, [1, *chunks.shape[1:]])


def variant(plan: Plan):
    """The module whose kernel runs ``plan``'s form of the loop: :mod:`.loop_scaled_sm100` for K̂ /
    V̂ᵀ by TMA (warp-specialized or not), :mod:`.loop_scaled_sm120` for K̂ in the quad key order,
    else :mod:`.loop_scaled_pointer`."""
    if plan.tma:
        return loop_scaled_sm100
    if plan.key_order == "quad":
        return loop_scaled_sm120
    return loop_scaled_pointer


def kernel(plan: Plan, recipe: AttentionRecipe, capability: tuple[int, int], *, d: int, dv_pad: int, block_m: int,
           has_mask: bool, sc_tma: bool = False, sparse: bool = False, query_tile: int = KEY_TILE,
           exact: bool = False):
    """(jit kernel, constexpr arguments) of ``plan``'s variant (:func:`variant`) running ``recipe``
    on a GPU of this compute capability ((0, 0): the interpreter) at head dim ``d``, value head dim
    padded to ``dv_pad``, ``block_m`` rows a program, with a key-padding mask or not; ``sc_tma``:
    the block scales by TMA in :func:`scale_chunks`'s layout (TMA plans); ``sparse``: the
    block-sparse form, key tiles from a :class:`.operands.KeyTileLists` of query tiles of
    ``query_tile`` rows; ``exact``: the exponents' exact form (:class:`.scaled_math.Config`'s
    EXACT), False for the form a call within :data:`.loop_e4m3.FAST_LOGIT_BOUND` runs (the
    default: what :mod:`.report` compiles). The block-sparse warp-specialized loop takes the exact
    form either way: with the fused one the partition computing the two-level factors (which takes
    the accumulator's tile) needs the scale as well, and spills. What :func:`attention_packed`
    launches (with the call's ``exact``) and :mod:`.report` compiles."""
    qk = FMT_NVFP4 if recipe.qk_format is Format.NVFP4 else FMT_MXFP4
    consts = {"HAS_MASK": has_mask, "QK": qk.value, "PV": (FMT_E4M3 if recipe.pv_format is Format.E4M3 else qk).value,
              "OCP": recipe.scale_rule is ScaleRule.OCP, "QMAX": recipe.scale_rule.qmax,
              "PNQ": recipe.row_sum is RowSum.QUANTIZED, "TWO_LEVEL": recipe.p_scale is PScale.TWO_LEVEL,
              "P_RANGE": TWO_LEVEL_P_RANGE, "FAST_RCP": capability >= (8, 0), "HW_E4M3": capability >= (8, 9),
              "HW_E2M1": capability >= (10, 0),  # Blackwell's E2M1 conversions
              "D": d, "QB": recipe.qk_format.block, "BLOCK_M": block_m, "BLOCK_N": KEY_TILE, "BLOCK_DV": dv_pad,
              "SPARSE": sparse, "QT": query_tile, "EXACT": bool(exact) or (sparse and plan.warp_specialized)}
    module = variant(plan)
    if module is not loop_scaled_sm120:
        consts["F32X2"] = capability[0] in WS_MAJORS  # datacenter Blackwell's two-lane fp32 arithmetic
    if module is loop_scaled_sm100:
        consts.update(WS=plan.warp_specialized, SC_TMA=sc_tma)
    return module.KERNEL, consts


def attention_packed(ops: PackedOperands, key_alive, plan: Plan, *, recipe: AttentionRecipe, scale: float, out_dtype,
                     dv: int, exact: bool = True, block_m=None, num_warps=None, num_stages=None,
                     visit: KeyTileLists | None = None):
    """The loop on :func:`.prepass.prepass_packed`'s operands (MXFP4 or NVFP4 Q·K, FP4 or FP8 P·V).
    ``plan.tma``: K̂ / V̂ᵀ codes by TMA (the CPU interpreter runs it when asked, which is how CI
    tests it); ``plan.warp_specialized``: the warp-specialized loop (TMA only); ``plan.key_order``
    ``"quad"``: K̂ is in the quad key order (``prepass_packed(..., quad_order=True)``: the
    pointer-load loop of consumer Blackwell, FP4 P·V). ``exact``: the exponents' exact form, right
    at any logit magnitude; False (only where every logit is known to lie within
    :data:`.loop_e4m3.FAST_LOGIT_BOUND` nats) runs NVFP4 P's fused form, one FMA an exponent
    (:func:`.scaled_math.nv_p`; MXFP4 and FP8 P have the exact form alone). ``visit``: a
    block-sparse call's key tiles (None: every tile). Returns (out, lse)."""
    nv = recipe.qk_format is Format.NVFP4
    pv8 = recipe.pv_format is Format.E4M3
    tma, ws, quad_order = plan.tma, plan.warp_specialized, ops.quad_order
    if recipe.qk_format not in (Format.MXFP4, Format.NVFP4) or recipe.pv_format not in (recipe.qk_format, Format.E4M3):
        raise ValueError(f"{recipe.name}: the dot_scaled loop runs MXFP4 or NVFP4 Q·K with P·V in the same format or "
                         f"in E4M3, not {recipe.qk_format} / {recipe.pv_format}")
    if quad_order != (plan.key_order == "quad"):
        raise ValueError(f"the operands' K̂ is {'' if quad_order else 'not '}in the quad key order, the plan's "
                         f"{plan.key_order!r}: prepare them with the plan")
    q4, k4, v4t = ops.q4, ops.k4, ops.v
    qb = recipe.qk_format.block
    if pv8:  # FP8 P·V: V̂ᵀ e4m3 in key order with its channel factors
        d = q4.shape[-1] * qb // (qb // 2 + 1) if nv else q4.shape[-1] * 2
        sk_pad = v4t.shape[-1]
        gqk, gv = (ops.g_q * ops.g_k).reshape(-1).contiguous(), q4.new_ones(1, dtype=torch.float32)
        qs, ks, vs = (q4, k4, ops.v_fac) if nv else (ops.q_scale, ops.k_scale, ops.v_fac)
        if reason := (pointer_loop_reason(plan.arch, recipe, "the dot_scaled loop's FP8-P·V form")):
            raise ValueError(f"{recipe.name}: {reason}")
    elif nv:
        d = q4.shape[-1] * qb // (qb // 2 + 1)  # rows of D/2 code bytes and D/16 scale bytes
        sk_pad = -(-k4.shape[-2] // KEY_TILE) * KEY_TILE  # (K̂'s and V̂ᵀ's rows are padded to 16 bytes)
        qs = ks = vs = None
        gqk, gv = (ops.g_q * ops.g_k).reshape(-1).contiguous(), ops.g_v.reshape(-1).contiguous()
    else:
        qs, ks, vs = ops.q_scale, ops.k_scale, ops.v_scale
        d, sk_pad = q4.shape[-1] * 2, v4t.shape[-1] * 2
        gqk = gv = q4.new_ones(1, dtype=torch.float32)
    b, h, sq = q4.shape[:3]
    sk, dvp = k4.shape[-2], v4t.shape[-2]
    dev = q4.device
    out, lse = outputs((b, h, sq, d), dv, dev, out_dtype)
    km = key_mask(key_alive, dev)
    if quad_order and (tma or pv8):
        raise ValueError("the quad key order: K̂'s rows are read by pointer loads (no TMA), for FP4 P·V")
    if ws and not tma:
        raise ValueError("a warp-specialized plan reads K̂ / V̂ᵀ by TMA (tma=True)")
    launch = TMA_LAUNCH[tma_launch_key(nv, pv8)] if tma else LAUNCH
    given = block_m is not None
    block_m, num_warps, num_stages = launch.resolve(dev, block_m, num_warps, num_stages)
    block_m = sparse_rows(visit, block_m, given)
    cap = torch.cuda.get_device_capability(dev) if q4.is_cuda else (0, 0)
    kt, vt = k4, v4t
    k_sc_arg, v_sc_arg = (k4 if nv else ks), (vs if pv8 else v4t if nv else vs)
    sc_tma = tma and scale_chunks_fit(d, qb, dvp, pv8)
    if sc_tma:  # the block scales by TMA in tensor memory's layout (:func:`scale_chunks`), one box a key tile
        k_chunks, v_chunks = chunked_scales(nv, pv8, d, qb, sk_pad, k4, ks, v4t, vs)
        k_sc_arg = _scale_descriptor(k_chunks)
        if v_chunks is not None:
            v_sc_arg = _scale_descriptor(v_chunks)
    if tma:  # the code rows as (B·H·SK, D/2) and (B·H·Dv, SK_pad/2) tables (FP8 P·V: V̂ᵀ's e4m3 rows
        # (B·H·Dv, SK_pad)): one box per key tile
        from triton.tools.tensor_descriptor import TensorDescriptor

        kt = TensorDescriptor.from_tensor(k4.reshape(b * h * sk, k4.shape[-1]), [KEY_TILE, d // 2])
        vt = TensorDescriptor.from_tensor(v4t.reshape(b * h * dvp, v4t.shape[-1]),
                                          [dvp, KEY_TILE if pv8 else KEY_TILE // 2])
    fn, consts = kernel(plan, recipe, cap, d=d, dv_pad=dvp, block_m=block_m, has_mask=key_alive is not None,
                        sc_tma=sc_tma, sparse=visit is not None, query_tile=visit.query_tile if visit else KEY_TILE,
                        exact=exact)
    fn[(triton.cdiv(sq, block_m), b * h)](
        (q4, q4 if nv else qs), kt, k_sc_arg, vt, v_sc_arg, (gqk, gv), km,
        (*KeyTileLists.pointers(visit, km), *(visit.index.shape[-2:] if visit else (1, 1))), (out, lse),
        (h, sq, sk, sk_pad, dv), q4.stride()[:3], k4.stride()[:3],
        (*v4t.stride()[:3], 0 if pv8 else v4t.stride(2) if nv else vs.stride(2)), km.stride(), out.stride(),
        lse.stride(), scale * LOG2E,
        **consts, num_warps=num_warps, num_stages=num_stages,
        enable_fp_fusion=False,  # explicit tl.fma only, as the reference
    )
    return out, lse
