#!/usr/bin/env python3
"""Video quality of every attention policy on the project's trained test model (fp4video.testmodel),
against its FP16 clips, on fixed held-out captions and seeds.

    python3 scripts/test_model_quality.py --out quality/              # GPU: every policy
    python scripts/test_model_quality.py --quick --out quality/       # fewer captions and policies (a CPU can)
    python3 scripts/test_model_quality.py --model $OUT/testmodel --out quality/   # a pack or folder

Policies: every fp4video method of METHODS everywhere and under the hybrid policy (block 0 and the
last two steps in FP16, configs/wan22_mxattn.yaml's shape) — the ``fp8`` tier among them;
block-sparse ``mxattn-pv8`` self-attention (hybrid) on static windows and on the dynamic selection
at several τ, each as is and as the shipped sparse configs run it (the window with the sinks each
call finds; the dynamic rule with sinks and a floor of 0.9 its check repairs to);
calibrated policies (``fp4video.calibrate`` on a few training captions, chosen again at each
budget); the quantized external backends that run here (others are listed as unavailable); the
linear layers in FP8 (torchao's per-row float8 on the layers fp4video's ``fp8-rowwise`` plan
quantizes: blocks 1 onwards, block 0, the embedders and the head kept), emulated exactly
(:func:`fp4video.formats.float8_linear`: any device runs it), with stock attention and with ``fp8``
attention under the hybrid policy.

Per policy and clip: per-frame PSNR / SSIM / cosine against the FP16 clip
(:func:`fp4video.eval.paired_metrics`), the motion checker's verdict and whether it agrees with the
FP16 clip's, and per attention site the output's relative L2 error against exact attention on the
same inputs (worst head; the mean over the clip's calls per block and kind), the density of sparse
calls and the exact attention mass their query tiles kept (each call's check, sampled rows;
:func:`fp4video.integration.processor.sparse_summary`), and the calibration's predicted error of the policy (its sites' calibration errors).

Written as it goes to ``--out``: ``results.json`` (after every policy; a second run with the same
settings skips the policies it holds), ``results.md`` (the table), ``psnr.png`` (PSNR per policy),
``calibration.png`` (predicted error against PSNR, Spearman ρ), ``calibration.json`` (the
calibration report) and ``reference.npz`` (the FP16 clips, uint8).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import fp4video  # noqa: F401
except ImportError:  # a checkout without an install: the package beside this script
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

HYBRID = [{"method": "fp16", "blocks": [0]}, {"method": "fp16", "steps": {"last": 2}}]
SPARSE_METHOD = "mxattn-pv8"
#: Static windows (radii in latent frames, rows, columns) on the 8 × 16 × 16 latent grid, narrowest first.
STATIC_WINDOWS = ([1, 3, 3], [2, 5, 5], [3, 8, 8])
DYNAMIC_TAUS = (0.8, 0.9, 0.95, 0.98)
BUDGETS = (0.05, 0.1, 0.2, 0.4)
#: The floor of the repaired dynamic rows (the shipped dynamic config's).
FLOOR = 0.9


def policy_list(quick: bool) -> list[dict]:
    """[{name, group, policy (Policy keyword arguments) or budget}] in the order they run."""
    from fp4video import METHODS
    from fp4video.calibration import OPTIONAL_BACKENDS

    out = []
    methods = [m for m in METHODS if m != "fp16"]
    if quick:
        methods = [m for m in ("mxattn", "mxattn-pv8", "nvfp4", "sage3", "fp8") if m in METHODS]
    for m in methods:
        out.append({"name": f"{m} hybrid", "group": "method hybrid", "policy": {"method": m, "rules": HYBRID}})
        if not quick or m == "mxattn":
            out.append({"name": m, "group": "method everywhere", "policy": {"method": m}})
    windows = STATIC_WINDOWS[1:2] if quick else STATIC_WINDOWS
    for w in windows:
        out.append({"name": f"{SPARSE_METHOD} static {','.join(map(str, w))} radial hybrid", "group": "sparse static",
                    "policy": {"method": SPARSE_METHOD, "rules": HYBRID + [
                        {"method": SPARSE_METHOD, "kinds": ["self"],
                         "sparsity": {"static": {"window": list(w), "radial": True}}}]}})
    for tau in (0.9,) if quick else DYNAMIC_TAUS:
        out.append({"name": f"{SPARSE_METHOD} dynamic τ={tau:g} hybrid", "group": "sparse dynamic",
                    "policy": {"method": SPARSE_METHOD, "rules": HYBRID + [
                        {"method": SPARSE_METHOD, "kinds": ["self"], "sparsity": {"dynamic": {"tau": tau}}}]}})
    # the shipped sparse configs' selections on this grid: a window with the sinks each call finds,
    # and the dynamic rule (2 estimate rows) with sinks and a floor its check repairs to
    for w in windows:
        out.append({"name": f"{SPARSE_METHOD} static {','.join(map(str, w))} radial + sinks hybrid",
                    "group": "sparse static",
                    "policy": {"method": SPARSE_METHOD, "rules": HYBRID + [
                        {"method": SPARSE_METHOD, "kinds": ["self"],
                         "sparsity": {"static": {"window": list(w), "radial": True}, "sinks": True}}]}})
    for tau in (0.9,) if quick else (0.8, 0.9):
        out.append({"name": f"{SPARSE_METHOD} dynamic τ={tau:g} + sinks, floor {FLOOR:g} hybrid",
                    "group": "sparse dynamic",
                    "policy": {"method": SPARSE_METHOD, "rules": HYBRID + [
                        {"method": SPARSE_METHOD, "kinds": ["self"],
                         "sparsity": {"dynamic": {"tau": tau, "estimate": "sampled", "estimate_rows": 2},
                                      "sinks": True, "floor": FLOOR}}]}})
    for b in (0.1,) if quick else BUDGETS:
        out.append({"name": f"calibrated {b:g}", "group": "calibrated", "budget": b})
    out.append({"name": "fp8-rowwise linear (emulated), stock attention", "group": "linear",
                "policy": {"method": "fp16"}, "linear": "fp8-rowwise"})
    out.append({"name": "fp8-rowwise linear (emulated), fp8 hybrid", "group": "linear",
                "policy": {"method": "fp8", "rules": HYBRID}, "linear": "fp8-rowwise"})
    for name in OPTIONAL_BACKENDS:
        out.append({"name": f"backend:{name} hybrid", "group": "external peer",
                    "policy": {"backend": name, "rules": HYBRID}})
        if not quick:
            out.append({"name": f"backend:{name}", "group": "external peer", "policy": {"backend": name}})
    return out


def emulated_linear(pipe, method: str):
    """The linear layers fp4video's ``method`` policy gives ``method`` (block 0, the embedders and the
    head kept, as ``bench pipeline --linear`` does; by block and kind, whatever the weights' dtype:
    torchao itself takes bf16 weights only), each running the exact emulation of torchao's float8
    product (:func:`fp4video.formats.float8_linear`, in fp32, back to the layer's dtype); returns
    the function that restores their forwards."""
    from fp4video.formats import float8_linear
    from fp4video.integration.linear import OUTSIDE_KINDS, LinearPolicy, linear_sites, shape_reason

    if method not in ("fp8-rowwise", "fp8-tensor"):
        raise ValueError(f"emulated linear layers: fp8-rowwise or fp8-tensor, got {method!r}")
    policy = LinearPolicy(method=method, rules=[{"method": "bf16", "blocks": [0]},
                                                {"method": "bf16", "kinds": list(OUTSIDE_KINDS)}])
    layers = [s.module for s in linear_sites(pipe)
              if policy.method_for(expert=s.expert, block=s.block, kind=s.kind) == method
              and shape_reason(s.module.in_features, s.module.out_features, method) is None]
    for layer in layers:
        def forward(x, layer=layer):
            return float8_linear(x.float(), layer.weight.float(), layer.bias,
                                 rowwise=method == "fp8-rowwise").to(x.dtype)
        layer.forward = forward

    def undo():
        for layer in layers:
            del layer.forward
    return undo


class SiteErrors:
    """An installation's observer: per (block, kind) the worst head's relative L2 error of each
    call's output against exact attention (float32 SDPA) on the same inputs."""

    def __init__(self):
        self.errors = defaultdict(list)

    def __call__(self, *, site, kind, call, out, ran):
        from fp4video.calibration.measure import head_errors

        out = out[0] if isinstance(out, tuple) else out
        q, k, v = (t.float().transpose(1, 2) for t in (call.query, call.key, call.value))
        mask = call.attn_mask
        exact = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=call.scale)
        rel, _ = head_errors(out, exact.transpose(1, 2))
        self.errors[(site.block, kind)].append(rel)

    def summary(self) -> dict:
        if not self.errors:
            return {}
        every = [e for errs in self.errors.values() for e in errs]
        return {"mean": sum(every) / len(every), "max": max(every),
                "per_site": {f"block {b} {k}": sum(e) / len(e) for (b, k), e in sorted(self.errors.items())}}


