"""Fused quantization pre-pass: one pass per tensor, the numerics of
:func:`fp4video.reference.prepare_qkv`.

Q and K: zero dead keys, subtract K's smoothing mean, rotate by the Hadamard matrix (fp32,
IEEE dot), block-quantize along the head dim; V: zero dead keys, block-quantize along tokens.
Outputs hold the dequantized values in bf16 (exact for E2M1 × E8M0/E4M3 scales) in a contiguous
(B, H, S, D) layout, Q/K zero-padded along D to the kernel's power-of-two head dim.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fp4video.formats import Format, ScaleRule, nvfp4_tensor_scale
from fp4video.recipe import AttentionRecipe
from fp4video.reference import KEY_TILE, qk_padded_dim
from fp4video.rotation import hadamard_matrix

from .checks import k_smoothing_mean
from .fp4_math import (FMT_E4M3, FMT_MXFP4, FMT_NONE, FMT_NVFP4, e4m3_pow2_shift, fake_quant_rows,
                       fp8_shift_from_raw_max, mx_block_exponent, mx_pack_rows, nv_pack_rows, pow2, round_e2m1_signed,
                       round_e4m3_signed)
from .key_order import as_mma_operand, key_order_matrix, quad_key_order, tile_key_position
from .launch import fitting_stages
from .operands import FP8Operands, PackedOperands, TileOperands, WorkOperands
from .tiles import next_pow2

#: the pre-pass kernels' ``FMT`` by format (none: rotated and smoothed only)
FMT_CODE = {None: FMT_NONE, Format.MXFP4: FMT_MXFP4, Format.NVFP4: FMT_NVFP4, Format.E4M3: FMT_E4M3}
#: the pre-pass kernels' ``OUT``, what a launch writes: WORK the work dtype's values; FP8_ROW E4M3 rows
#: with a factor per row (Q); FP8_TILE / FP8_TILE_ORDERED E4M3 rows with a factor per key tile (K; in
#: key or tile key order); FP8_AMAX V's channel maxima alone; FP8_HEAD E4M3 V̂ᵀ with a factor per
#: channel; E2M1_PACKED packed codes with block scales; TILE_ROWS work-dtype rows in tile key order;
#: HEAD_AMAX each head's largest |x| alone
(WORK, FP8_ROW, FP8_AMAX, FP8_HEAD, E2M1_PACKED, FP8_TILE, TILE_ROWS, FP8_TILE_ORDERED,
 HEAD_AMAX) = (tl.constexpr(i) for i in range(9))


#: shared memory of the row pre-pass by stages (K's 128-row key tiles, bf16 inputs: the most;
#: offline sm_90 compiles, the figure every architecture uses: :func:`.launch.stages_that_fit`)
ROW_SHARED_MEMORY = {"sm_90": {1: 98304, 2: 106496, 3: 139264}}
#: the same for the tensor-core V path at 64 channels and 4 tiles per program
V_SHARED_MEMORY = {"sm_90": {1: 49152, 2: 73728, 3: 90112}}


@dataclass(frozen=True)
class PrepassLaunch:
    """How the pre-pass kernels are launched (``tools/prepass_bandwidth.py --sweep`` times the
    alternatives on a GPU: pass ``dataclasses.replace(PREPASS_LAUNCH, ...)`` as ``launch=``). The
    defaults are the fastest it finds on Hopper."""

    #: rows per program of the row launches (Q; K outside the e4m3 path)
    block_s: int = 64
    #: warps per program of those launches
    row_warps: int = 4
    #: warps per key tile of K on the e4m3 path (8 is no faster)
    tile_warps: int = 4
    #: row blocks per program of the rotating launches (one read of the Hadamard matrix)
    blocks_per_program: int = 8
    #: software-pipelining stages of the row launches, and of K's key tiles on the e4m3 path
    row_stages: int = 2
    tile_stages: int = 2
    #: the e4m3 Q launch is persistent, this many programs per SM striding over all heads' row
    #: blocks, with this many stages: persistent, fewer launches than programs
    q8_programs_per_sm: int = 2
    q8_stages: int = 3
    #: K's per-tile e4m3 launch persistent (None: not; persistent is no faster there)
    tile_programs_per_sm: int | None = None
    #: warps of the V launches (8 are slower)
    v_warps: int = 4
    #: key tiles per program of V's channel maxima (one atomic per channel and program: fewer
    #: atomics than with one)
    v_tiles_amax: int = 4
    #: channels per program of the transposed V launches (of 32, 64, 128: fastest)
    v_channels: int = 128
    #: e4m3 V of bf16/fp16 inputs is transposed by the tensor cores (exact): 64 channels and 4 key
    #: tiles per program (Π read once for all); 3 stages
    v_channels_mma: int = 64
    v_tiles_mma: int = 4
    v_stages: int = 3


PREPASS_LAUNCH = PrepassLaunch()


@triton.jit
def _prepass_rows(
    X, Alive, Mean, Hm, Out, Fac,
    H, S, D_IN, h_norm, n_blocks, n_heads,
    sxb, sxh, sxs, sxd,
    sab, sas,
    smb, smh,
    sob, soh, sos,
    HAS_ALIVE: tl.constexpr, SMOOTH: tl.constexpr, ROTATE: tl.constexpr, ROT_PRECISION: tl.constexpr,
    ROT_PARTS: tl.constexpr,
    FMT: tl.constexpr, QB: tl.constexpr, OCP: tl.constexpr, QMAX: tl.constexpr,
    D: tl.constexpr, BLOCK_S: tl.constexpr, OUT: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr,
    PERSISTENT: tl.constexpr, TSCALE: tl.constexpr = False, HW_E4M3: tl.constexpr = False,
    QUAD: tl.constexpr = False,
):
    """Q or K: rows of D channels, quantized along D, in blocks of BLOCK_S rows (``n_blocks`` per
    head, ``n_heads`` = B·H heads). Each program reads the Hadamard matrix once, then takes
    BLOCKS_PER_PROGRAM consecutive blocks of head program_id(1) or, PERSISTENT (a grid of one
    dimension, a few programs per SM), every num_programs-th block of all heads' blocks: one
    software pipeline over all of them, no per-program start and drain.

    OUT: 0 writes the values in Out's dtype; FP8_ROW writes e4m3 values shifted per row (factor
    2^-c per row into Fac[b, h, row]); FP8_TILE shifted per block of BLOCK_S rows (one key tile
    of the attention loop; factor into Fac[b, h, tile]); E2M1_PACKED packed codes and scales;
    HEAD_AMAX no values, the largest |x| (as quantized: smoothed, rotated) of each head into
    Fac[b·H + h] (fp32, atomic). TSCALE (NVFP4, WORK or TILE_ROWS): Fac holds each head's tensor
    scale g and 1/g (powers of two, Fac[2·(b·H + h)] and the next): blocks are quantized on x / g.
    QUAD (E2M1_PACKED K̂ of consumer Blackwell's dot_scaled loop): key r is stored in row
    :func:`.key_order.quad_key_order` (r) (Out must have the rows of whole 32-key groups, and MXFP4's
    scale rows in Fac as many per head).
    """
    cols = tl.arange(0, D)
    hm = Hm
    if ROTATE:  # entries ±1 (0 in the padding)
        hm = tl.load(Hm + cols[:, None] * D + cols[None, :])
    if PERSISTENT:
        for item in tl.range(tl.program_id(0), n_blocks * n_heads, tl.num_programs(0)):
            bh = item // n_blocks
            _rows_block(X, Alive, Mean, hm, Out, Fac, bh // H, bh % H, bh, item % n_blocks,
                        S, D_IN, h_norm, sxb, sxh, sxs, sxd, sab, sas, smb, smh, sob, soh, sos,
                        HAS_ALIVE, SMOOTH, ROTATE, ROT_PRECISION, ROT_PARTS, FMT, QB, OCP, QMAX, D, BLOCK_S, OUT,
                        TSCALE, HW_E4M3, QUAD)
    else:
        bh = tl.program_id(1)
        for i in range(BLOCKS_PER_PROGRAM):
            _rows_block(X, Alive, Mean, hm, Out, Fac, bh // H, bh % H, bh, tl.program_id(0) * BLOCKS_PER_PROGRAM + i,
                        S, D_IN, h_norm, sxb, sxh, sxs, sxd, sab, sas, smb, smh, sob, soh, sos,
                        HAS_ALIVE, SMOOTH, ROTATE, ROT_PRECISION, ROT_PARTS, FMT, QB, OCP, QMAX, D, BLOCK_S, OUT,
                        TSCALE, HW_E4M3, QUAD)


@triton.jit
def _rows_block(X, Alive, Mean, hm, Out, Fac, b, h, bh, blk,
                S, D_IN, h_norm, sxb, sxh, sxs, sxd, sab, sas, smb, smh, sob, soh, sos,
                HAS_ALIVE: tl.constexpr, SMOOTH: tl.constexpr, ROTATE: tl.constexpr, ROT_PRECISION: tl.constexpr,
                ROT_PARTS: tl.constexpr, FMT: tl.constexpr, QB: tl.constexpr, OCP: tl.constexpr,
                QMAX: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, OUT: tl.constexpr,
                TSCALE: tl.constexpr = False, HW_E4M3: tl.constexpr = False, QUAD: tl.constexpr = False):
    """Block ``blk`` of BLOCK_S rows of :func:`_prepass_rows`."""
    rows = blk * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, D)
    ok = rows < S
    if HAS_ALIVE:
        ok = ok & (tl.load(Alive + b * sab + rows * sas, mask=rows < S, other=0) != 0)
    x = tl.load(X + b * sxb + h * sxh + rows[:, None] * sxs + cols[None, :] * sxd,
                mask=ok[:, None] & (cols[None, :] < D_IN), other=0.0).to(tl.float32)
    if SMOOTH:
        mean = tl.load(Mean + b * smb + h * smh + cols, mask=cols < D_IN, other=0.0)
        x = tl.where(ok[:, None], x - mean[None, :], 0.0)
    norm = 1.0
    if ROTATE:  # x · Hm, still to be multiplied by norm = h_norm
        norm = h_norm
        if ROT_PRECISION == "bf16":
            # x = x1 + … + x_ROT_PARTS exactly in bf16 parts (one for bf16 inputs, two for fp16,
            # three for fp32); ±1 is exact in bf16, so bf16 MMAs with fp32 accumulation give the
            # fp32 product (up to summation order)
            hb = hm.to(tl.bfloat16)
            x1 = x.to(tl.bfloat16)
            y = tl.zeros((BLOCK_S, D), tl.float32)
            if ROT_PARTS > 1:
                r1 = x - x1.to(tl.float32)
                x2 = r1.to(tl.bfloat16)
                if ROT_PARTS > 2:
                    y = tl.dot((r1 - x2.to(tl.float32)).to(tl.bfloat16), hb)
                y = tl.dot(x2, hb, y)
            x = tl.dot(x1, hb, y)
        else:
            x = tl.dot(x, hm, input_precision=ROT_PRECISION)
    out_ptrs = Out + b * sob + h * soh + rows[:, None] * sos + cols[None, :]
    if OUT == FP8_ROW or OUT == FP8_TILE or OUT == FP8_TILE_ORDERED:
        # the shift c follows from the largest |x · norm| before quantization (fp8_shift_from_raw_max),
        # so one product x · (norm · 2^c) both normalizes and shifts (2^c is exact: equal to
        # shifting the quantized values), and the blocks are quantized at their scales times 2^c
        if FMT == FMT_E4M3:  # E4M3 itself: no blocks, the row's / key tile's largest |x| into [128, 256)
            big = tl.max(tl.abs(x), axis=1)
            if OUT != FP8_ROW:
                big = tl.max(big, axis=0)
            c = e4m3_pow2_shift(big * norm)
            factor = norm * pow2(c)
            if OUT == FP8_ROW:
                y = round_e4m3_signed(x * factor[:, None], HW_E4M3)
            else:
                y = round_e4m3_signed(x * factor, HW_E4M3)
        else:
            xb = tl.reshape(x, (BLOCK_S, D // QB, QB))
            block_max = tl.max(tl.abs(xb), axis=2)
            big = tl.max(block_max, axis=1)
            if OUT != FP8_ROW:  # one shift per key tile
                big = tl.max(big, axis=0)
            c = fp8_shift_from_raw_max(big * norm, OCP, QMAX)
            factor = norm * pow2(c)
            if OUT == FP8_ROW:
                e = mx_block_exponent(block_max * factor[:, None], OCP, QMAX)
                xs = xb * factor[:, None, None]
            else:
                e = mx_block_exponent(block_max * factor, OCP, QMAX)
                xs = xb * factor
            # (all-zero blocks: any unit rounds them to 0)
            q = round_e2m1_signed(xs, pow2(tl.minimum(tl.maximum(e, -126), 126))[:, :, None])
            y = tl.reshape(q, (BLOCK_S, D)).to(tl.float8e4nv)
        if OUT == FP8_TILE_ORDERED:  # a whole key tile (zero rows past S), its rows in the loops' key order; none past the
            # last tile (a program's last blocks can lie beyond it)
            tl.store(Out + b * sob + h * soh + tile_key_position(rows, BLOCK_S)[:, None] * sos + cols[None, :], y,
                     mask=(rows < tl.cdiv(S, BLOCK_S) * BLOCK_S)[:, None])
        else:
            tl.store(out_ptrs, y, mask=(rows < S)[:, None])
        if OUT == FP8_ROW:
            tl.store(Fac + bh * S + rows, pow2(-c), mask=rows < S)
        else:
            tl.store(Fac + bh * tl.cdiv(S, BLOCK_S) + blk, pow2(-c), mask=blk * BLOCK_S < S)
    elif OUT == HEAD_AMAX:  # each head's largest |x|
        tl.atomic_max(Fac + bh, tl.max(tl.max(tl.abs(x * norm), axis=1), axis=0))
    elif OUT == E2M1_PACKED and FMT == FMT_NVFP4:  # NVFP4: each row of Out holds its codes along D, then its
        # E4M3 scale bytes (B, H, S, D // 2 + D // QB); blocks quantized on x / g (TSCALE: g, 1/g in Fac)
        x = x * norm
        if TSCALE:
            x = x * tl.load(Fac + 2 * bh + 1)
        codes, scales = nv_pack_rows(x, BLOCK_S, D, QB)
        half = tl.arange(0, D // 2)
        nb = tl.arange(0, D // QB)
        row_base = Out + b * sob + h * soh + (quad_key_order(rows) if QUAD else rows)[:, None] * sos
        tl.store(row_base + half[None, :], codes, mask=(rows < S)[:, None])
        tl.store(row_base + D // 2 + nb[None, :], scales, mask=(rows < S)[:, None])
    elif OUT == E2M1_PACKED:  # codes along D into Out, E8M0 scales into Fac (B, H, S, D // QB)
        codes, scales = mx_pack_rows(x * norm, BLOCK_S, D, QB, OCP, QMAX)
        half = tl.arange(0, D // 2)
        at = quad_key_order(rows) if QUAD else rows
        tl.store(Out + b * sob + h * soh + at[:, None] * sos + half[None, :], codes, mask=(rows < S)[:, None])
        nb = tl.arange(0, D // QB)
        sf_rows = tl.cdiv(S, 32) * 32 if QUAD else S  # (scale rows per head)
        tl.store(Fac + (bh * sf_rows + at)[:, None] * (D // QB) + nb[None, :], scales, mask=(rows < S)[:, None])
    else:
        x = x * norm
        if FMT != FMT_NONE and TSCALE:  # (x / g exact: g is a power of two)
            x = fake_quant_rows(x * tl.load(Fac + 2 * bh + 1), BLOCK_S, D, FMT, QB, OCP, QMAX, True) * tl.load(Fac + 2 * bh)
        elif FMT != FMT_NONE:
            x = fake_quant_rows(x, BLOCK_S, D, FMT, QB, OCP, QMAX, True)
        if OUT == WORK:
            tl.store(out_ptrs, x.to(Out.dtype.element_ty), mask=(rows < S)[:, None])
        else:  # TILE_ROWS: rows in tile key order, zero rows up to whole key tiles
            pos = tile_key_position(rows, 128)
            tl.store(Out + b * sob + h * soh + pos[:, None] * sos + cols[None, :], x.to(Out.dtype.element_ty),
                     mask=(rows < tl.cdiv(S, 128) * 128)[:, None])


@triton.jit
def _prepass_v(
    V, Alive, Out, Amax, Fac, Pi,
    H, S, DV,
    svb, svh, svs, svd,
    sab, sas,
    sob, soh, sos, sod,
    HAS_ALIVE: tl.constexpr, FMT: tl.constexpr, QB: tl.constexpr, OCP: tl.constexpr, QMAX: tl.constexpr,
    DV_PAD: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, OUT: tl.constexpr,
    MMA_T: tl.constexpr = False, IEEE: tl.constexpr = False,
    TILES: tl.constexpr = 1, TSCALE: tl.constexpr = False, HW_E4M3: tl.constexpr = False,
    KEY_ORDER: tl.constexpr = True,
):
    """V: quantized along tokens (blocks of QB consecutive keys per channel); each program takes
    BLOCK_S tokens of BLOCK_DV of the DV_PAD channels (grid axis 2) — the tensor-core transposed
    e4m3 path TILES such tiles. (Several tiles per program, with the next tile's loads issued
    before this one's arithmetic, is slower for the other paths: more registers, fewer programs
    per SM.)

    OUT: 0 writes Out's dtype; FP8_AMAX folds each channel's largest |v| (before quantization:
    the shift follows from it, :func:`.fp4_math.fp8_shift_from_raw_max`) into Amax[b, h, :];
    FP8_HEAD writes e4m3 values shifted per channel (factors into Fac[b, h, :]); the fp8 output
    is (B, H, Dv, S_pad) — transposed, as Hopper's fp8 MMA wants its B operand K-major, padded with
    zeros to whole tiles of BLOCK_S (= the loop's key tile) and ordered within each tile as the
    loop's P̂ operand holds the keys (:func:`.key_order.v8t_key_order`) — or, KEY_ORDER False (E4M3
    V, for the dot_scaled loop, whose P is in key order), with the tokens in order (``Pi`` then
    the identity).
    """
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    cols = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    if FMT == FMT_E4M3 and (OUT == FP8_HEAD or OUT == TILE_ROWS):  # E4M3 V: each channel's largest |v| into [128, 256)
        c = e4m3_pow2_shift(tl.load(Amax + bh * DV_PAD + cols).to(tl.float32, bitcast=True))
    elif OUT == FP8_HEAD:  # the channel shifts, from the maxima FP8_AMAX folded (before quantization)
        c = fp8_shift_from_raw_max(tl.load(Amax + bh * DV_PAD + cols).to(tl.float32, bitcast=True), OCP, QMAX)
    if OUT == FP8_HEAD and MMA_T:  # transposed by the tensor cores (V's own dtype): TILES tiles per
        # program, Π and the channel shifts read once for all of them
        k = tl.arange(0, BLOCK_S)
        pi = tl.load(Pi + k[:, None] * BLOCK_S + k[None, :])
        for i in tl.range(TILES):
            tile = pid * TILES + i
            x = _v_tile(V, Alive, b, h, tile, cols, S, DV, svb, svh, svs, svd, sab, sas, HAS_ALIVE, BLOCK_S)
            _v_e4m3_mma_transposed(x, pi, c, Out, Fac, b, h, bh, tile, cols, S, sob, soh, sod,
                                   DV_PAD, BLOCK_DV, BLOCK_S, QB, OCP, QMAX, IEEE, FMT, HW_E4M3, KEY_ORDER)
    elif OUT == FP8_AMAX:  # a plain read of TILES tiles, no quantization; one atomic per channel
        # for the channel maxima, and one for the smallest nonzero block maximum (Fac: the e4m3
        # window check: FP8Operands.v_span)
        amax = tl.zeros((BLOCK_DV,), tl.float32)
        bmin = tl.full((BLOCK_DV,), float("inf"), tl.float32)
        for i in tl.range(TILES):
            x = _v_tile(V, Alive, b, h, pid * TILES + i, cols, S, DV, svb, svh, svs, svd, sab, sas, HAS_ALIVE,
                        BLOCK_S)
            blk = tl.max(tl.reshape(tl.abs(x.to(tl.float32)), (BLOCK_S // QB, QB, BLOCK_DV)), axis=1)
            amax = tl.maximum(amax, tl.max(blk, axis=0))
            bmin = tl.minimum(bmin, tl.min(tl.where(blk > 0, blk, float("inf")), axis=0))
        tl.atomic_max(Amax + bh * DV_PAD + cols, amax.to(tl.int32, bitcast=True))
        tl.atomic_min(Fac + bh * DV_PAD + cols, bmin.to(tl.int32, bitcast=True))
    else:
        x = _v_tile(V, Alive, b, h, pid, cols, S, DV, svb, svh, svs, svd, sab, sas, HAS_ALIVE, BLOCK_S)
        rows = pid * BLOCK_S + tl.arange(0, BLOCK_S)
        x = x.to(tl.float32)
        if OUT == E2M1_PACKED and FMT == FMT_NVFP4:  # E2M1_PACKED, NVFP4, transposed: each channel's row holds its codes
            # along tokens, then its E4M3 scale bytes (B, H, Dv, S_pad // 2 + S_pad // QB); TSCALE: g, 1/g in Fac
            if TSCALE:
                x = x * tl.load(Fac + 2 * bh + 1)
            codes, scales = nv_pack_rows(tl.trans(x), BLOCK_DV, BLOCK_S, QB)
            half = pid * (BLOCK_S // 2) + tl.arange(0, BLOCK_S // 2)
            nb = pid * (BLOCK_S // QB) + tl.arange(0, BLOCK_S // QB)
            row_base = Out + b * sob + h * soh + cols[:, None] * sod
            tl.store(row_base + half[None, :], codes)
            tl.store(row_base + tl.cdiv(S, BLOCK_S) * (BLOCK_S // 2) + nb[None, :], scales)
        elif OUT == E2M1_PACKED:  # E2M1_PACKED, transposed: codes along tokens (B, H, Dv, S_pad // 2), scales
            # (B, H, Dv, S_pad // QB); S_pad is a multiple of BLOCK_S, so every program writes whole tiles
            codes, scales = mx_pack_rows(tl.trans(x), BLOCK_DV, BLOCK_S, QB, OCP, QMAX)
            half = pid * (BLOCK_S // 2) + tl.arange(0, BLOCK_S // 2)
            tl.store(Out + b * sob + h * soh + cols[:, None] * sod + half[None, :], codes)
            nb = pid * (BLOCK_S // QB) + tl.arange(0, BLOCK_S // QB)
            tl.store(Fac + (bh * DV_PAD + cols)[:, None] * (sod * 2 // QB) + nb[None, :], scales)
        else:
            if FMT == FMT_E4M3 and OUT == TILE_ROWS:  # E4M3 values with their channel scales, in Out's dtype (exact)
                x = round_e4m3_signed(x * pow2(c)[None, :], HW_E4M3).to(tl.float32) * pow2(-c)[None, :]
            elif FMT == FMT_E4M3:
                tl.static_assert(OUT == FP8_HEAD, "E4M3 V: the e4m3 (FP8_HEAD) or tile-ordered (TILE_ROWS) outputs")
            elif FMT != FMT_NONE and TSCALE:  # NVFP4 with the head's tensor scale g, 1/g in Fac (as in _prepass_rows)
                x = tl.trans(fake_quant_rows(tl.trans(x * tl.load(Fac + 2 * bh + 1)), BLOCK_DV, BLOCK_S, FMT, QB, OCP,
                                             QMAX, True)) * tl.load(Fac + 2 * bh)
            elif FMT != FMT_NONE:
                x = tl.trans(fake_quant_rows(tl.trans(x), BLOCK_DV, BLOCK_S, FMT, QB, OCP, QMAX, True))
            out_ptrs = Out + b * sob + h * soh + rows[:, None] * sos + cols[None, :] * sod
            out_ok = (rows < S)[:, None] & (cols[None, :] < DV)
            if OUT == TILE_ROWS:  # rows in tile key order, zero rows up to whole key tiles
                out_ptrs = Out + b * sob + h * soh + tile_key_position(rows, 128)[:, None] * sos + cols[None, :] * sod
                out_ok = (rows < tl.cdiv(S, 128) * 128)[:, None] & (cols[None, :] < DV)
            if OUT == WORK or OUT == TILE_ROWS:
                tl.store(out_ptrs, x.to(Out.dtype.element_ty), mask=out_ok)
            elif FMT == FMT_E4M3:  # FP8_HEAD of E4M3 V
                _store_v8t(Out, Fac, b, h, bh, pid, cols, sob, soh, sod, DV_PAD, BLOCK_S, QB,
                           round_e4m3_signed(x * pow2(c)[None, :], HW_E4M3), c, KEY_ORDER)
            else:  # FP8_HEAD
                _store_v8t(Out, Fac, b, h, bh, pid, cols, sob, soh, sod, DV_PAD, BLOCK_S, QB,
                           (x * pow2(c)[None, :]).to(tl.float8e4nv), c)


@triton.jit
def _v_tile(V, Alive, b, h, tile, cols, S, DV, svb, svh, svs, svd, sab, sas, HAS_ALIVE: tl.constexpr,
            BLOCK_S: tl.constexpr):
    """Tokens [tile·BLOCK_S, +BLOCK_S) of V's channels ``cols``, zero for dead keys and past the ends."""
    rows = tile * BLOCK_S + tl.arange(0, BLOCK_S)
    ok = rows < S
    if HAS_ALIVE:
        ok = ok & (tl.load(Alive + b * sab + rows * sas, mask=rows < S, other=0) != 0)
    return tl.load(V + b * svb + h * svh + rows[:, None] * svs + cols[None, :] * svd,
                   mask=ok[:, None] & (cols[None, :] < DV), other=0.0)


@triton.jit
def _store_v8t(Out, Fac, b, h, bh, pid, cols, sob, soh, sod, DV_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
               QB: tl.constexpr, y, c, KEY_ORDER: tl.constexpr = True):
    """FP8_HEAD's stores: y (BLOCK_S tokens × channels ``cols``, e4m3) transposed, its tokens in the
    order the attention loop's P̂ operand holds them (:func:`.key_order.v8t_key_order`: with
    QB = 32 and 128-token tiles, token 32t + 8i + 4a + 2b + e goes to 32i + 16a + 4t + 2b + e; KEY_ORDER
    False: in order); padded channels and tokens (up to whole tiles) are written as zeros. The
    channel factors 2^-c by the first tile."""
    if KEY_ORDER:
        y = tl.reshape(tl.permute(tl.reshape(y, (BLOCK_S // QB, QB // 8, 2, 2, 2, cols.shape[0])), (1, 2, 0, 3, 4, 5)),
                       (BLOCK_S, cols.shape[0]))
    rows = pid * BLOCK_S + tl.arange(0, BLOCK_S)
    tl.store(Out + b * sob + h * soh + rows[:, None] + cols[None, :] * sod, y)
    if pid == 0:
        tl.store(Fac + bh * DV_PAD + cols, pow2(-c))


@triton.jit
def _v_e4m3_mma_transposed(x, pi, c, Out, Fac, b, h, bh, pid, cols, S, sob, soh, sod, DV_PAD: tl.constexpr,
                           BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, QB: tl.constexpr, OCP: tl.constexpr,
                           QMAX: tl.constexpr, IEEE: tl.constexpr, FMT: tl.constexpr = 1,
                           HW_E4M3: tl.constexpr = False, KEY_ORDER: tl.constexpr = True):
    """FP8_HEAD with the transposition done by an MMA: Vᵀ · Π, Π (:func:`.key_order.key_order_matrix`)
    the 0/1 matrix that puts token ``mma_key_order(c)`` in column c — one product x · 1 per output,
    the rest zeros: exact (fp32 accumulation of bf16/fp16 inputs; IEEE fp32 in the interpreter).
    In the MMA's accumulator a lane holds the columns 8j + 2t + e of its rows (channels), i.e.
    the 32 tokens of block t: block maxima are in-thread reductions, no byte-wise transposition
    through shared memory; the stored order (:func:`.key_order.v8t_key_order`) is then the
    relabelling :func:`.key_order.as_mma_operand` applies to P̂. KEY_ORDER False (E4M3 V only): Π is
    the identity and the tokens are stored in order.
    ``pi``: Π; ``c``: the channel shifts; tile ``pid`` is written only if it holds one of the S
    tokens (a program's tiles past the last one are not)."""
    tl.static_assert(BLOCK_S == 128 and QB == 32, "the loop's key tiles of 128 and P blocks of 32")
    k = tl.arange(0, BLOCK_S)
    if IEEE:
        xt = tl.dot(tl.trans(x.to(tl.float32)), pi, input_precision="ieee")
    else:
        xt = tl.dot(tl.trans(x), pi)
    if FMT == FMT_E4M3:  # E4M3 V: the channel's shift only
        y = round_e4m3_signed(xt * pow2(c)[:, None], HW_E4M3)
    else:
        xb = tl.reshape(xt, (BLOCK_DV, BLOCK_S // 8, 4, 2))  # column 8j + 2t + e: block t
        amax = tl.max(tl.max(tl.abs(xb), axis=3), axis=1)
        e = tl.minimum(tl.maximum(mx_block_exponent(amax, OCP, QMAX), -126), 126)
        q = round_e2m1_signed(xb, pow2(e)[:, None, :, None])
        y = (tl.reshape(q, (BLOCK_DV, BLOCK_S)) * pow2(c)[:, None]).to(tl.float8e4nv)
    if KEY_ORDER:
        y = as_mma_operand(y, BLOCK_DV, BLOCK_S)
    else:
        tl.static_assert(FMT == FMT_E4M3, "tokens in order: E4M3 V only (MXFP4 V's blocks follow Π's column order)")
    first = pid * BLOCK_S + k * 0  # (the tile's first token, as a tensor: a mask for every column)
    tl.store(Out + b * sob + h * soh + cols[:, None] * sod + (pid * BLOCK_S + k)[None, :], y,
             mask=(first < S)[None, :] & (cols[:, None] >= 0))
    if pid == 0:
        tl.store(Fac + bh * DV_PAD + cols, pow2(-c))


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """SMs of a CUDA device (asked once: every attention call's Q launch sizes its grid by it); 1
    in the interpreter (a persistent grid of a few programs there)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=32)
def _sign_hadamard(dp: int, d: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The ±1 Hadamard matrix of order ``dp``, zero-padded to ``d``, built once per device: a
    host-to-device copy on every call would cost time and cannot be captured in a CUDA graph.
    Shared between calls: read it, never write it."""
    hm = torch.zeros(d, d, device=device, dtype=dtype)
    hm[:dp, :dp] = torch.sign(hadamard_matrix(dp, device=device))
    return hm


class PrePass:
    """Launches of the row (Q, K) and V pre-pass kernels for one attention call."""

    def __init__(self, q, k, v, recipe, key_alive, mean=None, launch: PrepassLaunch = PREPASS_LAUNCH):
        self.launch = launch
        self.q, self.k, self.v, self.recipe = q, k, v, recipe
        self.b, self.h, self.sq, self.d_in = q.shape
        self.sk, self.dv = k.shape[-2], v.shape[-1]
        self.dp = dp = qk_padded_dim(self.d_in, recipe)
        self.dev = dev = q.device
        self.key_alive = key_alive
        self.alive = key_alive.to(torch.int8).contiguous() if key_alive is not None else \
            torch.empty(1, 1, dtype=torch.int8, device=dev)
        self.none = torch.empty(1, 1, device=dev)
        self.d = next_pow2(dp, floor=32 if recipe.qk_format is Format.MXFP4 else 16)
        if recipe.hadamard:  # bf16 for the bf16 MMAs (half the bytes each program reads), fp32 otherwise
            self.hm32 = _sign_hadamard(dp, self.d, dev, torch.float32)
            self.hm = _sign_hadamard(dp, self.d, dev, torch.bfloat16)
        else:
            self.hm = self.hm32 = torch.empty(1, device=dev)
        self.mean = self.none
        if recipe.smooth_k:  # (given by a caller that also needs it: the LSE's shift)
            self.mean = k_smoothing_mean(k, key_alive) if mean is None else mean

    @staticmethod
    def rotation_parts(x, smooth: bool) -> int:
        """bf16 parts that hold the rotated rows exactly: the input's own precision (bf16: 8
        significant bits, fp16: 11), or fp32 (three parts) once the smoothing mean is subtracted."""
        if smooth:
            return 3
        return {torch.bfloat16: 1, torch.float16: 2}.get(x.dtype, 3)

    def rows(self, x, s, is_k, out_mode, out, fac=None, tscale=None, quad=False):
        """``tscale``: the heads' NVFP4 tensor scales (:meth:`tensor_scales`), for OUT 0 / TILE_ROWS;
        ``quad``: K̂'s rows in the quad key order (E2M1_PACKED)."""
        rule, fmt = self.recipe.scale_rule, self.recipe.qk_format
        if tscale is not None:
            fac = tscale
        mean = self.mean if is_k else self.none
        # FP8_TILE: one program per key tile of the attention loop (as many rows per thread as
        # BLOCK_S rows with 4 warps)
        per_tile = out_mode in (FP8_TILE, FP8_TILE_ORDERED)
        block_s, warps = (KEY_TILE, self.launch.tile_warps) if per_tile else (self.launch.block_s, self.launch.row_warps)
        rows_written = -(-s // KEY_TILE) * KEY_TILE if out_mode == TILE_ROWS else s  # TILE_ROWS: zero padding too
        blocks = triton.cdiv(rows_written, block_s)
        per_program = min(self.launch.blocks_per_program, blocks) if self.recipe.hadamard else 1
        per_sm = self.launch.tile_programs_per_sm if per_tile else self.launch.q8_programs_per_sm if out_mode == FP8_ROW else None
        stages = self.launch.tile_stages if per_tile else self.launch.q8_stages if out_mode == FP8_ROW else self.launch.row_stages
        if per_sm:  # persistent: a few programs per SM stride over all heads' blocks
            grid = (min(blocks * self.b * self.h, per_sm * multiprocessors(self.dev)), 1)
        else:
            grid = (triton.cdiv(blocks, per_program), self.b * self.h)
        hm = self.hm if self.recipe.hadamard and self.dev.type == "cuda" else self.hm32
        _prepass_rows[grid](
            x, self.alive, mean, hm, out, fac if fac is not None else self.none,
            self.h, s, self.d_in, self.dp ** -0.5 if self.recipe.hadamard else 1.0, blocks, self.b * self.h,
            *x.stride(),
            self.alive.stride(0), self.alive.stride(1),
            mean.stride(0), mean.stride(1),
            *out.stride()[:3],
            HAS_ALIVE=is_k and self.key_alive is not None, SMOOTH=mean.dim() == 3, ROTATE=self.recipe.hadamard,
            # fp32-accurate rotation on tensor cores on the GPU (ieee fp32 dots spill at D=128 and
            # are far slower); exact fp32 in the interpreter
            ROT_PRECISION="bf16" if self.dev.type == "cuda" else "ieee",
            ROT_PARTS=self.rotation_parts(x, smooth=mean.dim() == 3),
            FMT=FMT_CODE[fmt].value, QB=fmt.block if fmt and fmt.fp4 else 32, OCP=rule is ScaleRule.OCP, QMAX=rule.qmax,
            D=self.d, BLOCK_S=block_s, OUT=tl.constexpr(out_mode).value, BLOCKS_PER_PROGRAM=per_program, PERSISTENT=bool(per_sm),
            TSCALE=tscale is not None, HW_E4M3=self.dev.type == "cuda", QUAD=quad, num_warps=warps,
            num_stages=fitting_stages(self.dev, stages, ROW_SHARED_MEMORY),  # (1 on ~100 KB GPUs)
        )

    def values(self, out_mode, out, amax=None, fac=None, tscale=None, key_order=True):
        """V's launch; ``key_order`` (FP8_HEAD): V̂ᵀ's tokens in the e4m3 loop's P̂ operand order, else in order."""
        rule, fmt, dv = self.recipe.scale_rule, self.recipe.pv_format, self.v.shape[-1]
        if tscale is not None:
            fac = tscale
        transposed = out_mode in (FP8_AMAX, FP8_HEAD, E2M1_PACKED)  # (B, H, Dv, S_pad) outputs
        block_s = KEY_TILE if out_mode != WORK else self.launch.block_s  # whole key tiles unless WORK
        dv_pad = out.shape[-2] if transposed else next_pow2(dv)
        # the tensor-core transposition: exact for bf16/fp16 V on the GPU, fp32 (IEEE) in the interpreter
        gpu = self.dev.type == "cuda"
        mma_t = out_mode == FP8_HEAD and (
            not gpu or self.v.dtype in (torch.bfloat16, torch.float16))
        chunk = min(self.launch.v_channels_mma if mma_t else self.launch.v_channels, dv_pad) if transposed else dv_pad
        pi = key_order_matrix(self.dev, self.v.dtype if gpu else torch.float32, in_order=not key_order) if mma_t \
            else self.none
        tiles = self.launch.v_tiles_mma if mma_t else self.launch.v_tiles_amax if out_mode == FP8_AMAX else 1
        _prepass_v[(triton.cdiv(triton.cdiv(self.sk, block_s), tiles), self.b * self.h, dv_pad // chunk)](
            self.v, self.alive, out, amax if amax is not None else self.none, fac if fac is not None else self.none,
            pi,
            self.h, self.sk, dv,
            *self.v.stride(),
            self.alive.stride(0), self.alive.stride(1),
            *((out.stride(0), out.stride(1), 1, out.stride(2)) if transposed else (*out.stride()[:3], 1)),
            HAS_ALIVE=self.key_alive is not None, FMT=FMT_CODE[fmt].value, QB=fmt.block if fmt and fmt.fp4 else 32,
            OCP=rule is ScaleRule.OCP, QMAX=rule.qmax, DV_PAD=dv_pad, BLOCK_DV=chunk,
            BLOCK_S=block_s, OUT=tl.constexpr(out_mode).value, num_warps=self.launch.v_warps,
            # (exact for V's own precision only: bf16 or fp16, at most 11 significant bits)
            MMA_T=mma_t, IEEE=not gpu, TILES=tiles, num_stages=fitting_stages(self.dev, self.launch.v_stages, V_SHARED_MEMORY),
            TSCALE=tscale is not None, HW_E4M3=gpu, KEY_ORDER=key_order,
        )

    def tensor_scales(self):
        """The NVFP4 tensor scales (:func:`fp4video.formats.nvfp4_tensor_scale`) of Q, K and V, one
        per head as (B·H, 2) fp32 rows (g, 1/g), each None where the tensor is not NVFP4 or the
        recipe has no tensor scale. Q's and K's maxima are those of the rows as quantized (smoothed,
        rotated: one extra read of each, HEAD_AMAX); V's of its live keys (FP8_AMAX's channel maxima)."""
        r = self.recipe
        if not r.tensor_scale:
            return None, None, None

        def pair(amax):
            g = nvfp4_tensor_scale(amax.float().reshape(-1))
            return torch.stack([g, 1.0 / g], dim=-1).contiguous()

        ts_q = ts_k = ts_v = None
        if r.qk_format is Format.NVFP4:
            dummy = torch.empty(1, 1, 1, device=self.dev)
            amax_q = torch.zeros(self.b * self.h, device=self.dev)
            amax_k = torch.zeros(self.b * self.h, device=self.dev)
            self.rows(self.q, self.sq, False, HEAD_AMAX, dummy, fac=amax_q)
            self.rows(self.k, self.sk, True, HEAD_AMAX, dummy, fac=amax_k)
            ts_q, ts_k = pair(amax_q), pair(amax_k)
        if r.pv_format is Format.NVFP4:  # V's channel maxima over its live keys (FP8_AMAX's read)
            dvp = next_pow2(self.dv, floor=32)
            amax = torch.zeros(self.b, self.h, dvp, device=self.dev, dtype=torch.int32)
            bmin = torch.empty(self.b, self.h, dvp, device=self.dev, dtype=torch.int32)
            self.values(FP8_AMAX, torch.empty(1, 1, dvp, 1, device=self.dev), amax=amax, fac=bmin)
            ts_v = pair(amax.view(torch.float32).amax(dim=-1))
        return ts_q, ts_k, ts_v

    def run(self, work_dtype):
        if Format.E4M3 in (self.recipe.qk_format, self.recipe.pv_format):
            raise ValueError(f"{self.recipe.name}: E4M3 (FP8) operands come from prepass_fp8 (the e4m3 loop) or, with "
                             "NVFP4 Q/K, prepass_tiles (the NVFP4 loop), not from the work-dtype pre-pass")
        b, h, dev = self.b, self.h, self.dev
        q_hat = torch.empty(b, h, self.sq, self.d, device=dev, dtype=work_dtype)
        k_hat = torch.empty(b, h, self.sk, self.d, device=dev, dtype=work_dtype)
        v_hat = torch.empty(b, h, self.sk, self.dv, device=dev, dtype=work_dtype)
        ts_q, ts_k, ts_v = self.tensor_scales()
        self.rows(self.q, self.sq, False, WORK, q_hat, tscale=ts_q)
        self.rows(self.k, self.sk, True, WORK, k_hat, tscale=ts_k)
        self.values(WORK, v_hat, tscale=ts_v)
        return WorkOperands(q_hat, k_hat, v_hat)

    def run_tiles(self, work_dtype):
        """:meth:`run` with K̂ and V̂ in tile key order (:func:`tile_key_position`), (B, H, Sk_pad, ·)
        with zero rows up to whole key tiles: what the NVFP4 loops read (TMA copies whole tiles)."""
        b, h, dev = self.b, self.h, self.dev
        sk_pad = -(-self.sk // KEY_TILE) * KEY_TILE
        q_hat = torch.empty(b, h, self.sq, self.d, device=dev, dtype=work_dtype)
        k_hat = torch.empty(b, h, sk_pad, self.d, device=dev, dtype=work_dtype)
        v_hat = torch.empty(b, h, sk_pad, self.dv, device=dev, dtype=work_dtype)
        ts_q, ts_k, ts_v = self.tensor_scales()
        self.rows(self.q, self.sq, False, WORK, q_hat, tscale=ts_q)
        self.rows(self.k, self.sk, True, TILE_ROWS, k_hat, tscale=ts_k)
        amax = self.channel_maxima(next_pow2(self.dv)) if self.recipe.pv_format is Format.E4M3 else None
        self.values(TILE_ROWS, v_hat, amax=amax, tscale=ts_v)
        return TileOperands(q_hat, k_hat, v_hat, self.sk)

    def channel_maxima(self, width: int) -> torch.Tensor:
        """Each V channel's largest |v| over the live keys, as fp32 bits (B, H, ``width``) int32
        (FP8_AMAX's read): E4M3 V's channel scales."""
        amax = torch.zeros(self.b, self.h, width, device=self.dev, dtype=torch.int32)
        bmin = torch.empty(self.b, self.h, width, device=self.dev, dtype=torch.int32)
        self.values(FP8_AMAX, torch.empty(1, 1, width, 1, device=self.dev), amax=amax, fac=bmin)
        return amax

    def k_rows(self, width: int, quad: bool) -> torch.Tensor:
        """An empty (B, H, Sk, width) uint8 tensor for K̂'s packed rows; ``quad`` (the quad key order):
        a view of whole 32-key groups' rows, the rows past Sk of the last group reachable by its strides."""
        rows = -(-self.sk // 32) * 32 if quad else self.sk
        return torch.empty(self.b, self.h, rows, width, device=self.dev, dtype=torch.uint8)[:, :, :self.sk]

    def packed_qk(self, quad=False):
        """Q̂ and K̂ packed for the dot_scaled loop: ``(q4, q_scale, k4, k_scale, g, ts_v)``. MXFP4:
        codes (B, H, S, D/2) and E8M0 scales (B, H, S, D/32); NVFP4: rows of codes then E4M3 scale
        bytes (K̂'s padded to :func:`nv_row_bytes`), the scales None. ``g``: the heads' tensor scales
        (g_q, g_k, g_v) (B, H) (ones where the recipe has none); ``ts_v``: V's as
        :meth:`tensor_scales` gives it. ``quad``: K̂'s rows (and scales) in the quad key order (:meth:`k_rows`)."""
        b, h, d, dev, u8 = self.b, self.h, self.d, self.dev, torch.uint8
        ones = torch.ones(b, h, device=dev)
        if self.recipe.qk_format is Format.NVFP4:
            q4 = torch.empty(b, h, self.sq, d // 2 + d // Format.NVFP4.block, device=dev, dtype=u8)
            # K̂'s rows padded to whole 16 bytes (bytes past the scales unused): TMA copies need it
            k4 = self.k_rows(nv_row_bytes(d), quad)
            ts_q, ts_k, ts_v = self.tensor_scales()
            self.rows(self.q, self.sq, False, E2M1_PACKED, q4, tscale=ts_q)
            self.rows(self.k, self.sk, True, E2M1_PACKED, k4, tscale=ts_k, quad=quad)
            g = tuple(ones if ts is None else ts[:, 0].reshape(b, h) for ts in (ts_q, ts_k, ts_v))
            return q4, None, k4, None, g, ts_v
        q4 = torch.empty(b, h, self.sq, d // 2, device=dev, dtype=u8)
        q_scale = torch.empty(b, h, self.sq, d // 32, device=dev, dtype=u8)
        k4, k_scale = self.k_rows(d // 2, quad), self.k_rows(d // 32, quad)
        self.rows(self.q, self.sq, False, E2M1_PACKED, q4, fac=q_scale)
        self.rows(self.k, self.sk, True, E2M1_PACKED, k4, fac=k_scale, quad=quad)
        return q4, q_scale, k4, k_scale, (ones, ones, ones), None

    def run_packed_nv(self, quad=False):
        """NVFP4 Q̂, K̂, V̂ᵀ packed: each row its E2M1 codes, then its E4M3 block-scale bytes (one
        buffer per tensor; K̂'s and V̂ᵀ's rows padded to :func:`nv_row_bytes`), and the heads' tensor
        scales (B, H) fp32 of Q, K and V (ones without ``tensor_scale``): the dequantized value is
        code · scale · g. ``quad``: K̂'s rows in the quad key order (:meth:`k_rows`)."""
        q4, _, k4, _, (g_q, g_k, g_v), ts_v = self.packed_qk(quad)
        sk_pad = -(-self.sk // KEY_TILE) * KEY_TILE
        # V̂ᵀ's rows padded to whole 16 bytes, as K̂'s
        v4t = torch.empty(self.b, self.h, next_pow2(self.dv, floor=32), nv_row_bytes(sk_pad), device=self.dev,
                          dtype=torch.uint8)
        self.values(E2M1_PACKED, v4t, tscale=ts_v)
        return PackedOperands(q4, k4, v4t, g_q=g_q, g_k=g_k, g_v=g_v, quad_order=quad)

    def run_packed_pv8(self):
        """The FP8-P·V methods on the dot_scaled loop: Q̂ and K̂ packed by :meth:`packed_qk` (MXFP4
        codes and E8M0 scales; NVFP4 rows of codes and scale bytes, with the heads' tensor scales),
        V̂ᵀ in E4M3 with its channels' power-of-two factors as :meth:`run_fp8` makes it, its tokens in
        key order as the kernel writes them (the dot_scaled loop's P is in key order); the tensor
        scales ones where MXFP4 has none."""
        q4, q_scale, k4, k_scale, (g_q, g_k, _), _ = self.packed_qk()
        b, h, dev = self.b, self.h, self.dev
        dvp = next_pow2(self.dv, floor=32)
        v8 = torch.empty(b, h, dvp, -(-self.sk // KEY_TILE) * KEY_TILE, device=dev, dtype=torch.float8_e4m3fn)
        v_fac = torch.empty(b, h, dvp, device=dev)
        v_amax = torch.zeros(b, h, dvp, device=dev, dtype=torch.int32)
        v_bmin = torch.full((b, h, dvp), 0x7F800000, device=dev, dtype=torch.int32)
        self.values(FP8_AMAX, v8, amax=v_amax, fac=v_bmin)
        self.values(FP8_HEAD, v8, amax=v_amax, fac=v_fac, key_order=False)
        return PackedOperands(q4, k4, v8, q_scale=q_scale, k_scale=k_scale, v_fac=v_fac, g_q=g_q, g_k=g_k)

    def run_packed(self, quad=False):
        """``quad``: K̂'s rows (and MXFP4 scales) in the quad key order (FP4 P·V only)."""
        if self.recipe.pv_format is Format.E4M3:
            if quad:
                raise ValueError(f"{self.recipe.name}: the quad key order is for FP4 P·V (its P̂ operand's order)")
            return self.run_packed_pv8()
        if self.recipe.qk_format is Format.NVFP4:
            return self.run_packed_nv(quad)
        q4, q_scale, k4, k_scale, _, _ = self.packed_qk(quad)
        dvp = next_pow2(self.dv, floor=32)
        sk_pad = -(-self.sk // KEY_TILE) * KEY_TILE
        v4t = torch.empty(self.b, self.h, dvp, sk_pad // 2, device=self.dev, dtype=torch.uint8)
        v_scale = torch.empty(self.b, self.h, dvp, sk_pad // 32, device=self.dev, dtype=torch.uint8)
        self.values(E2M1_PACKED, v4t, fac=v_scale)
        return PackedOperands(q4, k4, v4t, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, quad_order=quad)

    def run_fp8(self, k_tile_order=False):
        b, h, dev, f8 = self.b, self.h, self.dev, torch.float8_e4m3fn
        dvp = next_pow2(self.dv, floor=32)
        q8 = torch.empty(b, h, self.sq, self.d, device=dev, dtype=f8)
        if k_tile_order:  # in tile key order, padded with zero rows (written by the kernel) to whole key tiles
            k8 = torch.empty(b, h, -(-self.sk // KEY_TILE) * KEY_TILE, self.d, device=dev, dtype=f8)
        else:
            k8 = torch.empty(b, h, self.sk, self.d, device=dev, dtype=f8)
        # transposed, padded with zeros (written by the kernel) to whole key tiles, in the loop's P̂ operand order
        v8 = torch.empty(b, h, dvp, -(-self.sk // KEY_TILE) * KEY_TILE, device=dev, dtype=f8)
        q_fac = torch.empty(b, h, self.sq, device=dev)
        k_fac = torch.empty(b, h, triton.cdiv(self.sk, KEY_TILE), device=dev)
        v_fac = torch.empty(b, h, dvp, device=dev)
        v_amax = torch.zeros(b, h, dvp, device=dev, dtype=torch.int32)
        v_bmin = torch.full((b, h, dvp), 0x7F800000, device=dev, dtype=torch.int32)  # +inf's bits
        self.rows(self.q, self.sq, False, FP8_ROW, q8, fac=q_fac)
        self.rows(self.k, self.sk, True, FP8_TILE_ORDERED if k_tile_order else FP8_TILE, k8, fac=k_fac)
        self.values(FP8_AMAX, v8, amax=v_amax, fac=v_bmin)
        self.values(FP8_HEAD, v8, amax=v_amax, fac=v_fac)
        # binades between each channel's largest and smallest nonzero block maximum (the bits of
        # non-negative floats order as integers; channels without a nonzero block: 0)
        v_span = torch.where(v_bmin < 0x7F800000, (v_amax >> 23) - (v_bmin >> 23), 0)
        return FP8Operands(q8, q_fac, k8, k_fac, v8, v_fac, self.sk, k_tile_order,
                           v_span=None if self.recipe.pv_format is Format.E4M3 else v_span)


def prepass(q, k, v, recipe: AttentionRecipe, key_alive, work_dtype, mean=None, launch=PREPASS_LAUNCH) -> WorkOperands:
    """Q̂, K̂, V̂ for the bf16 loop, in ``work_dtype``. ``key_alive``: (B, Sk) bool or None; ``mean``:
    K's smoothing mean (:func:`.checks.k_smoothing_mean`) where the caller has it."""
    return PrePass(q, k, v, recipe, key_alive, mean, launch).run(work_dtype)


def prepass_tiles(q, k, v, recipe: AttentionRecipe, key_alive, work_dtype, mean=None,
                  launch=PREPASS_LAUNCH) -> TileOperands:
    """:func:`prepass` with K̂ and V̂ in tile key order, padded with zero rows to whole key tiles
    of 128 (B, H, Sk_pad, ·): the NVFP4 loops' operands (:mod:`.loop_nvfp4`)."""
    return PrePass(q, k, v, recipe, key_alive, mean, launch).run_tiles(work_dtype)


def nv_row_bytes(n: int) -> int:
    """Bytes of a packed NVFP4 row of K̂ or V̂ᵀ holding ``n`` values: their ``n / 2`` code bytes and
    ``n / 16`` E4M3 scale bytes, padded to a multiple of 16 (a TMA copy's row stride must be)."""
    return -(-(n // 2 + n // Format.NVFP4.block) // 16) * 16


def prepass_packed(q, k, v, recipe: AttentionRecipe, key_alive, mean=None, launch=PREPASS_LAUNCH,
                   quad_order=False) -> PackedOperands:
    """Q̂, K̂, V̂ as packed E2M1 codes with their block scales, as :class:`.operands.PackedOperands`
    describes per format: MXFP4 and NVFP4 (``nvfp4``, ``sage3``, ``sage3-hpnq``) Q·K, FP4 or FP8
    (``mxattn-pv8``, ``sage3-pv8``) P·V. V is transposed (blocks run along tokens) and padded with
    zero codes to a multiple of 128 tokens. ``quad_order`` (consumer Blackwell's loop, FP4 P·V):
    K̂'s rows, and MXFP4's K scales, in :func:`.key_order.quad_key_order` within each 32 keys."""
    return PrePass(q, k, v, recipe, key_alive, mean, launch).run_packed(quad_order)


def prepass_fp8(q, k, v, recipe: AttentionRecipe, key_alive, k_tile_order: bool = False, mean=None,
                launch=PREPASS_LAUNCH) -> FP8Operands:
    """Q̂, K̂, V̂ as E4M3 for fp8 tensor cores, with power-of-two factors (:class:`.operands.FP8Operands`;
    ``k_tile_order``: K̂'s rows within each tile in the loops' key order, as a TMA box copies them to
    the loop: :func:`.key_order.tile_key_order`). E2M1 × 2^e is exact in e4m3 when the block's
    exponent is within 16 of the row's / key tile's / channel's largest value exponent (see
    :func:`.fp4_math.fp8_shift_from_raw_max`); blocks further below lose low bits (e4m3 subnormals) or flush to
    zero, which is what ``v_span`` lets the call check for V.
    """
    return PrePass(q, k, v, recipe, key_alive, mean, launch).run_fp8(k_tile_order)


#: the pre-pass's jit kernels, by public names: what offline compilation compiles
ROWS_KERNEL = _prepass_rows
V_KERNEL = _prepass_v
