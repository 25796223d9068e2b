"""An experiment: the e4m3 loop on Hopper with FlashAttention-3's overlap (Gluon, sm_90).

The numerics of :mod:`.loop_e4m3` (the same :func:`.loop_e4m3.quantize_p` on the same
:func:`.prepass.prepass_fp8` outputs, K̂ in tile key order, V̂ᵀ in P̂'s operand order, the same MMA
shapes), each CTA's 128 query rows two warpgroups of 64 in their own ``gl.warp_specialize``
partitions, sharing K̂ / V̂ᵀ tiles that come by TMA into NUM_BUF buffers (warpgroup 0 refills a
buffer once both released it). Two schedules:

- ``late=False`` ("early"): step j issues Q̂·K̂ᵀ of tile j with P̂·V̂ of tile j-1, runs tile j's
  softmax while P̂·V̂ is in flight (OVERLAP), then adds P̂·V̂ (FRESH: a fresh accumulator and the
  Triton TMA loop's FMA; else in place, as its ``fresh_pv=False`` form). Bit for bit the Triton
  loop's output on the H200 (2026-12-02), but 0.84× its speed at Wan 720p: P̂ is carried across
  the loop's back edge and its bytes are repacked every step (11.8 SASS instructions per element
  of S against the Triton loop's 10.1, offline).
- ``late=True``: P̂ goes to its MMA in the step that made it (9.0 instructions per element), the
  accumulator carried in flight (it enters as an MMA of a tile of zeros each warpgroup stores);
  ``pv_under_softmax``: the softmax before the wait for the previous P̂·V̂ (ptxas moves that wait
  up anyway). On the H200 these computed wrong rows (outputs off by a per-row scale, LSE off),
  even for a single key tile, cause not found; their times were 1.02× (late) and 0.95× (with
  pv_under_softmax) the Triton loop's.

Removed after the measurement (docs/history.md, 2026-12-02); kept in this commit so that
``tools/e4m3_hopper_experiments.py --part gluon`` reproduces it.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait

from fp4video.formats import Format, ScaleRule
from fp4video.recipe import AttentionRecipe, RowSum
from fp4video.reference import KEY_TILE

from .key_order import LANE_BLOCK
from .loop_e4m3 import TILE_EXP_FLOOR, _block_reduce, _view5, quantize_p
from .loop_nvfp4_sm90 import _cta_barrier, _masked_logits, _named_barrier, _tma_load
from .tiles import LOG2E, key_mask, outputs, store_out_lse

BLOCK_M = 128
#: K̂ / V̂ᵀ tile buffers (a tile is 32 KB of e4m3 at head dim 128)
NUM_BUFFERS = 4
#: registers per thread of warpgroup 1's partition (warpgroup 0 gets the rest of the 64 K)
CONSUMER_REGS = 240


@gluon.constexpr_function
def _fp8_smem_layout(rows, cols):
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.float8e4nv)


@gluon.constexpr_function
def _fp8_mma_layout(n):
    """The accumulator of a 64-row warpgroup MMA with N = n on 8-bit operands (K = 32 per instruction)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 32])


