#!/usr/bin/env python3
"""Where the time of one fp4video attention call goes, next to cuDNN SDPA in the same process.

Times the pre-pass variants (rows per program, rotation precision), the attention loop with and
without the in-loop P quantization (``QUANTIZE_P=False`` only casts P̃ to e4m3: the floor the
quantization is measured against) over launch configurations, and checks each loop variant's
output against the reference on a smaller problem first. Prints markdown tables
(BENCHMARKS.md keeps them).

    python scripts/kernel_breakdown.py [--seq 32760] [--heads 40] [--method mxattn] [--configs 64x4x2,64x4x3p]
                                       [--rep MS] [--no-floor] [--masked-keys N] [--skip-prepass]
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from fp4video import METHODS, fp4_attention
from fp4video.kernels import prepass as pp
from fp4video.kernels.attention_fwd import attention_prepared, mx_kernel, prepare
from fp4video.metrics import cossim


#: config suffix letters -> the e4m3 loop's options they set
FLAGS = {"p": ("tma", False, "K̂/V̂ᵀ by pointer loads, K̂ in key order"),
         "f": ("f16_p", False, "P rounded in fp32 (not on f16 pairs)"),
         "s": ("fresh_pv", False, "P̂·V̂ accumulated into the rescaled accumulator"),
         "a": ("fresh_pv", True, "P̂·V̂ in a fresh accumulator")}


def prepare_for(flags, q, k, v, recipe, key_alive=None):
    """The pre-pass a config's loop reads: as :func:`prepare` chooses for the GPU (on Hopper K̂ in
    tile key order, for TMA), or with flag p K̂ in key order (the pointer-load loop's own layout)."""
    if "p" in flags and mx_kernel(recipe, q.device) == "fp8":
        return ("fp8", (*pp.prepass_fp8(q, k, v, recipe, key_alive), k.shape[-2], False))
    return prepare(q, k, v, recipe, key_alive)


def config_name(bm, nw, ns, regs, flags=""):
    return f"{bm}x{nw}x{ns}" + (f", ≤ {regs} registers" if regs else "") + "".join(f", {FLAGS[f][2]}" for f in flags)


def parse_config(text: str):
    """``BMxWARPSxSTAGES[rN][flags]`` -> (bm, warps, stages, register cap or None, flags)."""
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)(?:r(\d+))?([%s]*)" % "".join(FLAGS), text)
    if not m:
        raise SystemExit(f"error: launch config {text!r} is not BMxWARPSxSTAGES[rN][{''.join(FLAGS)}], "
                         "e.g. 64x4x2r168 or 64x4x3p")
    bm, nw, ns, regs, flags = m.groups()
    return int(bm), int(nw), int(ns), int(regs) if regs else None, flags


def loop_options(regs, flags):
    """The e4m3 loop's options for a config (register cap, the flags' options)."""
    return {**({"max_registers": regs} if regs else {}), **{FLAGS[f][0]: FLAGS[f][1] for f in flags}}


#: milliseconds each timing repeats its call for (``--rep``; at Wan 720p 80 ms is a single call)
REP_MS = 80


def bench(fn):
    return triton.testing.do_bench(fn, warmup=20, rep=REP_MS, return_mode="median")


def prepass_tables(args, recipe, q, k, v, gbps):
    """The pre-pass variants (rows per program, rotation precision), against the copy bandwidth."""
    # pre-pass: bytes moved at the copy bandwidth is the floor
    print("\n| pre-pass | rows/program | rotation | ms | × copy-bandwidth floor |\n| --- | --- | --- | --- | --- |")
    n = q.numel()
    floor_ms = (3 * n * 2 + 3 * n * 1) / (gbps * 1e6)  # read bf16 Q,K,V once, write e4m3 once
    for block_s, rot in itertools.product((64, 128), ("bf16", "tf32x3")):
        pp._PrePass.BLOCK_S, pp._PrePass.ROTATION = block_s, rot
        try:
            t = bench(lambda: prepare(q, k, v, recipe, None))
            print(f"| {args.method} | {block_s} | {rot} | {t:.2f} | {floor_ms / t:.2f} |", flush=True)
        except Exception as e:  # noqa: BLE001  (out of resources: report, go on)
            print(f"| {args.method} | {block_s} | {rot} | failed: {type(e).__name__} | |", flush=True)
    pp._PrePass.BLOCK_S, pp._PrePass.ROTATION = 64, "bf16"
    # each launch of the e4m3 pre-pass against the copy bandwidth: scripts/prepass_bandwidth.py


