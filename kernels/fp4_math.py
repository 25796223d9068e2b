"""Triton device functions for the FP4 numerics of :mod:`fp4video.formats`, bit for bit.

Every rounding is done with exact operations: exponents read from the fp32 bits, powers of two
built from bits, round-to-nearest-even by the 1.5·2^23 addition, and correctly rounded division
where the reference divides by a non-power-of-two scale (``div_rn``, or in the attention loops
FMA-corrected divisions that tests prove correctly rounded for every fp32 mantissa).
"""

from __future__ import annotations

import triton
import triton.language as tl


#: format codes of the kernels' ``FMT`` constexprs: what an operand is quantized to (none: kept)
FMT_NONE, FMT_MXFP4, FMT_NVFP4, FMT_E4M3 = (tl.constexpr(i) for i in range(4))


@triton.jit
def pow2(e):
    """2^e as fp32 for integer e in [-126, 127], built from the exponent bits (exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp8_shift_from_raw_max(amax, OCP: tl.constexpr, QMAX: tl.constexpr):
    """Exponent c that moves MXFP4-quantized blocks into e4m3, from the largest |x| before quantization.

    E2M1 × power-of-two values have a mantissa of 1 or 1.5, so with E the binade of the largest
    the largest becomes at most 1.5·2^8 = 384 < 448 after scaling by 2^(8 - E); a block whose own
    largest exponent is e stays exact down to its smallest nonzero value 0.5·2^e as long as
    e >= E - 16 (e4m3's smallest subnormal is 2^-9). All-zero blocks get the largest shift.

    A block's largest quantized value is 4 or 6 times its scale 2^e (the rules put amax / 2^e in
    (3.625, 7.25] or [4, 8), which rounds to 4 or 6, saturating), so it lies in binade e + 2; and
    e grows with the block's amax. The largest of many blocks is then in binade e(amax) + 2, with
    amax the largest raw |x| of all of them: the shift needs no quantization (bit for bit equal).
    """
    e = tl.minimum(tl.maximum(mx_block_exponent(amax, OCP, QMAX), -126), 126)
    return tl.where(amax > 0, tl.minimum(tl.maximum(6 - e, -126), 126), 126)


@triton.jit
def exponent_and_mantissa(x):
    """floor(log2 x) and the mantissa in [1, 2) of positive normal fp32 x, from the bits."""
    bits = x.to(tl.int32, bitcast=True)
    e0 = ((bits >> 23) & 0xFF) - 127
    m = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    return e0, m


@triton.jit
def rint(x):
    """Nearest integer, ties to even, for |x| < 2^22: adding 1.5·2^23 leaves no fraction bits."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def round_e2m1_abs(a):
    """Round a >= 0 onto {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to even, saturating at 6."""
    return round_e2m1_at_scale(a, 1.0)


@triton.jit
def round_e2m1_at_scale(p, unit):
    """Round p >= 0 onto the E2M1 grid times the power of two ``unit`` (= 2^e), ties to even,
    saturating at 6·unit: ``round_e2m1_abs(p / unit) * unit`` without the scaling.

    E2M1 has one mantissa bit, so the grid step is half the binade of max(p, unit); adding
    2^22 times that binade's power of two (read from the bits) leaves exactly one fraction bit,
    rounded to nearest even by the fp32 addition, and subtracting it again is exact. The two
    are fused multiply-adds of the binade by ±2^22 (the product is exact, so each rounds once,
    as the plain additions of 2^22·binade would): five operations, no division, no conversion.
    Needs unit >= 2^-126 (a normal number) and max(p, unit) < 2^105 (the magic number must be
    finite): far beyond any activation.
    """
    return tl.minimum(round_e2m1_unsaturated(p, unit), 6.0 * unit)


