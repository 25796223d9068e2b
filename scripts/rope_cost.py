"""What RoPE costs in an attention call: the stock processor's torch operations on the queries and keys
against fp4video's fused kernel (:mod:`fp4video.kernels.rope`, what a routed call runs), bit for bit
the same: Wan's at Wan2.2 720p's shape by default (75,600 tokens, 40 heads of 128, bf16), or
HunyuanVideo's (``--style interleaved``: diffusers' ``apply_rotary_emb`` on the video tokens, the text
tokens after them as they are).

    PYTHONPATH=. python3 scripts/rope_cost.py --out rope-cost           # a CUDA GPU
    PYTHONPATH=. python3 scripts/rope_cost.py --out rope-cost --sweep   # + the kernel's launch settings
    PYTHONPATH=. python3 scripts/rope_cost.py --out rope-hy --style interleaved --tokens 118800 --text 256 --heads 24
                                                                        # HunyuanVideo 720p (129 frames)

Times are medians of ``--repeats`` calls after a warm-up call (CUDA events). Writes ``rope.md``
and ``rope.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fp4video.calibration.costs import median_seconds
from fp4video.integration.rope import stock_rope
from fp4video.kernels.rope import rope_pairs


def median_ms(fn, repeats: int) -> float:
    """The median of ``repeats`` timed calls after a warm-up, in ms (CUDA events)."""
    return median_seconds(fn, torch.device("cuda"), reps=repeats) * 1000


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--style", choices=["wan", "interleaved"], default="wan")
    p.add_argument("--tokens", type=int, default=75600, help="tokens the tables rotate")
    p.add_argument("--text", type=int, default=0, help="tokens after them, left as they are (interleaved only)")
    p.add_argument("--heads", type=int, default=40)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="also time the kernel's block sizes and warps")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (the fused kernel's time is what it measures)")
    if args.text and args.style == "wan":
        p.error("--text: Wan's self-attention has no tokens past its tables")
    s, h, d, style = args.tokens, args.heads, args.head_dim, args.style
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, s + args.text, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, s + args.text, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    angle = torch.rand(s, d // 2, device="cuda", dtype=torch.float64, generator=g) * 100
    cos, sin = angle.cos().repeat_interleave(2, -1).float(), angle.sin().repeat_interleave(2, -1).float()
    if style == "wan":
        cos, sin = cos.view(1, s, 1, d), sin.view(1, s, 1, d)
    fused = rope_pairs(q, k, cos, sin, style)
    same = torch.equal(fused[0], stock_rope(q, cos, sin, style)) and torch.equal(fused[1], stock_rope(k, cos, sin, style))
    stock_ms = median_ms(lambda: (stock_rope(q, cos, sin, style), stock_rope(k, cos, sin, style)), args.repeats)
    fused_ms = median_ms(lambda: rope_pairs(q, k, cos, sin, style), args.repeats)
    row = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, style=style, tokens=s, text=args.text,
               heads=h, head_dim=d, stock_ms=round(stock_ms, 3), fused_ms=round(fused_ms, 3),
               speedup=round(stock_ms / fused_ms, 2), bitwise_equal=same)
    md = (f"RoPE ({style}) on q and k, (1, {s} + {args.text}, {h}, {d}) bf16, fp32 tables, {row['device']}, torch "
          f"{row['torch']}: stock torch operations {row['stock_ms']} ms, fused kernel {row['fused_ms']} ms "
          f"({row['speedup']}×), bit for bit equal: {same}")
    if args.sweep:
        row["sweep"] = []
        md += "\n\n| tokens a program | pairs a program | warps | ms |\n| --- | --- | --- | --- |"
        for bt in (4, 8, 16, 32):
            for bp in (32, 64, 128, 256):
                for warps in (2, 4, 8):
                    ms = median_ms(lambda: rope_pairs(q, k, cos, sin, style, block_tokens=bt, block_pairs=bp,
                                                      num_warps=warps), args.repeats)
                    row["sweep"].append(dict(block_tokens=bt, block_pairs=bp, num_warps=warps, ms=round(ms, 3)))
                    md += f"\n| {bt} | {bp} | {warps} | {ms:.3f} |"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rope.json").write_text(json.dumps(row, indent=1))
    (args.out / "rope.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