def _to_uint8(frames: torch.Tensor):
    return (frames * 255).round().clamp(0, 255).to(torch.uint8).numpy()


def _predicted(report: dict, name: str, entry: dict, plan_errors: dict | None) -> float | None:
    """The calibration's predicted error of a policy: the mean over the calibrated sites of the
    relative L2 error its target there had in the calibration (0 where it runs FP16)."""
    sites = report.get("sites", [])
    if not sites:
        return None
    if entry["group"] == "calibrated":
        return plan_errors.get(name) if plan_errors else None
    policy = entry.get("policy", {})
    target = policy.get("method") or ("backend:" + policy["backend"] if policy.get("backend") else None)
    if target is None or "sparsity" in policy or any("sparsity" in r for r in policy.get("rules", [])):
        return None  # (the calibration measured dense targets only)
    num_steps = report.get("num_steps") or 0
    errors = []
    for s in sites:
        # the hybrid rules: block 0 and the last two steps in FP16
        fp16 = "rules" in policy and (s["block"] == 0 or (s["step"] is not None and s["step"] >= num_steps - 2))
        if fp16:
            errors.append(0.0)
        elif target in s["rel_l2"]:
            errors.append(float(s["rel_l2"][target]))
        else:
            return None
    return sum(errors) / len(errors)


