"""``fp4video bench``: speed on a GPU, always against the best baseline measured in the same run.

- ``bench kernel``: fp4video's Triton attention vs cuDNN / flash SDPA (bf16), per method, with the
  pre-pass and the attention loop also timed on their own.
- ``bench sparse``: block-sparse attention's time against its density, beside the dense kernels
  and the peers, and the selections' own cost (:mod:`.bench_sparse`).
- ``bench pipeline``: one denoising forward of a full-size Wan2.2-A14B- or HunyuanVideo-shaped
  transformer (random bf16 weights: speed does not depend on them) with diffusers' stock attention
  vs each policy, and (``--peers``) with each installed peer in place of diffusers' SDPA.
- ``bench parallel`` (under torchrun): the same forward on one GPU and split over N GPUs with
  context parallelism, in one job; speed-up and the cosine between the two outputs.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from .bench_shared import RATIO_PEERS, RATIO_TITLES, run_header, uniform_selection
from .common import UsageError, check_output_file

EXAMPLES = """examples:
  fp4video bench kernel --seqs 8192 32760 75600 --out BENCHMARKS-run.md --plot kernel-speed.png
  fp4video bench kernel --heads 24 --seqs 119056 --masked-keys 56     # HunyuanVideo 720p with its text padding
  fp4video bench sparse --densities 0.1 0.25 0.5 1.0 --plot sparse-speed.png   # Wan 720p
  fp4video bench pipeline --resolutions 480p 720p --methods fp16 mxattn sage3
  fp4video bench pipeline --model hunyuan --layers 2 --resolutions 720p
  fp4video bench pipeline --resolutions 720p --methods --configs configs/wan22_mxattn_pv8.yaml --peers
  torchrun --nproc-per-node 2 -m fp4video.cli.main bench parallel --layers 4 --resolution 720p
