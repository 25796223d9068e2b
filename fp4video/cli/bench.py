"""``fp4video bench``: speed on a GPU, always against the best baseline measured in the same run.

- ``bench kernel``: fp4video's Triton attention vs cuDNN / flash SDPA (bf16), per method, with the
  pre-pass and the attention loop also timed on their own.
- ``bench pipeline``: one denoising forward of a full-size Wan2.2-A14B- or HunyuanVideo-shaped
  transformer (random bf16 weights: speed does not depend on them) with diffusers' stock attention
  vs each policy.
- ``bench parallel`` (under torchrun): the same forward on one GPU and split over N GPUs with
  context parallelism, in one job; speed-up and the cosine between the two outputs.
"""

from __future__ import annotations

import argparse
import datetime
import sys

EXAMPLES = """examples:
  fp4video bench kernel --seqs 8192 32760 75600 --out BENCHMARKS-run.md --plot kernel-speed.png
  fp4video bench kernel --heads 24 --seqs 119056 --masked-keys 56     # HunyuanVideo 720p with its text padding
  fp4video bench pipeline --resolutions 480p 720p --methods fp16 mxattn sage3
  fp4video bench pipeline --model hunyuan --layers 2 --resolutions 720p
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
    which = p.add_subparsers(dest="what", required=True, metavar="{kernel,pipeline,parallel}")
    k = which.add_parser("kernel", help="attention kernels vs cuDNN / flash SDPA")
    k.add_argument("--seqs", type=int, nargs="+", default=[8192, 32760, 75600])
    k.add_argument("--heads", type=int, default=40)
    k.add_argument("--head-dim", type=int, default=128)
    k.add_argument("--methods", nargs="+", default=["fp16", "mxattn", "mxattn-sk", "sage3", "nvfp4", "mxfp4-ocp"])
    k.add_argument("--masked-keys", type=int, default=0,
                   help="mask the last N keys (key padding; HunyuanVideo 720p: --heads 24 --seqs 119056 --masked-keys 56)")
    k.add_argument("--layout", choices=["bhsd", "bshd"], default="bhsd",
                   help="bshd: (B, S, H, D) tensors as diffusers holds them (SDPA gets transposed views)")
    k.add_argument("--out", default=None, help="append the markdown table to this file")
    k.add_argument("--plot", default=None, metavar="PNG",
                   help="also draw the table (× best baseline per method and length) as this PNG")
    pl = which.add_parser("pipeline", help="Wan2.2-A14B-shaped transformer forward: stock vs policies")
    pl.add_argument("--resolutions", nargs="+", default=["480p", "720p"], choices=list(LATENTS))
    pl.add_argument("--methods", nargs="+", default=["fp16", "mxattn", "sage3"],
                    help="each runs with MXAttention's block-0-in-FP16 rule (the paper's policy)")
    pl.add_argument("--model", choices=["wan22", "hunyuan"], default="wan22", help="transformer shape")
    pl.add_argument("--layers", type=int, default=None,
                    help="transformer blocks (default: the real model's; HunyuanVideo: dual blocks, "
                         "with twice as many single blocks)")
    pl.add_argument("--reps", type=int, default=2)
    pl.add_argument("--out", default=None, help="append the markdown table to this file")
    pp = which.add_parser("parallel", help="under torchrun: one forward on 1 GPU vs split over N (context parallel)")
    pp.add_argument("--model", choices=["wan22", "hunyuan"], default="wan22", help="transformer shape")
    pp.add_argument("--layers", type=int, default=None, help="transformer blocks (default: the real model's)")
    pp.add_argument("--resolution", choices=list(LATENTS), default="720p")
    pp.add_argument("--methods", nargs="+", default=["fp16", "mxattn"], help="each fully in that method")
    pp.add_argument("--ring-degree", type=int, default=None)
    pp.add_argument("--ulysses-degree", type=int, default=None, help="default: all processes")
    pp.add_argument("--reps", type=int, default=2)
    pp.add_argument("--tiny", action="store_true", help="the tiny test transformers (CPU smoke run)")
    pp.add_argument("--out", default=None, help="append the markdown table to this file")
    return p


def run(args) -> int:
    import torch

    if not torch.cuda.is_available() and not getattr(args, "tiny", False):
        print("error: fp4video bench needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.what == "parallel":
        table = bench_parallel(args)
        if table is None:  # not rank 0
            return 0
    else:
        table = bench_kernel(args) if args.what == "kernel" else bench_pipeline(args)
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write(table + "\n")
    if getattr(args, "plot", None):
        from ..eval.speed import parse_kernel_tables, plot_kernel_tables

        print(f"wrote {plot_kernel_tables(parse_kernel_tables(table), args.plot)}", file=sys.stderr)
    return 0


def _header(what: str) -> str:
    import torch
    import triton

    return (f"### {what}: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
            f"{datetime.date.today().isoformat()}")


def bench_kernel(args) -> str:
    import contextlib

    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .. import METHODS, fp4_attention
    from ..kernels.dispatch import attention_prepared, prepare
    from ..metrics import cossim

    def bench(fn):  # ~1.5 s per measurement: at least 7 calls of the longest shapes
        return triton.testing.do_bench(fn, warmup=100, rep=1500, return_mode="median")

    sdpa = torch.nn.functional.scaled_dot_product_attention
    baselines = (("cuDNN SDPA bf16", SDPBackend.CUDNN_ATTENTION), ("flash SDPA bf16", SDPBackend.FLASH_ATTENTION),
                 ("SDPA default dispatch bf16", None))
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
        measured = []
        for name, backend in baselines:
            try:
                with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                    out = sdpa(q, k, v, attn_mask=mask)
                    measured.append((name, bench(lambda: sdpa(q, k, v, attn_mask=mask)), out))
            except RuntimeError as e:  # this backend cannot run the call (e.g. flash with a mask)
                print(f"  S={s} {name}: not available ({str(e).splitlines()[0][:80]})", file=sys.stderr)
        best_name, t_best, ref = min(measured, key=lambda r: r[1])
        for name, t, out in measured:
            cos = None if name == best_name else cossim(out.float(), ref.float())
            rows.append((s, name + (" (best baseline)" if name == best_name else ""), t, None, None, t_best / t, cos))
        del measured
        for m in args.methods:
            recipe = METHODS[m]
            out = fp4_attention(q, k, v, method=m, attn_mask=mask, backend="triton")
            t_total = bench(lambda: fp4_attention(q, k, v, method=m, attn_mask=mask, backend="triton"))
            t_pre = bench(lambda: prepare(q, k, v, recipe, key_alive)) if recipe.quantized else None
            prepared = prepare(q, k, v, recipe, key_alive)
            t_loop = bench(lambda: attention_prepared(prepared, key_alive, recipe=recipe, scale=args.head_dim**-0.5,
                                                      out_dtype=q.dtype, dv=v.shape[-1]))
            rows.append((s, f"fp4video {m}", t_total, t_pre, t_loop, t_best / t_total, cossim(out.float(), ref.float())))
            print(f"  S={s} {m}: {t_total:.2f} ms", file=sys.stderr, flush=True)
            prepared = None
        q = k = v = ref = None  # (frees the GPU memory before the next length; the closures above are done)
        torch.cuda.empty_cache()
    masked = f", last {args.masked_keys} keys masked (key padding)" if args.masked_keys else ""
    layout = ", (B, S, H, D) storage as in diffusers" if args.layout == "bshd" else ""
    return format_kernel_table(_header(f"bench kernel, B=1 H={args.heads} D={args.head_dim}, bf16{masked}{layout}"),
                               rows, args.heads, args.head_dim)


def format_kernel_table(header: str, rows, heads: int, head_dim: int) -> str:
    """``bench kernel``'s markdown: ``rows`` of (S, kernel, ms, pre-pass ms | None, loop ms | None,
    × best baseline, cosine | None for the baseline itself); :mod:`fp4video.eval.speed` reads it back."""
    lines = [header, "",
             "| S | kernel | ms (total) | TFLOP/s | pre-pass ms | loop ms | × best baseline | cosine to best baseline |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    fmt = lambda x: "" if x is None else f"{x:.2f}"  # noqa: E731
    for s, what, t, pre, loop, ratio, cos in rows:
        tflops = 4 * heads * s * s * head_dim / t / 1e9
        lines.append(f"| {s} | {what} | {t:.2f} | {tflops:.0f} | {fmt(pre)} | {fmt(loop)} | {ratio:.2f} | "
                     f"{'(reference)' if cos is None else f'{cos:.5f}'} |")
    return "\n".join(lines) + "\n"


def _build(args, device="cuda"):
    """(model, make_inputs(resolution) -> (kwargs, video tokens), description), random weights:
    bf16 full-size shapes on the GPU, or with ``args.tiny`` the tiny test transformers (CPU, fp32)."""
    import torch

    if getattr(args, "tiny", False):
        return _build_tiny(args, device)
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

    from ..integration.tiny import _tiny_wan_transformer, tiny_hunyuan_transformer

    model = (_tiny_wan_transformer(0, 32) if args.model == "wan22" else tiny_hunyuan_transformer(0, 32)).to(device)

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
        raise SystemExit("error: bench parallel runs under torchrun with at least 2 processes "
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


def bench_pipeline(args) -> str:
    import torch

    from ..integration import Policy, install, uninstall

    model, inputs, desc = _build(args)

    def forward_seconds(kw):
        with torch.no_grad():
            model(**kw)  # warm-up (and Triton compilation)
            torch.cuda.synchronize()
            times = []
            for _ in range(args.reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                model(**kw)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1000)
        return sorted(times)[len(times) // 2]

    rows = []
    for res in args.resolutions:
        kw, tokens = inputs(res)
        stock = forward_seconds(kw)
        rows.append((res, tokens, "stock diffusers attention (SDPA)", stock))
        print(f"  {res} stock: {stock:.2f} s", file=sys.stderr, flush=True)
        for m in args.methods:
            # Wan: MXAttention's block-0-in-FP16 rule; HunyuanVideo: fully 4-bit, as the paper runs it
            rules = [{"method": "fp16", "blocks": [0]}] if m != "fp16" and args.model == "wan22" else []
            install(model, Policy.model_validate({"method": m, "rules": rules}), record=False)
            try:
                secs = forward_seconds(kw)
            finally:
                uninstall(model)
            rows.append((res, tokens, f"fp4video {m}" + (" (block 0 fp16)" if rules else ""), secs))
            print(f"  {res} {m}: {secs:.2f} s", file=sys.stderr, flush=True)
        del kw
        torch.cuda.empty_cache()
    lines = [_header(f"bench pipeline, {desc}, one forward, batch 1, bf16"), "",
             "| resolution | video tokens | attention | s / forward | × stock |", "| --- | --- | --- | --- | --- |"]
    base = {r[0]: r[3] for r in rows if r[2].startswith("stock")}
    for res, tokens, what, secs in rows:
        lines.append(f"| {res} | {tokens} | {what} | {secs:.2f} | {base[res] / secs:.2f} |")
    return "\n".join(lines) + "\n"
