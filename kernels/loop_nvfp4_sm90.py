"""NVFP4 attention on Hopper, two warpgroups taking turns on the tensor cores (Gluon, sm_90).

The numerics of :mod:`.loop_nvfp4` (the same :func:`.loop_nvfp4.nv_quantize_p` on the
same pre-pass output: K̂/V̂ rows in tile key order, padded to whole tiles), scheduled as
FlashAttention-3's ping-pong: each CTA's 128 query rows are two warpgroups of 64, each its own
``gl.warp_specialize`` partition, and named barriers (14, 15) make them issue their MMAs in turn —
Q̂·K̂ᵀ of tile j with P̂·V̂ of tile j-1 — so one warpgroup's softmax and P quantization run
while the other's MMAs do. K̂/V̂ tiles come by TMA into three buffers (mbarriers ``ready``);
each warpgroup releases a buffer after its P̂·V̂ (``empty``, two arrivals) and warpgroup 0
refills it with tile j+2. A warpgroup waits for its own P̂·V̂ before its softmax: leaving it in
flight under the softmax is slower for both NVFP4 methods.

Why partitions: within one partition Triton's shared-memory barrier analysis puts CTA-wide
barriers around mbarrier and TMA operations, which make the warpgroups meet every key tile
(and slow them down); inside a partition they are partition barriers. Gluon has no CPU
interpreter: CI compiles this kernel for sm_90 offline; the GPU tests compare it with the Triton
loop, element for element, on Hopper.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from fp4video.recipe import AttentionRecipe
from fp4video.reference import KEY_TILE

from .key_order import mma_key_order
from .operands import TileOperands
from .launch import device_arch
from .plan import Plan, gluon_reason
from .loop_nvfp4 import nv_launch_args, nv_quantize_p, nv_row_vector
from .tiles import store_out_lse

BLOCK_M, NUM_BUFFERS = 128, 3
#: registers per thread of warpgroup 1's partition (warpgroup 0 gets the rest of the 64 K)
CONSUMER_REGS = 232

# TMA load and CTA barrier under either Triton's names (3.6's or the newer ones)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.constexpr_function
def _row_load_layout(cols, num_warps):
    """Rows of ``cols`` bf16 values read 16 bytes per thread, a warp covering whole rows."""
    per_row = min(32, max(1, cols // 8))
    return gl.BlockedLayout([1, 8], [32 // per_row, per_row], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _smem_layout(rows, cols):
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)


@gluon.constexpr_function
def _mma_layout(n, num_warps):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.jit
def _named_barrier(ASM: gl.constexpr):
    """One named-barrier instruction (inline PTX) per thread of this 4-warp partition."""
    t = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0]))
    gl.inline_asm_elementwise(ASM, "=r,r", [t], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _load_tile(kd, vd, k_buf, v_buf, bar, row):
    """TMA of one key tile of K̂ and V̂ (rows ``row`` onward), completion counted on ``bar``."""
    mbarrier.expect(bar, kd.block_type.nbytes + vd.block_type.nbytes)
    _tma_load(kd, [row, 0], bar, k_buf)
    _tma_load(vd, [row, 0], bar, v_buf)


@gluon.jit
def _masked_logits(s, scale_log2, M_base, start, SK, sms, HAS_MASK: gl.constexpr, BLOCK_N: gl.constexpr,
                   S_L: gl.constexpr):
    """The logits in log2 units, ``s · scale_log2`` rounded once (as :func:`.tiles.scaled_masked`
    does for the Triton loop: the same values), then masked keys (key-padding mask, or past SK in
    the last tile) selected to -inf: no -inf is multiplied. The tail test is a runtime branch: a
    peeled tail step made ptxas serialize every MMA (C7513)."""
    s = s * scale_log2
    if HAS_MASK:
        keys = start + mma_key_order(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L)), BLOCK_N // 32, 32)
        alive = gl.load(M_base + keys * sms, mask=keys < SK, other=0) != 0
        s = gl.where(alive[None, :], s, float("-inf"))
    elif start + BLOCK_N > SK:
        keys = start + mma_key_order(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L)), BLOCK_N // 32, 32)
        s = gl.where((keys < SK)[None, :], s, float("-inf"))
    return s


@gluon.jit
def _warpgroup(Q, Kd, Vd, KeyMask, Out, Lse, q_bufs, k_bufs, v_bufs, ready, empty,
               H, SQ, SK, SK_PAD, DV, sqb, sqh, sqs, smb, sms, sob, soh, sos, sod, slb, slh, sls, scale_log2,
               HAS_MASK: gl.constexpr, TWO_LEVEL: gl.constexpr, P_RANGE: gl.constexpr, PNQ: gl.constexpr,
               D: gl.constexpr, BLOCK_DV: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
               WG: gl.constexpr):
    """Query rows [64·WG, 64·WG + 64) of the program's 128: the whole attention loop."""
    ROWS: gl.constexpr = 64
    S_L: gl.constexpr = _mma_layout(BLOCK_N, 4)
    O_L: gl.constexpr = _mma_layout(BLOCK_DV, 4)
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    LQ: gl.constexpr = _row_load_layout(D, 4)
    # a turn: wait for the other warpgroup to have issued its MMAs, issue ours, let it go
    if WG == 0:
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
    q = gl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + offs_d[None, :], mask=(rows < SQ)[:, None], other=0.0)
    q_smem = q_bufs.index(WG)
    q_smem.store(q)
    fence_async_shared()
    _cta_barrier()  # inside a partition: this warpgroup's warps
    M_base = KeyMask + b * smb
    row0 = bh * SK_PAD
    n_tiles = gl.cdiv(SK, BLOCK_N)
    if WG == 1:
        _named_barrier("bar.arrive 14, 256; mov.u32 $0, 0;")  # warpgroup 0 takes the first turn

    zero = gl.zeros((ROWS, BLOCK_N), gl.float32, S_L)
    mbarrier.wait(ready.index(0), 0)
    _named_barrier(TURN)
    s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
    _named_barrier(DONE)
    s = warpgroup_mma_wait(0, deps=(s,))
    s = _masked_logits(s, scale_log2, M_base, 0, SK, sms, HAS_MASK, BLOCK_N, S_L)
    p, m_i, r_i, l_i, _ = nv_quantize_p(s, nv_row_vector(zero, float("-inf")), nv_row_vector(zero, 1.0),
                                        nv_row_vector(zero, 0.0), TWO_LEVEL, P_RANGE, PNQ, True, True,
                                        gl.bfloat16)
    p_prev = gl.convert_layout(p, P_L)
    acc = gl.zeros((ROWS, BLOCK_DV), gl.float32, O_L)
    for j in range(1, n_tiles):
        buf = j % NUM_BUF
        prev = (j - 1) % NUM_BUF
        mbarrier.wait(ready.index(buf), (j // NUM_BUF) & 1)
        _named_barrier(TURN)
        s = warpgroup_mma(q_smem, k_bufs.index(buf).permute((1, 0)), zero, use_acc=False, is_async=True)
        acc = warpgroup_mma(p_prev, v_bufs.index(prev), acc, is_async=True)
        _named_barrier(DONE)
        s, acc, p_prev = warpgroup_mma_wait(0, deps=(s, acc, p_prev))
        mbarrier.arrive(empty.index(prev))  # this warpgroup is done with tile j-1's buffer
        s = _masked_logits(s, scale_log2, M_base, j * BLOCK_N, SK, sms, HAS_MASK, BLOCK_N, S_L)
        p, m_i, r_i, l_i, acc_scale = nv_quantize_p(s, m_i, r_i, l_i, TWO_LEVEL, P_RANGE, PNQ, True,
                                                    True, gl.bfloat16)
        p_prev = gl.convert_layout(p, P_L)
        acc = acc * gl.convert_layout(acc_scale, gl.SliceLayout(1, O_L))[:, None]
        if WG == 0:
            if j + 2 < n_tiles:  # refill tile j-1's buffer with tile j+2 once both warpgroups released it
                mbarrier.wait(empty.index(prev), ((j - 1) // NUM_BUF) & 1)
                _load_tile(Kd, Vd, k_bufs.index(prev), v_bufs.index(prev), ready.index(prev),
                           row0 + (j + 2) * BLOCK_N)
    _named_barrier(TURN)
    acc = warpgroup_mma(p_prev, v_bufs.index((n_tiles - 1) % NUM_BUF), acc, is_async=True)
    _named_barrier(DONE)
    acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
    if WG == 0:
        _named_barrier("bar.sync 14, 256; mov.u32 $0, 0;")  # matches warpgroup 1's last DONE

    ROW: gl.constexpr = gl.SliceLayout(1, O_L)
    offs_m = row_start + gl.arange(0, ROWS, layout=ROW)
    offs_dv = gl.arange(0, BLOCK_DV, layout=gl.SliceLayout(0, O_L))
    store_out_lse(Out, Lse, acc, gl.convert_layout(r_i, ROW)[:, None], gl.convert_layout(l_i, ROW),
                  gl.convert_layout(m_i, ROW), 0.0, b, h, offs_m, offs_m < SQ, offs_dv, DV,
                  sob, soh, sos, sod, slb, slh, sls)  # acc is in units of the last two-level row factor


@gluon.jit
def _nv_attn_fwd_sm90(
    Q, Kd, Vd, KeyMask, Out, Lse,
    H, SQ, SK, SK_PAD, DV,
    sqb, sqh, sqs, smb, sms, sob, soh, sos, sod, slb, slh, sls, scale_log2,
    HAS_MASK: gl.constexpr, TWO_LEVEL: gl.constexpr, P_RANGE: gl.constexpr, PNQ: gl.constexpr,
    D: gl.constexpr, BLOCK_DV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_BUF: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):
    gl.static_assert(BLOCK_M == 128, "two warpgroups of 64 rows")
    gl.static_assert(NUM_BUF == 3, "the buffer of tile j-1 is refilled with tile j+2")
    q_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, 64, D], _smem_layout(64, D))
    k_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_N, D], Kd.layout)
    v_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_N, BLOCK_DV], Vd.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per warpgroup
    fence_async_shared()
    row0 = gl.program_id(1) * SK_PAD
    n_tiles = gl.cdiv(SK, BLOCK_N)
    for i in gl.static_range(NUM_BUF):
        if i < n_tiles:
            _load_tile(Kd, Vd, k_bufs.index(i), v_bufs.index(i), ready.index(i), row0 + i * BLOCK_N)
    # (the argument tuples are written out in the call: a tuple assigned to a name first turns its
    # constexprs into tensors)
    gl.warp_specialize([
        (_warpgroup, (Q, Kd, Vd, KeyMask, Out, Lse, q_bufs, k_bufs, v_bufs, ready, empty, H, SQ, SK, SK_PAD, DV,
                      sqb, sqh, sqs, smb, sms, sob, soh, sos, sod, slb, slh, sls, scale_log2, HAS_MASK, TWO_LEVEL,
                      P_RANGE, PNQ, D, BLOCK_DV, BLOCK_N, NUM_BUF, 0)),
        (_warpgroup, (Q, Kd, Vd, KeyMask, Out, Lse, q_bufs, k_bufs, v_bufs, ready, empty, H, SQ, SK, SK_PAD, DV,
                      sqb, sqh, sqs, smb, sms, sob, soh, sos, sod, slb, slh, sls, scale_log2, HAS_MASK, TWO_LEVEL,
                      P_RANGE, PNQ, D, BLOCK_DV, BLOCK_N, NUM_BUF, 1)),
    ], [4], [CONSUMER_REGS])


