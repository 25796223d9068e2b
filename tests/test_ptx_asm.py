"""The inline PTX of the device functions that only Blackwell runs (:func:`.fp4_math.e2m1_pack_hw`,
:func:`.fp4_math.e2m1_pair_sums_hw`, :func:`.fp4_math.fma_f32x2`,
:func:`.fp4_math.mul_f32x2`), run here by a small evaluator of the PTX instructions they use, with
the semantics the PTX ISA gives them (the E2M1 conversion's rounding taken from
:func:`fp4video.formats.round_e2m1`): which operand lands in which register and nibble, and that
the sums take every code once. No GPU here runs these instructions (sm_90 has none of them); the
layout their operands need is checked on the compiled loop (tests/test_offline_compile.py)."""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from fp4video.formats import E2M1_VALUES, round_e2m1  # noqa: E402
from fp4video.kernels import fp4_math  # noqa: E402

#: the asm strings (module constants the jit functions read: ``tl.constexpr``s)
FMA_F32X2_ASM, MUL_F32X2_ASM, E2M1_PACK_ASM, E2M1_PAIR_SUMS_ASM = (
    getattr(fp4_math, name).value for name in ("FMA_F32X2_ASM", "MUL_F32X2_ASM", "E2M1_PACK_ASM",
                                               "E2M1_PAIR_SUMS_ASM"))


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def _bits32(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _f16(bits: int) -> np.float16:
    return np.array([bits & 0xFFFF], dtype=np.uint16).view(np.float16)[0]


def _bits16(x) -> int:
    return int(np.array([x], dtype=np.float16).view(np.uint16)[0])


def _e2m1(nibble: int) -> float:
    return (-1.0 if nibble & 8 else 1.0) * E2M1_VALUES[nibble & 7]


def _e2m1_code(x: float) -> int:
    """The E2M1 code of fp32 ``x`` rounded to nearest even, saturating at ±6 (``.rn.satfinite``)."""
    v = float(round_e2m1(torch.tensor([abs(x)]))[0])
    return (8 if x < 0 else 0) | E2M1_VALUES.index(min(v, E2M1_VALUES[-1]))


def run_ptx(asm: str, operands: dict[int, int]) -> dict[int, int]:
    """Evaluate ``asm`` (one ``{ ... }`` block of the PTX subset below) with ``$k`` bound to 32-bit
    ``operands[k]``; returns every ``$k`` after it (outputs written, inputs as given). Registers hold
    bit patterns; a vector move packs / unpacks its elements least significant first."""
    regs: dict[str, int] = {f"${k}": v for k, v in operands.items()}
    width: dict[str, int] = {}
    body = asm.strip()
    assert body.startswith("{") and body.endswith("}"), asm
    for stmt in filter(None, (s.strip() for s in body[1:-1].split(";"))):
        op, _, args = stmt.partition(" ")
        if op == ".reg":
            kind, names = args.split(" ", 1)
            for name in names.split(","):
                width[name.strip()] = int(kind[2:])
            continue
        dst, *src = [a.strip() for a in re.split(r",(?![^{]*})", args)]
        if op in ("mov.b32", "mov.b64"):
            w = int(op[-2:])
            if src[0].startswith("{"):  # pack
                parts = [p.strip() for p in src[0][1:-1].split(",")]
                size = w // len(parts)
                regs[dst] = sum((regs[p] & ((1 << size) - 1)) << (size * i) for i, p in enumerate(parts))
            elif dst.startswith("{"):  # unpack
                parts = [p.strip() for p in dst[1:-1].split(",")]
                size = w // len(parts)
                for i, p in enumerate(parts):
                    regs[p] = (regs[src[0]] >> (size * i)) & ((1 << size) - 1)
            else:
                regs[dst] = regs[src[0]]
        elif op == "cvt.rn.satfinite.e2m1x2.f32":  # the first source to the upper nibble
            regs[dst] = _e2m1_code(_f32(regs[src[0]])) << 4 | _e2m1_code(_f32(regs[src[1]]))
        elif op == "cvt.rn.f16x2.e2m1x2":  # the byte's low nibble to the low half, its high to the high
            c = regs[src[0]]
            regs[dst] = _bits16(_e2m1(c & 0xF)) | _bits16(_e2m1(c >> 4)) << 16
        elif op in ("add.rn.f16x2", "add.f16x2"):
            a, b = regs[src[0]], regs[src[1]]
            regs[dst] = _bits16(_f16(a) + _f16(b)) | _bits16(_f16(a >> 16) + _f16(b >> 16)) << 16
        elif op in ("add.rn.f16", "add.f16"):
            regs[dst] = _bits16(_f16(regs[src[0]]) + _f16(regs[src[1]]))
        elif op == "cvt.f32.f16":
            regs[dst] = _bits32(float(_f16(regs[src[0]])))
        elif op in ("fma.rn.f32x2", "mul.rn.f32x2"):  # lane by lane; float64 is exact for the test's values
            lanes = []
            for half in (0, 32):
                x = [_f32(regs[s] >> half) for s in src]
                y = x[0] * x[1] + (x[2] if op.startswith("fma") else 0.0)
                lanes.append(_bits32(float(np.float32(y))))
            regs[dst] = lanes[0] | lanes[1] << 32
        else:
            raise NotImplementedError(f"PTX evaluator: {op}")
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$")}


def test_pack_asm_puts_each_pair_in_its_byte_low_value_low():
    """:func:`.fp4_math.e2m1_pack_hw`'s PTX: element i's (lo, hi) — ``$1+i``, ``$5+i`` — becomes byte
    i of ``$0``, lo's code in the low nibble (the order the loops' P̂ operand and the pair sums read),
    for every E2M1 grid value, ties and values past 6."""
    grid = [v for v in E2M1_VALUES] + [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, 0.1, 2.9]
    gen = torch.Generator().manual_seed(3)
    for _ in range(400):
        lo, hi = ([grid[i] for i in torch.randint(0, len(grid), (4,), generator=gen).tolist()] for _ in range(2))
        out = run_ptx(E2M1_PACK_ASM, {**{1 + i: _bits32(v) for i, v in enumerate(lo)},
                                      **{5 + i: _bits32(v) for i, v in enumerate(hi)}})
        want = [_e2m1_code(lo_) | _e2m1_code(hi_) << 4 for lo_, hi_ in zip(lo, hi)]
        assert list(out[0].to_bytes(4, "little")) == want, (lo, hi, hex(out[0]))


def test_pair_sums_asm_adds_the_two_values_of_each_byte():
    """:func:`.fp4_math.e2m1_pair_sums_hw`'s PTX: byte i of ``$2`` gives f16 half i of ``$0:$1``, the
    sum of its two codes' values, for every byte value in every position."""
    for pos in range(4):
        for value in range(256):
            word = value << (8 * pos)
            out = run_ptx(E2M1_PAIR_SUMS_ASM, {2: word})
            halves = [out[0] & 0xFFFF, out[0] >> 16, out[1] & 0xFFFF, out[1] >> 16]
            want = [_e2m1(b & 0xF) + _e2m1(b >> 4) for b in word.to_bytes(4, "little")]
            assert [float(_f16(h)) for h in halves] == want, (pos, value)


def test_f32x2_asm_pairs_each_operand_lane_with_its_own():
    """``fma.rn.f32x2`` / ``mul.rn.f32x2`` as :func:`.fp4_math.fma_f32x2` / :func:`.fp4_math.mul_f32x2`
    issue them: the first element of each operand (``$2``, ``$4``, ``$6``) meets the others' first
    and comes back in ``$0``, the second in ``$1`` (distinct values, exact products and sums)."""
    a, b, c = (2.0, 3.0), (5.0, 7.0), (11.0, 13.0)
    ops = {2: a[0], 3: a[1], 4: b[0], 5: b[1], 6: c[0], 7: c[1]}
    out = run_ptx(FMA_F32X2_ASM, {k: _bits32(v) for k, v in ops.items()})
    assert (_f32(out[0]), _f32(out[1])) == (2.0 * 5.0 + 11.0, 3.0 * 7.0 + 13.0)
    out = run_ptx(MUL_F32X2_ASM, {k: _bits32(v) for k, v in ops.items() if k < 6})
    assert (_f32(out[0]), _f32(out[1])) == (2.0 * 5.0, 3.0 * 7.0)


def test_ptx_evaluator_knows_its_instructions():
    """The evaluator refuses what it does not model, so a changed asm cannot pass by being skipped."""
    with pytest.raises(NotImplementedError):
        run_ptx("{ .reg .b32 x; max.f32 x, $1, $2; }", {1: 0, 2: 0})