def main(argv=None) -> int:
    global REP_MS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=32760)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--method", default="mxattn")
    ap.add_argument("--configs", default="64x4x2,64x4x3p,128x8x3p",
                    help="BLOCK_MxWARPSxSTAGES list for the loop; a suffix rN caps the registers per thread at N "
                         "(e4m3 loop: r168 keeps three programs per SM where the loop needs more), then flags: p reads "
                         "K̂/V̂ᵀ by pointer loads (K̂ in key order) where the loop would use TMA (Hopper); f rounds P in "
                         "fp32 instead of on f16 pairs; s accumulates P̂·V̂ into the rescaled accumulator, a into a "
                         "fresh one (defaults: a with TMA, s with pointer loads)")
    ap.add_argument("--warp-specialize", action="store_true", help="also try tl.range(warp_specialize=True)")
    ap.add_argument("--skip-prepass", action="store_true", help="time the attention loop only")
    ap.add_argument("--no-floor", action="store_true", help="do not time the floor (P only cast to e4m3)")
    ap.add_argument("--masked-keys", type=int, default=0,
                    help="time the loops with the last N keys masked (key padding; HunyuanVideo 720p: --heads 24 "
                         "--seq 119056 --masked-keys 56); cuDNN SDPA gets the same mask")
    ap.add_argument("--rep", type=int, default=REP_MS, help="milliseconds of calls per timing (median taken)")
    args = ap.parse_args(argv)
    REP_MS = args.rep
    recipe = METHODS[args.method]
    configs = [parse_config(c) for c in args.configs.split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)

    # correctness of every loop variant on a smaller problem (against the reference backend)
    q, k, v = (torch.randn(1, 4, 4000, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    ref = fp4_attention(q, k, v, method=args.method, backend="reference").float()
    print("| check (S=4000, H=4) | config | cosine to reference |\n| --- | --- | --- |")
    for config in list(configs):
        bm, nw, ns, regs, flags = config
        try:
            out, _ = attention_prepared(prepare_for(flags, q, k, v, recipe), None, recipe=recipe, scale=128**-0.5, out_dtype=q.dtype, dv=128,
                                        block_m=bm, num_warps=nw, num_stages=ns, **loop_options(regs, flags))
        except Exception as e:  # noqa: BLE001  (e.g. more shared memory than the GPU has: report, drop it)
            print(f"| {args.method} | {config_name(*config)} | failed: {type(e).__name__} (not timed) |", flush=True)
            configs.remove(config)
            continue
        print(f"| {args.method} | {config_name(*config)} | {cossim(out.float(), ref):.6f} |", flush=True)

    # long rows: the fp8 MMAs accumulate over every key tile
    ql, kl, vl = (torch.randn(1, 1, args.seq, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    ref = fp4_attention(ql[:, :, :2048], kl, vl, method=args.method, backend="reference").float()
    prepared = prepare(ql[:, :, :2048], kl, vl, recipe, None)
    for ws in (False, True) if args.warp_specialize else (False,):
        out, _ = attention_prepared(prepared, None, recipe=recipe, scale=128**-0.5, out_dtype=q.dtype, dv=128,
                                    **({"warp_specialize": True} if ws else {}))
        print(f"| {args.method}, Sk={args.seq}{', warp-specialized' if ws else ''} | default | "
              f"{cossim(out.float(), ref):.6f} |", flush=True)
    del ql, kl, vl, ref

    q, k, v = (torch.randn(1, args.heads, args.seq, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    alive = None
    if args.masked_keys:
        alive = torch.ones(1, args.seq, dtype=torch.bool, device="cuda")
        alive[:, args.seq - args.masked_keys:] = False
    mask = None if alive is None else alive[:, None, None, :]
    baseline = "cuDNN SDPA"
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            t_ref = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    except RuntimeError:  # this cuDNN cannot take the mask: SDPA's own choice (as `bench kernel` falls back)
        baseline = "SDPA (default dispatch)"
        t_ref = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    copy = torch.empty_like(q)
    t_copy = bench(lambda: copy.copy_(q))
    gbps = 2 * q.numel() * 2 / t_copy / 1e6
    print(f"\n{torch.cuda.get_device_name()}, S={args.seq}, H={args.heads}, D=128"
          f"{f', last {args.masked_keys} keys masked' if alive is not None else ''}: {baseline} {t_ref:.2f} ms; "
          f"bf16 copy of Q {t_copy:.3f} ms = {gbps:.0f} GB/s")

    if not args.skip_prepass:
        prepass_tables(args, recipe, q, k, v, gbps)

    prepared = {flags: prepare_for(flags, q, k, v, recipe, alive) for *_, flags in configs}
    print("\n| loop | config | ms | TFLOP/s | × cuDNN |\n| --- | --- | --- | --- | --- |")
    flops = 4 * args.heads * args.seq**2 * 128
    # the floor (P only cast to e4m3) and warp specialization exist in the e4m3 MXFP4 loop only
    fp8 = next(iter(prepared.values()))[0] == "fp8"
    variants = [(True, False)] + ([(False, False)] if fp8 and not args.no_floor else []) + ([(True, True)] if args.warp_specialize and fp8 else [])
    for (quant, ws), (bm, nw, ns, regs, flags) in itertools.product(variants, configs):
        try:
            opts = dict(quantize_p=quant, warp_specialize=ws, **loop_options(regs, flags)) if fp8 else {}
            t = bench(lambda: attention_prepared(prepared[flags], alive, recipe=recipe, scale=128**-0.5, out_dtype=q.dtype,
                                                 dv=128, block_m=bm, num_warps=nw, num_stages=ns, **opts))
            what = (args.method if quant else "P cast to e4m3 (floor)") + (", warp-specialized" if ws else "")
            print(f"| {what} | {config_name(bm, nw, ns, regs, flags)} | {t:.2f} | {flops / t / 1e9:.0f} | {t_ref / t:.2f} |",
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"| quantize_p={quant} | {config_name(bm, nw, ns, regs, flags)} | failed: {type(e).__name__}: {e} | | |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
