"""MXFP4 attention on Hopper's e4m3 tensor cores, two warpgroups taking turns (Gluon, sm_90).

The numerics of the e4m3 Triton loop (:func:`.attention_fwd._mx_fp8_attn_fwd`: the same
:func:`.attention_fwd.mx_quantize_p` on the same :func:`.prepass.prepass_fp8` outputs, the same
MMA shapes), scheduled as :mod:`.attention_nvfp4_sm90`'s ping-pong: each CTA's 128 query rows
are two warpgroups of 64, each its own ``gl.warp_specialize`` partition, and named barriers make
them issue their MMAs in turn — Q̂·K̂ᵀ of tile j with P̂·V̂ of tile j-1 — so that one warpgroup's
softmax and P quantization run while the other's MMAs do. K̂ tiles (rows in the loops' key order,
whole tiles) and V̂ᵀ tiles (keys in P̂'s operand order) come by TMA into three buffers; both
warpgroups read each tile once from shared memory, where the Triton loop's two 64-row programs
per SM each load their own.

P̂ leaves :func:`.attention_fwd.mx_quantize_p` already relabelled into the A-operand slots of
Hopper's 8-bit MMA (:func:`.attention_fwd.as_mma_operand`), so its conversion to the operand
layout moves no data. Gluon has no CPU interpreter: CI compiles this kernel for sm_90 offline;
the GPU tests compare it with the Triton loop, element for element, on the H200.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from fp4video.formats import ScaleRule
from fp4video.recipe import AttentionRecipe, RowSum
from fp4video.reference import KEY_TILE

from .attention_fwd import LOG2E, TILE_EXP_FLOOR, mx_quantize_p, mx_row_vector, store_out_lse
from .attention_nvfp4_sm90 import _cta_barrier, _masked_logits, _named_barrier, _tma_load, choose_loop

BLOCK_M, NUM_BUFFERS = 128, 3
#: the warpgroups issue their MMAs in turn (False: they run free, sharing the K̂/V̂ tiles only)
PING_PONG = True
#: registers per thread of warpgroup 1's partition (warpgroup 0 gets the rest of the 64 K)
CONSUMER_REGS = 232


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
def _softmax_step(s, j, q_scale, m_i, k_i, l_i, acc, M_base, SK, sms, HAS_MASK: gl.constexpr, OCP: gl.constexpr,
                  QMAX: gl.constexpr, PNQ: gl.constexpr, QB: gl.constexpr, EXP_FLOOR: gl.constexpr,
                  BLOCK_N: gl.constexpr, S_L: gl.constexpr, O_L: gl.constexpr, P_L: gl.constexpr):
    """Tile j's logits ``s`` masked, softmax and P quantization (:func:`.attention_fwd.mx_quantize_p`),
    the accumulator rescaled: returns (P̂ as the MMA's A operand, m, k, l, acc)."""
    s = _masked_logits(s, M_base, j * BLOCK_N, SK, sms, HAS_MASK, BLOCK_N, S_L)
    p8, m_i, k_i, l_i, alpha = mx_quantize_p(s, q_scale, m_i, k_i, l_i, OCP, QMAX, PNQ, QB, EXP_FLOOR, True)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
    return gl.convert_layout(p8, P_L), m_i, k_i, l_i, acc


@gluon.jit
def _warpgroup(Q8, QFac, KFac, VFac, Kd, Vd, KeyMask, Out, Lse, q_bufs, k_bufs, v_bufs, ready, empty,
               H, SQ, SK, SK_PAD, DV, sqb, sqh, sqs, smb, sms, sob, soh, sos, sod, slb, slh, sls, scale_log2,
               HAS_MASK: gl.constexpr, OCP: gl.constexpr, QMAX: gl.constexpr, PNQ: gl.constexpr,
               D: gl.constexpr, BLOCK_DV: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
               EXP_FLOOR: gl.constexpr, PING_PONG: gl.constexpr, WG: gl.constexpr):
    """Query rows [64·WG, 64·WG + 64) of the program's 128: the whole attention loop."""
    ROWS: gl.constexpr = 64
    QB: gl.constexpr = 32
    S_L: gl.constexpr = _fp8_mma_layout(BLOCK_N)
    O_L: gl.constexpr = _fp8_mma_layout(BLOCK_DV)
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=4)
    LQ: gl.constexpr = _fp8_row_load_layout(D)
    # a turn: wait for the other warpgroup to have issued its MMAs, issue ours, let it go
    if not PING_PONG:  # (the warpgroups run free: an experiment, kernel_breakdown.py --configs sm90free)
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
    fence_async_shared()
    _cta_barrier()  # inside a partition: this warpgroup's warps
    # logits in log2 units: Q̂·K̂ᵀ · q_fac · k_fac · scale · log2(e) (powers of two and one constant)
    zero = gl.zeros((ROWS, BLOCK_N), gl.float32, S_L)
    s_rows = row_start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, S_L))
    q_fac = gl.load(QFac + bh * SQ + s_rows, mask=s_rows < SQ, other=1.0) * scale_log2
    q_scale = mx_row_vector(zero + q_fac[:, None], QB)  # in the layout of mx_quantize_p's row vectors
    KF_base = KFac + bh * gl.cdiv(SK, BLOCK_N)
    M_base = KeyMask + b * smb
    n_tiles = gl.cdiv(SK, BLOCK_N)
    k_row0 = bh * SK_PAD
    if WG == 1 and PING_PONG:
        _named_barrier("bar.arrive 14, 256; mov.u32 $0, 0;")  # warpgroup 0 takes the first turn

    mbarrier.wait(ready.index(0), 0)
    _turn(TURN)
    s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
    _turn(DONE)
    s = warpgroup_mma_wait(0, deps=(s,))
    row0 = mx_row_vector(zero, QB)
    m_i, k_i, l_i = row0 + float("-inf"), row0.to(gl.int32), row0
    acc = gl.zeros((ROWS, BLOCK_DV), gl.float32, O_L)
    # each step: the softmax and P quantization of tile j, then (in this warpgroup's turn) P̂·V̂ of
    # tile j with Q̂·K̂ᵀ of tile j+1; P̂ goes to its MMA in the step that made it (a loop-carried 8-bit
    # operand is repacked into registers every step); the last tile is peeled (no Q̂·K̂ᵀ after it)
    for j in range(0, n_tiles - 1):
        buf = j % NUM_BUF
        nxt = (j + 1) % NUM_BUF
        p, m_i, k_i, l_i, acc = _softmax_step(s, j, q_scale * gl.load(KF_base + j), m_i, k_i, l_i, acc, M_base, SK,
                                              sms, HAS_MASK, OCP, QMAX, PNQ, QB, EXP_FLOOR, BLOCK_N, S_L, O_L, P_L)
        mbarrier.wait(ready.index(nxt), ((j + 1) // NUM_BUF) & 1)
        _turn(TURN)
        acc = warpgroup_mma(p, v_bufs.index(buf).permute((1, 0)), acc, is_async=True)
        s = warpgroup_mma(q_smem, k_bufs.index(nxt).permute((1, 0)), zero, use_acc=False, is_async=True)
        _turn(DONE)
        s, acc = warpgroup_mma_wait(0, deps=(s, acc))  # (8-bit P̂ cannot be a dependency; waited on here)
        mbarrier.arrive(empty.index(buf))  # this warpgroup is done with tile j's buffer
        if WG == 0:
            if j + NUM_BUF < n_tiles:  # refill it with tile j+3 once both warpgroups released it
                mbarrier.wait(empty.index(buf), (j // NUM_BUF) & 1)
                _load_tile(Kd, Vd, k_bufs.index(buf), v_bufs.index(buf), ready.index(buf),
                           k_row0 + (j + NUM_BUF) * BLOCK_N, bh * BLOCK_DV, (j + NUM_BUF) * BLOCK_N)
    j = n_tiles - 1
    p, m_i, k_i, l_i, acc = _softmax_step(s, j, q_scale * gl.load(KF_base + j), m_i, k_i, l_i, acc, M_base, SK,
                                          sms, HAS_MASK, OCP, QMAX, PNQ, QB, EXP_FLOOR, BLOCK_N, S_L, O_L, P_L)
    _turn(TURN)
    acc = warpgroup_mma(p, v_bufs.index(j % NUM_BUF).permute((1, 0)), acc, is_async=True)
    _turn(DONE)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    if WG == 0 and PING_PONG:
        _named_barrier("bar.sync 14, 256; mov.u32 $0, 0;")  # matches warpgroup 1's last DONE

    ROW: gl.constexpr = gl.SliceLayout(1, O_L)
    offs_m = row_start + gl.arange(0, ROWS, layout=ROW)
    offs_dv = gl.arange(0, BLOCK_DV, layout=gl.SliceLayout(0, O_L))
    v_fac = gl.load(VFac + bh * BLOCK_DV + offs_dv)  # acc is in units of V̂'s channel factors
    store_out_lse(Out, Lse, acc, v_fac[None, :], gl.convert_layout(l_i, ROW), gl.convert_layout(m_i, ROW),
                  gl.convert_layout(k_i, ROW).to(gl.float32), b, h, offs_m, offs_m < SQ, offs_dv, DV,
                  sob, soh, sos, sod, slb, slh, sls)


@gluon.jit
def _mx_attn_fwd_sm90(
    Q8, QFac, Kd, KFac, Vd, VFac, KeyMask, Out, Lse,
    H, SQ, SK, SK_PAD, DV,
    sqb, sqh, sqs, smb, sms, sob, soh, sos, sod, slb, slh, sls, scale_log2,
    HAS_MASK: gl.constexpr, OCP: gl.constexpr, QMAX: gl.constexpr, PNQ: gl.constexpr,
    D: gl.constexpr, BLOCK_DV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_BUF: gl.constexpr, EXP_FLOOR: gl.constexpr, CONSUMER_REGS: gl.constexpr, PING_PONG: gl.constexpr = True,
):
    gl.static_assert(BLOCK_M == 128, "two warpgroups of 64 rows")
    q_bufs = gl.allocate_shared_memory(gl.float8e4nv, [2, 64, D], _fp8_smem_layout(64, D))
    k_bufs = gl.allocate_shared_memory(gl.float8e4nv, [NUM_BUF, BLOCK_N, D], Kd.layout)
    v_bufs = gl.allocate_shared_memory(gl.float8e4nv, [NUM_BUF, BLOCK_DV, BLOCK_N], Vd.layout)
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
        (_warpgroup, (Q8, QFac, KFac, VFac, Kd, Vd, KeyMask, Out, Lse, q_bufs, k_bufs, v_bufs, ready, empty,
                      H, SQ, SK, SK_PAD, DV, sqb, sqh, sqs, smb, sms, sob, soh, sos, sod, slb, slh, sls, scale_log2,
                      HAS_MASK, OCP, QMAX, PNQ, D, BLOCK_DV, BLOCK_N, NUM_BUF, EXP_FLOOR, PING_PONG, 0)),
        (_warpgroup, (Q8, QFac, KFac, VFac, Kd, Vd, KeyMask, Out, Lse, q_bufs, k_bufs, v_bufs, ready, empty,
                      H, SQ, SK, SK_PAD, DV, sqb, sqh, sqs, smb, sms, sob, soh, sos, sod, slb, slh, sls, scale_log2,
                      HAS_MASK, OCP, QMAX, PNQ, D, BLOCK_DV, BLOCK_N, NUM_BUF, EXP_FLOOR, PING_PONG, 1)),
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


#: (head dim, value head dim) this kernel runs by default where it can (``FP4VIDEO_MX_LOOP``
#: forces a loop): none until it has been timed against the Triton loop on the H200
DEFAULT_SHAPES: set[tuple[int, int]] = set()


def choose(q8: torch.Tensor, v8t: torch.Tensor, launch_given: bool) -> str:
    """Which e4m3 MXFP4 loop runs: ``"sm90"`` (this one) where it can run, for
    :data:`DEFAULT_SHAPES`, when no launch options of the Triton loop are given; else ``"triton"``
    (:func:`.attention_fwd._mx_fp8_attn_fwd`). ``FP4VIDEO_MX_LOOP=triton|sm90`` forces one; a
    forced ``sm90`` raises where it cannot run."""
    return choose_loop("FP4VIDEO_MX_LOOP", lambda: unsupported_reason(q8, v8t),
                       (q8.shape[-1], v8t.shape[-2]) in DEFAULT_SHAPES, launch_given)


def attention_mx_sm90(q8, q_fac, k8, k_fac, v8t, v_fac, sk: int, key_alive, *, recipe: AttentionRecipe,
                      scale: float, out_dtype, dv: int):
    """The ping-pong e4m3 MXFP4 loop on :func:`.prepass.prepass_fp8`'s outputs for ``sk`` keys."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .attention_fwd import _key_mask

    reason = unsupported_reason(q8, v8t)
    if reason:
        raise ValueError(f"the sm_90 MXFP4 kernel cannot run this: {reason}")
    b, h, sq, d = q8.shape
    sk_pad, dvp = k8.shape[-2], v8t.shape[-2]
    out = torch.empty(b, h, sq, dv, device=q8.device, dtype=out_dtype)
    lse = torch.empty(b, h, sq, device=q8.device, dtype=torch.float32)
    km = _key_mask(key_alive, q8.device)
    # K̂ as (B·H·Sk_pad, D) and V̂ᵀ as (B·H·Dv_pad, Sk_pad) row tables for TMA (the pre-pass writes them contiguous)
    k_rows, v_rows = k8.reshape(b * h * sk_pad, d), v8t.reshape(b * h * dvp, sk_pad)
    kd = TensorDescriptor(k_rows, list(k_rows.shape), list(k_rows.stride()), [KEY_TILE, d], _fp8_smem_layout(KEY_TILE, d))
    vd = TensorDescriptor(v_rows, list(v_rows.shape), list(v_rows.stride()), [dvp, KEY_TILE],
                          _fp8_smem_layout(dvp, KEY_TILE))
    _mx_attn_fwd_sm90[(triton.cdiv(sq, BLOCK_M), b * h)](
        q8, q_fac, kd, k_fac, vd, v_fac, km, out, lse,
        h, sq, sk, sk_pad, dv,
        *q8.stride()[:3], km.stride(0), km.stride(1), *out.stride(), *lse.stride(),
        scale * LOG2E,
        HAS_MASK=key_alive is not None, OCP=recipe.scale_rule is ScaleRule.OCP, QMAX=recipe.scale_rule.qmax,
        PNQ=recipe.row_sum is RowSum.QUANTIZED, D=d, BLOCK_DV=dvp, BLOCK_M=BLOCK_M, BLOCK_N=KEY_TILE,
        NUM_BUF=NUM_BUFFERS, EXP_FLOOR=TILE_EXP_FLOOR, CONSUMER_REGS=CONSUMER_REGS, PING_PONG=PING_PONG,
        num_warps=4, enable_fp_fusion=False,  # explicit fma only
    )
    return out, lse
