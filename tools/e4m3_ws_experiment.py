#!/usr/bin/env python3
"""The warp-specialized Gluon e4m3 loop (``tools/e4m3_ws_kernel.py``, an experiment)
against the Triton e4m3 TMA loop on the same pre-pass output:

    python tools/e4m3_ws_experiment.py offline [--p-smem] [--in-place] [--ping-pong] [--sync] [--rows 192 --regs 160]
    python tools/e4m3_ws_experiment.py check  [--variants rs rs-inplace ...]     # GPU: bit equality, per row
    python tools/e4m3_ws_experiment.py diag                                        # GPU: how the wrong rows are off
    python tools/e4m3_ws_experiment.py speed  [--seqs 75600] [--variants ...]    # GPU: the loop alone, beside
                                                                                   # cuDNN and FlashAttention-3 FP8
    ncu -k regex:_e4m3_attn_fwd ... python tools/e4m3_ws_experiment.py launch    # one launch each, S = 16,384, H = 16

``offline`` compiles for sm_90 (no GPU) and prints, per partition loop, SASS instructions per element
of S and ptxas's spills. ``check`` compares outputs and LSE with the Triton loop (its default
``fresh_pv`` form, or ``fresh_pv=False`` for the in-place variants) on small shapes: masked, partial
tiles, sharp rows, V outlier channels. ``diag`` prints, per variant, the rows whose output is off by a
scale or whose LSE differs. ``speed`` times the loops at Wan sizes (B = 1, H = 40, D = 128).
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import tempfile

SCALE = 128 ** -0.5
#: the variants measured: P̂ from registers (rs) or through shared memory, fresh or in-place
#: accumulation, ping-pong, buffers
VARIANTS = {"rs": dict(), "rs-inplace": dict(fresh=False), "rs-pp": dict(ping_pong=True),
            "rs-inplace-pp": dict(fresh=False, ping_pong=True), "rs-b4": dict(num_buffers=4),
            "rs-sync": dict(sync=True), "rs-inplace-b2": dict(fresh=False, num_buffers=2),
            "smem": dict(p_smem=True), "smem-inplace": dict(p_smem=True, fresh=False),
            "smem-sync": dict(p_smem=True, sync=True), "smem-pp": dict(p_smem=True, ping_pong=True),
            "smem-inplace-pp": dict(p_smem=True, fresh=False, ping_pong=True),
            "serial": dict(serial=True), "serial-3wg": dict(serial=True, block_m=192, consumer_regs=160),
            "serial-3wg-b4": dict(serial=True, block_m=192, consumer_regs=160, num_buffers=4),
            "serial-3wg-168": dict(serial=True, block_m=192, consumer_regs=168)}


def offline(a) -> int:
    from offline_compile import WAN_480P_INTS, compile_kernel
    from triton.experimental.gluon import language as gl

    from fp4video.kernels.loop_e4m3 import TILE_EXP_FLOOR
    from e4m3_ws_kernel import KERNEL
    from fp4video.kernels.offline import _SASS_SYNTAX, _loops, sass_lines, tool_path

    desc = f"tensordesc<fp8e4nv[128, 128],{gl.NVMMASharedLayout.get_default_for([128, 128], gl.float8e4nv)!r}>"
    ptr = {"Q8": "*fp8e4nv", "QFac": "*fp32", "Kd": desc, "KFac": "*fp32", "Vd": desc, "VFac": "*fp32",
           "KeyMask": "*i8", "Out": "*bf16", "Lse": "*fp32"}
    consts = dict(HAS_MASK=a.mask, OCP=False, QMAX=7.25, PNQ=True, P_E4M3=True, D=128, BLOCK_DV=128, BLOCK_M=a.rows,
                  BLOCK_N=128, NUM_BUF=a.buffers, EXP_FLOOR=TILE_EXP_FLOOR, FRESH=not a.in_place,
                  PING_PONG=a.ping_pong, CONSUMER_REGS=a.regs, P_SMEM=int(a.p_smem), SYNC=a.sync,
                  SERIAL=a.serial)
    kernel = compile_kernel(KERNEL, consts, ptr, dict(WAN_480P_INTS, smb=32760 if a.mask else 1), arch=90,
                            floats=("scale_log2",), gluon=True, num_warps=4, enable_fp_fusion=False)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        for exe in ("ptxas", "ptxas-blackwell"):  # the first that takes this Triton's PTX version (Triton's choice)
            run = subprocess.run([tool_path(exe), "-v", "--gpu-name", "sm_90a", ptx, "-o", ptx + ".o"],
                                 capture_output=True, text=True)
            if run.returncode == 0:
                print(f"{exe}: " + " ".join(ln.strip() for ln in (run.stderr + run.stdout).splitlines()
                                            if "spill" in ln or "Used" in ln))
                break
        lines = sass_lines(kernel, tool_path("nvdisasm"), tmp)
    loops = [(start, end, ops) for start, end, ops in _loops(lines, **_SASS_SYNTAX) if any("GMMA" in op for op in ops)]
    for start, end, ops in loops:  # each consumer's key loop (per thread: 64 elements of S a tile), not loops around them
        if any(start < other < end for other, _, _ in loops):
            continue
        units = collections.Counter()
        for op, c in ops.items():
            units[op.split(".")[0]] += c
        print(f"consumer loop: {sum(ops.values()) / 64:.2f} SASS instructions per element of S; "
              + ", ".join(f"{op} {c}" for op, c in units.most_common(10)))
    return 0


def _inputs(s, g, heads=3, batch=2):
    import torch

    q, k, v = (torch.randn(batch, heads, s, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    q[:, :, :5] *= 8  # sharp rows
    k = k + 0.5
    v[:, :, :, 7] *= 30  # an outlier channel
    return q, k, v


def check(a, diag: bool = False) -> int:
    import torch

    from fp4video import METHODS
    from fp4video.kernels.dispatch import prepare
    from fp4video.kernels.loop_e4m3 import attention_e4m3
    from e4m3_ws_kernel import attention_e4m3_ws

    g = torch.Generator(device="cuda").manual_seed(0)
    cases = [(128, False), (256, False), (1000, False)] if diag else \
        [(1000, False), (300, True), (4096, False), (77, False), (128, False), (2048, True), (5000, False)]
    bad = 0
    for m in a.methods:
        r = METHODS[m]
        for s, masked in cases:
            q, k, v = _inputs(s, g)
            ka = None
            if masked:
                ka = torch.ones(2, s, dtype=torch.bool, device="cuda")
                ka[0, s - 37:] = False
                ka[1, :50] = False
            _, t = prepare(q, k, v, r, ka)
            ref = {fp: attention_e4m3(*t, ka, recipe=r, scale=SCALE, out_dtype=q.dtype, dv=128, tma=True, fresh_pv=fp)
                   for fp in (True, False)}
            for name in a.variants:
                kw = VARIANTS[name]
                o0, l0 = ref[kw.get("fresh", True)]
                for rep in range(2):
                    o, lse = attention_e4m3_ws(*t[:-1], ka, recipe=r, scale=SCALE, out_dtype=q.dtype, dv=128, **kw)
                    x, y = o.float().flatten(0, 2), o0.float().flatten(0, 2)
                    cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
                    ratio = (x * y).sum(-1) / (y * y).sum(-1)  # the row's scale against the Triton loop
                    dl = (lse - l0).flatten()
                    same = torch.equal(o, o0) and torch.equal(lse, l0)
                    bad += not same
                    off = ((ratio - 1).abs() > 1e-2) | ~(dl.abs() <= 1e-3)
                    print(f"{m} S={s} mask={masked} {name} run {rep}: bit-equal {same}; finite {o.isfinite().all().item()}; "
                          f"worst-row cosine {cos.min().item():.6f}; rows off (scale or LSE) {off.sum().item()}/{off.numel()}"
                          + (f"; row scales [{ratio.min().item():.4g}, {ratio.max().item():.4g}], LSE differences "
                             f"[{dl.min().item():.3g}, {dl.max().item():.3g}]" if diag or off.any() else ""), flush=True)
    print(f"{bad} runs differ from the Triton loop")
    return 0


def speed(a) -> int:
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fp4video import METHODS
    from fp4video.eval.peers import find_peers
    from fp4video.kernels.dispatch import prepare
    from fp4video.kernels.loop_e4m3 import attention_e4m3
    from e4m3_ws_kernel import attention_e4m3_ws

    def bench(f):
        return triton.testing.do_bench(f, warmup=30, rep=a.rep_ms, return_mode="median")

    fa3 = {p.name: p for p in find_peers()}["FlashAttention-3 FP8 (kernel only)"]
    g = torch.Generator(device="cuda").manual_seed(0)
    for s in a.seqs:
        q, k, v = (torch.randn(1, 40, s, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        k = k + 0.3
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            t_cudnn = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        t_fa3 = bench(lambda: fa3.fn(*prepared)) if fa3.fn is not None and (prepared := fa3.args(q, k, v)) else None
        print(f"S={s}: cuDNN SDPA {t_cudnn:.2f} ms" + (f", FlashAttention-3 FP8 kernel {t_fa3:.2f} ms" if t_fa3 else
                                                       f", FlashAttention-3 FP8: {fa3.missing}"), flush=True)
        for m in a.methods:
            r = METHODS[m]
            _, t = prepare(q, k, v, r, None)
            t_loop = bench(lambda: attention_e4m3(*t, None, recipe=r, scale=SCALE, out_dtype=q.dtype, dv=128, tma=True))
            print(f"  {m}: Triton loop {t_loop:.2f} ms ({t_cudnn / t_loop:.3f}× cuDNN)", flush=True)
            for name in a.variants:
                kw = VARIANTS[name]
                tv = bench(lambda: attention_e4m3_ws(*t[:-1], None, recipe=r, scale=SCALE, out_dtype=q.dtype, dv=128,
                                                     **kw))
                print(f"  {m} {name}: {tv:.2f} ms ({t_cudnn / tv:.3f}× cuDNN, {t_loop / tv:.3f}× the Triton loop"
                      + (f", {t_fa3 / tv:.3f}× FlashAttention-3 FP8's kernel" if t_fa3 else "") + ")", flush=True)
    return 0


def launch(a) -> int:
    """One launch of the Triton loop and of each variant (``fp8``), for Nsight Compute."""
    import torch

    from e4m3_ws_kernel import attention_e4m3_ws
    from fp4video import METHODS
    from fp4video.kernels.dispatch import prepare
    from fp4video.kernels.loop_e4m3 import attention_e4m3

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 16, 16384, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    r = METHODS["fp8"]
    _, t = prepare(q, k, v, r, None)
    kw = dict(recipe=r, scale=SCALE, out_dtype=q.dtype, dv=128)
    attention_e4m3(*t, None, tma=True, **kw)
    for name in a.variants:
        attention_e4m3_ws(*t[:-1], None, **kw, **VARIANTS[name])
    torch.cuda.synchronize()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["offline", "check", "diag", "speed", "launch"])
    ap.add_argument("--methods", nargs="+", default=["fp8", "mxattn-pv8"])
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS))
    ap.add_argument("--seqs", nargs="+", type=int, default=[75600])
    ap.add_argument("--rep-ms", type=int, default=600)
    ap.add_argument("--p-smem", action="store_true", help="offline: P̂ through shared memory")
    ap.add_argument("--in-place", action="store_true", help="offline: PV into the rescaled accumulator")
    ap.add_argument("--ping-pong", action="store_true", help="offline: the consumers take turns on the tensor cores")
    ap.add_argument("--sync", action="store_true", help="offline: both MMAs awaited at once")
    ap.add_argument("--serial", action="store_true", help="offline: the Triton loop's steps, no overlap within a warpgroup")
    ap.add_argument("--mask", action="store_true", help="offline: with a key-padding mask")
    ap.add_argument("--rows", type=int, default=128, choices=[128, 192], help="offline: query rows per CTA")
    ap.add_argument("--regs", type=int, default=240, help="offline: registers per consumer thread")
    ap.add_argument("--buffers", type=int, default=3)
    a = ap.parse_args(argv)
    if a.part == "offline":
        return offline(a)
    a.variants = a.variants or (["rs", "rs-inplace"] if a.part == "check" else ["rs", "smem", "smem-sync", "rs-sync"]
                                if a.part == "diag" else ["rs-pp", "rs"] if a.part == "launch"
                                else ["rs", "rs-inplace", "rs-pp", "rs-b4", "smem", "smem-inplace"])
    if a.part == "speed":
        return speed(a)
    if a.part == "launch":
        return launch(a)
    if a.part == "diag":
        a.methods = a.methods[:1]
    return check(a, diag=a.part == "diag")


if __name__ == "__main__":
    raise SystemExit(main())
