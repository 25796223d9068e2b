#!/usr/bin/env python3
"""Two NVFP4 loop schedules that were built, checked equal to the Triton NVFP4 loop and measured on
the H200 (BENCHMARKS.md, 2026-11-30): slower, except the TMA loop at 64 rows × 4 warps for nvfp4
at Wan 720p alone (2.6% faster there, slower at 480p and for sage3). Kept here so those rows can
be re-measured, not shipped in ``kernels/``; the ping-pong that shipped (one ``warp_specialize``
partition per warpgroup, ``kernels/attention_nvfp4_sm90.py``) is timed next to them.

1. ``tma``: the Triton NVFP4 loop (:mod:`fp4video.kernels.attention_nvfp4`) with K̂/V̂ read by TMA
   (host tensor descriptors) instead of ``cp.async``; fewer address instructions (17.7 instead
   of 18.3 per element for sage3, 192 registers instead of 255).
2. ``pingpong``: a Gluon kernel whose two warpgroups (64 query rows each) take turns on the
   tensor cores (FlashAttention-3's ping-pong: named barriers 1/2 order the MMA issue, barrier 3
   hands a K̂/V̂ buffer back before it is refilled), loads by TMA with mbarriers, both warpgroups
   in one partition.

Both read K̂/V̂ rows already in ``mma_key_order`` within each 128-key tile and padded to whole
tiles (:func:`fp4video.kernels.prepass.prepass_tiles`, as the shipped loops now read them), so TMA copies whole
boxes. Same numerics (``nv_quantize_p``): the outputs are compared element by element with the
Triton loop's.

    python scripts/nvfp4_schedule_experiments.py --seqs 75600 32760     # GPU: checks, then times
    python scripts/nvfp4_schedule_experiments.py --offline              # sm_90 code of the ping-pong loop

``--offline`` (no GPU needed) compiles the ping-pong kernel for sm_90 and checks that no CTA-wide
barrier lands inside a warpgroup's turn: Triton's shared-memory barrier analysis inserts CTA
barriers around mbarrier and TMA operations, and one between the turn's start and end deadlocks
(warpgroup 1 waits for warpgroup 0's turn to end, warpgroup 0 for warpgroup 1 at the barrier);
each turn therefore starts with an explicit CTA barrier. Those barriers are also why the
ping-pong did not pay: the two warpgroups meet once per key tile, so one warpgroup's softmax runs
alone while the other's MMAs run, and alone it is latency-bound.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl

from fp4video.kernels.attention_fwd import LOG2E, _key_mask, mma_key_order, program_rows, store_out_lse
from fp4video.kernels.attention_nvfp4 import nv_quantize_p
from fp4video.recipe import PScale, RowSum
from fp4video.reference import KEY_TILE, TWO_LEVEL_P_RANGE


def tile_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """:func:`fp4video.kernels.prepass.prepass_tiles`' K̂ or V̂ (B, H, Sk_pad, ·), already in tile key
    order and padded, as the (B·H·Sk_pad, ·) row table TMA descriptors take; and Sk_pad."""
    b, h, sp, d = x.shape
    return x.reshape(b * h * sp, d), sp


# --- 1. the Triton loop with TMA loads -------------------------------------------------------

@triton.jit
def _tma_tile(q, Kd, Vd, M_base, row0, start, SK, sms, scale_log2, m_i, r_i, l_i, acc,
              HAS_MASK: tl.constexpr, TAIL: tl.constexpr, TWO_LEVEL: tl.constexpr, P_RANGE: tl.constexpr,
              PNQ: tl.constexpr, FAST_RCP: tl.constexpr, BLOCK_N: tl.constexpr):
    qk = tl.dot(q, tl.trans(Kd.load([row0 + start, 0])))
    if HAS_MASK or TAIL:
        keys = start + mma_key_order(tl.arange(0, BLOCK_N), BLOCK_N // 32, 32)
        if HAS_MASK:
            qk = tl.where((tl.load(M_base + keys * sms, mask=keys < SK, other=0) != 0)[None, :], qk, float("-inf"))
        else:
            qk = tl.where((keys < SK)[None, :], qk, float("-inf"))
    p, m_i, r_i, l_i, acc_scale = nv_quantize_p(qk, scale_log2, m_i, r_i, l_i, TWO_LEVEL, P_RANGE, PNQ, FAST_RCP,
                                                FAST_RCP, Vd.dtype)  # FAST_RCP: the GPU (a Hopper one: TMA)
    v = Vd.load([row0 + start, 0])
    return m_i, r_i, l_i, tl.dot(p, v, acc * acc_scale[:, None])


@triton.jit
def _nv_attn_fwd_tma(Q, Kd, Vd, KeyMask, Out, Lse, H, SQ, SK, SK_PAD, DV, sqb, sqh, sqs, smb, sms,
                     sob, soh, sos, sod, slb, slh, sls, scale_log2,
                     HAS_MASK: tl.constexpr, TWO_LEVEL: tl.constexpr, P_RANGE: tl.constexpr, PNQ: tl.constexpr,
                     FAST_RCP: tl.constexpr, D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    b, h, offs_m, row_ok = program_rows(H, SQ, BLOCK_M)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqs + tl.arange(0, D)[None, :], mask=row_ok[:, None],
                other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    r_i = tl.full((BLOCK_M,), 1.0, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    row0 = (b * H + h) * SK_PAD
    M_base = KeyMask + b * smb
    n_full = (SK // BLOCK_N) * BLOCK_N
    for start in range(0, n_full, BLOCK_N):
        m_i, r_i, l_i, acc = _tma_tile(q, Kd, Vd, M_base, row0, start, SK, sms, scale_log2, m_i, r_i, l_i, acc,
                                       HAS_MASK, False, TWO_LEVEL, P_RANGE, PNQ, FAST_RCP, BLOCK_N)
    if n_full < SK:
        m_i, r_i, l_i, acc = _tma_tile(q, Kd, Vd, M_base, row0, n_full, SK, sms, scale_log2, m_i, r_i, l_i, acc,
                                       HAS_MASK, True, TWO_LEVEL, P_RANGE, PNQ, FAST_RCP, BLOCK_N)
    store_out_lse(Out, Lse, acc, r_i[:, None], l_i, m_i, 0.0, b, h, offs_m, row_ok, tl.arange(0, BLOCK_DV), DV,
                  sob, soh, sos, sod, slb, slh, sls)


def _outputs(qh, dv, key_alive, out_dtype):
    b, h, sq, _ = qh.shape
    return (torch.empty(b, h, sq, dv, device=qh.device, dtype=out_dtype),
            torch.empty(b, h, sq, device=qh.device, dtype=torch.float32), _key_mask(key_alive, qh.device))


def _meta(recipe, key_alive):
    return dict(HAS_MASK=key_alive is not None, TWO_LEVEL=recipe.p_scale is PScale.TWO_LEVEL,
                P_RANGE=TWO_LEVEL_P_RANGE, PNQ=recipe.row_sum is RowSum.QUANTIZED)


def attention_tma(qh, k_tiles, v_tiles, sk, sk_pad, key_alive, *, recipe, scale, out_dtype, launch=(128, 8, 3)):
    """The TMA loop on the bf16 pre-pass's Q̂ and :func:`tile_rows`' K̂, V̂."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    d, dv = qh.shape[-1], v_tiles.shape[-1]
    out, lse, km = _outputs(qh, dv, key_alive, out_dtype)
    kd = TensorDescriptor(k_tiles, list(k_tiles.shape), list(k_tiles.stride()), [KEY_TILE, d])
    vd = TensorDescriptor(v_tiles, list(v_tiles.shape), list(v_tiles.stride()), [KEY_TILE, dv])
    bm, nw, ns = launch
    _nv_attn_fwd_tma[(triton.cdiv(qh.shape[2], bm), qh.shape[0] * qh.shape[1])](
        qh, kd, vd, km, out, lse, qh.shape[1], qh.shape[2], sk, sk_pad, dv, *qh.stride()[:3], km.stride(0),
        km.stride(1), *out.stride(), *lse.stride(), scale * LOG2E, **_meta(recipe, key_alive),
        FAST_RCP=qh.is_cuda, D=d, BLOCK_DV=dv, BLOCK_M=bm, BLOCK_N=KEY_TILE, num_warps=nw, num_stages=ns,
        enable_fp_fusion=False)
    return out, lse