def _plan_error(calibration) -> float:
    errs = [0.0 if t == "fp16" or t not in calibration.stats[k].rel_l2 else float(calibration.stats[k].rel_l2[t])
            for k, t in calibration.plan.items()]
    return sum(errs) / max(len(errs), 1)


def _from_json(obj):
    """``results.json`` as read back: the non-finite numbers :func:`fp4video.eval.json_ready` spelled
    as strings ("inf", "-inf", "nan") floats again (a policy as exact as FP16 has an infinite PSNR)."""
    if isinstance(obj, str) and obj in ("inf", "-inf", "nan"):
        return float(obj)
    if isinstance(obj, dict):
        return {k: _from_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_from_json(v) for v in obj]
    return obj


def _write(out: Path, results: dict) -> None:
    from fp4video.eval import json_ready

    _plots(out, results)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(json_ready(results), indent=1))
    tmp.replace(out / "results.json")
    rows = ["| policy | group | PSNR dB | SSIM | cosine | checker pass | agrees with FP16 | attention rel L2 (mean / max) "
            "| density | kept mass min / mean | predicted error | seconds |", "|" + "---|" * 12]
    for name, r in results["policies"].items():
        if "error" in r or "unavailable" in r:
            rows.append(f"| {name} | {r['group']} | {r.get('unavailable') or r.get('error')} |" + " |" * 9)
            continue
        att = r.get("attention_error") or {}
        sparse = r.get("sparse") or {}
        rows.append("| {} | {} | {:.2f} | {:.4f} | {:.5f} | {:.0%} | {:.0%} | {} | {} | {} | {} | {:.1f} |".format(
            name, r["group"], r["psnr"], r["ssim"], r["cosine"], r["checker_rate"], r["checker_agreement"],
            f"{att['mean']:.4f} / {att['max']:.4f}" if att else "–",
            f"{r['density']:.3f}" if r.get("density") is not None else "–",
            f"{sparse['kept_min']:.3f} / {sparse['kept_mean']:.3f}" if "kept_min" in sparse else "–",
            f"{r['predicted_error']:.4f}" if r.get("predicted_error") is not None else "–", r["seconds"]))
    ref = results.get("reference", {})
    head = [f"# Attention policies on the fp4video test model ({results['settings']['device']}, "
            f"{results['settings']['dtype']})", "",
            f"{len(results['settings']['captions'])} held-out captions, seeds {results['settings']['seeds']}, "
            f"call {results['settings']['call']}.", "",
            f"FP16 reference: motion checker passes {ref.get('checker_rate', float('nan')):.0%} of the clips.", ""]
    if results.get("spearman_predicted_error_vs_psnr") is not None:
        head += [f"Spearman ρ of the calibration's predicted error and PSNR: "
                 f"{results['spearman_predicted_error_vs_psnr']:.2f}", ""]
    (out / "results.md").write_text("\n".join(head + rows) + "\n")


