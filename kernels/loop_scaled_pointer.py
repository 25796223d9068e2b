"""The dot_scaled loop by pointer loads, K̂ in key order: where Triton emulates ``dot_scaled``
(Hopper and older GPUs, operands upcast to bf16; the CPU interpreter), and the native forms the
other variants leave: sm_120's FP8-P·V methods (``mma.sync`` FP4 Q·K, e4m3 P̂·V̂) and sm_100 with
TMA turned off (``FP4VIDEO_MX_TMA=0``: no warp specialization, the softmax's arithmetic two lanes an
instruction, F32X2).

Where Triton emulates ``dot_scaled`` the e4m3 kernel of :mod:`.loop_e4m3` and the NVFP4 loops are
the fast paths; this loop still runs there and matches the reference.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp4_math import FMT_E4M3, FMT_NVFP4
from .scaled_math import Config, as_scales, e4m3_p, fp4_p, key_scales, masked_logits, store_result, value_scales
from .tiles import kv_bases, program_rows, visited_tiles


@triton.jit
def _tile(q4, q_sc, m_i, r_i, k_i, l_i, acc, K_base, KS_base, V_base, VS_base, M_base, start, SK, strides, scale_log2,
          C, TAIL: tl.constexpr):
    """One key tile: returns the updated (m, r, k, l, acc); m in log2 units, acc in units of r (the
    two-level row factor; 1 otherwise) and, FP8 P·V, of 2^k (P̂ and V̂ᵀ in E4M3: ``V_base`` V̂ᵀ's
    e4m3 rows, keys in order, padded to whole tiles). NVFP4: the scale bytes follow the codes in
    each row of K̂ (``KS_base`` = ``K_base`` + D/2) and V̂ᵀ, E4M3 to be read as such. ``strides``:
    (K̂'s row, V̂ᵀ's channel, V̂ᵀ's scale channel, the mask's key)."""
    sks, svd, svsd, sms = strides
    NB: tl.constexpr = C.BLOCK_N // C.QB
    keys = start + tl.arange(0, C.BLOCK_N)
    half_d = tl.arange(0, C.D // 2)
    nb_d = tl.arange(0, C.D // C.QB)
    dv = tl.arange(0, C.BLOCK_DV)
    key_ok = keys < SK
    k4 = tl.load(K_base + keys[:, None] * sks + half_d[None, :], mask=key_ok[:, None], other=0)
    k_sc = key_scales(KS_base, keys, nb_d, key_ok, sks, C)
    qk = tl.dot_scaled(q4, q_sc, "e2m1", tl.trans(k4), as_scales(k_sc, C), "e2m1")
    qk = masked_logits(qk, scale_log2, M_base, keys, SK, sms, C, TAIL)  # dead keys -inf
    if C.PV == FMT_E4M3:  # FP8 P·V: P̂ and V̂ᵀ in E4M3 on the FP8 MMA
        p8, m_new, k_i, l_i, alpha = e4m3_p(qk, m_i, k_i, l_i, C.PNQ, C.HW_E4M3, C.F32X2)
        v8t = tl.load(V_base + dv[:, None] * svd + keys[None, :])  # padded to whole tiles: no mask
        acc = acc * alpha[:, None] + tl.dot(p8, tl.trans(v8t))
    else:
        p4, p_sc, m_new, r_i, l_i, acc_scale = fp4_p(qk, m_i, r_i, l_i, scale_log2, C, WS=False)
        half_n = start // 2 + tl.arange(0, C.BLOCK_N // 2)
        nb_n = start // C.QB + tl.arange(0, NB)
        v4t = tl.load(V_base + dv[:, None] * svd + half_n[None, :])  # padded to whole tiles: no mask
        v_sc = value_scales(VS_base, dv, nb_n, svsd, C)
        pv = tl.dot_scaled(p4, p_sc, "e2m1", tl.trans(v4t), v_sc, "e2m1")
        acc = acc * acc_scale[:, None] + pv
    return m_new, r_i, k_i, l_i, acc


@triton.jit
def _attn_fwd(
    q_ptrs, K4, KS, V4T, VS, g_ptrs, KeyMask, lists, out_ptrs,
    sizes, strides_q, strides_k, strides_v, strides_m, strides_o, strides_lse, scale_log2,
    HAS_MASK: tl.constexpr, QK: tl.constexpr, PV: tl.constexpr, OCP: tl.constexpr, QMAX: tl.constexpr,
    PNQ: tl.constexpr, TWO_LEVEL: tl.constexpr, P_RANGE: tl.constexpr, FAST_RCP: tl.constexpr,
    HW_E4M3: tl.constexpr, HW_E2M1: tl.constexpr, F32X2: tl.constexpr, D: tl.constexpr, QB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, SPARSE: tl.constexpr = False,
    QT: tl.constexpr = 128, EXACT: tl.constexpr = True,
):
    """Online-softmax FP4 attention on ``tl.dot_scaled`` by pointer loads; operands from
    :func:`.prepass.prepass_packed`, arguments as :func:`.loop_scaled.attention_packed` groups them.
    ``q_ptrs``: (Q4, QS); MXFP4: scales in their own tensors (QS, KS, VS); NVFP4: each row of Q4 / K4 /
    V4T holds its codes then its E4M3 scale bytes (QS, KS, VS are those tensors again, read past
    the codes). ``g_ptrs``: (GQK, GV), B·H products of Q's and K's tensor scales and V's. FP8 P·V: V4T
    holds V̂ᵀ's e4m3 rows and VS V̂'s channel factors. ``out_ptrs``: (Out, Lse); ``sizes``: (H, SQ, SK,
    SK_PAD, DV); the strides of Q4, K4 and V4T (with V̂ᵀ's scale channels), the key mask, Out and
    Lse. SPARSE: the program visits only the key tiles of its query tile's list, in ascending order
    (``lists``: (KIdx, KCnt, NQT, NKT), :class:`.operands.KeyTileLists`' index and count, NQT query
    tiles of QT rows, NKT key tiles a list). The other constexprs are :class:`.scaled_math.Config`'s
    fields."""
    # the constexprs as one argument of the helpers (:class:`.scaled_math.Config`)
    C: tl.constexpr = Config(HAS_MASK, QK, PV, OCP, QMAX, PNQ, TWO_LEVEL, P_RANGE, FAST_RCP, HW_E4M3,
                             HW_E2M1, F32X2, D, QB, BLOCK_M, BLOCK_N, BLOCK_DV, EXACT)
    Q4, QS = q_ptrs
    GQK, GV = g_ptrs
    H, SQ, SK, SK_PAD, DV = sizes
    sqb, sqh, sqs = strides_q
    skb, skh, sks = strides_k
    svb, svh, svd, svsd = strides_v
    smb, sms = strides_m
    b, h, offs_m, row_ok = program_rows(H, SQ, C.BLOCK_M)
    bh = tl.program_id(1)
    half_d = tl.arange(0, C.D // 2)
    nb_d = tl.arange(0, C.D // C.QB)
    q_rows = Q4 + b * sqb + h * sqh + offs_m[:, None] * sqs
    q4 = tl.load(q_rows + half_d[None, :], mask=row_ok[:, None], other=0)
    K_base, V_base = kv_bases(K4, V4T, b, h, skb, skh, svb, svh, False)
    out_factor = 1.0
    if C.QK == FMT_NVFP4:  # Q̂'s E4M3 scale bytes after each row's codes
        q_sc = tl.load(q_rows + C.D // 2 + nb_d[None, :], mask=row_ok[:, None], other=0).to(tl.float8e4nv, bitcast=True)
        scale_log2 = scale_log2 * tl.load(GQK + bh)  # a power of two: the logits' product is exact
        KS_base = KS + b * skb + h * skh + C.D // 2  # (KS, VS: K4's and V4T's rows again, as pointers)
        VS_base = VS + b * svb + h * svh + SK_PAD // 2
        if C.PV != FMT_E4M3:
            out_factor = tl.load(GV + bh)
    else:  # MXFP4: Q̂'s E8M0 scale bytes from their own table (rows past SQ read as 2^0)
        q_sc = tl.load(QS + (bh * SQ + offs_m)[:, None] * (C.D // C.QB) + nb_d[None, :], mask=row_ok[:, None],
                       other=127)
        KS_base = KS + bh * SK * (C.D // C.QB)
        VS_base = VS + bh * C.BLOCK_DV * svsd

    m_i = tl.full((C.BLOCK_M,), float("-inf"), tl.float32)
    r_i = tl.full((C.BLOCK_M,), 1.0, tl.float32)  # units of acc (the two-level row factor)
    k_i = tl.zeros((C.BLOCK_M,), tl.int32)  # FP8 P·V: units of acc and l, 2^k_i
    l_i = tl.zeros((C.BLOCK_M,), tl.float32)
    acc = tl.zeros((C.BLOCK_M, C.BLOCK_DV), tl.float32)
    M_base = KeyMask + b * smb
    tile_strides = (sks, svd, svsd, sms)
    if SPARSE:  # the listed whole key tiles, then the partial last tile if listed
        KIdx, KCnt, NQT, NKT = lists
        visits, n_whole, tail = visited_tiles(KIdx, KCnt, NQT, NKT, SK, QT, C.BLOCK_M, C.BLOCK_N)
        for i in range(0, n_whole):
            m_i, r_i, k_i, l_i, acc = _tile(q4, q_sc, m_i, r_i, k_i, l_i, acc, K_base, KS_base, V_base, VS_base,
                                            M_base, tl.load(visits + i) * C.BLOCK_N, SK, tile_strides, scale_log2, C,
                                            TAIL=False)
        if tail >= 0:
            m_i, r_i, k_i, l_i, acc = _tile(q4, q_sc, m_i, r_i, k_i, l_i, acc, K_base, KS_base, V_base, VS_base,
                                            M_base, tail, SK, tile_strides, scale_log2, C, TAIL=True)
    else:
        n_full = (SK // C.BLOCK_N) * C.BLOCK_N
        for start in range(0, n_full, C.BLOCK_N):
            m_i, r_i, k_i, l_i, acc = _tile(q4, q_sc, m_i, r_i, k_i, l_i, acc, K_base, KS_base, V_base, VS_base,
                                            M_base, start, SK, tile_strides, scale_log2, C, TAIL=False)
        if n_full < SK:
            m_i, r_i, k_i, l_i, acc = _tile(q4, q_sc, m_i, r_i, k_i, l_i, acc, K_base, KS_base, V_base, VS_base,
                                            M_base, n_full, SK, tile_strides, scale_log2, C, TAIL=True)
    store_result(out_ptrs, acc, m_i, r_i, k_i, l_i, out_factor, VS, b, h, bh, offs_m, row_ok, DV, strides_o, strides_lse,
                 C)


#: the loop's jit kernel, by a public name: what :mod:`.loop_scaled` launches and offline
#: compilation (:mod:`.report`) compiles
KERNEL = _attn_fwd
