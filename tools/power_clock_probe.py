#!/usr/bin/env python3
"""Lab: what the GPU's clock and power do while each attention kernel runs back to back (GPU).

Is the e4m3 loop bound by the chip's power limit rather than by its schedule? For each kernel —
cuDNN SDPA (bf16), FlashAttention-3 FP8 (kernel only, if installed), fp4video's e4m3 loop for
``mxattn-pv8`` / ``fp8`` / ``mxattn`` (the loop alone on one pre-pass output), and the same loops
and FlashAttention-3 FP8 on all-zero 8-bit operands (the same instructions, no switching in the
tensor cores' data) — it runs calls back to back for ``--seconds`` while a thread samples NVML
every 20 ms: the SM clock, the board power, and the share of samples in which the driver reports
the software power cap (or a thermal or hardware slowdown) holding the clock down.

    python tools/power_clock_probe.py --seq 75600 --seconds 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=75600)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args(argv)

    import pynvml
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fp4video import METHODS
    from fp4video.eval.peers import find_peers
    from fp4video.kernels.dispatch import prepare
    from fp4video.kernels.loop_e4m3 import attention_e4m3

    pynvml.nvmlInit()
    dev = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    power_cap = getattr(pynvml, "nvmlClocksEventReasonSwPowerCap", 0x4)
    slowdown = (getattr(pynvml, "nvmlClocksEventReasonHwSlowdown", 0x8)
                | getattr(pynvml, "nvmlClocksEventReasonSwThermalSlowdown", 0x20)
                | getattr(pynvml, "nvmlClocksEventReasonHwThermalSlowdown", 0x40)
                | getattr(pynvml, "nvmlClocksEventReasonHwPowerBrakeSlowdown", 0x80))
    reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
    limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(dev) / 1000
    max_clock = pynvml.nvmlDeviceGetMaxClockInfo(dev, pynvml.NVML_CLOCK_SM)

    s, h = args.seq, args.heads
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, s, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    k = k + 0.5 * torch.randn(1, h, 1, 128, device="cuda", dtype=torch.bfloat16, generator=g)  # a K mean

    def probe(fn):
        """(ms a call, mean SM MHz, mean W, share of samples power-capped, share slowed down)."""
        fn()
        torch.cuda.synchronize()
        samples, stop = [], threading.Event()

        def sample():
            while not stop.is_set():
                r = reasons(dev)
                samples.append((pynvml.nvmlDeviceGetClockInfo(dev, pynvml.NVML_CLOCK_SM),
                                pynvml.nvmlDeviceGetPowerUsage(dev) / 1000, bool(r & power_cap), bool(r & slowdown)))
                time.sleep(0.02)

        t = threading.Thread(target=sample)
        t.start()
        t0, calls = time.perf_counter(), 0
        while time.perf_counter() - t0 < args.seconds:
            for _ in range(5):
                fn()
            calls += 5
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / calls * 1e3
        stop.set()
        t.join()
        late = samples[len(samples) // 4:]  # past the first quarter: the clock has settled
        return (ms, statistics.mean(x[0] for x in late), statistics.mean(x[1] for x in late),
                sum(x[2] for x in late) / len(late), sum(x[3] for x in late) / len(late))

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}; B=1 H={h} S={s} "
          f"D=128; enforced power limit {limit_w:.0f} W, max SM clock {max_clock} MHz; {args.seconds:.0f} s a kernel\n")
    print("| kernel | operands | ms a call | SM clock MHz | board W | power-capped | slowed (thermal/HW) |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")

    def row(name, operands, fn):
        ms, mhz, watts, capped, slowed = probe(fn)
        print(f"| {name} | {operands} | {ms:.2f} | {mhz:.0f} | {watts:.0f} | {capped:.0%} | {slowed:.0%} |", flush=True)

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        row("cuDNN SDPA bf16", "random", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    fa3 = next((p for p in find_peers() if p.name == "FlashAttention-3 FP8 (kernel only)"), None)
    if fa3 is not None and fa3.fn is not None:
        prepared = fa3.prepare(q, k, v)
        row("FlashAttention-3 FP8, kernel only", "random", lambda: fa3.fn(prepared))
        (q8, k8, v8), scales = prepared
        zeros = (torch.zeros_like(q8), torch.zeros_like(k8), torch.zeros_like(v8)), scales
        row("FlashAttention-3 FP8, kernel only", "all zero", lambda: fa3.fn(zeros))
        del prepared, zeros
    else:
        print(f"| FlashAttention-3 FP8 | missing: {fa3.missing if fa3 else 'not found'} | | | | | |")
    for m in ("mxattn-pv8", "fp8", "mxattn"):
        recipe = METHODS[m]
        _, tensors = prepare(q, k, v, recipe, None)
        run = lambda t=tensors: attention_e4m3(*t, None, recipe=recipe, scale=128 ** -0.5,  # noqa: E731
                                               out_dtype=q.dtype, dv=128)
        row(f"fp4video `{m}` e4m3 loop", "random", run)
        if m != "mxattn":
            zeroed = tuple(torch.zeros_like(x) if isinstance(x, torch.Tensor) and x.dtype == torch.float8_e4m3fn else x
                           for x in tensors)
            row(f"fp4video `{m}` e4m3 loop", "all-zero Q̂, K̂, V̂ᵀ", lambda: run(zeroed))
            del zeroed
        del tensors
        torch.cuda.empty_cache()
    pynvml.nvmlShutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