def unsupported_reason(qh: torch.Tensor, vh: torch.Tensor) -> str | None:
    """Why this kernel cannot run these pre-pass outputs, or None (:func:`.plan.gluon_reason`)."""
    return gluon_reason(device_arch(qh.device), qh.dtype, qh.shape[-1], vh.shape[-1])


def attention_nvfp4_sm90(ops: TileOperands, key_alive, plan: Plan, *, recipe: AttentionRecipe, scale: float,
                         out_dtype, dv: int, exact: bool = True, block_m=None, num_warps=None, num_stages=None):
    """The ping-pong NVFP4 loop on :func:`.prepass.prepass_tiles`' operands. Its launch is fixed
    (explicit launch values are an error); one exponent form, exact at any logit magnitude."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    qh, kh, vh = ops.q, ops.k, ops.v
    if any(x is not None for x in (block_m, num_warps, num_stages)):
        raise ValueError("the sm_90 NVFP4 kernel takes no launch values (block_m, num_warps, num_stages)")
    reason = unsupported_reason(qh, vh)
    if reason:
        raise ValueError(f"the sm_90 NVFP4 kernel cannot run this: {reason}")
    if dv != vh.shape[-1]:
        raise ValueError(f"dv={dv}, but V̂ has {vh.shape[-1]} channels")
    out, lse, args, meta = nv_launch_args(qh, kh, vh, key_alive, sk=ops.sk, recipe=recipe, scale=scale,
                                          out_dtype=out_dtype)
    b, h, sq, d = qh.shape
    sk_pad = kh.shape[-2]
    # K̂, V̂ as (B·H·Sk_pad, ·) row tables for TMA (the pre-pass writes them contiguous)
    k_rows, v_rows = kh.reshape(b * h * sk_pad, d), vh.reshape(b * h * sk_pad, dv)
    kd = TensorDescriptor(k_rows, list(k_rows.shape), list(k_rows.stride()), [KEY_TILE, d], _smem_layout(KEY_TILE, d))
    vd = TensorDescriptor(v_rows, list(v_rows.shape), list(v_rows.stride()), [KEY_TILE, dv],
                          _smem_layout(KEY_TILE, dv))
    # the shared arguments by name (the Triton loop's parameter names), K̂/V̂ as descriptors
    named = dict(args, Kd=kd, Vd=vd, SK_PAD=sk_pad)
    _nv_attn_fwd_sm90[(triton.cdiv(sq, BLOCK_M), b * h)](
        *(named[n] for n in _nv_attn_fwd_sm90.arg_names if n in named),
        **meta, BLOCK_DV=dv, BLOCK_M=BLOCK_M, NUM_BUF=NUM_BUFFERS,
        CONSUMER_REGS=CONSUMER_REGS,
        num_warps=4, enable_fp_fusion=False,  # explicit fma only
    )
    return out, lse


#: the loop's jit kernel, by a public name: what offline compilation (:mod:`.report`) compiles
KERNEL = _nv_attn_fwd_sm90
