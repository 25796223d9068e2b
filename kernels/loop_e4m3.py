"""The e4m3 attention loop: the MXFP4 methods on Hopper and Ada (sm_89+) fp8 tensor cores.

Q̂, K̂, V̂ come from :func:`.prepass.prepass_fp8` (e4m3 values, power-of-two factors per query row
/ key tile / value channel; exact inside e4m3's window, which the dispatch checks for V). P̃ is
quantized per block of QB keys exactly as the reference does (block exponent from the block
maximum, E2M1 rounding), rounded on f16 pairs (:func:`.fp4_math.round_e2m1_f16x2_odd`), in
units of 2^k per row and tile, k = 4 - (the tile's largest block exponent), folded into the exp2
argument: the largest P̂ value is 6·2^4 = 96, and every block whose scale is within 2^12 of the
tile's largest block scale is exact in e4m3 (smaller ones lose low bits to e4m3's subnormals;
their weights are below 2^-12·7.25 of the tile's largest). ``acc`` and ``l`` are kept in the
current tile's units (their rescale factor is one exp2 per row). Within a tile, keys sit in
:func:`.key_order.mma_key_order`, so each P block lives in one lane; P̂ is relabelled into the
MMA's operand order for free (:func:`.key_order.as_mma_operand`) and V̂ᵀ is stored in it.

On Hopper K̂/V̂ᵀ tiles come by TMA (K̂ stored in tile key order) and three programs share an SM;
elsewhere (and when ``FP4VIDEO_MX_TMA=0``) by pointer loads.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fp4video.formats import Format, ScaleRule
from fp4video.recipe import AttentionRecipe, RowSum
from fp4video.reference import KEY_TILE

from .fp4_math import e4m3_p_shift, mx_block_exponent, pow2, round_e2m1_f16x2_odd, round_e4m3_signed
from .key_order import LANE_BLOCK, as_mma_operand
from .launch import LoopLaunch
from .operands import FP8Operands, KeyTileLists
from .plan import Plan, tma_reason, pointer_loop_reason
from .tiles import (LOG2E, key_mask, kv_bases, outputs, program_rows, sparse_rows, store_out_lse,
                    tile_logits, visited_tiles)

#: lowest block exponent a key tile's shift follows (tiles entirely below 2^-60 of the row
#: maximum keep a fixed shift; their weights are below 1e-18)
TILE_EXP_FLOOR = -60
#: the largest logit bound (nats; :func:`fp4video.reference.range_summary`) under which the loop runs
#: its exponents' fast form (:func:`quantize_p`): there |m| < 2^18 in log2 units (2^17, twice over for
#: the smooth-K methods, whose loop sees q·(k - mean)), so the fused form's residual moves P̃ by under
#: 2^-6 of a binade; above it, the exact form
FAST_LOGIT_BOUND = 2.0**16

#: V channels whose block maxima span more than this many binades lose bits in the e4m3 loop:
#: its per-channel e4m3 window holds 16 binades of V̂, and P̂'s 2^12 window meets V's range too
#: (a P block 2^-13 of the tile's top that rounds coarsely, times a V 2^13 above the rest). With
#: 10, the loop equals the reference to worst-row cosine 0.9999 on sharp inputs with V outlier
#: tokens (interpreter, tests/test_robustness.py); wider heads take the exact bf16 loop
#: (the dispatch decides from the pre-pass's ``v_span``).
E4M3_V_SPAN_LIMIT = 10
#: pointer loads (Ada, or FP4VIDEO_MX_TMA=0)
#: Shared memory (bytes) per number of stages, compiled offline (Triton 3.9, head dim 128, masked, 64
#: rows, 4 warps), by pointer loads and by TMA
POINTER_SHARED_MEMORY = {"sm_90": {2: 73860, 3: 106632}, "sm_100": {2: 73892, 3: 106664},
                         "sm_120": {2: 49156, 3: 81928}}
TMA_SHARED_MEMORY = {"sm_90": {2: 73892, 3: 106696}, "sm_100": {2: 57524, 3: 90312}, "sm_120": {2: 49188, 3: 81960}}
POINTER_LAUNCH = LoopLaunch(
    64, 4, 3, shared_memory=POINTER_SHARED_MEMORY,
    reason="64 rows and one warpgroup per program, so that two programs share an SM and one's MMAs overlap "
           "the other's softmax; 2 stages on Ada's 99 KB")
#: TMA loads (Hopper)
TMA_LAUNCH = LoopLaunch(
    64, 4, 2, shared_memory=TMA_SHARED_MEMORY, shapes={"sm_120": (128, 8)},
    reason="2 stages and at most 168 registers let three programs share an SM. sm_120 (mma.sync): 128 rows "
           "and 8 warps, a warp's 16 rows each, where at 64 rows and 4 warps Triton splits the tile's keys "
           "across the warps and P goes through shuffles and shared memory")
#: registers per thread that let three 64-row TMA programs share an SM (3 × 128 threads × 168 ≤ 64 K;
#: the dense unmasked loop fits by itself, a masked or block-sparse one does not uncapped): the cap of
#: masked and block-sparse launches of that shape
TMA_REGISTER_BUDGET = 168


@triton.jit
def _blocks5(x):
    """A per-block (row, t) tensor broadcast to the 5-d view (row, a, b, t, e) of an S tile."""
    return x[:, None, :][:, :, None, :][:, :, :, :, None]


@triton.jit
def _rows5(x):
    """A per-row vector (as :func:`quantize_p` leaves it) broadcast to the 5-d view."""
    return _blocks5(x[:, None])


@triton.jit
def _block_reduce(x5, MAX: tl.constexpr):
    """Per-block maxima (MAX) or sums (row, t) of the 5-d view: e, then b, then a. In-thread
    reductions are chains of dependent instructions, and trees of 2, 4 and 4 are shorter than one
    chain of 16."""
    if MAX:
        return tl.max(tl.max(tl.max(x5, axis=4), axis=2), axis=1)
    else:
        return tl.sum(tl.sum(tl.sum(x5, axis=4), axis=2), axis=1)


@triton.jit
def _view5(qk, QB: tl.constexpr):
    """S tile (BLOCK_M, BLOCK_N) in mma_key_order as (row, a, b, t, e): column c = 2·NB·j + 2·t + e
    with j = (QB / 8)·a + b holds key QB·t + 2·j + e, so P block t is the columns with that t,
    within one lane of the MMA's quad."""
    return tl.reshape(qk, (qk.shape[0], 4, QB // 8, qk.shape[1] // QB, 2))


@triton.jit
def quantize_p(qk, q_scale, m_i, k_i, l_i, OCP: tl.constexpr, QMAX: tl.constexpr, PNQ: tl.constexpr,
               QB: tl.constexpr, EXP_FLOOR: tl.constexpr, ASM: tl.constexpr, P_E4M3: tl.constexpr = False,
               EXACT: tl.constexpr = True):
    """Online softmax and MXFP4 quantization of one key tile (keys in mma_key_order, masked keys
    selected to -inf: :func:`.tiles.tile_logits`). Two forms of the exponents, chosen per call by
    the dispatch from the logits' bound (:data:`FAST_LOGIT_BOUND`):

    - EXACT: ``qk`` holds the logits in log2 units, and every exponent is the exact difference of a
      logit and the row maximum, then the tile's shift k added: P̃ · 2^k = exp2((qk - m) + k), so
      the row's largest P̃ is exactly 1 at any magnitude.
    - fast: ``qk`` holds the raw products and ``q_scale`` (per row, > 0) turns them into log2 units;
      the exponent is one ``fma(qk, q_scale, k - m)``. Its rounding residual is at most half an ulp
      of m, harmless while |m| is bounded (past ~1e7 nats it moves P̃ out of its block scales'
      range, and the k in k - m is lost once |m| reaches 2^24), and it is cheaper than the
      exact form.

    Returns (P̂ as the e4m3 A operand of P̂·V̂, m_new, k_new, l_new, alpha): the caller
    rescales its accumulator by alpha and adds P̂·V̂. ``l`` is kept per row and P block (each
    lane's share), summed by the caller after the loop.

    The rounding runs on f16 pairs (:func:`.fp4_math.round_e2m1_f16x2_odd`; ASM: inline PTX,
    else its fp32 stand-in, bit for bit) and PNQ's block sums too (exact: a block's values are
    multiples of half its unit, at most 192 units). The values are the reference's except at exact
    ties of the E2M1 grid (rounded up, not to even: a 2^-22 chance for an exp2 output).

    P_E4M3 (the FP8-P·V methods): P̃ in E4M3 with one power-of-two scale per row and tile,
    k = 7 - ⌊log2 (the tile's largest P̃)⌋ (:func:`fp4video.formats.e4m3_pow2_quantize_dequantize`):
    the largest value lies in [128, 256), and P̂ is P̃·2^k rounded once, by the conversion to e4m3
    (ASM: the hardware's ``cvt.rn.satfinite``; else the same rounding in fp32).
    """
    BLOCK_M: tl.constexpr = qk.shape[0]
    BLOCK_N: tl.constexpr = qk.shape[1]
    s5 = _view5(qk, QB)
    block_max = _block_reduce(s5, True)
    if not EXACT:
        block_max = block_max * q_scale[:, None]
    tile_max = tl.max(block_max, axis=1)
    m_new = tl.maximum(m_i, tile_max)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    # block exponents of P̃ = exp2(s - m) from the block maxima (exp2 is monotonic); the block
    # holding the row maximum gets exactly exp2(0) = 1 (the kernel is compiled without FMA
    # contraction: a product fused into the subtraction leaves a residual of either sign, and
    # amax = 1 - 2^-24 would move that block to the next lower scale under the OCP rule)
    top = tl.exp2(tile_max - m_safe)
    if EXACT:
        d5 = s5 - _rows5(m_safe)  # exact near the maximum; masked keys -inf
    if P_E4M3:
        # the tile's largest P̃ (per row) from its largest logit, the same arithmetic as its element's
        k_new = e4m3_p_shift(top, EXP_FLOOR)
        if EXACT:
            p = tl.exp2(d5 + _rows5(k_new.to(tl.float32)))  # P̃ · 2^k_new < 256
        else:
            p = tl.exp2(tl.fma(s5, _rows5(q_scale), _rows5(k_new.to(tl.float32) - m_safe)))
        p8 = round_e4m3_signed(p, ASM)
        if PNQ:  # the sums of the rounded values
            part = _block_reduce(p8.to(tl.float32), False)
        else:
            part = _block_reduce(p, False)
        p8 = tl.reshape(p8, (BLOCK_M, BLOCK_N))
    else:
        amax = tl.exp2(block_max - m_safe[:, None])
        e_blk = tl.where(amax > 0, mx_block_exponent(amax, OCP, QMAX), EXP_FLOOR)
        # the tile's largest block exponent is the exponent of its largest block maximum: computed
        # per row from the row's tile maximum (the same arithmetic on the same value), not reduced
        # across the lanes that hold the blocks (shuffles on the loop's critical path)
        e_top = tl.maximum(tl.where(top > 0, mx_block_exponent(top, OCP, QMAX), EXP_FLOOR), EXP_FLOOR)
        e_blk = tl.minimum(e_blk, e_top[:, None])  # a no-op (exp2 is monotonic); the f16 rounding's unit <= 16 relies on it
        k_new = 4 - e_top
        if EXACT:
            p = tl.exp2(d5 + _rows5(k_new.to(tl.float32)))  # P̃ · 2^k_new
        else:
            p = tl.exp2(tl.fma(s5, _rows5(q_scale), _rows5(k_new.to(tl.float32) - m_safe)))
        unit = pow2(tl.maximum(e_blk + k_new[:, None], -126))
        p_hat = round_e2m1_f16x2_odd(p, _blocks5(unit.to(tl.float16)), _blocks5((unit * 6.0).to(tl.float16)), ASM)
        # l per row and block (lane): summed over the lanes once, after the loop
        if PNQ:  # block sums on f16 pairs (exact: multiples of unit / 2, at most 192 units)
            part = tl.sum(tl.sum(tl.sum(p_hat, axis=2), axis=1).to(tl.float32), axis=2)
        else:
            part = _block_reduce(p, False)
        p8 = tl.reshape(p_hat, (BLOCK_M, BLOCK_N)).to(tl.float8e4nv)
    alpha = tl.exp2(m_i - m_safe + (k_new - k_i).to(tl.float32))
    l_new = tl.fma(alpha[:, None], l_i, part)
    return as_mma_operand(p8, BLOCK_M, BLOCK_N), m_new, k_new, l_new, alpha


@triton.jit
def _tile(qk, q_scale, m_i, k_i, l_i, acc, V_base, start, svd,
          OCP: tl.constexpr, QMAX: tl.constexpr, PNQ: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, QB: tl.constexpr, EXP_FLOOR: tl.constexpr, TMA: tl.constexpr, v_row,
          ASM: tl.constexpr, FRESH_PV: tl.constexpr, P_E4M3: tl.constexpr, EXACT: tl.constexpr):
    """:func:`quantize_p` and P̂·V̂ of one key tile, given its logits from :func:`.tiles.tile_logits`:
    returns the updated (m, k, l, acc). TMA: ``V_base`` is a tensor descriptor of V̂ᵀ's rows
    (channels), this head's first at ``v_row``.

    FRESH_PV (the TMA launch): P̂·V̂ goes into a fresh accumulator and is added to the rescaled one
    by an FMA, so the MMA is awaited within its tile. Left in flight into the next tile, its
    accumulator and P̂ stay reserved while the next tile's Q̂·K̂ᵀ runs, and ptxas, short of registers
    at three programs per SM, makes every MMA wait for the previous one (warning C7512). The
    pointer-load loop, not register-bound, is faster overlapping P̂·V̂ with the next tile."""
    p8, m_new, k_new, l_i, alpha = quantize_p(qk, q_scale, m_i, k_i, l_i, OCP, QMAX, PNQ, QB, EXP_FLOOR, ASM, P_E4M3,
                                              EXACT)
    # V̂ᵀ is stored in P̂'s operand order, padded with zeros to whole tiles: plain loads
    if TMA:
        vt = V_base.load([v_row, start])
    else:
        vt = tl.load(V_base + tl.arange(0, BLOCK_DV)[:, None] * svd + (start + tl.arange(0, BLOCK_N))[None, :])
    if FRESH_PV:
        acc = tl.fma(acc, alpha[:, None], tl.dot(p8, tl.trans(vt)))
    else:
        acc = tl.dot(p8, tl.trans(vt), acc * alpha[:, None])
    return m_new, k_new, l_i, acc


@triton.jit
def _tile_scale(q_scale, k_fac, EXACT: tl.constexpr):
    """A key tile's factor from raw products to log2 units, per row; the fast form's held at or
    above fp32's smallest normal (see :func:`_e4m3_attn_fwd`)."""
    if EXACT:
        return q_scale * k_fac
    else:
        return tl.maximum(q_scale * k_fac, 1.1754943508222875e-38)


@triton.jit
def _key_tile(q, q_scale, m_i, k_i, l_i, acc, K_base, KF_base, V_base, M_base, start, SK, sks, svd, sms, k_row, v_row,
              HAS_MASK: tl.constexpr, TAIL: tl.constexpr, OCP: tl.constexpr, QMAX: tl.constexpr, PNQ: tl.constexpr,
              D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QB: tl.constexpr,
              EXP_FLOOR: tl.constexpr, TMA: tl.constexpr, K_TILE_ORDER: tl.constexpr, ASM: tl.constexpr,
              FRESH_PV: tl.constexpr, P_E4M3: tl.constexpr, EXACT: tl.constexpr):
    """The key tile of keys [start, start + BLOCK_N) (TAIL: the partial last one): its logits
    (:func:`.tiles.tile_logits`, in its factor's log2 units) and :func:`_tile`."""
    qk_scale = _tile_scale(q_scale, tl.load(KF_base + start // BLOCK_N), EXACT)
    qk = tile_logits(q, qk_scale[:, None] if EXACT else 1.0, K_base, M_base, start, SK, sks, sms, HAS_MASK, TAIL,
                     D, BLOCK_N, QB, False, K_TILE_ORDER, TMA, k_row)
    return _tile(qk, qk_scale, m_i, k_i, l_i, acc, V_base, start, svd, OCP, QMAX, PNQ, BLOCK_DV, BLOCK_M, BLOCK_N, QB,
                 EXP_FLOOR, TMA, v_row, ASM, FRESH_PV, P_E4M3, EXACT)


@triton.jit
def _e4m3_attn_fwd(
    Q8, QFac, K8, KFac, V8T, VFac, KeyMask, KIdx, KCnt, Out, Lse,
    H, SQ, SK, DV, NQT, NKT,
    sqb, sqh, sqs,
    skb, skh, sks,
    svb, svh, svd,
    smb, sms, SK_PAD,
    sob, soh, sos, sod,
    slb, slh, sls,
    scale_log2,
    HAS_MASK: tl.constexpr, OCP: tl.constexpr, QMAX: tl.constexpr, PNQ: tl.constexpr,
    D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    QB: tl.constexpr, EXP_FLOOR: tl.constexpr, TMA: tl.constexpr, K_TILE_ORDER: tl.constexpr,
    ASM: tl.constexpr, FRESH_PV: tl.constexpr, P_E4M3: tl.constexpr = False, EXACT: tl.constexpr = True,
    SPARSE: tl.constexpr = False, QT: tl.constexpr = 128,
):
    """MXFP4 attention on e4m3 tensor cores. TMA (with K_TILE_ORDER: K̂ stored in tile key order,
    whole tiles): ``K8`` and ``V8T`` are tensor descriptors of K̂'s rows (B·H·SK_PAD) and V̂ᵀ's
    (B·H·BLOCK_DV), one box per key tile; else pointers. SPARSE: the program visits only the key
    tiles of its query tile's list (``KIdx``, ``KCnt``: :class:`.operands.KeyTileLists`, NQT query
    tiles of QT rows, NKT key tiles a list), in ascending order."""
    b, h, offs_m, row_ok = program_rows(H, SQ, BLOCK_M)
    bh = tl.program_id(1)
    offs_d = tl.arange(0, D)
    q = tl.load(Q8 + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    # logits in log2 units: dot(q8, k8) · q_fac · k_fac · scale · log2(e), k_fac per key tile (q_fac
    # and k_fac powers of two: exact products). For heads of zeros or ~1e-30 the factors multiply to
    # below fp32's normal range: EXACT scales first and selects masked keys to -inf after; the fast
    # form multiplies the -inf of masked keys, so its factor is held at or above fp32's smallest
    # normal (live logits stay ~0, as they are, and -inf · factor stays -inf, never NaN)
    q_scale = tl.load(QFac + bh * SQ + offs_m, mask=row_ok, other=1.0) * scale_log2

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    k_i = tl.zeros((BLOCK_M,), tl.int32)  # units of acc and l: 2^k_i
    l_i = tl.zeros((BLOCK_M, BLOCK_N // QB), tl.float32)  # per row and P block (lane): summed at the end
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    # TMA: tensor descriptors of K̂ (B·H·SK_PAD rows, tile key order) and V̂ᵀ (B·H·BLOCK_DV rows)
    K_base, V_base = kv_bases(K8, V8T, b, h, skb, skh, svb, svh, TMA)
    k_row = bh * SK_PAD
    v_row = bh * BLOCK_DV
    M_base = KeyMask + b * smb
    KF_base = KFac + bh * tl.cdiv(SK, BLOCK_N)
    # full key tiles without a bounds mask (the key-padding mask, if any, applies to every
    # tile), then the partial last tile
    if SPARSE:
        visits, n_whole, tail = visited_tiles(KIdx, KCnt, NQT, NKT, SK, QT, BLOCK_M, BLOCK_N)
        for i in tl.range(0, n_whole):
            m_i, k_i, l_i, acc = _key_tile(q, q_scale, m_i, k_i, l_i, acc, K_base, KF_base, V_base, M_base,
                                           tl.load(visits + i) * BLOCK_N, SK, sks, svd, sms, k_row, v_row, HAS_MASK,
                                           False, OCP, QMAX, PNQ, D, BLOCK_DV, BLOCK_M, BLOCK_N, QB, EXP_FLOOR, TMA,
                                           K_TILE_ORDER, ASM, FRESH_PV, P_E4M3, EXACT)
        if tail >= 0:
            m_i, k_i, l_i, acc = _key_tile(q, q_scale, m_i, k_i, l_i, acc, K_base, KF_base, V_base, M_base, tail, SK,
                                           sks, svd, sms, k_row, v_row, HAS_MASK, True, OCP, QMAX, PNQ, D, BLOCK_DV,
                                           BLOCK_M, BLOCK_N, QB, EXP_FLOOR, TMA, K_TILE_ORDER, ASM, FRESH_PV, P_E4M3,
                                           EXACT)
    else:
        n_full = (SK // BLOCK_N) * BLOCK_N
        for start in tl.range(0, n_full, BLOCK_N):
            m_i, k_i, l_i, acc = _key_tile(q, q_scale, m_i, k_i, l_i, acc, K_base, KF_base, V_base, M_base, start, SK,
                                           sks, svd, sms, k_row, v_row, HAS_MASK, False, OCP, QMAX, PNQ, D, BLOCK_DV,
                                           BLOCK_M, BLOCK_N, QB, EXP_FLOOR, TMA, K_TILE_ORDER, ASM, FRESH_PV, P_E4M3,
                                           EXACT)
        if n_full < SK:
            m_i, k_i, l_i, acc = _key_tile(q, q_scale, m_i, k_i, l_i, acc, K_base, KF_base, V_base, M_base, n_full,
                                           SK, sks, svd, sms, k_row, v_row, HAS_MASK, True, OCP, QMAX, PNQ, D,
                                           BLOCK_DV, BLOCK_M, BLOCK_N, QB, EXP_FLOOR, TMA, K_TILE_ORDER, ASM, FRESH_PV,
                                           P_E4M3, EXACT)

    v_fac = tl.load(VFac + bh * BLOCK_DV + tl.arange(0, BLOCK_DV))  # acc is in units of V̂'s channel factors
    store_out_lse(Out, Lse, acc, v_fac[None, :], tl.sum(l_i, axis=1), m_i, k_i.to(tl.float32), b, h, offs_m, row_ok,
                  tl.arange(0, BLOCK_DV), DV, sob, soh, sos, sod, slb, slh, sls)


def attention_e4m3(ops: FP8Operands, key_alive, plan: Plan, *, recipe: AttentionRecipe, scale: float, out_dtype,
                   dv: int, exact: bool = True, fresh_pv: bool | None = None, block_m=None, num_warps=None,
                   num_stages=None, visit: KeyTileLists | None = None):
    """The loop on :func:`.prepass.prepass_fp8`'s operands, K̂/V̂ᵀ tiles by TMA where ``plan.tma``
    (K̂ then in tile key order; the CPU interpreter runs the TMA path when asked, which is how CI
    tests it). ``exact``: the exponents' exact form, right at any logit magnitude
    (:func:`quantize_p`); False only where every logit is known to lie within
    :data:`FAST_LOGIT_BOUND` nats. ``fresh_pv``: P̂·V̂ into a fresh accumulator (:func:`_tile`;
    None: with TMA, where it is faster). Explicit launch values lift the register cap. ``visit``: a
    block-sparse call's key tiles (None: every tile)."""
    q8, k8, v8t, sk, tma = ops.q8, ops.k8, ops.v8t, ops.sk, plan.tma
    b, h, sq, d = q8.shape
    sk_pad, dvp = k8.shape[-2], v8t.shape[-2]
    if tma and not ops.k_tile_order:
        raise ValueError("a TMA plan copies K̂ tiles as stored: it needs K̂ in tile key order "
                         "(prepass_fp8(..., k_tile_order=True))")
    if tma and q8.is_cuda and (reason := tma_reason(plan.arch)):
        raise ValueError(f"a TMA plan, but the e4m3 loop cannot copy tiles by TMA here: {reason}")
    if not tma and (reason := pointer_loop_reason(plan.arch, recipe)):
        raise ValueError(f"{recipe.name} by pointer loads: {reason}")
    if v8t.shape[-1] % KEY_TILE or (ops.k_tile_order and sk_pad % KEY_TILE):
        raise ValueError(f"V̂ᵀ (and K̂ in tile order) must be padded to whole key tiles of {KEY_TILE} (prepass_fp8 "
                         f"does), got {v8t.shape[-1]} (and {sk_pad})")
    dev = q8.device
    out, lse = outputs(q8.shape, dv, dev, out_dtype)
    km = key_mask(key_alive, dev)
    launch = TMA_LAUNCH if tma else POINTER_LAUNCH
    given = any((block_m, num_warps, num_stages))
    block_m, num_warps, num_stages = launch.resolve(dev, block_m, num_warps, num_stages)
    block_m = sparse_rows(visit, block_m, given)
    three_per_sm = (block_m, num_warps) == (TMA_LAUNCH.block_m, TMA_LAUNCH.num_warps)  # the cap's shape
    capped = tma and (key_alive is not None or visit is not None) and not given and three_per_sm
    kt, vt = k8, v8t
    if tma:  # K̂ as (B·H·Sk_pad, D) rows and V̂ᵀ as (B·H·Dv_pad, Sk_pad) rows: one box per key tile
        from triton.tools.tensor_descriptor import TensorDescriptor

        kt = TensorDescriptor.from_tensor(k8.reshape(b * h * sk_pad, d), [KEY_TILE, d])
        vt = TensorDescriptor.from_tensor(v8t.reshape(b * h * dvp, v8t.shape[-1]), [dvp, KEY_TILE])
    _e4m3_attn_fwd[(triton.cdiv(sq, block_m), b * h)](
        q8, ops.q_fac, kt, ops.k_fac, vt, ops.v_fac, km, *KeyTileLists.pointers(visit, km), out, lse,
        h, sq, sk, dv, *(visit.index.shape[-2:] if visit else (1, 1)),
        *q8.stride()[:3], *k8.stride()[:3], *v8t.stride()[:3],
        km.stride(0), km.stride(1), sk_pad,
        *out.stride(), *lse.stride(),
        scale * LOG2E,
        HAS_MASK=key_alive is not None, OCP=recipe.scale_rule is ScaleRule.OCP, QMAX=recipe.scale_rule.qmax,
        PNQ=recipe.row_sum is RowSum.QUANTIZED, D=d, BLOCK_DV=dvp, BLOCK_M=block_m, BLOCK_N=KEY_TILE,
        QB=LANE_BLOCK, EXP_FLOOR=TILE_EXP_FLOOR, TMA=tma, K_TILE_ORDER=ops.k_tile_order, P_E4M3=recipe.pv_format is Format.E4M3,
        ASM=q8.is_cuda, FRESH_PV=tma if fresh_pv is None else fresh_pv, EXACT=bool(exact),
        SPARSE=visit is not None, QT=visit.query_tile if visit else KEY_TILE,
        num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False,  # explicit tl.fma only
        **({"maxnreg": TMA_REGISTER_BUDGET} if capped else {}),  # registers per thread (ptxas spills the rest)
    )
    return out, lse


#: the loop's jit kernel, by a public name: what offline compilation (:mod:`.report`) compiles
KERNEL = _e4m3_attn_fwd
