#!/usr/bin/env python3
"""One fp4video attention call with the kernels of several revisions, side by side in one process,
next to cuDNN SDPA: is a kernel change faster, and by how much (GPU).

Each ``--rev NAME=DIR`` names a copy of ``kernels/`` from another revision, loaded as its own
package (the rest of fp4video is the current one); ``current`` (this checkout's kernels) is always
included. For every sequence length and method: each revision's output against the current one's
(cosine, and whether output and LSE are equal bit for bit), then the pre-pass alone, the attention loop alone and the whole call (medians), and the ratio of
the whole call to cuDNN SDPA timed in the same run. A markdown table goes to stdout.

    git archive ced3705 kernels | tar -x -C /tmp/ced3705
    python tools/compare_kernel_revisions.py --rev base=/tmp/ced3705/kernels --seqs 75600 32760
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

import torch


def load_kernels(name: str, path: str):
    """The dispatch module of the kernels package in ``path`` (``dispatch``; ``attention_fwd`` in
    revisions before 2026-12-01), imported as ``_rev_<name>``: both have ``attention``, ``prepare``
    and ``attention_prepared``."""
    pkg = f"_rev_{name}"
    spec = importlib.util.spec_from_file_location(pkg, os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    if spec is None:
        raise SystemExit(f"error: {path} is not a kernels package (no __init__.py)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[pkg] = module
    spec.loader.exec_module(module)
    name = "dispatch" if os.path.exists(os.path.join(path, "dispatch.py")) else "attention_fwd"
    return importlib.import_module(f"{pkg}.{name}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", action="append", default=[], metavar="NAME=DIR", help="kernels/ of another revision")
    ap.add_argument("--seqs", type=int, nargs="+", default=[75600])
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--methods", nargs="+", default=["mxattn"])
    ap.add_argument("--masked-keys", type=int, default=0, help="key padding at the end of every sequence")
    ap.add_argument("--rep-ms", type=int, default=1500, help="time per measurement (do_bench rep)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fp4video import METHODS
    from fp4video.kernels import dispatch as current
    from fp4video.metrics import cossim

    revs = {"current": current}
    for spec in args.rev:
        name, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"error: --rev wants NAME=DIR, got {spec!r}")
        revs[name] = load_kernels(name, path)

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=args.rep_ms, return_mode="median")

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"H={args.heads}, D=128, bf16, {args.masked_keys} masked keys\n")
    print("| S | method | kernels | pre-pass ms | loop ms | whole call ms | × cuDNN SDPA (same run) | cosine to current "
          "| bits equal to current (out, LSE) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    g = torch.Generator(device="cuda").manual_seed(0)
    for s in args.seqs:
        q, k, v = (torch.randn(1, args.heads, s, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(3))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            t_ref = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        mask = key_alive = None
        if args.masked_keys:
            mask = torch.ones(1, 1, 1, s, device="cuda", dtype=torch.bool)
            mask[..., s - args.masked_keys:] = False
            key_alive = mask[:, 0, 0, :]
        for method in args.methods:
            recipe = METHODS[method]
            outs = {}
            for name, mod in revs.items():
                def call(mod=mod):
                    return mod.attention(q, k, v, recipe=recipe, mask=mask, scale=128**-0.5)

                outs[name] = call()
                prepared = mod.prepare(q, k, v, recipe, key_alive)
                t_pre = bench(lambda mod=mod: mod.prepare(q, k, v, recipe, key_alive))
                t_loop = bench(lambda mod=mod, prepared=prepared: mod.attention_prepared(
                    prepared, key_alive, recipe=recipe, scale=128**-0.5, out_dtype=q.dtype, dv=128))
                t_all = bench(call)
                prepared = None
                (out, lse), (cur, cur_lse) = outs[name], outs["current"]
                equal = f"{torch.equal(out, cur)}, {torch.equal(lse, cur_lse)}"
                print(f"| {s} | {method} | {name} | {t_pre:.2f} | {t_loop:.2f} | {t_all:.2f} | {t_ref / t_all:.3f} | "
                      f"{cossim(out.float(), cur.float()):.6f} | {equal} |", flush=True)
        q = k = v = outs = mask = key_alive = None  # (frees the GPU memory before the next length; the closures above are done)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
