"""NVFP4 attention on Hopper with the tensor cores overlapping the P quantization (Gluon, sm_90).

The same numerics as :mod:`.attention_nvfp4` (it calls the same :func:`.attention_nvfp4.nv_quantize_p`
on the same bf16 pre-pass output, keys in ``mma_key_order``), scheduled as FlashAttention-3's
intra-warpgroup pipeline, which Triton's ``tl.dot`` loop cannot express (it waits on every MMA at
once): in each step the Q̂·K̂ᵀ MMA of key tile j and the P̂·V̂ MMA of tile j-1 are issued
asynchronously, and the softmax and NVFP4 quantization of tile j run on the CUDA cores while P̂·V̂
of tile j-1 is still on the tensor cores. K̂/V̂ tiles come through a ring of three shared-memory
buffers filled by ``cp.async`` one tile ahead (any row order, so the key permutation needs no
change to the pre-pass).

Opt-in (``FP4VIDEO_NV_KERNEL=sm90``): on the H200 it measured slower than the Triton loop.
The PTX has the P̂·V̂ wait after the quantization, but ptxas moves it up to right after the
Q̂·K̂ᵀ wait, so nothing overlaps on full tiles (``scripts/count_loop_instructions.py --kernel
nvfp4-sm90`` counts the instructions issued while an MMA is in flight; BENCHMARKS.md). Kept as
the measured record and the base for a schedule ptxas cannot collapse, not as the default.

Gluon is Triton's explicit-layout dialect; it has no CPU interpreter, so CI compiles this kernel
for sm_90 offline and the GPU tests compare it with the Triton loop and the reference on the H200.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from fp4video.recipe import AttentionRecipe

from .attention_fwd import mma_key_order, store_out_lse
from .attention_nvfp4 import nv_launch_args, nv_quantize_p, nv_row_vector

BLOCK_M, NUM_WARPS, NUM_BUFFERS = 128, 8, 3

# cp.async from pointers: ``async_copy_global_to_shared`` in Triton 3.6, renamed ``async_load`` later
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# CTA barrier: ``thread_barrier`` in Triton 3.6, ``barrier`` later
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
def _issue_tile(k_buf, v_buf, K_base, V_base, start, SK, sks, svs, DV,
                D: gl.constexpr, BLOCK_DV: gl.constexpr, BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    """cp.async of one key tile of K̂ and V̂ (rows in mma_key_order; keys past SK read as zeros)."""
    LK: gl.constexpr = _row_load_layout(D, num_warps)
    LV: gl.constexpr = _row_load_layout(BLOCK_DV, num_warps)
    keys_k = start + mma_key_order(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LK)), BLOCK_N // 32, 32)
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, LK))
    _cp_async(k_buf, K_base + keys_k[:, None] * sks + offs_d[None, :], mask=(keys_k < SK)[:, None])
    keys_v = start + mma_key_order(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LV)), BLOCK_N // 32, 32)
    offs_dv = gl.arange(0, BLOCK_DV, layout=gl.SliceLayout(0, LV))
    _cp_async(v_buf, V_base + keys_v[:, None] * svs + offs_dv[None, :],
              mask=(keys_v < SK)[:, None])  # BLOCK_DV == DV (the wrapper checks)
    async_copy.commit_group()


@gluon.jit
def _tile_ready():
    """This thread's copies of the oldest outstanding tile landed; make them (and every other
    thread's) visible to the tensor cores' async proxy."""
    async_copy.wait_group(0)
    fence_async_shared()
    _cta_barrier()


@gluon.jit
def _masked_logits(s, M_base, start, SK, sms, HAS_MASK: gl.constexpr, BLOCK_N: gl.constexpr, S_L: gl.constexpr):
    """Masked keys (key-padding mask, or past SK in the last tile) at -inf. The tail test is a
    runtime branch: a peeled tail step after the loop made ptxas serialize every MMA."""
    if HAS_MASK:
        keys = start + mma_key_order(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L)), BLOCK_N // 32, 32)
        alive = gl.load(M_base + keys * sms, mask=keys < SK, other=0) != 0
        s = gl.where(alive[None, :], s, float("-inf"))
    elif start + BLOCK_N > SK:
        keys = start + mma_key_order(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L)), BLOCK_N // 32, 32)
        s = gl.where((keys < SK)[None, :], s, float("-inf"))
    return s


@gluon.jit
def _nv_step(j, q_smem, k_bufs, v_bufs, p_prev, acc, m_i, r_i, l_i, K_base, V_base, M_base, SK, n_tiles,
             sks, svs, sms, DV, scale_log2,
             HAS_MASK: gl.constexpr, TWO_LEVEL: gl.constexpr, P_RANGE: gl.constexpr,
             PNQ: gl.constexpr, D: gl.constexpr, BLOCK_DV: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, num_warps: gl.constexpr):
    """Key tile j >= 1: Q̂·K̂ᵀ of tile j and P̂·V̂ of tile j-1 in flight together, then the softmax
    and quantization of tile j while P̂·V̂ runs, then acc rescaled for tile j."""
    S_L: gl.constexpr = _mma_layout(BLOCK_N, num_warps)
    O_L: gl.constexpr = _mma_layout(BLOCK_DV, num_warps)
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    _tile_ready()  # tile j is in its buffer; every thread is past step j-1 (its P̂·V̂ of tile j-2 done)
    s = warpgroup_mma(q_smem, k_bufs.index(j % NUM_BUF).permute((1, 0)),
                      gl.zeros((BLOCK_M, BLOCK_N), gl.float32, S_L), use_acc=False, is_async=True)
    acc = warpgroup_mma(p_prev, v_bufs.index((j - 1) % NUM_BUF), acc, is_async=True)
    if j + 1 < n_tiles:  # tile j+1 into the buffer of tile j-2 (no MMA reads it), under the MMAs
        nxt = (j + 1) % NUM_BUF
        _issue_tile(k_bufs.index(nxt), v_bufs.index(nxt), K_base, V_base, (j + 1) * BLOCK_N, SK, sks, svs, DV,
                    D, BLOCK_DV, BLOCK_N, num_warps)
    s = warpgroup_mma_wait(1, deps=(s,))  # Q̂·K̂ᵀ done; P̂·V̂ of tile j-1 still running
    s = _masked_logits(s, M_base, j * BLOCK_N, SK, sms, HAS_MASK, BLOCK_N, S_L)
    q, m_i, r_i, l_i, acc_scale = nv_quantize_p(s, scale_log2, m_i, r_i, l_i, TWO_LEVEL, P_RANGE, PNQ, True)
    p_next = gl.convert_layout(q.to(gl.bfloat16), P_L)
    acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
    acc = acc * gl.convert_layout(acc_scale, gl.SliceLayout(1, O_L))[:, None]
    return p_next, acc, m_i, r_i, l_i


@gluon.jit
def _nv_first(q_smem, k_bufs, v_bufs, K_base, V_base, M_base, SK, n_tiles, sks, svs, sms, DV, scale_log2,
              HAS_MASK: gl.constexpr, TWO_LEVEL: gl.constexpr, P_RANGE: gl.constexpr,
              PNQ: gl.constexpr, D: gl.constexpr, BLOCK_DV: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr, num_warps: gl.constexpr):
    """Key tile 0: its logits, softmax and quantization (nothing to overlap yet)."""
    S_L: gl.constexpr = _mma_layout(BLOCK_N, num_warps)
    O_L: gl.constexpr = _mma_layout(BLOCK_DV, num_warps)
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    _tile_ready()
    if n_tiles > 1:
        _issue_tile(k_bufs.index(1), v_bufs.index(1), K_base, V_base, BLOCK_N, SK, sks, svs, DV,
                    D, BLOCK_DV, BLOCK_N, num_warps)
    zero = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, S_L)
    s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    s = _masked_logits(s, M_base, 0, SK, sms, HAS_MASK, BLOCK_N, S_L)
    q, m_i, r_i, l_i, _ = nv_quantize_p(s, scale_log2, nv_row_vector(zero, float("-inf")),
                                        nv_row_vector(zero, 1.0), nv_row_vector(zero, 0.0), TWO_LEVEL, P_RANGE, PNQ,
                                        True)
    return gl.convert_layout(q.to(gl.bfloat16), P_L), m_i, r_i, l_i


@gluon.jit
def _nv_attn_fwd_sm90(
    Q, K, V, KeyMask, Out, Lse,
    H, SQ, SK, DV,
    sqb, sqh, sqs,
    skb, skh, sks,
    svb, svh, svs,
    smb, sms,
    sob, soh, sos, sod,
    slb, slh, sls,
    scale_log2,
    HAS_MASK: gl.constexpr, TWO_LEVEL: gl.constexpr, P_RANGE: gl.constexpr, PNQ: gl.constexpr,
    D: gl.constexpr, BLOCK_DV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_BUF: gl.constexpr, num_warps: gl.constexpr,
):
    gl.static_assert(NUM_BUF == 3, "step j refills the buffer of tile j-2: three buffers")
    O_L: gl.constexpr = _mma_layout(BLOCK_DV, num_warps)
    LQ: gl.constexpr = _row_load_layout(D, num_warps)
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    rows = gl.program_id(0) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LQ))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, LQ))
    q = gl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + offs_d[None, :], mask=(rows < SQ)[:, None], other=0.0)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, D], _smem_layout(BLOCK_M, D), q)
    k_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_N, D], _smem_layout(BLOCK_N, D))
    v_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_N, BLOCK_DV], _smem_layout(BLOCK_N, BLOCK_DV))
    K_base = K + b * skb + h * skh
    V_base = V + b * svb + h * svh
    M_base = KeyMask + b * smb
    n_tiles = gl.cdiv(SK, BLOCK_N)

    _issue_tile(k_bufs.index(0), v_bufs.index(0), K_base, V_base, 0, SK, sks, svs, DV, D, BLOCK_DV, BLOCK_N,
                num_warps)
    p_prev, m_i, r_i, l_i = _nv_first(q_smem, k_bufs, v_bufs, K_base, V_base, M_base, SK, n_tiles, sks, svs, sms, DV,
                                      scale_log2, HAS_MASK, TWO_LEVEL, P_RANGE, PNQ, D, BLOCK_DV, BLOCK_M, BLOCK_N,
                                      NUM_BUF, num_warps)
    acc = gl.zeros((BLOCK_M, BLOCK_DV), gl.float32, O_L)
    for j in range(1, n_tiles):
        p_prev, acc, m_i, r_i, l_i = _nv_step(j, q_smem, k_bufs, v_bufs, p_prev, acc, m_i, r_i, l_i, K_base, V_base,
                                              M_base, SK, n_tiles, sks, svs, sms, DV, scale_log2, HAS_MASK,
                                              TWO_LEVEL, P_RANGE, PNQ, D, BLOCK_DV, BLOCK_M, BLOCK_N, NUM_BUF,
                                              num_warps)
    acc = warpgroup_mma(p_prev, v_bufs.index((n_tiles - 1) % NUM_BUF), acc, is_async=True)
    acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))

    ROW: gl.constexpr = gl.SliceLayout(1, O_L)
    offs_m = gl.program_id(0) * BLOCK_M + gl.arange(0, BLOCK_M, layout=ROW)
    offs_dv = gl.arange(0, BLOCK_DV, layout=gl.SliceLayout(0, O_L))
    store_out_lse(Out, Lse, acc, gl.convert_layout(r_i, ROW)[:, None], gl.convert_layout(l_i, ROW),
                  gl.convert_layout(m_i, ROW), 0.0, b, h, offs_m, offs_m < SQ, offs_dv, DV,
                  sob, soh, sos, sod, slb, slh, sls)  # acc is in units of the last two-level row factor


def unsupported_reason(qh: torch.Tensor, vh: torch.Tensor) -> str | None:
    """Why this kernel cannot run these pre-pass outputs, or None: it is built for Hopper (sm_90),
    bf16 operands, head dims 64 and 128 and a power-of-two value head dim, rows 16-byte aligned."""
    if not qh.is_cuda or torch.cuda.get_device_capability(qh.device) != (9, 0):
        return f"it runs on sm_90 (Hopper) GPUs only, got {qh.device}"
    if qh.dtype != torch.bfloat16:
        return f"it takes bf16 operands, got {qh.dtype}"
    if qh.shape[-1] not in (64, 128):
        return f"it takes head dims 64 and 128, got {qh.shape[-1]}"
    if vh.shape[-2] == 0:
        return "it needs at least one key"
    dv = vh.shape[-1]
    if dv < 16 or dv & (dv - 1) or dv > 128:
        return f"it takes a power-of-two value head dim in [16, 128], got {dv}"
    return None


def choose(qh: torch.Tensor, vh: torch.Tensor, launch_given: bool) -> str:
    """Which NVFP4 loop runs: ``"triton"`` (:mod:`.attention_nvfp4`, the default: measured faster
    on the H200, BENCHMARKS.md) unless ``FP4VIDEO_NV_KERNEL=sm90`` asks for this one, which then
    raises where it cannot run (or when launch options, which it does not take, are given)."""
    import os

    forced = os.environ.get("FP4VIDEO_NV_KERNEL")
    if forced not in (None, "", "sm90", "triton"):
        raise ValueError(f"FP4VIDEO_NV_KERNEL must be 'sm90' or 'triton', got {forced!r}")
    if forced != "sm90":
        return "triton"
    reason = unsupported_reason(qh, vh)
    if reason or launch_given:
        raise ValueError(f"FP4VIDEO_NV_KERNEL=sm90: {reason or 'it takes no launch options (block_m, ...)'}")
    return "sm90"


def attention_nvfp4_sm90(qh, kh, vh, key_alive, *, recipe: AttentionRecipe, scale: float, out_dtype):
    """The pipelined NVFP4 loop on the bf16 pre-pass's (B, H, S, D) outputs (contiguous along D)."""
    reason = unsupported_reason(qh, vh)
    if reason:
        raise ValueError(f"the sm_90 NVFP4 kernel cannot run this: {reason}")
    for name, t in (("q", qh), ("k", kh), ("v", vh)):
        if t.stride(-2) % 8:
            raise ValueError(f"the sm_90 NVFP4 kernel wants {name}'s rows 16-byte aligned (the pre-pass writes them so)")
    out, lse, args, meta = nv_launch_args(qh, kh, vh, key_alive, recipe=recipe, scale=scale, out_dtype=out_dtype)
    b, h, sq, _ = qh.shape
    _nv_attn_fwd_sm90[(triton.cdiv(sq, BLOCK_M), b * h)](
        *args, **meta, BLOCK_DV=vh.shape[-1], BLOCK_M=BLOCK_M, NUM_BUF=NUM_BUFFERS, num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # explicit fma only
    )
    return out, lse
