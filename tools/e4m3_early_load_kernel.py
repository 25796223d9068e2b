"""An experiment: the shipped e4m3 loop's step, with its loads issued a whole step ahead (Gluon, sm_90).

Compiled by Triton's pipeliner (num_stages=2), the shipped loop (:mod:`fp4video.kernels.loop_e4m3`)
issues the TMA copies of tile j+1's K̂ and V̂ᵀ, and the cp.async of its K̂ factor, at the *end* of
step j, after tile j's P̂·V̂; step j+1 waits for them at its top. The buffer they fill held tile j-1,
free since step j-1, so they could start at the top of step j and arrive under tile j's MMAs and
softmax. This kernel is that: per CTA 64 query rows and one warpgroup (three CTAs an SM, as the
shipped launch), two K̂ / V̂ᵀ buffers, and step j

    issue the TMA of tile j+1 (buffer (j+1) % 2) (and, EARLY = 2, load its K̂ factor);
    wait for tile j;  S = Q̂·K̂ⱼᵀ (awaited);  softmax and P quantization (``loop_e4m3.quantize_p``);
    PV = P̂ⱼ·V̂ⱼ into a fresh accumulator (awaited);  acc = fma(acc, alpha, PV)

— the shipped loop's arithmetic in the shipped loop's order, so the same bits are expected.

A lab kernel beside ``tools/e4m3_early_load_experiment.py``, which runs it; removed after the
measurement (docs/history.md, 2026-12-03).
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
from fp4video.kernels.loop_e4m3 import TILE_EXP_FLOOR, TMA_REGISTER_BUDGET, _block_reduce, _view5, quantize_p
from fp4video.kernels.loop_nvfp4_sm90 import _cta_barrier, _tma_load
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
def _issue(Kd, Vd, k_bufs, v_bufs, ready, j, n_tiles, k_row0, v_row0, BLOCK_N: gl.constexpr):
    """The TMA of tile j's K̂ and V̂ᵀ into buffer j % 2 (none past the last tile)."""
    if j < n_tiles:
        buf = j % 2
        bar = ready.index(buf)
        mbarrier.expect(bar, Kd.block_type.nbytes + Vd.block_type.nbytes)
        _tma_load(Kd, [k_row0 + j * BLOCK_N, 0], bar, k_bufs.index(buf))
        _tma_load(Vd, [v_row0, j * BLOCK_N], bar, v_bufs.index(buf))


