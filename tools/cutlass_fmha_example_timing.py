#!/usr/bin/env python3
"""Lab: NVIDIA's CuTe DSL Hopper FMHA example, timed beside cuDNN SDPA and fp4video's e4m3 loop (GPU).

Is NVIDIA's CuTe DSL, by itself, the way to a FlashAttention-3-class e4m3 loop? Its own Hopper
attention example is warp-specialized the way FlashAttention-3 is (a TMA producer warpgroup, two
consumer warpgroups of 64 query rows at 240 registers, P from registers into P·V) and takes e4m3
inputs. This times it in e4m3 and bf16 at a shape, in one process with cuDNN SDPA and the
shipped e4m3 loop (``fp8`` and ``mxattn-pv8``, the loop alone on one pre-pass output).

Nothing of CUTLASS is part of fp4video: bring the example yourself, at the release whose DSL is
installed (the example imports ``helpers/fmha_helpers.py`` beside its own folder)::

    pip install nvidia-cutlass-dsl==4.4.2      # 4.6+ wheels on some mirrors lack the DSL's Python
    git clone --depth 1 -b v4.4.2 https://github.com/NVIDIA/cutlass
    python tools/cutlass_fmha_example_timing.py --examples cutlass/examples/python/CuTeDSL --seq 75600
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", required=True, help="CUTLASS's examples/python/CuTeDSL folder (hopper/fmha.py)")
    ap.add_argument("--seq", type=int, default=75600)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--tile", type=int, nargs=2, default=[64, 128], help="the example's mma_tiler_mn")
    args = ap.parse_args(argv)

    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sys.path[:0] = [args.examples, os.path.join(args.examples, "hopper")]
    import cutlass
    import fmha as example  # hopper/fmha.py of the release installed

    s, h = args.seq, args.heads
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, s, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    bench = lambda fn: triton.testing.do_bench(fn, warmup=100, rep=1000, return_mode="median")  # noqa: E731
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        t_ref = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}; B=1 H={h} S={s} "
          f"D=128; cuDNN SDPA {t_ref:.2f} ms\n")
    print("| kernel | ms | × cuDNN |\n| --- | --- | --- |")

    from fp4video import METHODS
    from fp4video.kernels.dispatch import prepare
    from fp4video.kernels.loop_e4m3 import attention_e4m3

    for m in ("fp8", "mxattn-pv8"):
        recipe = METHODS[m]
        _, tensors = prepare(q, k, v, recipe, None)
        run = lambda: attention_e4m3(*tensors, None, recipe=recipe, scale=128 ** -0.5,  # noqa: E731
                                     out_dtype=q.dtype, dv=128)
        run()
        t = bench(run)
        print(f"| fp4video `{m}`, e4m3 loop alone | {t:.2f} | {t_ref / t:.3f} |", flush=True)
        del tensors
    del q, k, v
    torch.cuda.empty_cache()

    def example_ms(dtype, shape, persistent, check):
        """The example's own run(): its inputs, its CUDA-event timing (µs), its reference check."""
        with contextlib.redirect_stdout(io.StringIO()):  # its parameter listing
            us = example.run(q_shape=shape, k_shape=shape, in_dtype=dtype, out_dtype=cutlass.BFloat16,
                             qk_acc_dtype=cutlass.Float32, pv_acc_dtype=cutlass.Float32,
                             mma_tiler_mn=tuple(args.tile), is_persistent=persistent, is_causal=False,
                             bottom_right_align=False, scale_q=1.0, scale_k=1.0, scale_v=1.0, inv_scale_o=1.0,
                             scale_softmax=0.0, window_size=(-1, -1), tolerance=0.1, warmup_iterations=3,
                             iterations=10, skip_ref_check=not check)
        return us / 1000

    t0 = time.time()
    example_ms(cutlass.Float8E4M3FN, (1, 2048, 4, 128), False, True)  # raises if it disagrees with its reference
    print(f"(the example's e4m3 kernel passed its own reference check at S=2048, {time.time() - t0:.0f} s)", flush=True)
    for dtype in (cutlass.Float8E4M3FN, cutlass.BFloat16):
        for persistent in (True, False):
            t = example_ms(dtype, (1, s, h, 128), persistent, False)
            print(f"| CUTLASS CuTe DSL Hopper FMHA example, {dtype.__name__}, tile {tuple(args.tile)}, "
                  f"{'persistent' if persistent else 'one CTA a tile'} | {t:.2f} | {t_ref / t:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
