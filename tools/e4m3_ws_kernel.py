"""An experiment: the e4m3 loop on Hopper with FlashAttention-3's whole structure (Gluon, sm_90).

The numerics of :mod:`fp4video.kernels.loop_e4m3` (its ``quantize_p`` on ``prepass.prepass_fp8``'s
outputs, K̂ in tile key order, V̂ᵀ in P̂'s operand order). Per CTA, 64·NUM_WG query rows: a TMA
producer (the default partition; Triton leaves it 24 registers a thread) fills NUM_BUF K̂ / V̂ᵀ
buffers (``ready``: TMA bytes; ``empty``: one arrival per consumer), and NUM_WG consumer warpgroups
of 64 rows (worker partitions, CONSUMER_REGS a thread) run FlashAttention-3's intra-warpgroup
overlap, nothing in flight across the loop's back edge:

    step j:  issue S_j = Q̂·K̂_jᵀ and PV_{j-1} = P̂_{j-1}·V̂_{j-1};  wait for S_j;
             tile j's softmax and P quantization while PV_{j-1} runs;  wait for PV_{j-1};
             release tile j-1's buffer;  acc = fma(acc, alpha_{j-1}, PV_{j-1})  (FRESH)

- P_SMEM = 0: P̂ from registers (carried to the next step, so its bytes are repacked: 11.9 SASS
  instructions per element of S against the Triton loop's 10.1, offline, Triton 3.6). **Bit for bit
  the Triton TMA loop's output and LSE** on the H200 (``fp8``, ``mxattn-pv8``; masked, partial tiles,
  sharp rows; 2026-12-03), and **0.82–0.89× its speed** at Wan 720p (ping-pong the fastest; with
  two buffers 0.59–0.61×).
- P_SMEM = 1: P̂ through shared memory (stmatrix, double-buffered per warpgroup; 9.4–9.9
  instructions per element): **wrong row sums** on the H200 — the outputs right up to a per-row
  scale (0.07–2,600×) and the LSE off by the same factor, in nearly every row, one key tile too,
  with the MMAs awaited at once as well; cause not found (the PTX computes the row sum from the
  same converted bytes it stores; these forms spill, the register forms do not). 0.78–0.89× the
  Triton loop's speed.
- SERIAL: each warpgroup runs the Triton loop's step (Q̂·K̂ᵀ awaited, softmax, P̂·V̂ from registers
  awaited at once), only the warpgroups and the producer overlapping one another (9.4 instructions
  per element, 16 spill loads a tile): **wrong row sums** like the shared-memory forms — the wrong
  forms are exactly the ones ptxas spills in — and 0.88–0.91× the Triton loop's speed.
- The k factor of a tile is loaded before the step's waits (it was loaded after the Q̂·K̂ᵀ wait
  in the previous commit's kernel): no change in speed (0.879 / 0.889× with ping-pong).
- FRESH = False: PV into the rescaled accumulator (the Triton loop's ``fresh_pv=False`` bits);
  SYNC: both MMAs awaited at once (no overlap); PING_PONG: FlashAttention-3's turns of the two
  consumers on the tensor cores (named barriers 14, 15); NUM_WG = 3 (192 rows): spills 3.5 KB at
  160 registers, offline.

A lab kernel beside ``tools/e4m3_ws_experiment.py``, which runs it; removed after the measurement
(docs/history.md, 2026-12-03), kept in the commits that measured it so that the tool reproduces it.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait

from fp4video.formats import Format, ScaleRule
from fp4video.recipe import AttentionRecipe, RowSum
from fp4video.reference import KEY_TILE

from fp4video.kernels.key_order import mma_key_order
from fp4video.kernels.loop_e4m3 import TILE_EXP_FLOOR, _block_reduce, _view5, quantize_p
from fp4video.kernels.loop_nvfp4_sm90 import _cta_barrier, _named_barrier, _tma_load
from fp4video.kernels.tiles import LOG2E, key_mask, outputs, store_out_lse


@gluon.constexpr_function
def _fp8_smem_layout(rows, cols):
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.float8e4nv)


@gluon.constexpr_function
def _fp8_mma_layout(n):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 32])


@gluon.constexpr_function
def _fp8_row_load_layout(cols):
    per_row = min(32, max(1, cols // 16))
    return gl.BlockedLayout([1, 16], [32 // per_row, per_row], [4, 1], [1, 0])


@gluon.jit
def _turn(ASM: gl.constexpr):
    if ASM != "":
        _named_barrier(ASM)


@gluon.jit
def _producer(Kd, Vd, k_bufs, v_bufs, ready, empty, SK, SK_PAD, BLOCK_DV: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_BUF: gl.constexpr):
    bh = gl.program_id(1)
    n_tiles = gl.cdiv(SK, BLOCK_N)
    k_row0 = bh * SK_PAD
    v_row0 = bh * BLOCK_DV
    for j in range(n_tiles):
        buf = j % NUM_BUF
        if j >= NUM_BUF:  # both consumers released this buffer's previous tile
            mbarrier.wait(empty.index(buf), ((j // NUM_BUF) - 1) & 1)
        bar = ready.index(buf)
        mbarrier.expect(bar, Kd.block_type.nbytes + Vd.block_type.nbytes)
        _tma_load(Kd, [k_row0 + j * BLOCK_N, 0], bar, k_bufs.index(buf))
        _tma_load(Vd, [v_row0, j * BLOCK_N], bar, v_bufs.index(buf))


@gluon.jit
def _softmax(s, j, q_scale, m_i, k_i, l_i, M_base, SK, sms, HAS_MASK: gl.constexpr, TAIL: gl.constexpr,
             OCP: gl.constexpr, QMAX: gl.constexpr, PNQ: gl.constexpr, QB: gl.constexpr, EXP_FLOOR: gl.constexpr,
             BLOCK_N: gl.constexpr, P_E4M3: gl.constexpr, S_L: gl.constexpr, P_L: gl.constexpr,
             P_SMEM: gl.constexpr = 1):
    """Tile j's logits masked (a key-padding mask; TAIL: keys past SK), softmax and P quantization."""
    if HAS_MASK or TAIL:
        keys = j * BLOCK_N + mma_key_order(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L)), BLOCK_N // 32, 32)
        if HAS_MASK:
            alive = gl.load(M_base + keys * sms, mask=keys < SK, other=0) != 0
        else:
            alive = keys < SK
        s = gl.where(alive[None, :], s, float("-inf"))
    p8, m_i, k_i, l_i, alpha = quantize_p(s, q_scale, m_i, k_i, l_i, OCP, QMAX, PNQ, QB, EXP_FLOOR, True, P_E4M3)
    return gl.convert_layout(p8, P_L), m_i, k_i, l_i, alpha


