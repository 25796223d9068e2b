"""The dot_scaled loop of datacenter Blackwell (sm_100): K̂ / V̂ᵀ codes by TMA, the key loop
warp-specialized by Triton.

Triton splits the loop into a TMA-load partition, an MMA partition issuing the asynchronous
``tcgen05`` MMAs (``kind::mxf4`` / ``kind::mxf4nvf4 … block16``; FP8 P·V: ``kind::f8f6f4``), a
correction partition, and the softmax in the default partition; S is double-buffered in tensor
memory. K̂'s and (FP4 P·V) V̂ᵀ's block scales come by TMA in :func:`.loop_scaled.scale_chunks`'s
layout, which Triton copies from shared into tensor memory by the MMA partition's ``tcgen05.cp``
(SC_TMA; at head dims whose scales do not fill a chunk, by pointer loads). The softmax computes its
arithmetic two lanes an instruction (F32X2) and PNQ's block sums from the codes
(:func:`.scaled_math.code_block_sums`).

The same kernel without warp specialization (WS false) is the TMA loop in key order that tests run
in the interpreter and on Hopper, where Triton emulates ``dot_scaled``.

The block-sparse form (SPARSE) is warp-specialized as well: the loop runs over the list's entries,
each iteration loading its key tile's index, from which the TMA boxes' rows and the scale chunk
follow.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp4_math import FMT_E4M3, FMT_NVFP4
from .scaled_math import Config, as_scales, e4m3_p, fp4_p, key_scales, masked_logits, store_result, value_scales
from .tiles import program_rows, visited_tiles


@triton.jit
def chunk_scales(desc, chunk, ROWS: tl.constexpr, NS: tl.constexpr):
    """The (ROWS, NS) block scales of one key tile (K̂: its keys' scales along D; V̂ᵀ: its
    channels' scales along the tile's keys) from chunk ``chunk`` of :func:`.loop_scaled.scale_chunks`'s
    layout, by TMA. Written as the reshape, permute and reshape that Triton recognizes (its
    ``UseShmemForScales`` rewrite): the scales then go from shared to tensor memory by the MMA
    partition's ``tcgen05.cp``, not through registers into a ``tcgen05.st`` of four warps."""
    raw = desc.load([chunk, 0, 0])
    return raw.reshape(ROWS // 128, NS // 4, 32, 4, 4).trans(0, 3, 2, 1, 4).reshape(ROWS, NS)


@triton.jit
def _tile(q4, q_sc, m_i, r_i, k_i, l_i, acc, K, KS_base, V, VS_base, M_base, rows, start, chunk, SK, strides,
          scale_log2, C, TAIL: tl.constexpr, WS: tl.constexpr, SC_TMA: tl.constexpr):
    """One key tile: returns the updated (m, r, k, l, acc); m in log2 units, acc in units of r (the
    two-level row factor; 1 otherwise) and, FP8 P·V, of 2^k. ``K`` and ``V`` are tensor descriptors
    of K̂'s rows (this head's first at ``rows[0]``; rows past SK are another head's or zeros,
    masked like any key past SK) and V̂ᵀ's (this head's first channel at ``rows[1]``; FP8 P·V: its
    e4m3 rows, keys in order), a box holding a key tile's codes. SC_TMA: ``KS_base`` (and, FP4 P·V,
    ``VS_base``) are tensor descriptors of :func:`.loop_scaled.scale_chunks`'s layout, ``chunk``
    this tile's; else the scales are pointer loads (4 or 8 bytes a row, below TMA's 16-byte box).
    ``strides``: (K̂'s row, V̂ᵀ's channel, V̂ᵀ's scale channel, the mask's key). WS: the
    warp-specialized loop's arithmetic (:func:`.scaled_math.mx_p`)."""
    k_row, v_row = rows
    sks, _, svsd, sms = strides  # (V̂ᵀ's channel stride: the descriptor's)
    NB: tl.constexpr = C.BLOCK_N // C.QB
    keys = start + tl.arange(0, C.BLOCK_N)
    nb_d = tl.arange(0, C.D // C.QB)
    dv = tl.arange(0, C.BLOCK_DV)
    key_ok = keys < SK
    k4 = K.load([k_row + start, 0])
    if SC_TMA:
        k_sc = chunk_scales(KS_base, chunk, C.BLOCK_N, C.D // C.QB)
    else:
        k_sc = key_scales(KS_base, keys, nb_d, key_ok, sks, C)
    qk = tl.dot_scaled(q4, q_sc, "e2m1", tl.trans(k4), as_scales(k_sc, C), "e2m1")
    qk = masked_logits(qk, scale_log2, M_base, keys, SK, sms, C, TAIL)  # dead keys -inf
    if C.PV == FMT_E4M3:  # FP8 P·V: P̂ and V̂ᵀ in E4M3 on the FP8 MMA
        p8, m_new, k_i, l_i, alpha = e4m3_p(qk, m_i, k_i, l_i, C.PNQ, C.HW_E4M3, C.F32X2)
        v8t = V.load([v_row, start])
        # the rescaled accumulator plus P̂·V̂, as the FP4-P form writes it: the warp-specialized loop's
        # MMA then adds into the accumulator in tensor memory, the correction partition rescales it
        # there (as an FMA of a fresh product, that partition reads both and spills)
        acc = acc * alpha[:, None] + tl.dot(p8, tl.trans(v8t))
    else:
        p4, p_sc, m_new, r_i, l_i, acc_scale = fp4_p(qk, m_i, r_i, l_i, scale_log2, C, WS=WS)
        nb_n = start // C.QB + tl.arange(0, NB)
        v4t = V.load([v_row, start // 2])
        if SC_TMA:
            v_sc = chunk_scales(VS_base, chunk, C.BLOCK_DV, NB)
        else:
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
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, WS: tl.constexpr, SC_TMA: tl.constexpr,
    SPARSE: tl.constexpr = False, QT: tl.constexpr = 128, EXACT: tl.constexpr = True,
):
    """Online-softmax FP4 attention on ``tl.dot_scaled`` with K̂ / V̂ᵀ by TMA; operands from
    :func:`.prepass.prepass_packed`, arguments as :func:`.loop_scaled.attention_packed` groups them.
    ``q_ptrs``: (Q4, QS); MXFP4: scales in their own tensors (QS, KS, VS); NVFP4: each row of Q4 / K4 /
    V4T holds its codes then its E4M3 scale bytes (QS, KS, VS are those tensors again, read past the
    codes). ``g_ptrs``: (GQK, GV), B·H products of Q's and K's tensor scales and V's. K4 and V4T are
    tensor descriptors of the rows (B·H·SK and B·H·BLOCK_DV rows; a box holds a key tile's codes).
    SC_TMA: KS, and VS for FP4 P·V, are tensor descriptors of the K̂ / V̂ᵀ block scales in
    :func:`.loop_scaled.scale_chunks`'s layout, chunk bh · (SK_PAD / BLOCK_N) + tile. FP8 P·V: VS
    holds V̂'s channel factors. ``out_ptrs``: (Out, Lse); ``sizes``: (H, SQ, SK, SK_PAD, DV); the strides
    of Q4, K4 and V4T (with V̂ᵀ's scale channels), the key mask, Out and Lse. WS: Triton's
    warp-specialized key loop. SPARSE: the program visits only the key tiles of its query tile's
    list, in ascending order (``lists``: (KIdx, KCnt, NQT, NKT), :class:`.operands.KeyTileLists`'
    index and count, NQT query tiles of QT rows, NKT key tiles a list); each tile's boxes, scale
    chunk and scales follow its listed start. The other constexprs are :class:`.scaled_math.Config`'s
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
    rows = (bh * SK, bh * C.BLOCK_DV)  # this head's first row of K̂ and of V̂ᵀ in the descriptors
    out_factor = 1.0
    if C.QK == FMT_NVFP4:  # Q̂'s E4M3 scale bytes after each row's codes
        q_sc = tl.load(q_rows + C.D // 2 + nb_d[None, :], mask=row_ok[:, None], other=0).to(tl.float8e4nv, bitcast=True)
        scale_log2 = scale_log2 * tl.load(GQK + bh)  # a power of two: the logits' product is exact
        if SC_TMA:
            KS_base = KS
            VS_base = VS
        else:
            KS_base = KS + b * skb + h * skh + C.D // 2  # (KS, VS: K4's and V4T's rows again, as pointers)
            VS_base = VS + b * svb + h * svh + SK_PAD // 2
        if C.PV != FMT_E4M3:
            out_factor = tl.load(GV + bh)
    else:  # MXFP4: Q̂'s E8M0 scale bytes from their own table (rows past SQ read as 2^0)
        q_sc = tl.load(QS + (bh * SQ + offs_m)[:, None] * (C.D // C.QB) + nb_d[None, :], mask=row_ok[:, None],
                       other=127)
        if SC_TMA:
            KS_base = KS
            VS_base = VS
        else:
            KS_base = KS + bh * SK * (C.D // C.QB)
            VS_base = VS + bh * C.BLOCK_DV * svsd

    m_i = tl.full((C.BLOCK_M,), float("-inf"), tl.float32)
    r_i = tl.full((C.BLOCK_M,), 1.0, tl.float32)  # units of acc (the two-level row factor)
    k_i = tl.zeros((C.BLOCK_M,), tl.int32)  # FP8 P·V: units of acc and l, 2^k_i
    l_i = tl.zeros((C.BLOCK_M,), tl.float32)
    acc = tl.zeros((C.BLOCK_M, C.BLOCK_DV), tl.float32)
    M_base = KeyMask + b * smb
    tile_strides = (sks, svd, svsd, sms)
    first_chunk = bh * (SK_PAD // C.BLOCK_N)  # this head's first key tile among the scale chunks
    if SPARSE:  # the listed whole key tiles, then the partial last tile if listed
        KIdx, KCnt, NQT, NKT = lists
        visits, n_whole, tail = visited_tiles(KIdx, KCnt, NQT, NKT, SK, QT, C.BLOCK_M, C.BLOCK_N)
        if WS:
            for i in tl.range(0, n_whole, warp_specialize=True, disallow_acc_multi_buffer=C.PV == FMT_E4M3):
                tile = tl.load(visits + i)
                m_i, r_i, k_i, l_i, acc = _tile(q4, q_sc, m_i, r_i, k_i, l_i, acc, K4, KS_base, V4T, VS_base, M_base,
                                                rows, tile * C.BLOCK_N, first_chunk + tile, SK, tile_strides,
                                                scale_log2, C, TAIL=False, WS=True, SC_TMA=SC_TMA)
        else:
            for i in range(0, n_whole):
                tile = tl.load(visits + i)
                m_i, r_i, k_i, l_i, acc = _tile(q4, q_sc, m_i, r_i, k_i, l_i, acc, K4, KS_base, V4T, VS_base, M_base,
                                                rows, tile * C.BLOCK_N, first_chunk + tile, SK, tile_strides,
                                                scale_log2, C, TAIL=False, WS=False, SC_TMA=SC_TMA)
        if tail >= 0:
            m_i, r_i, k_i, l_i, acc = _tile(q4, q_sc, m_i, r_i, k_i, l_i, acc, K4, KS_base, V4T, VS_base, M_base,
                                            rows, tail, first_chunk + tail // C.BLOCK_N, SK, tile_strides, scale_log2,
                                            C, TAIL=True, WS=False, SC_TMA=SC_TMA)
    else:
        n_full = (SK // C.BLOCK_N) * C.BLOCK_N
        if WS:  # (the keyword exists from Triton 3.4: only named where asked for)
            for start in tl.range(0, n_full, C.BLOCK_N, warp_specialize=True,
                                  disallow_acc_multi_buffer=C.PV == FMT_E4M3):
                m_i, r_i, k_i, l_i, acc = _tile(q4, q_sc, m_i, r_i, k_i, l_i, acc, K4, KS_base, V4T, VS_base, M_base,
                                                rows, start, first_chunk + start // C.BLOCK_N, SK, tile_strides,
                                                scale_log2, C, TAIL=False, WS=True, SC_TMA=SC_TMA)
        else:
            for start in range(0, n_full, C.BLOCK_N):
                m_i, r_i, k_i, l_i, acc = _tile(q4, q_sc, m_i, r_i, k_i, l_i, acc, K4, KS_base, V4T, VS_base, M_base,
                                                rows, start, first_chunk + start // C.BLOCK_N, SK, tile_strides,
                                                scale_log2, C, TAIL=False, WS=False, SC_TMA=SC_TMA)
        if n_full < SK:
            m_i, r_i, k_i, l_i, acc = _tile(q4, q_sc, m_i, r_i, k_i, l_i, acc, K4, KS_base, V4T, VS_base, M_base,
                                            rows, n_full, first_chunk + n_full // C.BLOCK_N, SK, tile_strides,
                                            scale_log2, C, TAIL=True, WS=False, SC_TMA=SC_TMA)
    store_result(out_ptrs, acc, m_i, r_i, k_i, l_i, out_factor, VS, b, h, bh, offs_m, row_ok, DV, strides_o, strides_lse,
                 C)


#: the loop's jit kernel, by a public name: what :mod:`.loop_scaled` launches and offline
#: compilation (:mod:`.report`) compiles
KERNEL = _attn_fwd