@gluon.constexpr_function
def _fp8_row_load_layout(cols):
    """Rows of ``cols`` bytes read 16 per thread, a warp covering whole rows (4 warps)."""
    per_row = min(32, max(1, cols // 16))
    return gl.BlockedLayout([1, 16], [32 // per_row, per_row], [4, 1], [1, 0])


@gluon.jit
def _turn(ASM: gl.constexpr):
    """A named-barrier step of the ping-pong (nothing when the warpgroups run free)."""
    if ASM != "":
        _named_barrier(ASM)


@gluon.jit
def _load_tile(kd, vd, k_buf, v_buf, bar, k_row, v_row, v_col):
    """TMA of one key tile: K̂ rows ``k_row`` onward, V̂ᵀ rows (channels) ``v_row`` onward at key
    column ``v_col``; completion counted on ``bar``."""
    mbarrier.expect(bar, kd.block_type.nbytes + vd.block_type.nbytes)
    _tma_load(kd, [k_row, 0], bar, k_buf)
    _tma_load(vd, [v_row, v_col], bar, v_buf)


@gluon.jit
def _block_vector(tile, QB: gl.constexpr):
    """A per-row-and-block tensor in the layout of :func:`.loop_e4m3.quantize_p`'s ``l`` (zeros;
    ``tile``: any finite tile of S's shape and layout)."""
    return _block_reduce(_view5(tile * 0.0, QB), False)


@gluon.jit
def _softmax(s, j, q_scale, m_i, k_i, l_i, M_base, SK, sms, HAS_MASK: gl.constexpr, TAIL: gl.constexpr,
             OCP: gl.constexpr,
             QMAX: gl.constexpr, PNQ: gl.constexpr, QB: gl.constexpr, EXP_FLOOR: gl.constexpr,
             BLOCK_N: gl.constexpr, P_E4M3: gl.constexpr, S_L: gl.constexpr, P_L: gl.constexpr):
    """Tile j's logits ``s`` masked, softmax and P quantization: (P̂ as the MMA's A operand, m, k, l, alpha)."""
    if HAS_MASK or TAIL:
        s = _masked_logits(s, M_base, j * BLOCK_N, SK, sms, HAS_MASK, BLOCK_N, S_L)
    p8, m_i, k_i, l_i, alpha = quantize_p(s, q_scale, m_i, k_i, l_i, OCP, QMAX, PNQ, QB, EXP_FLOOR, True, P_E4M3,
                                          )
    return gl.convert_layout(p8, P_L), m_i, k_i, l_i, alpha


@gluon.jit
def _step(j, p, m_i, k_i, l_i, alpha, acc, q_smem, k_bufs, v_bufs, ready, empty, Kd, Vd, q_scale, KF_base, M_base,
          SK, sms, k_row0, v_row0, n_tiles, zero, zero_o, HAS_MASK: gl.constexpr, TAIL: gl.constexpr,
          OCP: gl.constexpr, QMAX: gl.constexpr, PNQ: gl.constexpr, QB: gl.constexpr, EXP_FLOOR: gl.constexpr,
          BLOCK_N: gl.constexpr, P_E4M3: gl.constexpr, NUM_BUF: gl.constexpr, OVERLAP: gl.constexpr,
          TURN: gl.constexpr, DONE: gl.constexpr, WG: gl.constexpr, S_L: gl.constexpr, P_L: gl.constexpr,
          ROW_O: gl.constexpr, FRESH: gl.constexpr):
    """Step j: Q̂·K̂ᵀ of tile j and P̂·V̂ of tile j-1 issued together; tile j's softmax while P̂·V̂
    runs (OVERLAP) or after both are done; then the accumulator takes tile j-1's P̂·V̂ (in units of
    tile j-1: rescaled by tile j-1's alpha, as the Triton loop does in tile j-1). TAIL: tile j
    is the partial last one (its keys past SK masked)."""
    buf = j % NUM_BUF
    prev = (j - 1) % NUM_BUF
    mbarrier.wait(ready.index(buf), (j // NUM_BUF) & 1)
    _turn(TURN)
    s = warpgroup_mma(q_smem, k_bufs.index(buf).permute((1, 0)), zero, use_acc=False, is_async=True)
    if FRESH:
        pv = warpgroup_mma(p, v_bufs.index(prev).permute((1, 0)), zero_o, use_acc=False, is_async=True)
    else:  # acc is in units of tile j-1 already
        pv = warpgroup_mma(p, v_bufs.index(prev).permute((1, 0)), acc, is_async=True)
    _turn(DONE)
    alpha_prev = alpha
    if OVERLAP:
        s = warpgroup_mma_wait(1, deps=(s,))
        p, m_i, k_i, l_i, alpha = _softmax(s, j, q_scale * gl.load(KF_base + j), m_i, k_i, l_i, M_base, SK, sms,
                                           HAS_MASK, TAIL, OCP, QMAX, PNQ, QB, EXP_FLOOR, BLOCK_N, P_E4M3, S_L, P_L)
        pv = warpgroup_mma_wait(0, deps=(pv,))
    else:
        s, pv = warpgroup_mma_wait(0, deps=(s, pv))
        p, m_i, k_i, l_i, alpha = _softmax(s, j, q_scale * gl.load(KF_base + j), m_i, k_i, l_i, M_base, SK, sms,
                                           HAS_MASK, TAIL, OCP, QMAX, PNQ, QB, EXP_FLOOR, BLOCK_N, P_E4M3, S_L, P_L)
    mbarrier.arrive(empty.index(prev))  # this warpgroup is done with tile j-1's buffer
    if FRESH:
        acc = gl.fma(acc, gl.convert_layout(alpha_prev, ROW_O)[:, None], pv)
    else:  # into tile j's units
        acc = pv * gl.convert_layout(alpha, ROW_O)[:, None]
    if WG == 0:
        if j - 1 + NUM_BUF < n_tiles:  # refill it once both warpgroups released it
            mbarrier.wait(empty.index(prev), ((j - 1) // NUM_BUF) & 1)
            _load_tile(Kd, Vd, k_bufs.index(prev), v_bufs.index(prev), ready.index(prev),
                       k_row0 + (j - 1 + NUM_BUF) * BLOCK_N, v_row0, (j - 1 + NUM_BUF) * BLOCK_N)
    return p, m_i, k_i, l_i, alpha, acc


@gluon.jit
def _late_step(j, s, acc, pv, m_i, k_i, l_i, alpha, q_smem, k_bufs, v_bufs, ready, empty, Kd, Vd, q_scale, KF_base,
               M_base, SK, sms, k_row0, v_row0, n_tiles, zero, zero_o, HAS_MASK: gl.constexpr, TAIL: gl.constexpr,
               LAST: gl.constexpr, OCP: gl.constexpr, QMAX: gl.constexpr, PNQ: gl.constexpr, QB: gl.constexpr,
               EXP_FLOOR: gl.constexpr, BLOCK_N: gl.constexpr, P_E4M3: gl.constexpr, NUM_BUF: gl.constexpr,
               TURN: gl.constexpr, DONE: gl.constexpr, WG: gl.constexpr, S_L: gl.constexpr, P_L: gl.constexpr,
               ROW_O: gl.constexpr, FRESH: gl.constexpr, SYNC: gl.constexpr = False, PVU: gl.constexpr = False):
    """Step j: tile j's softmax and P quantization (P̂·V̂ of tile j-1 still on the tensor cores),
    then the accumulator takes tile j-1's P̂·V̂, then Q̂·K̂ᵀ of tile j+1 (unless LAST) and P̂·V̂ of
    tile j are issued, and Q̂·K̂ᵀ awaited: P̂ goes to its MMA in the step that made it (a
    loop-carried 8-bit operand is repacked every step)."""
    if PVU:  # tile j's softmax under P̂·V̂ of tile j-1; buffer j-1 released after the MMAs are issued
        p, m_i, k_i, l_i, alpha_new = _softmax(s, j, q_scale * gl.load(KF_base + j), m_i, k_i, l_i, M_base, SK,
                                               sms, HAS_MASK, TAIL, OCP, QMAX, PNQ, QB, EXP_FLOOR, BLOCK_N, P_E4M3,
                                               S_L, P_L)
        if FRESH:
            pv = warpgroup_mma_wait(0, deps=(pv,))
            acc = gl.fma(acc, gl.convert_layout(alpha, ROW_O)[:, None], pv)
        else:
            acc = warpgroup_mma_wait(0, deps=(acc,))
            acc = acc * gl.convert_layout(alpha_new, ROW_O)[:, None]
    else:
        # P̂·V̂ of tile j-1 (ptxas waits for it here in any case), its buffer released and refilled:
        # before the softmax, so that no branch separates P̂ from its MMA (P̂'s bytes would be
        # unpacked and repacked around it)
        if FRESH:
            pv = warpgroup_mma_wait(0, deps=(pv,))
        else:
            acc = warpgroup_mma_wait(0, deps=(acc,))
        if j > 0:
            prev = (j - 1) % NUM_BUF
            mbarrier.arrive(empty.index(prev))  # this warpgroup is done with tile j-1's buffer
            if WG == 0:
                if j - 1 + NUM_BUF < n_tiles:  # refill it once both warpgroups released it
                    mbarrier.wait(empty.index(prev), ((j - 1) // NUM_BUF) & 1)
                    _load_tile(Kd, Vd, k_bufs.index(prev), v_bufs.index(prev), ready.index(prev),
                               k_row0 + (j - 1 + NUM_BUF) * BLOCK_N, v_row0, (j - 1 + NUM_BUF) * BLOCK_N)
        p, m_i, k_i, l_i, alpha_new = _softmax(s, j, q_scale * gl.load(KF_base + j), m_i, k_i, l_i, M_base, SK, sms,
                                               HAS_MASK, TAIL, OCP, QMAX, PNQ, QB, EXP_FLOOR, BLOCK_N, P_E4M3, S_L, P_L)
        if FRESH:
            acc = gl.fma(acc, gl.convert_layout(alpha, ROW_O)[:, None], pv)  # tiles < j, in units of tile j-1
        else:
            acc = acc * gl.convert_layout(alpha_new, ROW_O)[:, None]  # tiles < j, in units of tile j
    if j + 1 < n_tiles:
        mbarrier.wait(ready.index((j + 1) % NUM_BUF), ((j + 1) // NUM_BUF) & 1)
    _turn(TURN)
    # after the last tile this reads a stale buffer: its S is never used (and costs one MMA a row block)
    s = warpgroup_mma(q_smem, k_bufs.index((j + 1) % NUM_BUF).permute((1, 0)), zero, use_acc=False, is_async=True)
    if FRESH:
        pv = warpgroup_mma(p, v_bufs.index(j % NUM_BUF).permute((1, 0)), zero_o, use_acc=False, is_async=True)
    else:
        acc = warpgroup_mma(p, v_bufs.index(j % NUM_BUF).permute((1, 0)), acc, is_async=True)
    _turn(DONE)
    if SYNC:  # (an experiment: both MMAs awaited here)
        s = warpgroup_mma_wait(0, deps=(s,))
    else:
        s = warpgroup_mma_wait(1, deps=(s,))
    if PVU:
        if j > 0:
            prev = (j - 1) % NUM_BUF
            mbarrier.arrive(empty.index(prev))  # this warpgroup is done with tile j-1's buffer
            if WG == 0:
                if j - 1 + NUM_BUF < n_tiles:  # refill it once both warpgroups released it
                    mbarrier.wait(empty.index(prev), ((j - 1) // NUM_BUF) & 1)
                    _load_tile(Kd, Vd, k_bufs.index(prev), v_bufs.index(prev), ready.index(prev),
                               k_row0 + (j - 1 + NUM_BUF) * BLOCK_N, v_row0, (j - 1 + NUM_BUF) * BLOCK_N)
    return s, acc, pv, m_i, k_i, l_i, alpha_new


@gluon.jit
def _warpgroup(Q8, QFac, KFac, VFac, Kd, Vd, KeyMask, Out, Lse, q_bufs, k_bufs, v_bufs, zeros_smem, ready, empty,
               H, SQ, SK, SK_PAD, DV, sqb, sqh, sqs, smb, sms, sob, soh, sos, sod, slb, slh, sls, scale_log2,
               HAS_MASK: gl.constexpr, OCP: gl.constexpr, QMAX: gl.constexpr, PNQ: gl.constexpr,
               P_E4M3: gl.constexpr, D: gl.constexpr, BLOCK_DV: gl.constexpr, BLOCK_N: gl.constexpr,
               NUM_BUF: gl.constexpr, EXP_FLOOR: gl.constexpr, PING_PONG: gl.constexpr, OVERLAP: gl.constexpr,
               FRESH: gl.constexpr, LATE: gl.constexpr, SYNC: gl.constexpr, PVU: gl.constexpr, WG: gl.constexpr):
    """Query rows [64·WG, 64·WG + 64) of the program's 128: the whole attention loop."""
    ROWS: gl.constexpr = 64
    QB: gl.constexpr = 32
    S_L: gl.constexpr = _fp8_mma_layout(BLOCK_N)
    O_L: gl.constexpr = _fp8_mma_layout(BLOCK_DV)
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=4)
    LQ: gl.constexpr = _fp8_row_load_layout(D)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
    if not PING_PONG:
        TURN: gl.constexpr = ""
        DONE: gl.constexpr = ""
    elif WG == 0:
        TURN: gl.constexpr = "bar.sync 14, 256; mov.u32 $0, 0;"
        DONE: gl.constexpr = "bar.arrive 15, 256; mov.u32 $0, 0;"
    else:
        TURN: gl.constexpr = "bar.sync 15, 256; mov.u32 $0, 0;"
        DONE: gl.constexpr = "bar.arrive 14, 256; mov.u32 $0, 0;"
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    row_start = gl.program_id(0) * (2 * ROWS) + WG * ROWS
    rows = row_start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LQ))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, LQ))
    q = gl.load(Q8 + b * sqb + h * sqh + rows[:, None] * sqs + offs_d[None, :], mask=(rows < SQ)[:, None], other=0.0)
    q_smem = q_bufs.index(WG)
    q_smem.store(q)
    zeros_smem = zeros_smem.index(WG)
    zeros_smem.store(gl.zeros((ROWS, BLOCK_N), gl.float8e4nv, _fp8_row_load_layout(BLOCK_N)))
    fence_async_shared()
    _cta_barrier()  # inside a partition: this warpgroup's warps
    # logits in log2 units: Q̂·K̂ᵀ · q_fac · k_fac · scale · log2(e) (powers of two and one constant)
    zero = gl.zeros((ROWS, BLOCK_N), gl.float32, S_L)
    zero_o = gl.zeros((ROWS, BLOCK_DV), gl.float32, O_L)
    s_rows = row_start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, S_L))
    q_fac = gl.load(QFac + bh * SQ + s_rows, mask=s_rows < SQ, other=1.0) * scale_log2
    l_i = _block_vector(zero, QB)
    q_scale = gl.max(_block_reduce(_view5(zero + q_fac[:, None], QB), True), axis=1)  # quantize_p's row layout
    m_i = q_scale * 0.0 + float("-inf")
    k_i = (q_scale * 0.0).to(gl.int32)
    KF_base = KFac + bh * gl.cdiv(SK, BLOCK_N)
    M_base = KeyMask + b * smb
    n_tiles = gl.cdiv(SK, BLOCK_N)
    k_row0 = bh * SK_PAD
    v_row0 = bh * BLOCK_DV
    if WG == 1 and PING_PONG:
        _named_barrier("bar.arrive 14, 256; mov.u32 $0, 0;")  # warpgroup 0 takes the first turn

    mbarrier.wait(ready.index(0), 0)
    _turn(TURN)
    s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
    _turn(DONE)
    s = warpgroup_mma_wait(0, deps=(s,))
    if LATE:
        # the loop carries the accumulator (FRESH: P̂·V̂) in flight: it enters as the result of an
        # MMA of zeros (exactly 0: P̂ = 0, V̂ finite)
        first = warpgroup_mma(zeros_smem, v_bufs.index(0).permute((1, 0)), zero_o, use_acc=False, is_async=True)
        if FRESH:
            acc = zero_o
            pv = first
        else:
            acc = first
            pv = zero_o
        alpha = q_scale * 0.0 + 1.0
        # the full tiles (a key-padding mask, if any, applies to every tile), then the last tile
        # (masked past SK); each step leaves its P̂·V̂ in flight
        for j in range(0, n_tiles - 1):
            s, acc, pv, m_i, k_i, l_i, alpha = _late_step(
                j, s, acc, pv, m_i, k_i, l_i, alpha, q_smem, k_bufs, v_bufs, ready, empty, Kd, Vd, q_scale, KF_base,
                M_base, SK, sms, k_row0, v_row0, n_tiles, zero, zero_o, HAS_MASK, False, False, OCP, QMAX, PNQ, QB,
                EXP_FLOOR, BLOCK_N, P_E4M3, NUM_BUF, TURN, DONE, WG, S_L, P_L, ROW_O, FRESH, SYNC, PVU)
        s, acc, pv, m_i, k_i, l_i, alpha = _late_step(
            n_tiles - 1, s, acc, pv, m_i, k_i, l_i, alpha, q_smem, k_bufs, v_bufs, ready, empty, Kd, Vd, q_scale,
            KF_base, M_base, SK, sms, k_row0, v_row0, n_tiles, zero, zero_o, HAS_MASK, True, True, OCP, QMAX,
            PNQ, QB, EXP_FLOOR, BLOCK_N, P_E4M3, NUM_BUF, TURN, DONE, WG, S_L, P_L, ROW_O, FRESH, SYNC, PVU)
        if FRESH:
            pv = warpgroup_mma_wait(0, deps=(pv,))
            acc = gl.fma(acc, gl.convert_layout(alpha, ROW_O)[:, None], pv)
        else:
            acc = warpgroup_mma_wait(0, deps=(acc,))
    else:
        p, m_i, k_i, l_i, alpha = _softmax(s, 0, q_scale * gl.load(KF_base), m_i, k_i, l_i, M_base, SK, sms, HAS_MASK,
                                           True, OCP, QMAX, PNQ, QB, EXP_FLOOR, BLOCK_N, P_E4M3, S_L, P_L)
        acc = zero_o
        # full key tiles without a bounds mask (a key-padding mask, if any, applies to every tile), then
        # the partial last tile
        n_full = gl.maximum(SK // BLOCK_N, 1)
        for j in range(1, n_full):
            p, m_i, k_i, l_i, alpha, acc = _step(
                j, p, m_i, k_i, l_i, alpha, acc, q_smem, k_bufs, v_bufs, ready, empty, Kd, Vd, q_scale, KF_base,
                M_base, SK, sms, k_row0, v_row0, n_tiles, zero, zero_o, HAS_MASK, False, OCP, QMAX, PNQ, QB, EXP_FLOOR,
                BLOCK_N, P_E4M3, NUM_BUF, OVERLAP, TURN, DONE, WG, S_L, P_L, ROW_O, FRESH)
        if n_full < n_tiles:
            p, m_i, k_i, l_i, alpha, acc = _step(
                n_full, p, m_i, k_i, l_i, alpha, acc, q_smem, k_bufs, v_bufs, ready, empty, Kd, Vd, q_scale, KF_base,
                M_base, SK, sms, k_row0, v_row0, n_tiles, zero, zero_o, HAS_MASK, True, OCP, QMAX, PNQ, QB, EXP_FLOOR,
                BLOCK_N, P_E4M3, NUM_BUF, OVERLAP, TURN, DONE, WG, S_L, P_L, ROW_O, FRESH)
        _turn(TURN)
        if FRESH:
            pv = warpgroup_mma(p, v_bufs.index((n_tiles - 1) % NUM_BUF).permute((1, 0)), zero_o, use_acc=False,
                               is_async=True)
        else:
            pv = warpgroup_mma(p, v_bufs.index((n_tiles - 1) % NUM_BUF).permute((1, 0)), acc, is_async=True)
        _turn(DONE)
        pv = warpgroup_mma_wait(0, deps=(pv,))
        if FRESH:
            acc = gl.fma(acc, gl.convert_layout(alpha, ROW_O)[:, None], pv)
        else:
            acc = pv
    if WG == 0 and PING_PONG:
        _named_barrier("bar.sync 14, 256; mov.u32 $0, 0;")  # matches warpgroup 1's last DONE

    offs_m = row_start + gl.arange(0, ROWS, layout=ROW_O)
    offs_dv = gl.arange(0, BLOCK_DV, layout=gl.SliceLayout(0, O_L))
    v_fac = gl.load(VFac + bh * BLOCK_DV + offs_dv)  # acc is in units of V̂'s channel factors
    store_out_lse(Out, Lse, acc, v_fac[None, :], gl.convert_layout(gl.sum(l_i, axis=1), ROW_O),
                  gl.convert_layout(m_i, ROW_O), gl.convert_layout(k_i, ROW_O).to(gl.float32), b, h, offs_m,
                  offs_m < SQ, offs_dv, DV, sob, soh, sos, sod, slb, slh, sls)


@gluon.jit
def _e4m3_attn_fwd_sm90(
    Q8, QFac, Kd, KFac, Vd, VFac, KeyMask, Out, Lse,
    H, SQ, SK, SK_PAD, DV,
    sqb, sqh, sqs, smb, sms, sob, soh, sos, sod, slb, slh, sls, scale_log2,
    HAS_MASK: gl.constexpr, OCP: gl.constexpr, QMAX: gl.constexpr, PNQ: gl.constexpr, P_E4M3: gl.constexpr,
    D: gl.constexpr, BLOCK_DV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_BUF: gl.constexpr, EXP_FLOOR: gl.constexpr, CONSUMER_REGS: gl.constexpr, PING_PONG: gl.constexpr,
    OVERLAP: gl.constexpr, FRESH: gl.constexpr, LATE: gl.constexpr, SYNC: gl.constexpr, PVU: gl.constexpr = False,
):
    gl.static_assert(BLOCK_M == 128, "two warpgroups of 64 rows")
    q_bufs = gl.allocate_shared_memory(gl.float8e4nv, [2, 64, D], _fp8_smem_layout(64, D))
    k_bufs = gl.allocate_shared_memory(gl.float8e4nv, [NUM_BUF, BLOCK_N, D], Kd.layout)
    v_bufs = gl.allocate_shared_memory(gl.float8e4nv, [NUM_BUF, BLOCK_DV, BLOCK_N], Vd.layout)
    # a 64-row tile of zeros: the A operand of the MMA that starts each warpgroup's accumulator
    zeros_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, 64, BLOCK_N], _fp8_smem_layout(64, BLOCK_N))
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per warpgroup
    fence_async_shared()
    bh = gl.program_id(1)
    n_tiles = gl.cdiv(SK, BLOCK_N)
    for i in gl.static_range(NUM_BUF):
        if i < n_tiles:
            _load_tile(Kd, Vd, k_bufs.index(i), v_bufs.index(i), ready.index(i), bh * SK_PAD + i * BLOCK_N,
                       bh * BLOCK_DV, i * BLOCK_N)
    # (the argument tuples are written out in the call: a tuple assigned to a name first turns its
    # constexprs into tensors)
    gl.warp_specialize([
        (_warpgroup, (Q8, QFac, KFac, VFac, Kd, Vd, KeyMask, Out, Lse, q_bufs, k_bufs, v_bufs, zeros_smem, ready, empty,
                      H, SQ, SK, SK_PAD, DV, sqb, sqh, sqs, smb, sms, sob, soh, sos, sod, slb, slh, sls, scale_log2,
                      HAS_MASK, OCP, QMAX, PNQ, P_E4M3, D, BLOCK_DV, BLOCK_N, NUM_BUF, EXP_FLOOR, PING_PONG,
                      OVERLAP, FRESH, LATE, SYNC, PVU, 0)),
        (_warpgroup, (Q8, QFac, KFac, VFac, Kd, Vd, KeyMask, Out, Lse, q_bufs, k_bufs, v_bufs, zeros_smem, ready, empty,
                      H, SQ, SK, SK_PAD, DV, sqb, sqh, sqs, smb, sms, sob, soh, sos, sod, slb, slh, sls, scale_log2,
                      HAS_MASK, OCP, QMAX, PNQ, P_E4M3, D, BLOCK_DV, BLOCK_N, NUM_BUF, EXP_FLOOR, PING_PONG,
                      OVERLAP, FRESH, LATE, SYNC, PVU, 1)),
    ], [4], [CONSUMER_REGS])


def unsupported_reason(q8: torch.Tensor, v8t: torch.Tensor) -> str | None:
    """Why this kernel cannot run these pre-pass outputs, or None: it is built for Hopper (sm_90),
    e4m3 operands, head dims 64 and 128 and a value head dim (padded) up to 128."""
    if not q8.is_cuda or torch.cuda.get_device_capability(q8.device) != (9, 0):
        return f"it runs on sm_90 (Hopper) GPUs only, got {q8.device}"
    if q8.dtype != torch.float8_e4m3fn:
        return f"it takes e4m3 operands, got {q8.dtype}"
    if q8.shape[-1] not in (64, 128):
        return f"it takes head dims 64 and 128, got {q8.shape[-1]}"
    if v8t.shape[-2] > 128:
        return f"it takes a value head dim up to 128, got {v8t.shape[-2]}"
    return None


def attention_e4m3_sm90(q8, q_fac, k8, k_fac, v8t, v_fac, sk: int, key_alive, *, recipe: AttentionRecipe,
                        scale: float, out_dtype, dv: int, ping_pong: bool = False, overlap: bool = True, fresh_pv: bool = False, late: bool = True, sync: bool = False, pv_under_softmax: bool = False,
                        num_buffers: int = NUM_BUFFERS, consumer_regs: int = CONSUMER_REGS):
    """The loop on :func:`.prepass.prepass_fp8`'s outputs (K̂ in tile key order) for ``sk`` keys."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    reason = unsupported_reason(q8, v8t)
    if reason:
        raise ValueError(f"the sm_90 e4m3 kernel cannot run this: {reason}")
    b, h, sq, d = q8.shape
    sk_pad, dvp = k8.shape[-2], v8t.shape[-2]
    out, lse = outputs(q8.shape, dv, q8.device, out_dtype)
    km = key_mask(key_alive, q8.device)
    # K̂ as (B·H·Sk_pad, D) and V̂ᵀ as (B·H·Dv_pad, Sk_pad) row tables for TMA (the pre-pass writes them contiguous)
    k_rows, v_rows = k8.reshape(b * h * sk_pad, d), v8t.reshape(b * h * dvp, v8t.shape[-1])
    kd = TensorDescriptor(k_rows, list(k_rows.shape), list(k_rows.stride()), [KEY_TILE, d],
                          _fp8_smem_layout(KEY_TILE, d))
    vd = TensorDescriptor(v_rows, list(v_rows.shape), list(v_rows.stride()), [dvp, KEY_TILE],
                          _fp8_smem_layout(dvp, KEY_TILE))
    _e4m3_attn_fwd_sm90[(triton.cdiv(sq, BLOCK_M), b * h)](
        q8, q_fac, kd, k_fac, vd, v_fac, km, out, lse,
        h, sq, sk, sk_pad, dv,
        *q8.stride()[:3], km.stride(0), km.stride(1), *out.stride(), *lse.stride(),
        scale * LOG2E,
        HAS_MASK=key_alive is not None, OCP=recipe.scale_rule is ScaleRule.OCP, QMAX=recipe.scale_rule.qmax,
        PNQ=recipe.row_sum is RowSum.QUANTIZED, P_E4M3=recipe.pv_format is Format.E4M3, D=d, BLOCK_DV=dvp,
        BLOCK_M=BLOCK_M, BLOCK_N=KEY_TILE, NUM_BUF=num_buffers, EXP_FLOOR=TILE_EXP_FLOOR,
        CONSUMER_REGS=consumer_regs, PING_PONG=ping_pong, OVERLAP=overlap, FRESH=fresh_pv, LATE=late, SYNC=sync, PVU=pv_under_softmax,
        num_warps=4, enable_fp_fusion=False,  # explicit fma only
    )
    return out, lse


#: the loop's jit kernel, by a public name: what offline compilation (:mod:`.report`) compiles
KERNEL = _e4m3_attn_fwd_sm90