@gluon.jit
def _step(j, acc, alpha, m_i, k_i, l_i, q_smem, p_bufs, k_bufs, v_bufs, ready, empty, q_scale, KF_base, M_base, SK,
          sms, zero, zero_o, HAS_MASK: gl.constexpr, TAIL: gl.constexpr, OCP: gl.constexpr, QMAX: gl.constexpr,
          PNQ: gl.constexpr, QB: gl.constexpr, EXP_FLOOR: gl.constexpr, BLOCK_N: gl.constexpr,
          P_E4M3: gl.constexpr, NUM_BUF: gl.constexpr, FRESH: gl.constexpr, TURN: gl.constexpr,
          DONE: gl.constexpr, WG: gl.constexpr, S_L: gl.constexpr, P_L: gl.constexpr, ROW_O: gl.constexpr,
          p_prev, P_SMEM: gl.constexpr, SYNC: gl.constexpr):
    """S_j and PV_{j-1} issued together; tile j's softmax while PV_{j-1} runs; P̂_j to its buffer;
    the accumulator takes PV_{j-1}. Nothing is left in flight."""
    buf = j % NUM_BUF
    prev = (j - 1) % NUM_BUF
    k_fac = gl.load(KF_base + j)  # issued before the waits: its latency hides under them
    mbarrier.wait(ready.index(buf), (j // NUM_BUF) & 1)
    if not FRESH:  # acc into tile j-1's units before P̂_{j-1}·V̂_{j-1} lands in it
        acc = acc * gl.convert_layout(alpha, ROW_O)[:, None]
    _turn(TURN)
    s = warpgroup_mma(q_smem, k_bufs.index(buf).permute((1, 0)), zero, use_acc=False, is_async=True)
    if P_SMEM:
        a_op = p_bufs.index(2 * WG + (j - 1) % 2)
    else:
        a_op = p_prev
    if FRESH:
        pv = warpgroup_mma(a_op, v_bufs.index(prev).permute((1, 0)), zero_o, use_acc=False, is_async=True)
    else:
        acc = warpgroup_mma(a_op, v_bufs.index(prev).permute((1, 0)), acc, is_async=True)
    _turn(DONE)
    if SYNC:
        if FRESH:
            s, pv = warpgroup_mma_wait(0, deps=(s, pv))
        else:
            s, acc = warpgroup_mma_wait(0, deps=(s, acc))
    else:
        s = warpgroup_mma_wait(1, deps=(s,))
    alpha_prev = alpha
    p, m_i, k_i, l_i, alpha = _softmax(s, j, q_scale * k_fac, m_i, k_i, l_i, M_base, SK, sms,
                                       HAS_MASK, TAIL, OCP, QMAX, PNQ, QB, EXP_FLOOR, BLOCK_N, P_E4M3, S_L, P_L, P_SMEM)
    if P_SMEM:
        p_bufs.index(2 * WG + j % 2).store(p)  # its previous tile's MMA was awaited in the last step
    if FRESH:
        pv = warpgroup_mma_wait(0, deps=(pv,))
        acc = gl.fma(acc, gl.convert_layout(alpha_prev, ROW_O)[:, None], pv)
    else:
        acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(empty.index(prev))  # this warpgroup is done with tile j-1's buffer
    if P_SMEM:
        fence_async_shared()
        _cta_barrier()
    return acc, alpha, m_i, k_i, l_i, p


@gluon.jit
def _serial_step(j, acc, m_i, k_i, l_i, q_smem, k_bufs, v_bufs, ready, empty, q_scale, KF_base, M_base, SK, sms, zero,
                 zero_o, HAS_MASK: gl.constexpr, TAIL: gl.constexpr, OCP: gl.constexpr, QMAX: gl.constexpr,
                 PNQ: gl.constexpr, QB: gl.constexpr, EXP_FLOOR: gl.constexpr, BLOCK_N: gl.constexpr,
                 P_E4M3: gl.constexpr, NUM_BUF: gl.constexpr, S_L: gl.constexpr, P_L: gl.constexpr,
                 ROW_O: gl.constexpr):
    """SERIAL: tile j as the Triton TMA loop runs it (Q̂·K̂ᵀ awaited, softmax, P̂·V̂ from registers into a
    fresh accumulator, awaited at once, then the FMA), its buffer released after: no overlap within the
    warpgroup, P̂ carried nowhere; the warpgroups of the CTA (and the producer) overlap one another."""
    buf = j % NUM_BUF
    mbarrier.wait(ready.index(buf), (j // NUM_BUF) & 1)
    s = warpgroup_mma(q_smem, k_bufs.index(buf).permute((1, 0)), zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    p, m_i, k_i, l_i, alpha = _softmax(s, j, q_scale * gl.load(KF_base + j), m_i, k_i, l_i, M_base, SK, sms,
                                       HAS_MASK, TAIL, OCP, QMAX, PNQ, QB, EXP_FLOOR, BLOCK_N, P_E4M3, S_L, P_L, 0)
    pv = warpgroup_mma(p, v_bufs.index(buf).permute((1, 0)), zero_o, use_acc=False, is_async=True)
    pv = warpgroup_mma_wait(0, deps=(pv,))
    mbarrier.arrive(empty.index(buf))
    acc = gl.fma(acc, gl.convert_layout(alpha, ROW_O)[:, None], pv)
    return acc, m_i, k_i, l_i


@gluon.jit
def _consumer(Q8, QFac, KFac, VFac, KeyMask, Out, Lse, q_bufs, p_bufs, k_bufs, v_bufs, ready, empty,
              H, SQ, SK, DV, sqb, sqh, sqs, smb, sms, sob, soh, sos, sod, slb, slh, sls, scale_log2,
              HAS_MASK: gl.constexpr, OCP: gl.constexpr, QMAX: gl.constexpr, PNQ: gl.constexpr,
              P_E4M3: gl.constexpr, D: gl.constexpr, BLOCK_DV: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_BUF: gl.constexpr, EXP_FLOOR: gl.constexpr, FRESH: gl.constexpr, PING_PONG: gl.constexpr,
              P_SMEM: gl.constexpr, SYNC: gl.constexpr, SERIAL: gl.constexpr, NUM_WG: gl.constexpr,
              WG: gl.constexpr):
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
    row_start = gl.program_id(0) * (NUM_WG * ROWS) + WG * ROWS
    rows = row_start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LQ))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, LQ))
    q = gl.load(Q8 + b * sqb + h * sqh + rows[:, None] * sqs + offs_d[None, :], mask=(rows < SQ)[:, None], other=0.0)
    q_smem = q_bufs.index(WG)
    q_smem.store(q)
    fence_async_shared()
    _cta_barrier()  # inside a partition: this warpgroup's warps
    zero = gl.zeros((ROWS, BLOCK_N), gl.float32, S_L)
    zero_o = gl.zeros((ROWS, BLOCK_DV), gl.float32, O_L)
    s_rows = row_start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, S_L))
    q_fac = gl.load(QFac + bh * SQ + s_rows, mask=s_rows < SQ, other=1.0) * scale_log2
    if P_E4M3:  # l per row and P block, in the layout quantize_p's row sums leave it
        l_i = _block_reduce(_view5(zero, QB), False)
    else:
        l_i = gl.sum(gl.sum(gl.sum(_view5(zero, QB), axis=2), axis=1), axis=2)
    q_scale = gl.max(_block_reduce(_view5(zero + q_fac[:, None], QB), True), axis=1)  # quantize_p's row layout
    m_i = q_scale * 0.0 + float("-inf")
    k_i = (q_scale * 0.0).to(gl.int32)
    KF_base = KFac + bh * gl.cdiv(SK, BLOCK_N)
    M_base = KeyMask + b * smb
    n_tiles = gl.cdiv(SK, BLOCK_N)
    if WG == 1 and PING_PONG:
        _named_barrier("bar.arrive 14, 256; mov.u32 $0, 0;")  # warpgroup 0 takes the first turn

    if SERIAL:
        acc = zero_o
        n_full = SK // BLOCK_N
        for j in range(0, n_full):
            acc, m_i, k_i, l_i = _serial_step(j, acc, m_i, k_i, l_i, q_smem, k_bufs, v_bufs, ready, empty, q_scale,
                                              KF_base, M_base, SK, sms, zero, zero_o, HAS_MASK, False, OCP, QMAX, PNQ,
                                              QB, EXP_FLOOR, BLOCK_N, P_E4M3, NUM_BUF, S_L, P_L, ROW_O)
        if n_full < n_tiles:
            acc, m_i, k_i, l_i = _serial_step(n_full, acc, m_i, k_i, l_i, q_smem, k_bufs, v_bufs, ready, empty,
                                              q_scale, KF_base, M_base, SK, sms, zero, zero_o, HAS_MASK, True, OCP,
                                              QMAX, PNQ, QB, EXP_FLOOR, BLOCK_N, P_E4M3, NUM_BUF, S_L, P_L, ROW_O)
    else:
        # tile 0: Q̂·K̂ᵀ alone, its softmax, P̂ into buffer 0
        mbarrier.wait(ready.index(0), 0)
        _turn(TURN)
        s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
        _turn(DONE)
        s = warpgroup_mma_wait(0, deps=(s,))
        p, m_i, k_i, l_i, alpha = _softmax(s, 0, q_scale * gl.load(KF_base), m_i, k_i, l_i, M_base, SK, sms, HAS_MASK,
                                           SK < BLOCK_N, OCP, QMAX, PNQ, QB, EXP_FLOOR, BLOCK_N, P_E4M3, S_L, P_L, P_SMEM)
        if P_SMEM:
            p_bufs.index(2 * WG).store(p)
            fence_async_shared()
            _cta_barrier()
        acc = zero_o
        # the full tiles unmasked (a key-padding mask, if any, applies to every tile), then a partial last one
        n_full = gl.maximum(SK // BLOCK_N, 1)
        for j in range(1, n_full):
            acc, alpha, m_i, k_i, l_i, p = _step(j, acc, alpha, m_i, k_i, l_i, q_smem, p_bufs, k_bufs, v_bufs, ready, empty,
                                              q_scale, KF_base, M_base, SK, sms, zero, zero_o, HAS_MASK, False, OCP, QMAX,
                                              PNQ, QB, EXP_FLOOR, BLOCK_N, P_E4M3, NUM_BUF, FRESH, TURN, DONE, WG, S_L,
                                              P_L, ROW_O, p, P_SMEM, SYNC)
        if n_full < n_tiles:
            acc, alpha, m_i, k_i, l_i, p = _step(n_full, acc, alpha, m_i, k_i, l_i, q_smem, p_bufs, k_bufs, v_bufs, ready,
                                              empty, q_scale, KF_base, M_base, SK, sms, zero, zero_o, HAS_MASK, True, OCP,
                                              QMAX, PNQ, QB, EXP_FLOOR, BLOCK_N, P_E4M3, NUM_BUF, FRESH, TURN, DONE, WG,
                                              S_L, P_L, ROW_O, p, P_SMEM, SYNC)
        last = n_tiles - 1
        if not FRESH:
            acc = acc * gl.convert_layout(alpha, ROW_O)[:, None]
        _turn(TURN)
        if P_SMEM:
            a_op = p_bufs.index(2 * WG + last % 2)
        else:
            a_op = p
        if FRESH:
            pv = warpgroup_mma(a_op, v_bufs.index(last % NUM_BUF).permute((1, 0)), zero_o, use_acc=False, is_async=True)
        else:
            acc = warpgroup_mma(a_op, v_bufs.index(last % NUM_BUF).permute((1, 0)), acc, is_async=True)
        _turn(DONE)
        if FRESH:
            pv = warpgroup_mma_wait(0, deps=(pv,))
            acc = gl.fma(acc, gl.convert_layout(alpha, ROW_O)[:, None], pv)
        else:
            acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index(last % NUM_BUF))
    if WG == 0 and PING_PONG:
        _named_barrier("bar.sync 14, 256; mov.u32 $0, 0;")  # matches warpgroup 1's last DONE

    offs_m = row_start + gl.arange(0, ROWS, layout=ROW_O)
    offs_dv = gl.arange(0, BLOCK_DV, layout=gl.SliceLayout(0, O_L))
    v_fac = gl.load(VFac + bh * BLOCK_DV + offs_dv)
    store_out_lse(Out, Lse, acc, v_fac[None, :], gl.convert_layout(gl.sum(l_i, axis=1), ROW_O),
                  gl.convert_layout(m_i, ROW_O), gl.convert_layout(k_i, ROW_O).to(gl.float32), b, h, offs_m,
                  offs_m < SQ, offs_dv, DV, sob, soh, sos, sod, slb, slh, sls)