@triton.jit
def round_e2m1_unsaturated(p, unit):
    """:func:`round_e2m1_at_scale` before its saturation at 6·unit (p above 7·unit rounds to
    8·unit or more): the rounding itself, four operations."""
    binade = (tl.maximum(p, unit).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.fma(binade, -4194304.0, tl.fma(binade, 4194304.0, p))


@triton.jit
def round_e2m1_signed(x, unit):
    """sign(x) · :func:`round_e2m1_at_scale`(|x|, unit) for x of either sign, without taking the
    sign apart and putting it back: x is clamped to ±6·unit first (on the grid; every |x| above
    it rounds to 6·unit after saturation either way), then rounded by adding and subtracting
    M = 1.5·2^22 times the binade of max(|x|, unit). M ± |x| stays in M's binade, whose step is
    the grid's, and M is an even number of steps, so M - |x| rounds to nearest even exactly as
    M + |x| does. Four operations and the clamp's two (the sign's where and the |x| it needs cost
    three more); values that round to zero come out +0."""
    six = 6.0 * unit
    xc = tl.minimum(tl.maximum(x, -six), six)
    binade = (tl.maximum(tl.abs(xc), unit).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.fma(binade, -6291456.0, tl.fma(binade, 6291456.0, xc))


@triton.jit
def f16_round_to_odd(p):
    """p >= 0 (fp32, f16's normal range) rounded to f16's 11 significant bits by truncation with
    the last bit set ("round to odd"): what :func:`round_e2m1_f16x2_odd` starts from, in fp32
    (the CPU interpreter's stand-in for its ``cvt.rz`` and ``or``)."""
    return ((p.to(tl.int32, bitcast=True) & -8192) | 8192).to(tl.float32, bitcast=True)


@triton.jit
def round_e2m1_f16x2_odd(p, unit, six_units, ASM: tl.constexpr):
    """:func:`round_e2m1_at_scale`(p, unit) for fp32 p >= 0 as f16, computed on f16 pairs.

    p is first rounded to f16 *to odd* (truncated, last bit set): an odd value is never a tie of
    a coarser format, and f16 keeps 9 bits more than E2M1, so rounding it again to nearest even
    gives what rounding p once would (Boldo & Melquiond) — except where p is exactly an E2M1
    midpoint, which then rounds up instead of to even (p comes from exp2: a 2^-22 chance, below
    the rate at which the GPU's approximate exp2 already moves p across a midpoint). The rounding
    itself is :func:`round_e2m1_at_scale`'s on f16 pairs with magic 512·binade (binade <= 64:
    needs p < 128 — six_units <= 96); ``unit`` (a power of two, 2^-11 to 16 where the result
    matters) and ``six_units`` = 6·unit as f16. ASM (the GPU): inline PTX on f16 pairs
    (sm_80+); else the same arithmetic in fp32 (bit for bit for unit >= 2^-11)."""
    if ASM:
        asm: tl.constexpr = ("{ .reg .b32 x, b, c; "
                             "cvt.rz.f16x2.f32 x, $2, $1; or.b32 x, x, 0x00010001; "
                             "min.f16x2 x, x, $4; max.f16x2 b, x, $3; and.b32 b, b, 0x7C007C00; "
                             "mov.b32 c, 0x60006000; fma.rn.f16x2 x, b, c, x; "
                             "mov.b32 c, 0xE000E000; fma.rn.f16x2 $0, b, c, x; }")
        return tl.inline_asm_elementwise(asm, "=r,r,r,r,r", [p, tl.broadcast_to(unit, p.shape),
                                                             tl.broadcast_to(six_units, p.shape)],
                                         dtype=tl.float16, is_pure=True, pack=2)
    else:
        return round_e2m1_at_scale(f16_round_to_odd(p), unit.to(tl.float32)).to(tl.float16)


@triton.jit
def e2m1_times_scale(x, scale, OUT_DTYPE: tl.constexpr, PACKED: tl.constexpr):
    """round_e2m1(x) · scale as ``OUT_DTYPE`` (bf16, fp16 or fp32): x >= 0 (fp32) in units of the
    E4M3 block scale ``scale`` (fp32, broadcastable to x). The product of an E2M1 value (two
    significant bits, at most 6) and an E4M3 value (four bits, 2^-9 to 448) is exact in both
    16-bit formats, so this equals ``(round_e2m1_abs(x) * scale).to(OUT_DTYPE)`` bit for bit.

    PACKED (the GPU; no inline PTX in the interpreter): x is rounded in fp32 but converted before
    its saturation and scaling, which then run on pairs of 16-bit values — ``min`` and ``fma``
    on ``.bf16x2`` / ``.f16x2`` registers (sm_80+): two elements an instruction, where the same two
    steps in fp32 take one instruction each element."""
    if PACKED and OUT_DTYPE != tl.float32:
        q = round_e2m1_unsaturated(x, 1.0).to(OUT_DTYPE)  # exact: E2M1 grid values (x < 9: at most 8)
        s = tl.broadcast_to(scale.to(OUT_DTYPE), q.shape)  # exact: E4M3 values
        if OUT_DTYPE == tl.bfloat16:
            asm: tl.constexpr = ("{ .reg .b32 six, nz; mov.b32 six, 0x40C040C0; mov.b32 nz, 0x80008000; "
                                 "min.bf16x2 $0, $1, six; fma.rn.bf16x2 $0, $0, $2, nz; }")
        else:
            asm: tl.constexpr = ("{ .reg .b32 six, nz; mov.b32 six, 0x46004600; mov.b32 nz, 0x80008000; "
                                 "min.f16x2 $0, $1, six; fma.rn.f16x2 $0, $0, $2, nz; }")
        return tl.inline_asm_elementwise(asm, "=r,r,r", [q, s], dtype=q.dtype, is_pure=True, pack=2)
    else:
        return (round_e2m1_at_scale(x, 1.0) * scale).to(OUT_DTYPE)


@triton.jit
def round_e4m3_abs(x):
    """Round x >= 0 onto E4M3 (subnormals from 2^-9), ties to even, saturating at 448."""
    e0, _ = exponent_and_mantissa(tl.maximum(x, 1e-30))
    e0 = tl.minimum(tl.maximum(e0, -6), 9)
    return tl.minimum(rint(x * pow2(3 - e0)) * pow2(e0 - 3), 448.0)


@triton.jit
def e4m3_pow2_shift(amax):
    """The shift c of :func:`fp4video.formats.e4m3_pow2_quantize_dequantize` for a group whose
    largest magnitude is ``amax``: ``7 − ⌊log2 amax⌋`` from the exponent bits, at most 126 (also
    for amax = 0, which any shift leaves zero); normal amax only (subnormal groups get 126)."""
    e0 = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    return tl.where(amax > 0, tl.minimum(7 - e0, 126), 126)


@triton.jit
def round_e4m3_signed(x, HW: tl.constexpr):
    """x rounded onto E4M3 (ties to even, saturating at ±448) as ``float8e4nv``. HW (the GPU,
    sm_89+): the hardware conversion (``cvt.rn.satfinite``); else :func:`round_e4m3_abs` in fp32
    (the interpreter's fp8 conversion is not that rounding), then an exact conversion."""
    if HW:
        return x.to(tl.float8e4nv)
    else:
        r = round_e4m3_abs(tl.abs(x))
        return tl.where(x < 0, -r, r).to(tl.float8e4nv)


@triton.jit
def e4m3_p_shift(top, EXP_FLOOR: tl.constexpr):
    """The FP8-P·V methods' shift of P̃ for one row and tile: k = 7 - ⌊log2 top⌋ (``top``: the
    tile's largest P̃ of the row), so that P̃ · 2^k's largest value lies in [128, 256); the exponent
    read from the bits, at least EXP_FLOOR (a tile whose top is 0 or below 2^EXP_FLOOR)."""
    e_top = tl.where(top > 0, ((top.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EXP_FLOOR)
    return 7 - tl.maximum(e_top, EXP_FLOOR)


@triton.jit
def mx_block_exponent(amax, OCP: tl.constexpr, QMAX: tl.constexpr):
    """E8M0 exponent of a block with maximum ``amax > 0``: the OCP rule floor(log2 amax) - 2, or
    the smallest e with amax <= QMAX · 2^e (UOS: QMAX = 7.25), exactly, from the bits.

    With QMAX / 4 = 2^s · (1 + f*) (f* its 23 mantissa bits as an integer), the ceiling rule is
    floor(log2 amax) - 2 - s, plus one when amax's mantissa bits exceed f*: adding 2^23 - 1 - f*
    to amax's bits carries into the exponent field exactly then. Two integer operations, as
    cheap as the OCP rule (this sits on the attention loop's critical path, once per P block).
    """
    bits = amax.to(tl.int32, bitcast=True)  # amax >= 0: no sign bit
    if OCP:
        return (bits >> 23) - 129
    else:
        qbits = tl.full([], QMAX * 0.25, tl.float32).to(tl.int32, bitcast=True)
        return ((bits + (0x7FFFFF - (qbits & 0x7FFFFF))) >> 23) - 129 - ((qbits >> 23) - 127)


@triton.jit
def e2m1_magnitude_codes(q):
    """3-bit E2M1 magnitude codes of grid values q >= 0 (0, 0.5, …, 6).

    From 1 up, the code is the fp32 exponent and first mantissa bit: (bits >> 22) - 252.
    """
    return tl.where(q >= 1.0, (q.to(tl.int32, bitcast=True) >> 22) - 252, (q * 2.0).to(tl.int32))


@triton.jit
def e2m1_codes(q, negative):
    """4-bit E2M1 codes of grid values q >= 0, with the sign bit where ``negative`` (and q > 0)."""
    mag = e2m1_magnitude_codes(q)
    return tl.where(negative & (q > 0), mag | 8, mag)


@triton.jit
def pack_nibbles(codes, ROWS: tl.constexpr, COLS: tl.constexpr):
    """[ROWS, COLS] codes -> [ROWS, COLS // 2] uint8, element 2i in the low nibble."""
    lo, hi = tl.split(tl.reshape(codes, (ROWS, COLS // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def mx_pack_rows(x, ROWS: tl.constexpr, COLS: tl.constexpr, QB: tl.constexpr, OCP: tl.constexpr,
                 QMAX: tl.constexpr):
    """MXFP4-quantize ``x`` ([ROWS, COLS] fp32) in blocks of QB along the last axis, as packed
    E2M1 codes ([ROWS, COLS // 2] uint8) and E8M0 scales ([ROWS, COLS // QB] uint8): the same
    values as ``fake_quant_rows(x, .., FMT=FMT_MXFP4, SIGNED=True)``, in the storage ``tl.dot_scaled`` takes."""
    xb = tl.reshape(x, (ROWS, COLS // QB, QB))
    a = tl.abs(xb)
    amax = tl.max(a, axis=2)
    e = tl.where(amax > 0, tl.minimum(tl.maximum(mx_block_exponent(amax, OCP, QMAX), -126), 126), 0)
    q = round_e2m1_at_scale(a, pow2(e)[:, :, None]) * pow2(-e)[:, :, None]  # grid values, exact
    codes = tl.reshape(e2m1_codes(q, xb < 0), (ROWS, COLS))
    return pack_nibbles(codes, ROWS, COLS), (e + 127).to(tl.uint8)


#: :func:`e2m1_pack_hw`'s PTX: four (lo, hi) pairs ($1-$4, $5-$8) to four bytes of $0, the first pair
#: in the lowest byte (``cvt.rn.satfinite.e2m1x2.f32 d, a, b`` puts a in the upper nibble)
E2M1_PACK_ASM = tl.constexpr("{ .reg .b8 c0, c1, c2, c3; "
                             "cvt.rn.satfinite.e2m1x2.f32 c0, $5, $1; cvt.rn.satfinite.e2m1x2.f32 c1, $6, $2; "
                             "cvt.rn.satfinite.e2m1x2.f32 c2, $7, $3; cvt.rn.satfinite.e2m1x2.f32 c3, $8, $4; "
                             "mov.b32 $0, {c0, c1, c2, c3}; }")
#: :func:`e2m1_pair_sums_hw`'s PTX: the four bytes of $2 to four f16 sums, in $0 (bytes 0, 1) and $1
E2M1_PAIR_SUMS_ASM = tl.constexpr(
    "{ .reg .b8 c0, c1, c2, c3; .reg .b32 h0, h1, h2, h3; .reg .f16 a0, b0, a1, b1, a2, b2, a3, b3; "
    ".reg .f16 s0, s1, s2, s3; mov.b32 {c0, c1, c2, c3}, $2; "
    "cvt.rn.f16x2.e2m1x2 h0, c0; cvt.rn.f16x2.e2m1x2 h1, c1; cvt.rn.f16x2.e2m1x2 h2, c2; cvt.rn.f16x2.e2m1x2 h3, c3; "
    "mov.b32 {a0, b0}, h0; mov.b32 {a1, b1}, h1; mov.b32 {a2, b2}, h2; mov.b32 {a3, b3}, h3; "
    "add.f16 s0, a0, b0; add.f16 s1, a1, b1; add.f16 s2, a2, b2; add.f16 s3, a3, b3; "
    "mov.b32 $0, {s0, s1}; mov.b32 $1, {s2, s3}; }")


@triton.jit
def e2m1_pack_hw(lo, hi):
    """E2M1 codes of ``lo`` and ``hi`` (fp32 >= 0, in units of the block scale) packed in one byte
    per pair, ``lo`` in the low nibble, by Blackwell's conversion (``cvt.rn.satfinite.e2m1x2.f32``,
    sm_100+ only; the value of its first source goes to the upper nibble): round to nearest even,
    saturating at 6 — :func:`round_e2m1_at_scale` at unit 1 and :func:`e2m1_magnitude_codes`, bit
    for bit, one conversion for each pair."""
    return tl.inline_asm_elementwise(E2M1_PACK_ASM, "=r,r,r,r,r,r,r,r,r", [lo, hi], dtype=tl.uint8, is_pure=True,
                                     pack=4)


@triton.jit
def e2m1_pair_sums_hw(packed):
    """The sum of each byte's two E2M1 values (:func:`e2m1_pack_hw`'s output) as fp16, exact (grid
    values up to 6), by Blackwell's conversion back (``cvt.rn.f16x2.e2m1x2``, sm_100+)."""
    return tl.inline_asm_elementwise(E2M1_PAIR_SUMS_ASM, "=r,=r,r", [packed], dtype=tl.float16, is_pure=True, pack=4)


#: E2M1's magnitudes doubled (0, 1, 2, 3, 4, 6, 8, 12: integers), a byte each, as ``prmt`` looks them
#: up: magnitude code c (0-7) selects byte c of the pair {E2M1_DOUBLED_HI, E2M1_DOUBLED_LO}
E2M1_DOUBLED_LO, E2M1_DOUBLED_HI = 0x03020100, 0x0C080604


def block_sum_lut_asm(words: int) -> str:
    """The PTX of :func:`e2m1_block_sums_lut` for a block held in ``words`` 32-bit registers (8 codes
    a register, of values >= 0: no sign bit; one output a byte, the inputs after them). Each four
    codes' doubled magnitudes come from one ``prmt``, whose selector nibbles are the codes (a
    register's low 16 bits, then its high 16 bits shifted down) and whose source bytes are
    :data:`E2M1_DOUBLED_LO` / :data:`E2M1_DOUBLED_HI`; the looked-up words are added as integers
    (at most 8 of them: 96 a byte, no carry between bytes), ``dp4a`` adds the four bytes (at most
    384 for 32 codes), and that integer, converted to fp32 and halved (both exact), is the first
    output ($0); the others copy it (unused: the caller keeps the first element)."""
    n = 4 * words
    looked = [f"v{i}" for i in range(2 * words)]
    lines = [f"{{ .reg .b32 lo, hi, t, s, {', '.join(looked)}, {', '.join(f'h{w}' for w in range(words))};",
             f"mov.b32 lo, {E2M1_DOUBLED_LO:#010x}; mov.b32 hi, {E2M1_DOUBLED_HI:#010x};"]
    for w in range(words):
        lines += [f"prmt.b32 v{2 * w}, lo, hi, ${n + w};", f"shr.b32 h{w}, ${n + w}, 16;",
                  f"prmt.b32 v{2 * w + 1}, lo, hi, h{w};"]
    lines += [f"add.u32 t, {looked[0]}, {looked[1]};"] + [f"add.u32 t, t, {v};" for v in looked[2:]]
    lines += ["dp4a.u32.u32 s, t, 0x01010101, 0;", "cvt.rn.f32.u32 $0, s;", "mul.f32 $0, $0, 0f3F000000;"]
    lines += [f"mov.b32 ${i}, $0;" for i in range(1, n)]
    return " ".join(lines) + " }"


#: :func:`e2m1_block_sums_lut`'s PTX for blocks of 16 and 32 codes
BLOCK_SUM_LUT_ASM_16 = tl.constexpr(block_sum_lut_asm(2))
BLOCK_SUM_LUT_ASM_32 = tl.constexpr(block_sum_lut_asm(4))
#: ``fma.rn.f32x2`` / ``mul.rn.f32x2`` on two elements: the operands' pairs as 64-bit registers, the
#: first element in the low half (as PTX's vector moves place them)
FMA_F32X2_ASM = tl.constexpr("{ .reg .b64 a, b, c, d; mov.b64 a, {$2, $3}; mov.b64 b, {$4, $5}; "
                             "mov.b64 c, {$6, $7}; fma.rn.f32x2 d, a, b, c; mov.b64 {$0, $1}, d; }")
MUL_F32X2_ASM = tl.constexpr("{ .reg .b64 a, b, d; mov.b64 a, {$2, $3}; mov.b64 b, {$4, $5}; "
                             "mul.rn.f32x2 d, a, b; mov.b64 {$0, $1}, d; }")


@triton.jit
def _first_of_pairs(x):
    """x[..., 0] of a tensor whose last axis has size 2 (a register pick, no arithmetic)."""
    first, _ = tl.split(x)
    return first


@triton.jit
def e2m1_block_sums_lut(packed, QB: tl.constexpr):
    """The sum of each block of QB (16 or 32) E2M1 values in packed codes (ROWS, COLS // 2)
    (:func:`e2m1_pack_hw`'s output, two codes a byte in key order) as fp32 (ROWS, COLS // QB), exact,
    for codes of values >= 0 (no sign bit: P's), by table look-ups and integer additions
    (:func:`block_sum_lut_asm`): QB // 4 ``prmt`` and QB // 8 shifts, QB // 4 - 1 additions, one
    ``dp4a`` and one conversion a block (Blackwell's conversions back to f16 would take QB // 2
    conversions and as many additions). Instructions of every GPU since sm_61 (Blackwell's loops
    use it; a GPU test runs it). Each block's QB // 2 bytes must lie in one thread, in order (as the
    loops' S tiles hold them: a thread owns whole blocks of a row)."""
    tl.static_assert(QB == 16 or QB == 32, "blocks of 16 or 32 codes")
    if QB == 16:
        sums = tl.inline_asm_elementwise(BLOCK_SUM_LUT_ASM_16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [packed],
                                         dtype=tl.float32, is_pure=True, pack=8)
    else:
        sums = tl.inline_asm_elementwise(BLOCK_SUM_LUT_ASM_32,
                                         "=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [packed],
                                         dtype=tl.float32, is_pure=True, pack=16)
    return _block_firsts(sums, QB)


@triton.jit
def _block_firsts(sums, QB: tl.constexpr):
    """The first of each block's QB // 2 values (ROWS, COLS // 2) — a block-sum asm's $0 — as (ROWS,
    COLS // QB): halves taken off the block's axis, no arithmetic."""
    ROWS: tl.constexpr = sums.shape[0]
    NB: tl.constexpr = 2 * sums.shape[1] // QB
    if QB == 16:
        x = tl.reshape(sums, (ROWS, NB, 4, 2))
    else:
        x = tl.reshape(_first_of_pairs(tl.reshape(sums, (ROWS, NB, 8, 2))), (ROWS, NB, 4, 2))
    x = tl.reshape(_first_of_pairs(x), (ROWS, NB, 2, 2))
    return _first_of_pairs(_first_of_pairs(x))


@triton.jit
def fma_f32x2(a, b, c):
    """a · b + c rounded once (IEEE fma: ``tl.fma``'s value), two elements an instruction:
    ``fma.rn.f32x2`` of datacenter Blackwell (sm_10x; sm_120 splits it into two FFMA)."""
    return tl.inline_asm_elementwise(FMA_F32X2_ASM, "=r,=r,r,r,r,r,r,r", [a, b, c], dtype=tl.float32, is_pure=True,
                                     pack=2)


@triton.jit
def fma_lanes(a, b, c, F32X2: tl.constexpr):
    """``tl.fma(a, b, c)`` with ``b`` and ``c`` broadcast to ``a``'s shape; F32X2 (datacenter
    Blackwell): two elements an instruction (:func:`fma_f32x2`), the same values."""
    if F32X2:
        return fma_f32x2(a, tl.broadcast_to(b, a.shape), tl.broadcast_to(c, a.shape))
    return tl.fma(a, b, c)


@triton.jit
def sub_lanes(a, c, F32X2: tl.constexpr):
    """``a - c`` (rounded once) with ``c`` broadcast to ``a``'s shape; F32X2 (datacenter Blackwell):
    as :func:`fma_f32x2` (a · 1 - c: the same value), two elements an instruction."""
    if F32X2:
        return fma_f32x2(a, tl.full(a.shape, 1.0, tl.float32), tl.broadcast_to(-c, a.shape))
    return a - c


@triton.jit
def mul_f32x2(a, b):
    """a · b rounded to nearest even (``*``'s value), two elements an instruction: ``mul.rn.f32x2`` of
    datacenter Blackwell (sm_10x)."""
    return tl.inline_asm_elementwise(MUL_F32X2_ASM, "=r,=r,r,r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=2)


@triton.jit
def e4m3_bits(s):
    """The E4M3 (e4m3fn) byte of ``s`` >= 0, an E4M3 value (0, subnormals 2^-9·{1..7}, normals up to
    448), from its fp32 bits: exponent + 7 and the top three mantissa bits; subnormals s · 2^9. The
    scale bytes of NVFP4 blocks, written without the fp8 conversion (the interpreter's rounds
    differently)."""
    bits = s.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    normal = ((e + 7) << 3) | ((bits >> 20) & 7)
    return tl.where(s >= 0.015625, normal, (s * 512.0).to(tl.int32)).to(tl.uint8)


@triton.jit
def nv_pack_rows(x, ROWS: tl.constexpr, COLS: tl.constexpr, QB: tl.constexpr):
    """NVFP4-quantize ``x`` ([ROWS, COLS] fp32) in blocks of QB (16) along the last axis, as packed
    E2M1 codes ([ROWS, COLS // 2] uint8) and E4M3 scale bytes ([ROWS, COLS // QB] uint8): the values
    of ``fake_quant_rows(x, .., FMT=FMT_NVFP4, SIGNED=True)`` (a block whose scale rounds to 0 becomes 0),
    in the storage Blackwell's ``kind::mxf4nvf4`` MMAs take."""
    xb = tl.reshape(x, (ROWS, COLS // QB, QB))
    a = tl.abs(xb)
    s = nvfp4_block_scale(tl.max(a, axis=2), False)
    live = s > 0
    s_safe = tl.where(live, s, 1.0)
    q = round_e2m1_abs(tl.math.div_rn(a, s_safe[:, :, None] + tl.zeros_like(a)))  # grid values 0 … 6
    q = tl.where(live[:, :, None], q, 0.0)
    codes = tl.reshape(e2m1_codes(q, xb < 0), (ROWS, COLS))
    return pack_nibbles(codes, ROWS, COLS), e4m3_bits(s)


@triton.jit
def div_const_rn(a, D: tl.constexpr, RCP_D: tl.constexpr):
    """rn(a / D) for fp32 a >= 0 and a constant D, without a division (a correctly rounded
    ``div_rn`` is a longer sequence with a slow-path branch): q0 = rn(a · rn(1/D)) is within an
    ulp, its residual a - D·q0 is exact as an FMA, and one more FMA rounds correctly — for the
    divisors used here (6 and 448·6), as ``tests/test_fp4_math.py`` checks for every fp32 mantissa
    (results below 2^-126 may differ: far below where this is used). ``RCP_D``: rn(1/D)."""
    q0 = a * RCP_D
    return tl.fma(tl.fma(q0, -D, a), RCP_D, q0)


@triton.jit
def div6_rn(a):
    """rn(a / 6) (:func:`div_const_rn`)."""
    return div_const_rn(a, 6.0, 0.16666667163372040)


@triton.jit
def approx_recip(x, FAST: tl.constexpr):
    """1/x within 2 ulp for normal x > 0: ``rcp.approx.ftz`` on the GPU (FAST: one MUFU, without
    the range fix-ups of the fp32 division), the fp32 division in the CPU interpreter (no inline
    PTX there). The callers correct it with FMAs to the correctly rounded result."""
    if FAST:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return 1.0 / x


@triton.jit
def const_div_rn(C: tl.constexpr, b, FAST: tl.constexpr):
    """rn(C / b) for normal b > 0 and the constant C = 448·6, without a division: one Newton step
    from the approximate reciprocal (:func:`approx_recip`), then Markstein's correction of
    q0 = rn(C · 1/b). Correctly rounded for every fp32 mantissa of b from reciprocal start points
    up to ±4 ulp off (the GPU's estimate is within 2), checked in ``tests/test_fp4_math.py``."""
    return const_div_from(C, b, approx_recip(b, FAST))


@triton.jit
def const_div_from(C: tl.constexpr, b, y0):
    """:func:`const_div_rn` from the reciprocal estimate ``y0``."""
    y = newton_recip(b, y0)
    q0 = C * y
    return tl.fma(tl.fma(-b, q0, C), y, q0)


@triton.jit
def recip_rn_few_bits(s, FAST: tl.constexpr):
    """rn(1 / s) for s > 0 with at most 4 significant bits (an E4M3 value): one Newton step from
    the approximate reciprocal (:func:`approx_recip`, within 2 ulp) rounds correctly, since 1/s
    is then far from every rounding boundary (checked for every E4M3 value and start points up
    to ±4 ulp off)."""
    return newton_recip(s, approx_recip(s, FAST))


@triton.jit
def newton_recip(s, r0):
    """One Newton step for 1/s from r0: the residual 1 - s·r0 is exact as an FMA."""
    return tl.fma(r0, tl.fma(-s, r0, 1.0), r0)


@triton.jit
def nvfp4_block_scale(amax, HW: tl.constexpr):
    """NVFP4's E4M3 block scale round_e4m3(amax / 6), the division correctly rounded in fp32 (as
    the reference's); 0 for blocks too small for E4M3 (they quantize to 0). HW (the GPU, sm_89+):
    the rounding by the hardware's conversion to E4M3 and back (``cvt.rn.satfinite``, two scales
    per instruction, far shorter than the fp32 arithmetic; the same rounding, ties to even,
    subnormals, saturation at 448 — ``tests/test_fp4_math.py`` compares the two); else in fp32
    arithmetic (:func:`round_e4m3_abs`: the interpreter's fp8 conversion is not that rounding)."""
    if HW:
        return div6_rn(amax).to(tl.float8e4nv).to(tl.float32)
    else:
        return round_e4m3_abs(div6_rn(amax))


@triton.jit
def fake_quant_rows(x, ROWS: tl.constexpr, COLS: tl.constexpr, FMT: tl.constexpr, QB: tl.constexpr,
                    OCP: tl.constexpr, QMAX: tl.constexpr, SIGNED: tl.constexpr):
    """Quantize-dequantize ``x`` ([ROWS, COLS] fp32) in blocks of QB along the last axis.

    FMT_MXFP4: MXFP4 (E8M0 scale, OCP floor rule or ceil(log2(amax / QMAX))); FMT_NVFP4: NVFP4
    (:func:`nvfp4_block_scale`; a block whose scale rounds to 0 becomes 0). All-zero blocks
    stay zero. Exponents are kept in [-126, 126] (the reference allows ±127: only blocks with
    amax below 2^-124 or above 2^126 differ).
    """
    xb = tl.reshape(x, (ROWS, COLS // QB, QB))
    a = tl.abs(xb) if SIGNED else xb
    amax = tl.max(a, axis=2)
    if FMT == FMT_MXFP4:
        e = tl.where(amax > 0, tl.minimum(tl.maximum(mx_block_exponent(amax, OCP, QMAX), -126), 126), 0)
        if SIGNED:  # exact: the grid scales with 2^e
            q = round_e2m1_signed(xb, pow2(e)[:, :, None])
        else:
            q = round_e2m1_at_scale(a, pow2(e)[:, :, None])
    else:
        s = nvfp4_block_scale(amax, False)
        live = s > 0
        s_safe = tl.where(live, s, 1.0)
        q = round_e2m1_abs(tl.math.div_rn(a, s_safe[:, :, None] + tl.zeros_like(a))) * s_safe[:, :, None]
        q = tl.where(live[:, :, None], q, 0.0)
    if SIGNED and FMT != 1:
        q = tl.where(xb < 0, -q, q)
    return tl.reshape(q, (ROWS, COLS))