@gluon.jit
def _step(j, n_tiles, kf, acc, m_i, k_i, l_i, q_smem, k_bufs, v_bufs, ready, Kd, Vd, k_row0, v_row0, q_scale,
          KF_base, M_base, SK, sms, zero, zero_o, HAS_MASK: gl.constexpr, TAIL: gl.constexpr, OCP: gl.constexpr,
          QMAX: gl.constexpr, PNQ: gl.constexpr, QB: gl.constexpr, EXP_FLOOR: gl.constexpr, BLOCK_N: gl.constexpr,
          P_E4M3: gl.constexpr, S_L: gl.constexpr, P_L: gl.constexpr, ROW_O: gl.constexpr, EARLY: gl.constexpr):
    buf = j % 2
    if EARLY == 1 or EARLY == 2:  # tile j+1 into the buffer tile j-1 left (its MMAs were awaited in step j-1)
        _cta_barrier()
        _issue(Kd, Vd, k_bufs, v_bufs, ready, j + 1, n_tiles, k_row0, v_row0, BLOCK_N)
    if EARLY == 2:
        kf_next = gl.load(KF_base + j + 1, mask=j + 1 < n_tiles, other=1.0)
    mbarrier.wait(ready.index(buf), (j // 2) & 1)
    s = warpgroup_mma(q_smem, k_bufs.index(buf).permute((1, 0)), zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    if HAS_MASK or TAIL:
        keys = j * BLOCK_N + mma_key_order(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L)), BLOCK_N // 32, 32)
        if HAS_MASK:
            alive = gl.load(M_base + keys * sms, mask=keys < SK, other=0) != 0
        else:
            alive = keys < SK
        s = gl.where(alive[None, :], s, float("-inf"))
    p8, m_i, k_i, l_i, alpha = quantize_p(s, q_scale * kf, m_i, k_i, l_i, OCP, QMAX, PNQ, QB, EXP_FLOOR, True, P_E4M3)
    p = gl.convert_layout(p8, P_L)
    pv = warpgroup_mma(p, v_bufs.index(buf).permute((1, 0)), zero_o, use_acc=False, is_async=True)
    pv = warpgroup_mma_wait(0, deps=(pv,))
    acc = gl.fma(acc, gl.convert_layout(alpha, ROW_O)[:, None], pv)
    if EARLY == 0:  # the shipped loop's order: tile j+1 issued after tile j's MMAs
        _cta_barrier()
        _issue(Kd, Vd, k_bufs, v_bufs, ready, j + 1, n_tiles, k_row0, v_row0, BLOCK_N)
    if EARLY == 3:  # as late, but tile j+2, into the buffer tile j just left
        _cta_barrier()
        _issue(Kd, Vd, k_bufs, v_bufs, ready, j + 2, n_tiles, k_row0, v_row0, BLOCK_N)
    if EARLY != 2:
        kf_next = gl.load(KF_base + j + 1, mask=j + 1 < n_tiles, other=1.0)
    return kf_next, acc, m_i, k_i, l_i


@gluon.jit
def _e4m3_attn_fwd_early(
    Q8, QFac, Kd, KFac, Vd, VFac, KeyMask, Out, Lse,
    H, SQ, SK, SK_PAD, DV,
    sqb, sqh, sqs, smb, sms, sob, soh, sos, sod, slb, slh, sls, scale_log2,
    HAS_MASK: gl.constexpr, OCP: gl.constexpr, QMAX: gl.constexpr, PNQ: gl.constexpr, P_E4M3: gl.constexpr,
    D: gl.constexpr, BLOCK_DV: gl.constexpr, BLOCK_N: gl.constexpr, EXP_FLOOR: gl.constexpr, EARLY: gl.constexpr,
):
    ROWS: gl.constexpr = 64
    QB: gl.constexpr = 32
    S_L: gl.constexpr = _fp8_mma_layout(BLOCK_N)
    O_L: gl.constexpr = _fp8_mma_layout(BLOCK_DV)
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=4)
    LQ: gl.constexpr = _fp8_row_load_layout(D)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [ROWS, D], _fp8_smem_layout(ROWS, D))
    k_bufs = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_N, D], Kd.layout)
    v_bufs = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_DV, BLOCK_N], Vd.layout)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()

    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    n_tiles = gl.cdiv(SK, BLOCK_N)
    k_row0 = bh * SK_PAD
    v_row0 = bh * BLOCK_DV
    _issue(Kd, Vd, k_bufs, v_bufs, ready, 0, n_tiles, k_row0, v_row0, BLOCK_N)  # tile 0 first
    if EARLY == 3:
        _issue(Kd, Vd, k_bufs, v_bufs, ready, 1, n_tiles, k_row0, v_row0, BLOCK_N)
    row_start = gl.program_id(0) * ROWS
    rows = row_start + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LQ))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, LQ))
    q = gl.load(Q8 + b * sqb + h * sqh + rows[:, None] * sqs + offs_d[None, :], mask=(rows < SQ)[:, None], other=0.0)
    q_smem.store(q)
    fence_async_shared()
    _cta_barrier()
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
    KF_base = KFac + bh * n_tiles
    M_base = KeyMask + b * smb
    acc = zero_o
    kf = gl.load(KF_base)
    n_full = SK // BLOCK_N
    for j in range(0, n_full):
        kf, acc, m_i, k_i, l_i = _step(j, n_tiles, kf, acc, m_i, k_i, l_i, q_smem, k_bufs, v_bufs, ready, Kd, Vd,
                                       k_row0, v_row0, q_scale, KF_base, M_base, SK, sms, zero, zero_o, HAS_MASK,
                                       False, OCP, QMAX, PNQ, QB, EXP_FLOOR, BLOCK_N, P_E4M3, S_L, P_L, ROW_O, EARLY)
    if n_full < n_tiles:
        kf, acc, m_i, k_i, l_i = _step(n_full, n_tiles, kf, acc, m_i, k_i, l_i, q_smem, k_bufs, v_bufs, ready, Kd, Vd,
                                       k_row0, v_row0, q_scale, KF_base, M_base, SK, sms, zero, zero_o, HAS_MASK,
                                       True, OCP, QMAX, PNQ, QB, EXP_FLOOR, BLOCK_N, P_E4M3, S_L, P_L, ROW_O, EARLY)
    offs_m = row_start + gl.arange(0, ROWS, layout=ROW_O)
    offs_dv = gl.arange(0, BLOCK_DV, layout=gl.SliceLayout(0, O_L))
    v_fac = gl.load(VFac + bh * BLOCK_DV + offs_dv)
    store_out_lse(Out, Lse, acc, v_fac[None, :], gl.convert_layout(gl.sum(l_i, axis=1), ROW_O),
                  gl.convert_layout(m_i, ROW_O), gl.convert_layout(k_i, ROW_O).to(gl.float32), b, h, offs_m,
                  offs_m < SQ, offs_dv, DV, sob, soh, sos, sod, slb, slh, sls)


def attention_e4m3_early(q8, q_fac, k8, k_fac, v8t, v_fac, sk: int, key_alive, *, recipe: AttentionRecipe,
                         scale: float, out_dtype, dv: int, early: int = 1, maxnreg: int | None = None):
    """The experiment's loop on ``prepass_fp8``'s outputs (K̂ in tile key order) for ``sk`` keys,
    FP8-P·V recipes (``fp8``, ``mxattn-pv8``). ``early``: 1, tile j+1's TMA copies at the top of
    step j and its K̂ factor at the step's end; 2, both at the top; 3, tile j+2's copies at the end
    of step j (into the buffer tile j left), its K̂ factor at the end too; 0, both at the end (the
    shipped loop's order). ``maxnreg``: None caps at the shipped loop's budget (three CTAs an SM)."""
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
    _e4m3_attn_fwd_early[(triton.cdiv(sq, 64), b * h)](
        q8, q_fac, kd, k_fac, vd, v_fac, km, out, lse,
        h, sq, sk, sk_pad, dv,
        *q8.stride()[:3], km.stride(0), km.stride(1), *out.stride(), *lse.stride(),
        scale * LOG2E,
        HAS_MASK=key_alive is not None, OCP=recipe.scale_rule is ScaleRule.OCP, QMAX=recipe.scale_rule.qmax,
        PNQ=recipe.row_sum is RowSum.QUANTIZED, P_E4M3=recipe.pv_format is Format.E4M3, D=d, BLOCK_DV=dvp,
        BLOCK_N=KEY_TILE, EXP_FLOOR=TILE_EXP_FLOOR, EARLY=early,
        num_warps=4, enable_fp_fusion=False, maxnreg=maxnreg or TMA_REGISTER_BUDGET,
    )
    return out, lse


#: the loop's jit kernel (offline compilation)
KERNEL = _e4m3_attn_fwd_early