# --- 2. the ping-pong Gluon loop ---------------------------------------------------------------

try:  # Gluon's Hopper API (Triton >= 3.5)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)
except ImportError:  # pragma: no cover
    gluon = None

if gluon is not None:
    from fp4video.kernels.attention_nvfp4 import nv_row_vector
    from fp4video.kernels.attention_nvfp4_sm90 import (_cta_barrier, _load_tile, _masked_logits, _mma_layout,
                                                       _row_load_layout, _smem_layout)

    # named barriers (0 is the CTA's): 1 = warpgroup 0's turn, 2 = warpgroup 1's, 3 = warpgroup 1
    # is done with a K̂/V̂ buffer. Each asm runs once per thread; w0: the thread is in warpgroup 0
    wg = "{ .reg .pred w0; .reg .u32 t; mov.u32 t, %tid.x; setp.lt.u32 w0, t, 128; "
    turn_begin = gl.constexpr(wg + "@w0 bar.sync 1, 256; @!w0 bar.sync 2, 256; mov.u32 $0, 0; }")
    turn_end = gl.constexpr(wg + "@w0 bar.arrive 2, 256; @!w0 bar.arrive 1, 256; mov.u32 $0, 0; }")
    first_turn = gl.constexpr(wg + "@!w0 bar.arrive 1, 256; mov.u32 $0, 0; }")
    last_turn = gl.constexpr(wg + "@w0 bar.sync 1, 256; mov.u32 $0, 0; }")
    wg1_releases = gl.constexpr(wg + "@!w0 bar.arrive 3, 256; mov.u32 $0, 0; }")
    wg0_acquires = gl.constexpr(wg + "@w0 bar.sync 3, 256; mov.u32 $0, 0; }")

    @gluon.jit
    def named(ASM: gl.constexpr, num_warps: gl.constexpr):
        t = gl.arange(0, 32 * num_warps, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
        gl.inline_asm_elementwise(ASM, "=r,r", [t], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def begin(num_warps: gl.constexpr):
        _cta_barrier()  # see the module docstring: no CTA barrier may fall inside a turn
        named(turn_begin, num_warps)

    @gluon.jit
    def _nv_attn_fwd_pingpong(Q, Kd, Vd, KeyMask, Out, Lse, H, SQ, SK, SK_PAD, DV, sqb, sqh, sqs, smb, sms,
               sob, soh, sos, sod, slb, slh, sls, scale_log2,
               HAS_MASK: gl.constexpr, TWO_LEVEL: gl.constexpr, P_RANGE: gl.constexpr, PNQ: gl.constexpr,
               D: gl.constexpr, BLOCK_DV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               NUM_BUF: gl.constexpr, num_warps: gl.constexpr):
        gl.static_assert(NUM_BUF == 3, "step j refills the buffer of tile j-1 with tile j+2")
        gl.static_assert(num_warps == 8, "two warpgroups")
        S_L: gl.constexpr = _mma_layout(BLOCK_N, num_warps)
        O_L: gl.constexpr = _mma_layout(BLOCK_DV, num_warps)
        P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        LQ: gl.constexpr = _row_load_layout(D, num_warps)
        bh = gl.program_id(1)
        b = bh // H
        h = bh % H
        rows = gl.program_id(0) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LQ))
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, LQ))
        q = gl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + offs_d[None, :], mask=(rows < SQ)[:, None],
                    other=0.0)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, D], _smem_layout(BLOCK_M, D), q)
        k_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_N, D], Kd.layout)
        v_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_N, BLOCK_DV], Vd.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(ready.index(i), count=1)
        fence_async_shared()
        _cta_barrier()
        M_base = KeyMask + b * smb
        row0 = bh * SK_PAD
        n_tiles = gl.cdiv(SK, BLOCK_N)
        _load_tile(Kd, Vd, k_bufs.index(0), v_bufs.index(0), ready.index(0), row0)
        for i in gl.static_range(1, NUM_BUF):
            if i < n_tiles:
                _load_tile(Kd, Vd, k_bufs.index(i), v_bufs.index(i), ready.index(i), row0 + i * BLOCK_N)

        named(first_turn, num_warps)
        zero = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, S_L)
        mbarrier.wait(ready.index(0), 0)
        begin(num_warps)
        s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
        named(turn_end, num_warps)
        s = warpgroup_mma_wait(0, deps=(s,))
        s = _masked_logits(s, M_base, 0, SK, sms, HAS_MASK, BLOCK_N, S_L)
        p, m_i, r_i, l_i, _ = nv_quantize_p(s, scale_log2, nv_row_vector(zero, float("-inf")),
                                            nv_row_vector(zero, 1.0), nv_row_vector(zero, 0.0), TWO_LEVEL, P_RANGE,
                                            PNQ, True, True, gl.bfloat16)
        p_prev = gl.convert_layout(p, P_L)
        acc = gl.zeros((BLOCK_M, BLOCK_DV), gl.float32, O_L)
        for j in range(1, n_tiles):
            buf = j % NUM_BUF
            mbarrier.wait(ready.index(buf), (j // NUM_BUF) & 1)
            begin(num_warps)
            s = warpgroup_mma(q_smem, k_bufs.index(buf).permute((1, 0)), zero, use_acc=False, is_async=True)
            acc = warpgroup_mma(p_prev, v_bufs.index((j - 1) % NUM_BUF), acc, is_async=True)
            named(turn_end, num_warps)
            s, acc, p_prev = warpgroup_mma_wait(0, deps=(s, acc, p_prev))
            named(wg1_releases, num_warps)  # warpgroup 1 is done with tile j-1's buffer
            s = _masked_logits(s, M_base, j * BLOCK_N, SK, sms, HAS_MASK, BLOCK_N, S_L)
            p, m_i, r_i, l_i, acc_scale = nv_quantize_p(s, scale_log2, m_i, r_i, l_i, TWO_LEVEL, P_RANGE, PNQ, True,
                                                        True, gl.bfloat16)
            p_prev = gl.convert_layout(p, P_L)
            acc = acc * gl.convert_layout(acc_scale, gl.SliceLayout(1, O_L))[:, None]
            named(wg0_acquires, num_warps)  # warpgroup 0 (its thread 0 issues the TMA) waits for it
            if j + 2 < n_tiles:
                nxt = (j + 2) % NUM_BUF
                _load_tile(Kd, Vd, k_bufs.index(nxt), v_bufs.index(nxt), ready.index(nxt), row0 + (j + 2) * BLOCK_N)
        begin(num_warps)
        acc = warpgroup_mma(p_prev, v_bufs.index((n_tiles - 1) % NUM_BUF), acc, is_async=True)
        named(turn_end, num_warps)
        acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
        named(last_turn, num_warps)  # matches warpgroup 1's last turn_end
        for i in gl.static_range(NUM_BUF):
            mbarrier.invalidate(ready.index(i))
        ROW: gl.constexpr = gl.SliceLayout(1, O_L)
        offs_m = gl.program_id(0) * BLOCK_M + gl.arange(0, BLOCK_M, layout=ROW)
        offs_dv = gl.arange(0, BLOCK_DV, layout=gl.SliceLayout(0, O_L))
        store_out_lse(Out, Lse, acc, gl.convert_layout(r_i, ROW)[:, None], gl.convert_layout(l_i, ROW),
                      gl.convert_layout(m_i, ROW), 0.0, b, h, offs_m, offs_m < SQ, offs_dv, DV,
                      sob, soh, sos, sod, slb, slh, sls)




def attention_pingpong(qh, k_tiles, v_tiles, sk, sk_pad, key_alive, *, recipe, scale, out_dtype):
    """The ping-pong loop (Hopper, bf16, head dim 128) on :func:`tile_rows`' K̂, V̂."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    d, dv = qh.shape[-1], v_tiles.shape[-1]
    out, lse, km = _outputs(qh, dv, key_alive, out_dtype)
    kd = TensorDescriptor(k_tiles, list(k_tiles.shape), list(k_tiles.stride()), [KEY_TILE, d],
                          gl.NVMMASharedLayout.get_default_for([KEY_TILE, d], gl.bfloat16))
    vd = TensorDescriptor(v_tiles, list(v_tiles.shape), list(v_tiles.stride()), [KEY_TILE, dv],
                          gl.NVMMASharedLayout.get_default_for([KEY_TILE, dv], gl.bfloat16))
    _nv_attn_fwd_pingpong[(triton.cdiv(qh.shape[2], 128), qh.shape[0] * qh.shape[1])](
        qh, kd, vd, km, out, lse, qh.shape[1], qh.shape[2], sk, sk_pad, dv, *qh.stride()[:3], km.stride(0),
        km.stride(1), *out.stride(), *lse.stride(), scale * LOG2E, **_meta(recipe, key_alive), D=d, BLOCK_DV=dv,
        BLOCK_M=128, BLOCK_N=KEY_TILE, NUM_BUF=3, num_warps=8, enable_fp_fusion=False)
    return out, lse


def pingpong_sass(two_level: bool = True) -> str:
    """The ping-pong kernel compiled for sm_90 offline, disassembled (Triton's nvdisasm)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = _nv_attn_fwd_pingpong
    consts = dict(HAS_MASK=False, TWO_LEVEL=two_level, P_RANGE=TWO_LEVEL_P_RANGE, PNQ=False, D=128, BLOCK_DV=128,
                  BLOCK_M=128, BLOCK_N=128, NUM_BUF=3, num_warps=8)
    desc = f"tensordesc<bf16[128, 128],{gl.NVMMASharedLayout.get_default_for([128, 128], gl.bfloat16)!r}>"
    ptr = {"Q": "*bf16", "KeyMask": "*i8", "Out": "*bf16", "Lse": "*fp32", "Kd": desc, "Vd": desc}
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else ptr.get(n, "fp32" if n == "scale_log2" else "i32") for n in names}
    aligned = [n for n in names if sig[n].startswith("*") or n in ("sqb", "sqh", "sqs", "sob", "soh", "sos", "slb")]
    src = GluonASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                         attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, enable_fp_fusion=False))
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        return subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout


def barriers_inside_turns(sass: str) -> list[str]:
    """CTA barriers (BAR.SYNC 0) issued between a turn's start and its end (BAR.ARV 1 or 2): each
    would deadlock the ping-pong. A turn starts with the pair BAR.SYNC 1 / BAR.SYNC 2 (one per
    warpgroup, predicated); barrier 2 is waited on nowhere else (warpgroup 0's last wait is on 1)."""
    inside, bad = False, []
    for line in sass.splitlines():
        if re.search(r"BAR\.SYNC(?:\.DEFER_BLOCKING)? 0x2,", line):
            inside = True
        elif re.search(r"BAR\.ARV 0x[12],", line):
            inside = False
        elif inside and re.search(r"BAR\.SYNC(?:\.DEFER_BLOCKING)? 0x0 ;", line):
            bad.append(line.strip())
    return bad


# --- measurement -------------------------------------------------------------------------------

def _median_ms(fn, n=3):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[n // 2]


def _shipped_pingpong(qh, k_tiles, v_tiles, sk, sk_pad, key_alive, *, recipe, scale, out_dtype):
    from fp4video.kernels.attention_nvfp4_sm90 import attention_nvfp4_sm90

    b, h = qh.shape[:2]
    return attention_nvfp4_sm90(qh, k_tiles.view(b, h, sk_pad, -1), v_tiles.view(b, h, sk_pad, -1), key_alive, sk=sk,
                                recipe=recipe, scale=scale, out_dtype=out_dtype)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, nargs="+", default=[75600], help="sequence lengths to time (B=1, H=40, D=128)")
    ap.add_argument("--offline", action="store_true", help="only compile the ping-pong loop for sm_90 and check it")
    args = ap.parse_args(argv)
    if args.offline:
        sass = pingpong_sass()
        bad = barriers_inside_turns(sass)
        if not all(op in sass for op in ("HGMMA", "UTMALDG", "BAR.ARV 0x1")):
            raise SystemExit("error: the compiled loop lacks its MMAs, TMA loads or turn barriers")
        print(f"ping-pong loop, Triton {triton.__version__}, sm_90: {len(bad)} CTA barriers inside a turn; "
              f"{len(re.findall(r'BAR.SYNC(?:.DEFER_BLOCKING)? 0x0 ;', sass))} CTA barriers in the kernel")
        return 1 if bad else 0

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fp4video import METHODS
    from fp4video.kernels.attention_fwd import prepare
    from fp4video.kernels.attention_nvfp4 import attention_nvfp4

    scale = 128 ** -0.5
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}")
    variants = {"tma 128x8x3": lambda *a, **k: attention_tma(*a, **k),
                "tma 64x4x1": lambda *a, **k: attention_tma(*a, **k, launch=(64, 4, 1)),
                "pingpong": attention_pingpong,
                "pingpong, a partition per warpgroup (shipped)": _shipped_pingpong}
    # checks: every element equal to the Triton loop's (odd lengths, key-padding mask, Sq != Sk)
    for name in ("nvfp4", "sage3"):
        recipe = METHODS[name]
        for sq, sk, masked in ((1000, 1000, False), (300, 777, True), (200, 90, False)):
            gen = torch.Generator(device="cuda").manual_seed(sq + sk)
            q = torch.randn(2, 3, sq, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
            k, v = (torch.randn(2, 3, sk, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
            alive = torch.rand(2, sk, device="cuda", generator=gen) > 0.3 if masked else None
            _, (qh, kh, vh, _) = prepare(q, k, v, recipe, alive)
            base, base_lse = attention_nvfp4(qh, kh, vh, alive, sk=sk, recipe=recipe, scale=scale,
                                             out_dtype=torch.bfloat16)
            k_tiles, sk_pad = tile_rows(kh)
            v_tiles, _ = tile_rows(vh)
            for label, fn in variants.items():
                out, lse = fn(qh, k_tiles, v_tiles, sk, sk_pad, alive, recipe=recipe, scale=scale,
                              out_dtype=torch.bfloat16)
                same = torch.equal(out, base) and torch.equal(lse, base_lse)
                print(f"check {name} {label} Sq={sq} Sk={sk} mask={masked}: "
                      f"{'equal to the Triton loop' if same else 'DIFFERENT'}", flush=True)
                if not same:
                    return 1
    for s in args.seqs:
        q, k, v = (torch.randn(1, 40, s, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            t_cudnn = _median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        print(f"\nS = {s}: cuDNN SDPA {t_cudnn:.2f} ms\n\n| method | loop | ms | × cuDNN (loop alone) |\n"
              "| --- | --- | --- | --- |", flush=True)
        for name in ("nvfp4", "sage3"):
            recipe = METHODS[name]
            _, (qh, kh, vh, _) = prepare(q, k, v, recipe, None)
            k_tiles, sk_pad = tile_rows(kh)
            v_tiles, _ = tile_rows(vh)
            runs = {"Triton loop (cp.async, 128x8x3)": lambda: attention_nvfp4(qh, kh, vh, None, sk=s, recipe=recipe, scale=scale,
                                                                          out_dtype=torch.bfloat16)}
            for label, fn in variants.items():
                runs[label] = lambda fn=fn: fn(qh, k_tiles, v_tiles, s, sk_pad, None, recipe=recipe, scale=scale,
                                               out_dtype=torch.bfloat16)
            for label, fn in runs.items():
                t = _median_ms(fn)
                print(f"| {name} | {label} | {t:.2f} | {t_cudnn / t:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