"""

#: Wan2.2-T2V-A14B transformer config (each expert), from its published config.
WAN22_A14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
                  out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                  qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
#: 81 frames -> 21 latent frames; VAE /8; patch 2x2.  480p: 21·30·52 = 32,760 tokens; 720p: 21·45·80 = 75,600.
LATENTS = {"480p": (21, 60, 104), "720p": (21, 90, 160)}
#: HunyuanVideo (13B) transformer config, from its published config.
HUNYUAN = dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
               num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
               qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768,
               rope_theta=256.0, rope_axes_dim=(16, 56, 56))
#: 129 frames -> 33 latent frames.  720p: 33·45·80 = 118,800 video tokens (+ 256 text tokens, masked).
HUNYUAN_LATENTS = {"480p": (33, 60, 104), "720p": (33, 90, 160)}


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="GPU speed: kernels and full-size transformer steps", description=__doc__,
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_subparsers(dest="what", required=True, metavar="{kernel,sparse,pipeline,parallel}")
    fmt = argparse.ArgumentDefaultsHelpFormatter
    k = which.add_parser("kernel", help="attention kernels vs every bf16 attention and peer installed",
                         description=bench_kernel.__doc__, formatter_class=fmt)
    k.add_argument("--seqs", type=int, nargs="+", default=[8192, 32760, 75600],
                   help="sequence lengths (Wan2.2 480p: 32760, 720p: 75600; HunyuanVideo 720p: 119056)")
    k.add_argument("--heads", type=int, default=40, help="attention heads (Wan2.2-A14B: 40, HunyuanVideo: 24)")
    k.add_argument("--head-dim", type=int, default=128, help="head dimension")
    k.add_argument("--methods", nargs="+", default=["fp16", "mxattn", "mxattn-pv8", "fp8", "sage3", "nvfp4", "mxfp4-ocp"],
                   help="fp4video methods to time (fp4video methods lists them)")
    k.add_argument("--masked-keys", type=int, default=0,
                   help="mask the last N keys (key padding; HunyuanVideo 720p: --heads 24 --seqs 119056 --masked-keys 56)")
    k.add_argument("--density", type=float, default=None,
                   help="also time each method block-sparse at this density (a row per method; the sparse "
                        "loops' methods only); time against density: fp4video bench sparse")
    k.add_argument("--layout", choices=["bhsd", "bshd"], default="bhsd",
                   help="bshd: (B, S, H, D) tensors as diffusers holds them (SDPA gets transposed views)")
    k.add_argument("--out", default=None, help="append the markdown table to this file")
    k.add_argument("--plot", default=None, metavar="PNG",
                   help="also draw the table (× best baseline per method and length) as this PNG")
    from . import bench_sparse

    sp = which.add_parser("sparse", help="block-sparse attention: time against density, beside the dense kernels "
                                         "and peers", description=bench_sparse.__doc__,
                          formatter_class=fmt)
    sp.add_argument("--seq", type=int, default=75600, help="tokens (Wan2.2 720p: 75600; HunyuanVideo 720p: 119056)")
    sp.add_argument("--heads", type=int, default=40, help="attention heads (Wan2.2-A14B: 40, HunyuanVideo: 24)")
    sp.add_argument("--head-dim", type=int, default=128, help="head dimension")
    sp.add_argument("--methods", nargs="+", default=["mxattn-pv8", "mxattn", "fp8", "fp16"],
                    help="fp4video methods (those whose loop takes a selection)")
    sp.add_argument("--densities", type=float, nargs="+", default=list(bench_sparse.DENSITIES), help="densities to time")
    sp.add_argument("--grid", type=int, nargs=3, default=[21, 45, 80], metavar=("FRAMES", "HEIGHT", "WIDTH"),
                    help="the latent grid of the static selection (Wan2.2 720p: 21 45 80)")
    sp.add_argument("--window", type=int, nargs=3, default=[2, 12, 12], metavar=("FRAMES", "ROWS", "COLUMNS"),
                    help="the static window's radii")
    sp.add_argument("--tau", type=float, default=0.9, help="the dynamic selection's kept share of estimated mass")
    sp.add_argument("--rep-ms", type=int, default=600, help="milliseconds of timing per measurement")
    sp.add_argument("--out", default=None, help="append the markdown table to this file")
    sp.add_argument("--plot", default=None, metavar="PNG", help="draw time against density as this PNG")
    pl = which.add_parser("pipeline", help="Wan2.2-A14B-shaped transformer forward: stock vs policies and peers",
                          description="One denoising forward of a full-size transformer (random bf16 weights) "
                                      "with diffusers' stock attention, with each policy and (--peers) with each "
                                      "installed peer in place of diffusers' SDPA, in one run.",
                          formatter_class=fmt)
    pl.add_argument("--resolutions", nargs="+", default=["480p", "720p"], choices=list(LATENTS),
                    help="81 frames (Wan) / 129 frames (HunyuanVideo) at these sizes")
    pl.add_argument("--methods", nargs="*", default=["fp16", "mxattn", "sage3"],
                    help="each runs with MXAttention's block-0-in-FP16 rule on Wan (the paper's policy), "
                         "fully in that method on HunyuanVideo; none: --methods with no names")
    pl.add_argument("--configs", nargs="+", default=[], metavar="YAML",
                    help="also each run config's policy (its family must match --model; a lone forward is a "
                         "middle step, so step rules do not apply)")
    pl.add_argument("--model", choices=["wan22", "hunyuan"], default="wan22", help="transformer shape")
    pl.add_argument("--layers", type=int, default=None,
                    help="transformer blocks (default: the real model's; HunyuanVideo: dual blocks, "
                         "with twice as many single blocks)")
    pl.add_argument("--reps", type=int, default=2, help="timed forwards after one warm-up (the median is kept)")
    pl.add_argument("--peers", action="store_true",
                    help="also each installed peer (FlashAttention-3 bf16, FlashAttention-3 FP8 with its cast, "
                         "SageAttention2) in place of diffusers' SDPA; calls it cannot take (masks) stay on SDPA, "
                         "counted under the table")
    pl.add_argument("--linear", nargs="+", default=["bf16"], metavar="VARIANT", type=linear_variant,
                    help="the linear layers' variants, each timed with every attention row: a method (bf16, "
                         "fp8-rowwise, fp8-tensor, mxfp8, nvfp4) through fp4video.integration.linear with block 0 "
                         "and the layers outside the blocks kept in bf16; +compile compiles each transformer block (regional torch.compile, which "
                         "fuses the activations' quantization with its neighbours); torchao:METHOD is torchao's "
                         "own quantize_ on the same layers (no way back: it runs last)")
    pl.add_argument("--local-heads", type=float, nargs=2, default=None, metavar=("FLATTEST", "SHARPEST"),
                    help="Wan only: make every self-attention head attend by position (queries and keys from the "
                         "projections' biases, so RoPE alone shapes the logits, which fall with the latent-grid "
                         "distance), the heads' sharpness (their norms' weight) spread over this range: 1 is "
                         "nearly as uniform as random weights' attention at 720p, 2 keeps most of a head's mass "
                         "within ten latent positions (0 < FLATTEST <= SHARPEST <= 100; bf16 linear layers only: "
                         "the q/k projections' weights are zero). A stand-in for trained attention's locality, to time a "
                         "dynamic sparse rule at the density such heads give (reported under the table); it says "
                         "nothing of a real model's density or quality")
    pl.add_argument("--tiny", action="store_true", help="the tiny test transformers (CPU smoke run)")
    pl.add_argument("--out", default=None, help="append the markdown table to this file")
    pp = which.add_parser("parallel", help="under torchrun: one forward on 1 GPU vs split over N (context parallel)",
                          description=bench_parallel.__doc__, formatter_class=fmt)
    pp.add_argument("--model", choices=["wan22", "hunyuan"], default="wan22", help="transformer shape")
    pp.add_argument("--layers", type=int, default=None, help="transformer blocks (default: the real model's)")
    pp.add_argument("--resolution", choices=list(LATENTS), default="720p", help="video size of the forward")
    pp.add_argument("--methods", nargs="+", default=["fp16", "mxattn"], help="each fully in that method")
    pp.add_argument("--ring-degree", type=int, default=None,
                    help="ring attention degree (default: processes / ulysses degree)")
    pp.add_argument("--ulysses-degree", type=int, default=None, help="default: all processes")
    pp.add_argument("--reps", type=int, default=2, help="timed forwards after one warm-up (the median is kept)")
    pp.add_argument("--tiny", action="store_true", help="the tiny test transformers (CPU smoke run)")
    pp.add_argument("--out", default=None, help="append the markdown table to this file")
    return p


def run(args) -> int:
    import torch

    if not torch.cuda.is_available() and not getattr(args, "tiny", False):
        raise UsageError("fp4video bench needs a CUDA GPU")
    if args.out:  # written after minutes of timing: checked first
        check_output_file(args.out, "--out")
    if getattr(args, "plot", None):
        check_output_file(args.plot, "--plot")
    if args.what == "parallel":
        table = bench_parallel(args)
        if table is None:  # not rank 0
            return 0
    elif args.what == "sparse":
        from .bench_sparse import bench_sparse, plot_sparse

        table, rows = bench_sparse(args)
        if args.plot:
            print(f"wrote {plot_sparse(rows, args.plot, table.splitlines()[0].removeprefix('### '))}", file=sys.stderr)
    else:
        table = bench_kernel(args) if args.what == "kernel" else bench_pipeline(args)
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write(table + "\n")
    if getattr(args, "plot", None) and args.what != "sparse":
        from ..eval.speed import parse_kernel_tables, plot_kernel_tables

        print(f"wrote {plot_kernel_tables(parse_kernel_tables(table), args.plot)}", file=sys.stderr)
    return 0


#: Heads of the fp32 reference every row's accuracy is measured against (all heads cost seconds).
REFERENCE_HEADS = 4


def bench_kernel(args) -> str:
    """Every bf16 attention installed (cuDNN, flash and default SDPA, FlashAttention-3), the peers
    (SageAttention2, FlashAttention-3 FP8 with and without its cast) and fp4video's methods, timed in
    this process on the same inputs; speed × the fastest bf16 and × each peer, accuracy against an
    fp32 reference (its first 4 heads: cosine, worst row), and with NVML (``fp4video[bench]``) the
    SM clock over each timing and the share of it at the power cap. ``--density``: each method whose
    loop takes a selection also block-sparse at that density (a random selection); its accuracy is
    against the dense reference, so it includes the weight the selection drops."""
    import contextlib

    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .. import METHODS, fp4_attention
    from ..eval.peers import find_peers
    from ..eval.power import ClockSampler
    from ..kernels.dispatch import prepare, run_loop
    from ..kernels.plan import plan
    from ..metrics import cossim, row_cosine

    def bench(fn):  # ~1.5 s per measurement: at least 7 calls of the longest shapes
        return triton.testing.do_bench(fn, warmup=100, rep=1500, return_mode="median")

    sampler = ClockSampler.for_device(torch.cuda.current_device())
    if not sampler.available:
        print(f"  clock and power not sampled: {sampler.why}", file=sys.stderr)

    def timed(fn):
        """(median ms, the SM clock and power over the timing: :class:`PowerSample` or None)."""
        with sampler:
            t = bench(fn)
        return t, sampler.result

    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa_rows = (("cuDNN SDPA bf16", SDPBackend.CUDNN_ATTENTION), ("flash SDPA bf16", SDPBackend.FLASH_ATTENTION),
                 ("SDPA default dispatch bf16", None))
    peers = find_peers(key_mask=bool(args.masked_keys))
    for p in peers:
        if p.fn is None:
            print(f"  {p.name}: not timed, {p.missing}", file=sys.stderr)
    rows = []
    for s in args.seqs:
        g = torch.Generator(device="cuda").manual_seed(0)
        shape = (1, args.heads, s, args.head_dim) if args.layout == "bhsd" else (1, s, args.heads, args.head_dim)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        if args.layout == "bshd":  # (B, H, S, D) views of (B, S, H, D) storage
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        mask = key_alive = None
        if args.masked_keys:  # key padding at the end, as HunyuanVideo's padded text tokens
            mask = torch.ones(1, 1, 1, s, device="cuda", dtype=torch.bool)
            mask[..., s - args.masked_keys:] = False
            key_alive = mask[:, 0, 0, :]
        h = min(REFERENCE_HEADS, args.heads)
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):  # fp32, O(S) memory
            truth = sdpa(*(t[:, :h].float() for t in (q, k, v)), attn_mask=mask)

        def accuracy(out):
            out = out[:, :h].float()
            return cossim(out, truth), float(row_cosine(out, truth).min())

        measured = []  # Measured rows
        for name, backend in sdpa_rows:
            try:
                with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                    out = sdpa(q, k, v, attn_mask=mask)
                    measured.append(Measured(name, "bf16", *timed(lambda: sdpa(q, k, v, attn_mask=mask)), out))
            except RuntimeError as e:  # this backend cannot run the call (e.g. flash with a mask)
                print(f"  S={s} {name}: not available ({str(e).splitlines()[0][:80]})", file=sys.stderr)
        for p in peers:
            if p.fn is None:
                continue
            try:
                a = p.args(q, k, v)
                out = p.fn(*a)
                measured.append(Measured(p.name, p.precision, *timed(lambda: p.fn(*a)), out))
            except Exception as e:  # a peer's build that cannot run this shape: say so, keep going
                print(f"  S={s} {p.name}: failed ({type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''})",
                      file=sys.stderr)
            a = None
        for m in args.methods:
            recipe = METHODS[m]
            out = fp4_attention(q, k, v, method=m, attn_mask=mask, backend="triton")
            t_total, power = timed(lambda: fp4_attention(q, k, v, method=m, attn_mask=mask, backend="triton"))
            call_plan = plan(recipe, q, v, mask)
            t_pre = bench(lambda: prepare(q, k, v, recipe, key_alive, call_plan)) if recipe.quantized else None
            operands = prepare(q, k, v, recipe, key_alive, call_plan)
            # the loop as these calls run it: random inputs' logits lie within the e4m3 loop's fast bound
            t_loop = bench(lambda: run_loop(call_plan, operands, key_alive, recipe=recipe, scale=args.head_dim**-0.5,
                                            out_dtype=q.dtype, dv=v.shape[-1], exact=False))
            measured.append(Measured(f"fp4video {m}", m, t_total, power, out, t_pre, t_loop))
            if args.density is not None and call_plan.sparse_reason is None:
                sel = uniform_selection(args.heads, s, s, args.density)
                sparse_out = fp4_attention(q, k, v, method=m, attn_mask=mask, backend="triton", sparsity=sel)
                t_sparse, p_sparse = timed(lambda: fp4_attention(q, k, v, method=m, attn_mask=mask, backend="triton",
                                                                 sparsity=sel))
                measured.append(Measured(f"fp4video {m} block-sparse, density {float(sel.density()):.2f}", m,
                                         t_sparse, p_sparse, sparse_out))
                sparse_out = sel = None
            print(f"  S={s} {m}: {t_total:.2f} ms", file=sys.stderr, flush=True)
            operands = None
        best = min((r for r in measured if r.precision == "bf16"), key=lambda r: r.ms)
        peer_ms = {r.name: r.ms for r in measured}
        for r in measured:
            cos32, worst32 = accuracy(r.out)
            rows.append(KernelTiming(
                s, r.name + (" (best bf16)" if r is best else ""), r.ms, r.pre_ms, r.loop_ms, best.ms / r.ms,
                {peer: peer_ms[peer] / r.ms if peer in peer_ms else None for peer in RATIO_PEERS},
                cos32, worst32, None if r is best else cossim(r.out.float(), best.out.float()),
                None if r.power is None else r.power.mhz, None if r.power is None else r.power.capped))
        del measured, best
        q = k = v = truth = out = None  # (frees the GPU memory before the next length)
        torch.cuda.empty_cache()
    masked = f", last {args.masked_keys} keys masked (key padding)" if args.masked_keys else ""
    layout = ", (B, S, H, D) storage as in diffusers" if args.layout == "bshd" else ""
    notes = [f"{p.name}: {p.missing}" for p in peers if p.fn is None]
    if not sampler.available or any(r.mhz is None for r in rows):
        notes.append(f"SM clock and power cap: {sampler.why or 'not sampled for every row'}")
    return format_kernel_table(run_header(f"bench kernel, B=1 H={args.heads} D={args.head_dim}, bf16{masked}{layout}"),
                               rows, args.heads, args.head_dim, notes=notes)


@dataclass(frozen=True, eq=False)
class Measured:
    """One timed kernel of a ``bench kernel`` run: its name and precision, median ms, the SM clock
    and power over the timing (None: not sampled), its output, and (fp4video's methods) the
    pre-pass's and the loop's own times."""

    name: str
    precision: str
    ms: float
    power: object
    out: object
    pre_ms: float | None = None
    loop_ms: float | None = None


@dataclass(frozen=True)
class KernelTiming:
    """One row of ``bench kernel``: times in ms (pre-pass and loop for fp4video's methods),
    speed × the best bf16 of the run and × each of :data:`RATIO_PEERS` (None: not run), cosine and
    worst-row cosine to the fp32 reference, cosine to the best bf16 (None for that row itself)."""

    seq: int
    kernel: str
    ms: float
    pre_ms: float | None
    loop_ms: float | None
    x_best_bf16: float
    x_peers: dict
    cos_fp32: float
    worst_row_fp32: float
    cos_best_bf16: float | None
    #: mean SM clock (MHz) over the timing, and the share of it the power cap held the clock down
    #: (None: not sampled, :mod:`fp4video.eval.power`)
    mhz: float | None = None
    capped: float | None = None


def format_kernel_table(header: str, rows: list[KernelTiming], heads: int, head_dim: int, *,
                        notes: list[str] = ()) -> str:
    """``bench kernel``'s markdown (:mod:`fp4video.eval.speed` reads it back); ``notes`` (peers not
    run, and why) follow the table. The last two columns: the SM clock over the row's timing and the
    share of it spent at the power cap (a kernel that draws more power runs at a lower clock)."""
    lines = [header, "",
             "| S | kernel | ms (total) | TFLOP/s | pre-pass ms | loop ms | × best bf16 | "
             + " | ".join(RATIO_TITLES) + " | cosine to fp32 | worst-row cosine to fp32 | cosine to best bf16 | "
             "SM MHz | power-capped |",
             "|" + " --- |" * (13 + len(RATIO_TITLES) - 1)]
    fmt = lambda x, spec=".2f": "" if x is None else format(x, spec)  # noqa: E731
    for r in rows:
        tflops = 4 * heads * r.seq * r.seq * head_dim / r.ms / 1e9
        ratios = " | ".join("n/a" if r.x_peers.get(p) is None else f"{r.x_peers[p]:.2f}" for p in RATIO_PEERS)
        lines.append(f"| {r.seq} | {r.kernel} | {r.ms:.2f} | {tflops:.0f} | {fmt(r.pre_ms)} | {fmt(r.loop_ms)} | "
                     f"{r.x_best_bf16:.2f} | {ratios} | {r.cos_fp32:.5f} | {r.worst_row_fp32:.4f} | "
                     f"{'(best bf16)' if r.cos_best_bf16 is None else f'{r.cos_best_bf16:.5f}'} | "
                     f"{fmt(r.mhz, '.0f')} | {fmt(None if r.capped is None else 100 * r.capped, '.0f')}"
                     f"{'' if r.capped is None else '%'} |")
    lines.append("")
    lines += [f"Not timed: {n}." for n in notes]
    return "\n".join(lines).rstrip("\n") + "\n"


def make_heads_local(model, flattest: float, sharpest: float, seed: int = 0) -> None:
    """Make every self-attention head of a Wan transformer attend by position, in place: each
    block's ``to_q`` and ``to_k`` give one vector for every token (zero weight, a shared random
    bias), so after RoPE a logit depends only on the query's and key's latent-grid offset and is
    largest at offset 0; the norms' weights set each head's sharpness (the logits scale with its
    square), spread over the heads from ``flattest`` to ``sharpest``. Values, cross-attention and
    everything else stay random."""
    import torch

    _check_local(flattest, sharpest)
    g = torch.Generator().manual_seed(seed)
    for block in model.blocks:
        attn = block.attn1
        heads, width = attn.heads, attn.to_q.out_features
        shared = torch.randn(width, generator=g)
        sharp = torch.linspace(flattest, sharpest, heads).repeat_interleave(width // heads)
        with torch.no_grad():
            for proj in (attn.to_q, attn.to_k):
                proj.weight.zero_()
                proj.bias.copy_(shared.to(proj.bias))
            for norm in (attn.norm_q, attn.norm_k):
                norm.weight.copy_(sharp.to(norm.weight))


#: ``--local-heads``' largest sharpness: the logits scale with its square (about 11 · s² at offset 0)
LOCAL_SHARPEST = 100.0


def _check_local(flattest: float, sharpest: float) -> None:
    if not (math.isfinite(flattest) and math.isfinite(sharpest) and 0 < flattest <= sharpest <= LOCAL_SHARPEST):
        raise UsageError(f"--local-heads takes 0 < FLATTEST <= SHARPEST <= {LOCAL_SHARPEST:g}, got {flattest:g} "
                         f"{sharpest:g}")


def _local_heads(args) -> list | None:
    """``args.local_heads`` once checked (a one-line ``UsageError`` where it cannot apply), else None."""
    local = getattr(args, "local_heads", None)
    if not local:
        return None
    if args.model != "wan22":
        raise UsageError("--local-heads is for --model wan22 (Wan's processor and RoPE)")
    _check_local(*local)
    variants = [linear_variant(v) if isinstance(v, str) else v for v in getattr(args, "linear", ["bf16"])]
    if any(v != LinearVariant("bf16") for v in variants):
        raise UsageError("--local-heads zeroes the self-attention's q/k projection weights: time it with "
                         "bf16 linear layers only (a quantized zero weight has no scale)")
    return local


def local_note(flattest: float, sharpest: float) -> str:
    return (f"--local-heads {flattest:g} {sharpest:g}: every self-attention head attends by position (RoPE alone shapes "
            "its logits), its sharpness spread over that range: a stand-in for trained attention's locality; the "
            "density is this construction's, not a real model's")


def _build(args, device="cuda"):
    """(model, make_inputs(resolution) -> (kwargs, video tokens), description), random weights:
    bf16 full-size shapes on the GPU, or with ``args.tiny`` the tiny test transformers (CPU, fp32)."""
    local = _local_heads(args)
    built = _build_tiny(args, device) if getattr(args, "tiny", False) else _build_full(args, device)
    if local:
        model, inputs, desc = built
        make_heads_local(model, *local)
        return model, inputs, desc + ", self-attention heads made local (--local-heads)"
    return built


def _build_full(args, device):
    import torch

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            if args.model == "wan22":
                from diffusers import WanTransformer3DModel

                layers = args.layers or WAN22_A14B["num_layers"]
                model = WanTransformer3DModel(**{**WAN22_A14B, "num_layers": layers}).eval()
                desc = f"Wan2.2-A14B-shaped transformer ({layers} of 40 blocks), 512 text tokens"
            else:
                from diffusers import HunyuanVideoTransformer3DModel

                dual = args.layers or HUNYUAN["num_layers"]
                model = HunyuanVideoTransformer3DModel(**{**HUNYUAN, "num_layers": dual,
                                                          "num_single_layers": 2 * dual}).eval()
                desc = (f"HunyuanVideo-shaped transformer ({dual} of 20 dual + {2 * dual} of 40 single blocks), "
                        "256 text tokens of which 200 valid (key-padding mask)")
    finally:
        torch.set_default_dtype(default)

    def inputs(res):
        g = torch.Generator(device=device).manual_seed(1)  # the same inputs on every rank
        rand = lambda *shape: torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=g)  # noqa: E731
        kw = {"timestep": torch.tensor([500.0], device=device), "return_dict": False}
        if args.model == "wan22":
            f, h, w = LATENTS[res]
            kw.update(hidden_states=rand(1, 16, f, h, w), encoder_hidden_states=rand(1, 512, 4096))
        else:
            f, h, w = HUNYUAN_LATENTS[res]
            mask = torch.zeros(1, 256, device=device, dtype=torch.bool)
            mask[:, :200] = True
            kw.update(hidden_states=rand(1, 16, f, h, w), encoder_hidden_states=rand(1, 256, 4096),
                      encoder_attention_mask=mask, pooled_projections=rand(1, 768),
                      guidance=torch.tensor([6000.0], device=device))
        return kw, f * (h // 2) * (w // 2)

    return model, inputs, desc


def _build_tiny(args, device):
    """The tiny random transformers of the tests (CPU smoke runs of the bench code paths)."""
    import torch

    from ..integration.tiny import tiny_hunyuan_transformer, tiny_wan_transformer

    model = (tiny_wan_transformer(0, 32) if args.model == "wan22" else tiny_hunyuan_transformer(0, 32)).to(device)

    def inputs(res):
        g = torch.Generator(device=device).manual_seed(1)
        kw = {"timestep": torch.tensor([500.0], device=device), "return_dict": False,
              "encoder_hidden_states": torch.randn(1, 24, 32 if args.model == "wan22" else 16, device=device,
                                                   generator=g)}
        if args.model == "wan22":
            kw["hidden_states"] = torch.randn(1, 16, 2, 16, 16, device=device, generator=g)
        else:
            mask = torch.zeros(1, 24, dtype=torch.bool, device=device)
            mask[:, :17] = True
            kw.update(hidden_states=torch.randn(1, 4, 2, 16, 16, device=device, generator=g), encoder_attention_mask=mask,
                      pooled_projections=torch.randn(1, 8, device=device, generator=g),
                      guidance=torch.tensor([6000.0], device=device))
        return kw, 2 * 8 * 8

    return model, inputs, f"tiny {args.model} transformer (smoke test)"


def _timer(device):
    """seconds(fn) on ``device``: CUDA events on a GPU, wall clock on the CPU."""
    import time

    import torch

    def seconds(fn):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1000
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return seconds


def bench_parallel(args) -> str | None:
    """Under ``torchrun --nproc-per-node N``: one transformer forward per method on one GPU (every
    rank runs it alone, concurrently) and then split over the N GPUs with context parallelism, in
    the same job; the outputs are compared. Returns the table on rank 0, None elsewhere."""
    import torch
    import torch.distributed as dist

    from ..integration import Policy, distributed, install, uninstall
    from ..metrics import cossim

    rank, size = distributed.world()
    if size < 2:
        raise ValueError("bench parallel runs under torchrun with at least 2 processes "
                         "(torchrun --nproc-per-node 2 -m fp4video.cli.main bench parallel ...)")
    device = distributed.setup_process_group(None if torch.cuda.is_available() else "cpu")
    ring = args.ring_degree or (size // args.ulysses_degree if args.ulysses_degree else 1)
    ulysses = args.ulysses_degree or size // ring
    model, inputs, desc = _build(args, device)
    kw, tokens = inputs(args.resolution)
    seconds = _timer(device)

    def forward():
        with torch.no_grad():
            return model(**kw)[0]

    def timed(policy):
        install(model, policy, record=False)
        try:
            out = forward()  # warm-up (and compilation)
            dist.barrier()
            times = sorted(seconds(forward) for _ in range(args.reps))
        finally:
            uninstall(model)
        return out, times[len(times) // 2]

    policies = {m: Policy.model_validate({"method": m}) for m in args.methods}
    single = {m: timed(p) for m, p in policies.items()}

    distributed.enable_context_parallel(model, ring_degree=ring, ulysses_degree=ulysses, device=device)
    split = {m: timed(p) for m, p in policies.items()}
    dist.barrier()  # every rank done with its collectives before the group goes
    dist.destroy_process_group()
    if rank != 0:
        return None
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    lines = [f"### bench parallel, {desc}, {args.resolution} ({tokens} video tokens), one forward, fully "
             f"{'/'.join(args.methods)}: {size} × {name}, ring {ring} × ulysses {ulysses}, "
             f"torch {torch.__version__}, {datetime.date.today().isoformat()}", "",
             f"| method | 1 GPU s / forward | {size} GPUs s / forward | speed-up | cosine {size} vs 1 GPU |",
             "| --- | --- | --- | --- | --- |"]
    for m in args.methods:
        (o1, t1), (on, tn) = single[m], split[m]
        lines.append(f"| {m} | {t1:.3f} | {tn:.3f} | {t1 / tn:.2f} | {cossim(on.float(), o1.float()):.6f} |")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class LinearVariant:
    """One ``bench pipeline --linear`` entry: ``method`` through fp4video's linear installation (block
    0 kept in bf16), or with ``own`` through torchao's ``quantize_`` on the same layers; ``compile``:
    each transformer block compiled."""

    method: str
    compile: bool = False
    own: bool = False

    def label(self) -> str:
        text = f"torchao quantize_ {self.method}" if self.own else self.method
        return text + (", blocks compiled" if self.compile else "")


LINEAR_METHODS = ("bf16", "fp8-rowwise", "fp8-tensor", "mxfp8", "nvfp4")


def linear_variant(text: str) -> LinearVariant:
    """``METHOD``, ``METHOD+compile``, ``torchao:METHOD`` or ``torchao:METHOD+compile``."""
    rest, compiled = (text[:-len("+compile")], True) if text.endswith("+compile") else (text, False)
    own = rest.startswith("torchao:")
    method = rest[len("torchao:"):] if own else rest
    if method not in LINEAR_METHODS or (own and method == "bf16"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a linear variant: METHOD, METHOD+compile, torchao:METHOD or torchao:METHOD+compile, "
            f"METHOD one of {', '.join(LINEAR_METHODS)} (torchao: not bf16)")
    return LinearVariant(method, compiled, own)


def bench_pipeline(args) -> str:
    """Stock diffusers attention, each policy and (``--peers``) each installed peer in place of
    diffusers' SDPA, on one transformer forward each, in one process; all of it under each linear
    variant (``--linear``), the first row set always with bf16 linear layers (the stock step)."""
    import torch

    from ..eval.peers import find_peers, sdpa_replaced_by
    from ..integration import Policy, install, uninstall
    from ..integration.config import load_config
    from ..integration.linear import OUTSIDE_KINDS as OUTSIDE
    from ..integration.linear import (LinearPolicy, check_linear_support, install_linear, plan_linear,
                                      torchao_config, uninstall_linear)
    from ..integration.processor import sparse_summary

    tiny = getattr(args, "tiny", False)
    device = torch.device("cpu" if tiny else "cuda")
    local = _local_heads(args)  # checked before anything is built or installed
    variants = [v if isinstance(v, LinearVariant) else linear_variant(v) for v in getattr(args, "linear", ["bf16"])]
    variants = list(dict.fromkeys(variants))
    if LinearVariant("bf16") not in variants:  # every ratio needs the stock step
        variants.insert(0, LinearVariant("bf16"))
    variants.sort(key=lambda v: (v != LinearVariant("bf16"), v.own))  # stock first; torchao's own has no way back
    if sum(v.own for v in variants) > 1:
        raise UsageError("at most one torchao:METHOD variant per run (quantize_ cannot be undone)")
    for v in variants:  # before the model is built: one line where a method cannot run
        check_linear_support(v.method, device)
    policies = []  # (row label, policy); every config read before the model is built
    notes = [local_note(*local)] if local else []
    for m in args.methods:
        # Wan: MXAttention's block-0-in-FP16 rule; HunyuanVideo: fully 4-bit, as the paper runs it
        rules = [{"method": "fp16", "blocks": [0]}] if m != "fp16" and args.model == "wan22" else []
        policies.append((f"fp4video {m}" + (" (block 0 fp16)" if rules else ""),
                         Policy.model_validate({"method": m, "rules": rules})))
    for path in args.configs:
        config = load_config(path)
        if config.family != {"wan22": "wan", "hunyuan": "hunyuan"}[args.model]:
            raise ValueError(f"{path} is a {config.family} config; this bench runs --model {args.model}")
        policy = config.policy
        stepped = [r for r in policy.rules if r.steps is not None]
        if stepped:  # one forward outside a pipeline has no denoising step: its step rules cannot apply
            policy = policy.model_copy(update={"rules": [r for r in policy.rules if r.steps is None]})
            notes.append(f"{Path(path).name}: its step rules ({', '.join(r.describe() for r in stepped)}) do not "
                         "apply to one forward outside a pipeline; timed without them")
        policies.append((f"fp4video {Path(path).name}", policy))
    if any(v.compile for v in variants) and not tiny:
        import torch._dynamo

        # every attention row and block-0/other-block pair is a graph of its own; the default limit
        # would drop later rows back to eager silently
        for name, least in (("recompile_limit", 256), ("accumulated_recompile_limit", 4096)):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), least))
    model, inputs, desc = _build(args, device)
    seconds = _timer(device)
    cuda = device.type == "cuda"
    gib = lambda b: b / 2 ** 30  # noqa: E731

    forwards = 1 + args.reps  # what forward_seconds runs: a warm-up and the timed ones

    def forward_seconds(kw):
        """(median seconds, warm-up seconds, peak GiB allocated during the forwards)."""
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            warm = seconds(lambda: model(**kw))  # warm-up (Triton and torch.compile compilation)
            times = [seconds(lambda: model(**kw)) for _ in range(args.reps)]
        peak = gib(torch.cuda.max_memory_allocated()) if cuda else float("nan")
        return sorted(times)[len(times) // 2], warm, peak

    peers = []
    if getattr(args, "peers", False):
        for p in find_peers():
            if not p.whole_call:  # a kernel-only timing: not something a forward can run
                continue
            if p.fn is None:
                notes.append(f"{p.name}: not timed, {p.missing}")
            else:
                peers.append(p)
    # a tiny CPU run lets a stand-in take its fp32 calls (the smoke test of this code path)
    peer_options = dict(dtypes=(torch.float32,), devices=("cpu",)) if tiny else {}
    rows = []  # (resolution, tokens, attention, linear label, seconds, peak GiB)
    weights = {}  # linear label -> GiB allocated with no forward running (the weights, mostly)
    for variant in variants:
        label = variant.label()
        try:
            # block 0 and the small layers outside the blocks (time, text embedders, head) in bf16
            policy = LinearPolicy(method=variant.method, compile=variant.compile,
                                  rules=[{"method": "bf16", "blocks": [0]}, {"method": "bf16", "kinds": list(OUTSIDE)}]
                                  if variant.method != "bf16" else [])
            report = None
            if variant.own:  # torchao's own entry point on exactly the layers fp4video would quantize
                from torchao.quantization import quantize_

                plan = plan_linear(model, policy)  # the layers fp4video's variant quantizes
                names = {id(plan.sites[n].module) for n in plan.quantized()}
                quantize_(model, torchao_config(variant.method), filter_fn=lambda m, fqn: id(m) in names)
                notes.append(f"{label}: the {len(names)} linear layers fp4video's {variant.method} quantizes, through "
                             f"torchao.quantization.quantize_ ({type(torchao_config(variant.method)).__name__})")
                if variant.compile:
                    report = install_linear(model, LinearPolicy(compile=True))
            elif variant != LinearVariant("bf16"):
                report = install_linear(model, policy)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                weights[label] = gib(torch.cuda.memory_allocated())
            if report is not None:
                runs = "; ".join(report.runs.values())
                notes.append(f"{label}: {report.summary()}" + (f" ({runs})" if runs else ""))
            for res in args.resolutions:
                kw, tokens = inputs(res)

                def row(what, timing):
                    secs, warm, peak = timing
                    rows.append((res, tokens, what, label, secs, peak))
                    print(f"  {res} {what} | linear {label}: {secs:.2f} s (warm-up {warm:.1f} s, peak {peak:.1f} GiB)",
                          file=sys.stderr, flush=True)

                row("stock diffusers attention (SDPA)", forward_seconds(kw))
                for what, policy_ in policies:
                    # recorded (an entry per call; nothing read back until the end) for the sparse calls' density
                    ctx = install(model, policy_, record=True)
                    try:
                        timing = forward_seconds(kw)
                    finally:
                        uninstall(model)
                    summary = sparse_summary(ctx.recorded_calls())
                    if summary is not None and variant == variants[0]:
                        notes.append(_sparse_note(f"{res} {what}", summary))
                    row(what, timing)
                for p in peers:
                    try:
                        with sdpa_replaced_by(p, **peer_options) as route:
                            timing = forward_seconds(kw)
                    except Exception as e:  # a peer's build that cannot run these shapes: say so, keep going
                        notes.append(f"{res} {p.name} (linear {label}): failed ({type(e).__name__}: "
                                     f"{str(e).splitlines()[0][:80] if str(e) else ''})")
                        continue
                    if not route.routed:  # a row would be stock SDPA under the peer's name
                        if variant == variants[0]:
                            notes.append(f"{res} {p.name}: not timed, it can take none of the forward's attention "
                                         f"calls ({route.reasons(per=forwards)}) per forward")
                        continue
                    if variant == variants[0]:
                        notes.append(f"{res} {route.summary(per=forwards)} per forward")
                    row(f"{p.name} in place of SDPA", timing)
                del kw
                if cuda:
                    torch.cuda.empty_cache()
            if report is not None and report.refused():
                refused = report.refused()
                notes.append(f"{label}: cuBLASLt refused the GEMM of {len(refused)} layers, which ran those calls "
                             f"weight-only (e.g. {next(iter(refused.items()))}: token count: calls)")
        except Exception as e:  # a variant that cannot run here (a GEMM the GPU refuses): say so, keep going
            notes.append(f"linear {label}: failed ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})")
            print(f"  linear {label}: failed: {e}", file=sys.stderr, flush=True)
            if variant == LinearVariant("bf16"):
                raise
        finally:
            if not variant.own:
                uninstall_linear(model)
    lines = [run_header(f"bench pipeline, {desc}, one forward, batch 1, {'fp32' if tiny else 'bf16'}"), "",
             "| resolution | video tokens | attention | linear layers | s / forward | × stock | "
             "× same attention, bf16 linear | peak GiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    stock_label = LinearVariant("bf16").label()
    base = {(r[0], r[2]): r[4] for r in rows if r[3] == stock_label}
    stock = {r[0]: r[4] for r in rows if r[3] == stock_label and r[2].startswith("stock")}
    for res, tokens, what, label, secs, peak in rows:
        same = base.get((res, what))
        ratio = f"{same / secs:.2f}" if same else "–"
        lines.append(f"| {res} | {tokens} | {what} | {label} | {secs:.2f} | {stock[res] / secs:.2f} | {ratio} | "
                     f"{f'{peak:.1f}' if cuda else '–'} |")
    if weights:
        notes.append("GPU memory allocated between forwards (the transformer's weights, mostly): " + "; ".join(
            f"{label} {w:.1f} GiB ({w / weights[stock_label]:.2f}×)" for label, w in weights.items()))
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _sparse_note(what: str, summary: dict) -> str:
    return (f"{what}: {100 * summary['share']:.0f}% of the attention calls block-sparse, "
            f"mean density {summary['density']:.3f}" + (
                f" ({summary['density_before']:.3f} before repair); exact mass kept per query "
                f"tile (sampled rows): min {summary['kept_min']:.3f}, 1% {summary['kept_q01']:.3f}, "
                f"mean {summary['kept_mean']:.4f} (min {summary['kept_min_before']:.3f} before); "
                f"{100 * summary['repaired']:.1f}% of query tiles repaired; 99% lower bound on each query "
                f"tile's mean over all its rows: min {summary['unseen_min']:.3f}, "
                f"{100 * summary['unseen_under_floor']:.1f}% of query tiles whose bound is under the floor"
                if "kept_min" in summary else ""))
