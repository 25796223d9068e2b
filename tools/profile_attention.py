#!/usr/bin/env python3
"""Hardware counters of the attention loops (GPU, Nsight Compute): where their cycles go.

Two steps. ``run`` calls each kernel once, so that ``ncu`` profiles one launch per method (the
first call compiles the kernel, which launches nothing else that matches ``-k``); ``summarize`` turns ncu's raw CSV into a markdown table:
issue-slot use, tensor-pipe activity and the warp stall reasons per issued instruction;
``source`` (with ``--section SourceCounters`` in the profile) reads ncu's per-instruction page and
tells where in each kernel's main loop the warps' stall samples fall.

    ncu --clock-control none -k 'regex:_nv_attn_fwd|_e4m3_attn_fwd|cudnn' \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        --section SchedulerStats --section InstructionStats -o prof \\
        python3 tools/profile_attention.py run --seq 16384 --heads 16 sage3 nvfp4 sage3-triton mxattn cudnn
    ncu -i prof.ncu-rep --page raw --csv > raw.csv
    python3 tools/profile_attention.py summarize raw.csv
    ncu -i prof.ncu-rep --page source --print-source sass --csv > source.csv
    python3 tools/profile_attention.py source source.csv [--chunk 36]

``fa3`` / ``fa3-fp8`` are FlashAttention-3's bf16 and FP8 kernels (the FP8 one on inputs cast before
its launch), when installed; ncu names their kernels ``device_kernel`` (add it to ``-k``).
``summarize --memory`` adds the memory hierarchy's throughput (profile with ``--section
MemoryWorkloadAnalysis`` too).

``NAME-triton`` forces the Triton NVFP4 loop (``FP4VIDEO_NV_KERNEL=triton``), ``NAME-pointer``
the e4m3 MXFP4 loop with pointer loads instead of TMA (``FP4VIDEO_MX_TMA=0``); ``cudnn`` is
PyTorch's cuDNN SDPA. ``--clock-control none`` leaves the clocks as they are (the project's
measuring rule); ncu then warns that results may vary from run to run.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

#: kernel name suffixes of ``run``: the environment variable each sets for its call
VARIANTS = {"triton": ("FP4VIDEO_NV_KERNEL", "triton"), "pointer": ("FP4VIDEO_MX_TMA", "0")}

#: the stall reasons reported (ncu's smsp__average_warps_issue_stalled_<reason>_per_issue_active)
STALLS = ("selected", "barrier", "wait", "not_selected", "no_instruction", "dispatch_stall", "short_scoreboard",
          "gmma", "mio_throttle", "long_scoreboard", "math_pipe_throttle")


def run(args) -> int:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fp4video import fp4_attention

    if not torch.cuda.is_available():
        raise SystemExit("error: profiling needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, args.seq, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))

    peers = {}
    if {"fa3", "fa3-fp8"} & set(args.kernels):
        from fp4video.eval.peers import find_peers

        found = {p.name: p for p in find_peers()}
        peers = {"fa3": found["FlashAttention-3 bf16"], "fa3-fp8": found["FlashAttention-3 FP8 (kernel only)"]}
        for name, peer in peers.items():
            if peer.fn is None and name in args.kernels:
                raise SystemExit(f"error: {peer.name}: {peer.missing}")
    prepared = {name: peer.args(q, k, v) for name, peer in peers.items() if name in args.kernels}

    def call(name: str):
        if name == "cudnn":
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)
        if name in peers:  # FlashAttention-3, the FP8 form on inputs cast before (its kernel alone)
            return peers[name].fn(*prepared[name])
        method, _, suffix = name.partition("-")
        if suffix and suffix not in VARIANTS:
            method, suffix = name, ""  # a method whose name has a dash
        var, value = VARIANTS.get(suffix, (None, None))
        previous = os.environ.get(var) if var else None
        if var:
            os.environ[var] = value
        try:
            return fp4_attention(q, k, v, method=method, backend="triton")
        finally:
            if var and previous is None:
                os.environ.pop(var, None)
            elif var:
                os.environ[var] = previous

    for name in args.kernels:  # one launch each (its first call compiles it, which launches nothing)
        call(name)
        torch.cuda.synchronize()
        print(f"profiled {name}", file=sys.stderr)
    return 0


def summarize(args) -> int:
    with open(args.csv, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    header, units, data = rows[0], rows[1], rows[2:]
    col = {name: i for i, name in enumerate(header)}

    def value(row, metric):
        i = col.get(metric)
        return float(row[i].replace(",", "")) if i is not None and row[i] not in ("", "n/a") else float("nan")

    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    print("| kernel | ms | issue slots busy % | tensor pipe active % | warp cycles per issue (these reasons) | "
          + " | ".join(s.replace("_", " ") for s in STALLS) + " |")
    print("| --- " * (5 + len(STALLS)) + "|")
    for row in data:
        name = row[col["Kernel Name"]][:40]
        duration = "gpu__time_duration.sum"
        ms = value(row, duration) / {"ns": 1e6, "us": 1e3, "usecond": 1e3, "nsecond": 1e6}.get(units[col[duration]], 1.0)
        cycles = sum(x for s in STALLS if (x := value(row, stall.format(s))) == x)  # reasons ncu reported
        print(f"| {name} | {ms:.2f} | {value(row, 'sm__issue_active.avg.pct_of_peak_sustained_elapsed'):.1f} | "
              f"{value(row, 'sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active'):.1f} | {cycles:.2f} | "
              + " | ".join(f"{value(row, stall.format(s)):.2f}" for s in STALLS) + " |")
    if args.memory:  # the memory hierarchy's throughput (sections SpeedOfLight, MemoryWorkloadAnalysis)
        wanted = [m for m in header if m.startswith(("lts__", "l1tex__", "dram__")) and
                  ("pct" in m or "per_second" in m or m.endswith(".sum"))]
        print()
        print("| metric (unit) | " + " | ".join(r[col["Kernel Name"]][:24] for r in data) + " |")
        print("| --- " * (1 + len(data)) + "|")
        for m in wanted:
            print(f"| {m} ({units[col[m]]}) | " + " | ".join(f"{value(r, m):.4g}" for r in data) + " |")
    return 0


def source(args) -> int:
    """Per kernel in ncu's source page (SASS, CSV): the share of warp-state samples per stall reason,
    and the main loop — the instructions executed at least 90% as often as the most executed one —
    cut into chunks of ``--chunk`` instructions with each chunk's share of the loop's samples and
    its most frequent opcodes (markdown)."""
    import collections
    import csv
    import re

    with open(args.csv, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    kernels = []  # (name, header, rows)
    for r in rows:
        if r[0] == "Kernel Name":
            kernels.append((r[1] if len(r) > 1 else "?", None, []))
        elif r[0] == "Address" and kernels:
            kernels[-1] = (kernels[-1][0], r, kernels[-1][2])
        elif kernels and kernels[-1][1] is not None:
            kernels[-1][2].append(r)
    if not kernels:
        print(f"error: no 'Kernel Name' blocks in {args.csv} (ncu -i REP --page source --print-source sass --csv)",
              file=sys.stderr)
        return 2
    for n, (name, header, body) in enumerate(kernels):
        col = {h: i for i, h in enumerate(header)}
        for need in ("Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"):
            if need not in col:
                print(f"error: kernel {name}: no column {need!r} (profile with --section SourceCounters)", file=sys.stderr)
                return 2
        reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]

        def num(r, h):
            x = r[col[h]].replace(",", "")
            return float(x) if x not in ("", "-", "n/a") else 0.0

        samples = [num(r, "Warp Stall Sampling (All Samples)") for r in body]
        total = sum(samples) or 1.0
        by_reason = collections.Counter({h[6:]: sum(num(r, h) for r in body) for h in reasons})
        print(f"\n### {n}: {name[:60]} — {int(total)} samples\n")
        print("stall reasons, % of samples: " + ", ".join(f"{k} {100 * v / total:.1f}" for k, v in by_reason.most_common()
                                                          if v))
        executed = [num(r, "Instructions Executed") for r in body]
        top = max(executed, default=0.0)
        loop = [i for i, e in enumerate(executed) if top and e >= 0.9 * top]
        if not loop:
            continue
        lo, hi = loop[0], loop[-1] + 1
        in_loop = sum(samples[lo:hi]) or 1.0
        print(f"\nmain loop: instructions {lo}–{hi - 1} ({hi - lo}), {100 * in_loop / total:.1f}% of the samples\n")
        print("| loop instructions | % of the loop's samples | most frequent opcodes |\n| --- | --- | --- |")
        for a in range(lo, hi, args.chunk):
            b = min(a + args.chunk, hi)
            ops = collections.Counter()
            for r in body[a:b]:
                m = re.match(r"\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", r[col["Source"]])
                if m:
                    ops[m.group(1)] += 1
            print(f"| {a - lo}–{b - lo - 1} | {100 * sum(samples[a:b]) / in_loop:.1f} | "
                  + ", ".join(f"{op} {c}" for op, c in ops.most_common(4)) + " |")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one launch of each kernel (run under ncu)")
    r.add_argument("kernels", nargs="+", help="fp4video methods, NAME-triton (the Triton NVFP4 loop), NAME-pointer "
                                                 "(the e4m3 loop without TMA), cudnn, fa3 or fa3-fp8 (FlashAttention-3)")
    r.add_argument("--seq", type=int, default=16384)
    r.add_argument("--heads", type=int, default=16)
    s = sub.add_parser("summarize", help="markdown table from `ncu -i REP --page raw --csv`")
    s.add_argument("csv")
    s.add_argument("--memory", action="store_true", help="also the L1, L2 and DRAM throughput metrics, a column per kernel")
    src = sub.add_parser("source", help="where the main loop's stall samples fall, from `ncu -i REP --page source "
                                        "--print-source sass --csv`")
    src.add_argument("csv")
    src.add_argument("--chunk", type=int, default=36, help="loop instructions per row")
    args = ap.parse_args(argv)
    return {"run": run, "summarize": summarize, "source": source}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
