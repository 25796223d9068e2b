"""Prompt × method sweeps that produce tables shaped like MXAttention's Table 2 (methods under the
config's hybrid policy) and Table 3 (sequential ablation, fully 4-bit), against FP16 videos made
with the same prompts and seeds. Resumable: a video whose mp4 and sidecar exist is not remade."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..integration.media import write_text_atomic
from .paired import evaluate_paths, json_ready

__all__ = ["TABLE2", "TABLE3", "run_sweep"]

#: (row label, method); Table 2 keeps the config's policy rules (e.g. block 0 / last steps in FP16).
TABLE2 = [("MXFP4 (OCP)", "mxfp4-ocp"), ("NVFP4", "nvfp4"), ("NVFP4 + SageAttention", "sage3"),
          ("MXAttention", "mxattn")]
#: Table 3: fully 4-bit, UOS removed first, then PNQ, then the Hadamard rotation.
TABLE3 = [("Full", "mxattn", "✓", "✓", "✓"), ("w/o UOS", "mxattn-no-uos", "✓", "✓", "–"),
          ("w/o PNQ and UOS", "mxattn-no-pnq-uos", "✓", "–", "–"), ("OCP MXFP4", "mxfp4-ocp", "–", "–", "–")]
SIMILARITY = ("cosine", "ssim", "psnr")


def _jobs(cfg):
    from ..integration.policy import Policy

    rules = [r.model_dump(exclude_none=True) for r in cfg.policy.rules]
    jobs = [("fp16", Policy(method="fp16"))]
    jobs += [(f"table2-{m}", Policy.model_validate({"method": m, "rules": rules})) for _, m in TABLE2]
    jobs += [(f"table3-{m}", Policy(method=m)) for _, m, *_ in TABLE3]
    return jobs


def run_sweep(cfg, out: Path, *, device=None, backend: str = "auto", vbench_python: str | None = None) -> dict:
    """Generate every (method, prompt) video under ``out/videos``, evaluate, write ``tables.md``,
    ``tables.json`` and plots into ``out``. Returns the JSON result. A frame count the pipeline's
    VAE cannot take is a :class:`~fp4video.integration.pipelines.FrameCountError` before any video."""
    import torch
    from tqdm import tqdm

    from ..integration import install, uninstall
    from ..integration.pipelines import check_pipeline_frames, load_pipeline, pipeline_kwargs
    from ..integration.runner import generate_video

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    jobs = _jobs(cfg)
    todo = [(tag, pol, i, p) for tag, pol in jobs for i, p in enumerate(cfg.prompts)
            if not _done(out / "videos" / tag / f"{i:03d}.mp4")]
    if todo:
        pipe = load_pipeline(cfg, device)
        # a count the VAE cannot take is rounded or cut by the pipeline: the tables would name the wrong one
        check_pipeline_frames(pipe, cfg.frames)
        calls = [pipeline_kwargs(cfg, p, device) for p in cfg.prompts]  # same seed for every method
        current = None
        for tag, policy, i, prompt in tqdm(todo, desc="sweep", unit="video"):
            if current != tag:
                if current is not None:
                    uninstall(pipe)
                ctx, current = install(pipe, policy, backend=backend), tag
            generate_video(pipe, ctx, cfg, prompt, calls[i], out / "videos" / tag / f"{i:03d}.mp4",
                           device=device, backend=backend)
        uninstall(pipe)
    ref = out / "videos" / "fp16"
    sims = {tag: evaluate_paths(ref, out / "videos" / tag) for tag, _ in jobs if tag != "fp16"}
    vb = {}
    if vbench_python:
        from .vbench_driver import run_vbench

        vb = {tag: run_vbench(out / "videos" / tag, python=vbench_python, out_dir=out / "vbench" / tag)["overall"]
              for tag, _ in jobs}
    result = _tables(cfg, sims, vb)
    # PSNR of a video identical to FP16 is inf: "inf" in the JSON, which has no infinity
    write_text_atomic(out / "tables.json", json.dumps(json_ready(result), indent=1, allow_nan=False))
    write_text_atomic(out / "tables.md", _markdown(result))
    _plots(result, sims, out)
    return result


def _done(mp4: Path) -> bool:
    return mp4.is_file() and mp4.with_suffix(".json").is_file()


def _row(tag, sims, vb):
    row = {d: vb.get(tag, {}).get(d) for d in ("subject_consistency", "imaging_quality", "aesthetic_quality")}
    if tag != "fp16":
        row.update({k: sims[tag][k] for k in SIMILARITY})
        for k in SIMILARITY:  # the spread over prompts: what a difference between methods must exceed
            vals = [v[k] for v in sims[tag]["videos"].values() if v[k] is not None and math.isfinite(v[k])]
            n = len(vals)
            row[f"{k}_se"] = (math.sqrt(sum((x - sum(vals) / n) ** 2 for x in vals) / (n - 1) / n) if n > 1 else None)
    return row


def describe_rules(rules) -> str:
    """Policy rules in words: "block 0 in fp16; the last 2 steps in fp16"."""
    parts = []
    for r in rules:
        where = []
        if r.get("blocks") is not None:
            where.append(("block " if len(r["blocks"]) == 1 else "blocks ") + ", ".join(map(str, r["blocks"])))
        if r.get("kinds") is not None:
            where.append("/".join(r["kinds"]) + " attention")
        if r.get("experts") is not None:
            where.append("the " + "/".join(r["experts"]) + " expert")
        steps = r.get("steps")
        if steps:
            (key, val), = steps.items()
            if key in ("first", "last"):
                where.append(f"the {key} {val} steps")
            elif key == "range":
                where.append(f"steps {val[0]} to {val[1] - 1}")
            else:
                where.append(f"steps in [{val[0]:g}, {val[1]:g}) of the schedule")
        parts.append(f"{' and '.join(where) or 'every call'} in {r['method']}")
    return "; ".join(parts) if parts else "none (every call in the method)"


def _tables(cfg, sims, vb):
    t2 = [{"method": "FP16", **_row("fp16", sims, vb)}]
    t2 += [{"method": label, "key": m, **_row(f"table2-{m}", sims, vb)} for label, m in TABLE2]
    t3 = [{"configuration": label, "key": m, "hadamard": h, "pnq": p, "uos": u, **_row(f"table3-{m}", sims, vb)}
          for label, m, h, p, u in TABLE3]
    return {"model": cfg.model, "prompts": len(cfg.prompts), "steps": cfg.steps, "seed": cfg.seed,
            "policy_rules_table2": [r.model_dump(exclude_none=True) for r in cfg.policy.rules],
            "policy_table2": describe_rules([r.model_dump(exclude_none=True) for r in cfg.policy.rules]),
            "vbench": bool(vb), "table2": t2, "table3": t3}


def _fmt(v, digits=4):
    if v is None:
        return "–"
    if isinstance(v, float) and math.isinf(v):
        return "∞"
    return f"{v:.{digits}f}"


def bold_best(rows, keys):
    """Cell text, the best value among quantized rows in bold (higher is better everywhere) only
    where it beats the runner-up by more than twice the larger of their standard errors over
    prompts (a difference within the spread is not a win; with one prompt there is no spread, so
    nothing is bold; VBench's dimensions carry no spread here, so they are never bold)."""
    winner = {}
    for k in keys:
        ranked = sorted((r for r in rows if r.get(k) is not None and r.get("method") != "FP16"),
                        key=lambda r: r[k], reverse=True)
        if len(ranked) < 2:
            continue
        (a, b), se = ranked[:2], [ranked[0].get(f"{k}_se"), ranked[1].get(f"{k}_se")]
        if None not in se and a[k] - b[k] > 2 * max(se):
            winner[k] = id(a)
    out = []
    for r in rows:
        cells = {}
        for k in keys:
            text = _fmt(r.get(k), {"psnr": 2, "cosine": 6}.get(k, 4))
            cells[k] = f"**{text}**" if winner.get(k) == id(r) else text
        out.append(cells)
    return out


def _markdown(res) -> str:
    keys = ["subject_consistency", "imaging_quality", "aesthetic_quality", *SIMILARITY]
    head = "| {} | Subject | Imaging | Aesthetic | Cosine | SSIM | PSNR |"
    lines = [f"Model `{res['model']}`, {res['prompts']} prompt(s), {res['steps']} steps, seed {res['seed']}. "
             f"VBench: {'run' if res['vbench'] else 'not run (–)'}. A quantized value is bold where it beats the "
             "next best by more than twice their standard error over prompts.", "",
             f"**Table 2 — methods under the config's policy rules: {res.get('policy_table2') or describe_rules(res['policy_rules_table2'])}**", "",
             head.format("Method"), "|" + " --- |" * 7]
    for r, cells in zip(res["table2"], bold_best(res["table2"], keys)):
        lines.append(f"| {r['method']} | " + " | ".join(cells[k] for k in keys) + " |")
    lines += ["", "**Table 3 — sequential ablation, fully 4-bit**", "",
              "| Configuration | Hadamard | PNQ | UOS | Subject | Imaging | Aesthetic | Cosine | SSIM | PSNR |",
              "|" + " --- |" * 10]
    for r, cells in zip(res["table3"], bold_best(res["table3"], keys)):
        lines.append(f"| {r['configuration']} | {r['hadamard']} | {r['pnq']} | {r['uos']} | "
                     + " | ".join(cells[k] for k in keys) + " |")
    return "\n".join(lines) + "\n"


def _plots(res, sims, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    for ax, key in zip(axes, SIMILARITY):
        shown = []
        for table, rows, label_key in (("T2", res["table2"][1:], "method"), ("T3", res["table3"], "configuration")):
            rows = [r for r in rows if r.get(key) is not None and math.isfinite(r[key])]  # PSNR of identical videos: inf
            names = [f"{table}: {r[label_key]}" for r in rows]
            vals = [r[key] for r in rows]
            errs = [r.get(f"{key}_se") or 0 for r in rows]
            ax.barh(names, vals, xerr=errs, color="tab:blue" if table == "T2" else "tab:orange")
            shown += vals
        if shown:  # the axis spans the values, not 0 to 1: the differences must be visible
            lo, hi = min(shown), max(shown)
            pad = (hi - lo) * 0.15 or abs(hi) * 1e-3 or 1e-3
            ax.set_xlim(lo - pad, hi + pad)
        ax.set_title(f"{key} vs FP16 (± s.e. over prompts)", fontsize=9)
        ax.invert_yaxis()
    for ax in axes[1:]:
        ax.set_yticklabels([])
    fig.tight_layout()
    fig.savefig(out / "methods.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for tag, sim in sims.items():
        per_frame = [v["per_frame"]["ssim"] for v in sim["videos"].values()]
        mean = [sum(col) / len(col) for col in zip(*per_frame)]
        ax.plot(range(len(mean)), mean, label=tag)
    ax.set(xlabel="frame", ylabel="SSIM to FP16 (mean over prompts)", title="Similarity over frames")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "similarity_over_frames.png", dpi=110)
    plt.close(fig)