def _plots(out: Path, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fp4video.calibration.report import spearman

    done = [(n, r) for n, r in results["policies"].items() if "psnr" in r and math.isfinite(r["psnr"])]
    if not done:
        return
    groups = sorted({r["group"] for _, r in done})
    colours = {g: plt.cm.tab10(i) for i, g in enumerate(groups)}
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(done) + 1.2))
    ax.barh(range(len(done)), [r["psnr"] for _, r in done], color=[colours[r["group"]] for _, r in done])
    ax.set_yticks(range(len(done)), [n for n, _ in done], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("PSNR to the FP16 clips (dB, mean of frames and clips)")
    from matplotlib.patches import Patch

    ax.axvline(30, color="grey", linestyle="--", linewidth=0.8)  # the 30 dB the tables ask of a policy
    ax.legend(handles=[Patch(color=colours[g], label=g) for g in groups], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.01, 1.0))  # beside the bars, not over them
    fig.tight_layout()
    fig.savefig(out / "psnr.png", dpi=110, bbox_inches="tight")  # the longest policy names whole
    plt.close(fig)
    pts = [(r["predicted_error"], r["psnr"], n, r["group"]) for n, r in done if r.get("predicted_error")]
    if len(pts) >= 2:
        rho = spearman([p[0] for p in pts], [p[1] for p in pts])
        fig, ax = plt.subplots(figsize=(6, 4.2))
        for g in groups:
            sel = [p for p in pts if p[3] == g]
            if sel:
                ax.scatter([p[0] for p in sel], [p[1] for p in sel], color=colours[g], label=g, s=22)
        names: dict[tuple, list[str]] = {}  # which policies each point is (a plan can equal a method)
        for x, y, n, _ in pts:
            names.setdefault((round(x, 6), round(y, 3)), []).append(n)
        for (x, y), ns in names.items():
            ax.annotate(" = ".join(ns), (x, y), xytext=(4, 3), textcoords="offset points", fontsize=6)
        ax.set_xscale("log")
        from matplotlib.ticker import NullFormatter

        ax.xaxis.set_minor_formatter(NullFormatter())  # the decades only: minor labels overlap
        ax.axhline(30, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xlabel("calibration's predicted error (mean relative L2 over sites)")
        ax.set_ylabel("PSNR to the FP16 clips (dB)")
        ax.set_title(f"Spearman ρ = {rho:.2f} over {len(pts)} policies" if rho is not None else "")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "calibration.png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        results["spearman_predicted_error_vs_psnr"] = rho


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="test_model_quality.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for results.json, results.md and the plots")
    p.add_argument("--model", type=Path, help="a test-model pipeline folder or pack (default: the shipped weights)")
    p.add_argument("--quick", action="store_true", help="3 captions and a few policies of each group")
    p.add_argument("--captions", type=int, help="held-out captions (default 12; --quick 3)")
    p.add_argument("--steps", type=int, help="denoising steps (default TEST_MODEL_CALL's)")
    p.add_argument("--height", type=int, help="(default TEST_MODEL_CALL's; with --width and --frames for a plumbing "
                                             "check on a smaller model)")
    p.add_argument("--width", type=int)
    p.add_argument("--frames", type=int)
    p.add_argument("--calibration-captions", type=int, help="training captions to calibrate on (default 4; --quick 1)")
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only the policies whose names contain one of these")
    p.add_argument("--device", help="default: cuda when available, else cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="the transformer's dtype (default bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--backend", default="auto", choices=["auto", "reference", "triton"], help="fp4video's kernels")
    p.add_argument("--fresh", action="store_true", help="start over even where results.json has results")
    args = p.parse_args(argv)
    for name in ("captions", "steps", "calibration_captions", "height", "width", "frames"):
        v = getattr(args, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {v}")
    if args.out.exists() and not args.out.is_dir():
        p.error(f"--out {args.out}: a file, not a folder")
    if args.model is not None and not args.model.is_dir():
        p.error(f"--model {args.model}: no such folder")
    for name, multiple in (("height", 16), ("width", 16)):  # what WanPipeline takes (it refuses other sizes late)
        v = getattr(args, name)
        if v is not None and v % multiple:
            p.error(f"--{name} {v}: must be a multiple of {multiple} (the Wan pipeline's)")
    if args.frames is not None and (args.frames - 1) % 4:  # WanPipeline would round it
        p.error(f"--frames {args.frames}: must be 4n + 1 (the VAE's 4× in time), e.g. "
                f"{args.frames - (args.frames - 1) % 4} or {args.frames - (args.frames - 1) % 4 + 4}")
    if args.only is not None:
        empty = [o for o in args.only if not o.strip()]
        if empty:
            p.error("--only: an empty name matches every policy; give words of the policies' names")
        entries = [e for e in policy_list(args.quick) if any(o in e["name"] for o in args.only)]
        if not entries:
            p.error(f"--only {' '.join(args.only)}: matches no policy{' of --quick' if args.quick else ''} (names: "
                    + "; ".join(e["name"] for e in policy_list(args.quick)) + ")")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device here")
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)

    import numpy as np

    import fp4video
    from fp4video.calibration import replan
    from fp4video.eval import paired_metrics
    from fp4video.integration import Policy
    from fp4video.integration.backends import BackendUnavailable
    from fp4video.integration.processor import sparse_summary
    from fp4video.testmodel import TEST_MODEL_CALL, check_clip, held_out_scenes, sample_scenes, test_model_pipeline
    from fp4video.testmodel.train import generate

    try:
        pipe = test_model_pipeline(device=device, dtype=dtype, path=args.model)
    except (FileNotFoundError, ValueError) as e:
        p.error(f"--model {args.model or 'shipped'}: {str(e).splitlines()[0]}")
    n_captions = args.captions or (3 if args.quick else 12)
    scenes = held_out_scenes(seed=0, repeats=math.ceil(n_captions / 24)).subset(torch.arange(n_captions))
    captions, seed = scenes.captions(), 1000
    call = dict(TEST_MODEL_CALL)
    for key, v in (("num_inference_steps", args.steps), ("height", args.height), ("width", args.width),
                   ("num_frames", args.frames)):
        if v is not None:
            call[key] = v
    settings = {"model": str(args.model or "shipped"), "captions": captions, "seeds": [seed + i for i in range(n_captions)],
                "call": call, "device": str(device), "dtype": dtype_name, "backend": args.backend, "quick": args.quick}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    results = {"settings": settings, "policies": {}}
    if path.is_file() and not args.fresh:
        old = _from_json(json.loads(path.read_text()))
        if old.get("settings") != settings:
            p.error(f"{path} holds results of other settings: give --fresh to start over, or another --out")
        results = old
    print(f"{len(captions)} held-out captions, call {call}, {device} {dtype_name}", flush=True)

    # the FP16 reference clips (stock attention), kept for a later run
    ref_path = args.out / "reference.npz"
    if ref_path.is_file() and "reference" in results:
        ref = torch.from_numpy(np.load(ref_path)["clips"]).float() / 255
    else:
        t = time.perf_counter()
        ref = generate(pipe, captions, call, seed, device)
        np.savez_compressed(ref_path, clips=_to_uint8(ref))
        ref = torch.from_numpy(_to_uint8(ref)).float() / 255  # the clips as stored (and as video files hold them)
        verdicts = [check_clip(c, s) for c, s in zip(ref, scenes.specs)]
        results["reference"] = {"checker_rate": sum(v.passed for v in verdicts) / len(verdicts),
                                "verdicts": [v.as_dict() for v in verdicts], "seconds": round(time.perf_counter() - t, 1)}
        _write(args.out, results)
    ref_pass = [v["passed"] for v in results["reference"]["verdicts"]]
    print(f"FP16 reference: checker passes {results['reference']['checker_rate']:.0%}", flush=True)

    entries = policy_list(args.quick)
    if args.only:
        entries = [e for e in entries if any(o in e["name"] for o in args.only)]
    calibration, report, plan_errors = None, None, {}
    if any(e["group"] == "calibrated" for e in entries) and (args.out / "calibration.json").is_file():
        report = json.loads((args.out / "calibration.json").read_text())
    for entry in entries:
        name = entry["name"]
        if name in results["policies"] and "psnr" in results["policies"][name]:
            continue
        t = time.perf_counter()
        row = {"group": entry["group"]}
        try:
            if entry["group"] == "calibrated":
                if report is None:
                    k = args.calibration_captions or (1 if args.quick else 4)
                    train_captions = sample_scenes(k, seed=77).captions()
                    calibration = fp4video.calibrate(pipe, train_captions, budget=entry["budget"], call=call,
                                                     backend=args.backend, progress=False,
                                                     model_name="fp4video test model")
                    report = calibration.report
                    (args.out / "calibration.json").write_text(json.dumps(report, indent=1, default=str))
                    row["calibration_seconds"] = round(time.perf_counter() - t, 1)
                chosen = replan(report, budget=entry["budget"])
                plan_errors[name] = _plan_error(chosen)
                policy = chosen.policy
                row["chosen"] = dict(Counter(chosen.plan.values()))
            else:
                policy = Policy(**entry["policy"])
            undo_linear = emulated_linear(pipe, entry["linear"]) if "linear" in entry else None
            try:
                ctx = fp4video.install(pipe, policy, backend=args.backend)
            except Exception:
                if undo_linear is not None:
                    undo_linear()
                raise
        except (BackendUnavailable, ImportError) as e:
            results["policies"][name] = {**row, "unavailable": str(e).splitlines()[0][:200]}
            _write(args.out, results)
            print(f"{name}: unavailable ({results['policies'][name]['unavailable']})", flush=True)
            continue
        except ValueError as e:  # a policy that does not fit the model: recorded, the others still run
            results["policies"][name] = {**row, "error": str(e).splitlines()[0][:300]}
            _write(args.out, results)
            print(f"{name}: refused ({results['policies'][name]['error']})", flush=True)
            continue
        observer = SiteErrors()
        ctx.observer = observer
        try:
            clips = generate(pipe, captions, call, seed, device)
        except Exception as e:  # one policy's failure is recorded, the others still run
            results["policies"][name] = {**row, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            _write(args.out, results)
            print(f"{name}: failed ({results['policies'][name]['error']})", flush=True)
            continue
        finally:
            ctx.observer = None
            if undo_linear is not None:
                undo_linear()
            fp4video.uninstall(pipe)
        clips = torch.from_numpy(_to_uint8(clips)).float() / 255
        metrics = [paired_metrics(r, c, name=cap) for r, c, cap in zip(ref, clips, captions)]
        verdicts = [check_clip(c, s) for c, s in zip(clips, scenes.specs)]
        calls = ctx.recorded_calls()
        densities = [c["density"] for c in calls if c.get("density") is not None]
        finite = [m["psnr"] for m in metrics if math.isfinite(m["psnr"])]
        row.update(
            psnr=sum(finite) / len(finite) if finite else math.inf,
            ssim=sum(m["ssim"] for m in metrics) / len(metrics),
            cosine=sum(m["cosine"] for m in metrics) / len(metrics),
            per_clip=[{"psnr": m["psnr"], "ssim": m["ssim"], "cosine": m["cosine"], "checker": v.passed}
                      for m, v in zip(metrics, verdicts)],
            checker_rate=sum(v.passed for v in verdicts) / len(verdicts),
            checker_agreement=sum(v.passed == r for v, r in zip(verdicts, ref_pass)) / len(verdicts),
            attention_error=observer.summary(), calls=dict(Counter(c["method"] for c in calls)),
            density=sum(densities) / len(densities) if densities else None, sparse=sparse_summary(calls),
            fallbacks=dict(ctx.fallbacks), seconds=round(time.perf_counter() - t, 1))
        if report is not None:
            row["predicted_error"] = _predicted(report, name, entry, plan_errors)
        results["policies"][name] = row
        _write(args.out, results)
        print(f"{name}: PSNR {row['psnr']:.2f} dB, SSIM {row['ssim']:.4f}, checker {row['checker_rate']:.0%} "
              f"(agrees {row['checker_agreement']:.0%}), {row['seconds']:.0f}s", flush=True)
    if report is not None:  # predictions for the policies measured before the calibration ran
        for entry in entries:
            r = results["policies"].get(entry["name"])
            if r is not None and "psnr" in r and r.get("predicted_error") is None:
                r["predicted_error"] = _predicted(report, entry["name"], entry, plan_errors)
    _write(args.out, results)
    print(f"written: {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    from fp4video.cli.common import quiet_optional_imports

    with quiet_optional_imports():  # torchao's import-time log lines, as the CLI drops them
        code = main()
    sys.exit(code)