@gluon.jit
def _e4m3_attn_fwd_ws(
    Q8, QFac, Kd, KFac, Vd, VFac, KeyMask, Out, Lse,
    H, SQ, SK, SK_PAD, DV,
    sqb, sqh, sqs, smb, sms, sob, soh, sos, sod, slb, slh, sls, scale_log2,
    HAS_MASK: gl.constexpr, OCP: gl.constexpr, QMAX: gl.constexpr, PNQ: gl.constexpr, P_E4M3: gl.constexpr,
    D: gl.constexpr, BLOCK_DV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_BUF: gl.constexpr, EXP_FLOOR: gl.constexpr, FRESH: gl.constexpr, PING_PONG: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, P_SMEM: gl.constexpr, SYNC: gl.constexpr, SERIAL: gl.constexpr = False,
):
    NUM_WG: gl.constexpr = BLOCK_M // 64
    q_bufs = gl.allocate_shared_memory(gl.float8e4nv, [NUM_WG, 64, D], _fp8_smem_layout(64, D))
    p_bufs = gl.allocate_shared_memory(gl.float8e4nv, [2 * NUM_WG, 64, BLOCK_N], _fp8_smem_layout(64, BLOCK_N))
    k_bufs = gl.allocate_shared_memory(gl.float8e4nv, [NUM_BUF, BLOCK_N, D], Kd.layout)
    v_bufs = gl.allocate_shared_memory(gl.float8e4nv, [NUM_BUF, BLOCK_DV, BLOCK_N], Vd.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=NUM_WG)  # one arrival per consumer warpgroup
    fence_async_shared()
    # the producer is the default partition (its warps idle but one), the consumers are workers: the
    # default partition keeps the kernel's arguments live, which made a consumer there spill
    if NUM_WG == 3:
        gl.warp_specialize([
            (_producer, (Kd, Vd, k_bufs, v_bufs, ready, empty, SK, SK_PAD, BLOCK_DV, BLOCK_N, NUM_BUF)),
            (_consumer, (Q8, QFac, KFac, VFac, KeyMask, Out, Lse, q_bufs, p_bufs, k_bufs, v_bufs, ready, empty,
                     H, SQ, SK, DV, sqb, sqh, sqs, smb, sms, sob, soh, sos, sod, slb, slh, sls, scale_log2,
                     HAS_MASK, OCP, QMAX, PNQ, P_E4M3, D, BLOCK_DV, BLOCK_N, NUM_BUF, EXP_FLOOR, FRESH, PING_PONG,
                     P_SMEM, SYNC, SERIAL, NUM_WG, 0)),
            (_consumer, (Q8, QFac, KFac, VFac, KeyMask, Out, Lse, q_bufs, p_bufs, k_bufs, v_bufs, ready, empty,
                     H, SQ, SK, DV, sqb, sqh, sqs, smb, sms, sob, soh, sos, sod, slb, slh, sls, scale_log2,
                     HAS_MASK, OCP, QMAX, PNQ, P_E4M3, D, BLOCK_DV, BLOCK_N, NUM_BUF, EXP_FLOOR, FRESH, PING_PONG,
                     P_SMEM, SYNC, SERIAL, NUM_WG, 1)),
            (_consumer, (Q8, QFac, KFac, VFac, KeyMask, Out, Lse, q_bufs, p_bufs, k_bufs, v_bufs, ready, empty,
                     H, SQ, SK, DV, sqb, sqh, sqs, smb, sms, sob, soh, sos, sod, slb, slh, sls, scale_log2,
                     HAS_MASK, OCP, QMAX, PNQ, P_E4M3, D, BLOCK_DV, BLOCK_N, NUM_BUF, EXP_FLOOR, FRESH, PING_PONG,
                     P_SMEM, SYNC, SERIAL, NUM_WG, 2)),
        ], [4, 4, 4], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS])
    else:
        gl.warp_specialize([
            (_producer, (Kd, Vd, k_bufs, v_bufs, ready, empty, SK, SK_PAD, BLOCK_DV, BLOCK_N, NUM_BUF)),
            (_consumer, (Q8, QFac, KFac, VFac, KeyMask, Out, Lse, q_bufs, p_bufs, k_bufs, v_bufs, ready, empty,
                     H, SQ, SK, DV, sqb, sqh, sqs, smb, sms, sob, soh, sos, sod, slb, slh, sls, scale_log2,
                     HAS_MASK, OCP, QMAX, PNQ, P_E4M3, D, BLOCK_DV, BLOCK_N, NUM_BUF, EXP_FLOOR, FRESH, PING_PONG,
                     P_SMEM, SYNC, SERIAL, NUM_WG, 0)),
            (_consumer, (Q8, QFac, KFac, VFac, KeyMask, Out, Lse, q_bufs, p_bufs, k_bufs, v_bufs, ready, empty,
                     H, SQ, SK, DV, sqb, sqh, sqs, smb, sms, sob, soh, sos, sod, slb, slh, sls, scale_log2,
                     HAS_MASK, OCP, QMAX, PNQ, P_E4M3, D, BLOCK_DV, BLOCK_N, NUM_BUF, EXP_FLOOR, FRESH, PING_PONG,
                     P_SMEM, SYNC, SERIAL, NUM_WG, 1)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


def attention_e4m3_ws(q8, q_fac, k8, k_fac, v8t, v_fac, sk: int, key_alive, *, recipe: AttentionRecipe,
                      scale: float, out_dtype, dv: int, fresh: bool = True, ping_pong: bool = False,
                      num_buffers: int = 3, consumer_regs: int = 240, p_smem: bool = False,
                      sync: bool = False, block_m: int = 128, serial: bool = False):
    """The experiment's loop on ``prepass_fp8``'s outputs (K̂ in tile key order) for
    ``sk`` keys, FP8-P·V recipes (``fp8``, ``mxattn-pv8``); the switches as the module says."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    b, h, sq, d = q8.shape
    sk_pad, dvp = k8.shape[-2], v8t.shape[-2]
    out, lse = outputs(q8.shape, dv, q8.device, out_dtype)
    km = key_mask(key_alive, q8.device)
    k_rows, v_rows = k8.reshape(b * h * sk_pad, d), v8t.reshape(b * h * dvp, v8t.shape[-1])
    kd = TensorDescriptor(k_rows, list(k_rows.shape), list(k_rows.stride()), [KEY_TILE, d],
                          _fp8_smem_layout(KEY_TILE, d))
    vd = TensorDescriptor(v_rows, list(v_rows.shape), list(v_rows.stride()), [dvp, KEY_TILE],
                          _fp8_smem_layout(dvp, KEY_TILE))
    _e4m3_attn_fwd_ws[(triton.cdiv(sq, block_m), b * h)](
        q8, q_fac, kd, k_fac, vd, v_fac, km, out, lse,
        h, sq, sk, sk_pad, dv,
        *q8.stride()[:3], km.stride(0), km.stride(1), *out.stride(), *lse.stride(),
        scale * LOG2E,
        HAS_MASK=key_alive is not None, OCP=recipe.scale_rule is ScaleRule.OCP, QMAX=recipe.scale_rule.qmax,
        PNQ=recipe.row_sum is RowSum.QUANTIZED, P_E4M3=recipe.pv_format is Format.E4M3, D=d, BLOCK_DV=dvp,
        BLOCK_M=block_m, BLOCK_N=KEY_TILE, NUM_BUF=num_buffers, EXP_FLOOR=TILE_EXP_FLOOR, FRESH=fresh,
        PING_PONG=ping_pong, CONSUMER_REGS=consumer_regs, P_SMEM=int(p_smem), SYNC=sync, SERIAL=serial,
        num_warps=4, enable_fp_fusion=False,  # the producer's 4 warps (one issues); explicit fma only
    )
    return out, lse


#: the loop's jit kernel (offline compilation)
KERNEL = _e4m3_attn_fwd_ws
