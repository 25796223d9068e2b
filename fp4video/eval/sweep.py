"""Prompt × method sweeps that produce tables shaped like MXAttention's Table 2 (methods under the
config's hybrid policy) and Table 3 (sequential ablation, fully 4-bit), against FP16 videos made
with the same prompts and seeds. Resumable: a video whose mp4 and sidecar exist is not remade."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .paired import evaluate_paths

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
    ``tables.json`` and plots into ``out``. Returns the JSON result."""
    import torch
    from tqdm import tqdm

    from ..integration import install, uninstall
    from ..integration.pipelines import load_pipeline, pipeline_kwargs
    from ..integration.runner import generate_video

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    jobs = _jobs(cfg)
    todo = [(tag, pol, i, p) for tag, pol in jobs for i, p in enumerate(cfg.prompts)
            if not _done(out / "videos" / tag / f"{i:03d}.mp4")]
    if todo:
        pipe = load_pipeline(cfg, device)
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
    (out / "tables.json").write_text(json.dumps(result, indent=1))
    (out / "tables.md").write_text(_markdown(result))
    _plots(result, sims, out)
    return result


def _done(mp4: Path) -> bool:
    return mp4.is_file() and mp4.with_suffix(".json").is_file()


def _row(tag, sims, vb):
    row = {d: vb.get(tag, {}).get(d) for d in ("subject_consistency", "imaging_quality", "aesthetic_quality")}
    if tag != "fp16":
        row.update({k: sims[tag][k] for k in SIMILARITY})
    return row


def _tables(cfg, sims, vb):
    t2 = [{"method": "FP16", **_row("fp16", sims, vb)}]
    t2 += [{"method": label, "key": m, **_row(f"table2-{m}", sims, vb)} for label, m in TABLE2]
    t3 = [{"configuration": label, "key": m, "hadamard": h, "pnq": p, "uos": u, **_row(f"table3-{m}", sims, vb)}
          for label, m, h, p, u in TABLE3]
    return {"model": cfg.model, "prompts": len(cfg.prompts), "steps": cfg.steps, "seed": cfg.seed,
            "policy_rules_table2": [r.model_dump(exclude_none=True) for r in cfg.policy.rules],
            "vbench": bool(vb), "table2": t2, "table3": t3}


def _fmt(v, digits=4):
    if v is None:
        return "–"
    if isinstance(v, float) and math.isinf(v):
        return "∞"
    return f"{v:.{digits}f}"


def _bold_best(rows, keys):
    """Cell text with the best value among quantized rows in bold (higher is better everywhere)."""
    best = {}
    for k in keys:
        vals = [r[k] for r in rows if r.get(k) is not None and r.get("method") != "FP16"]
        best[k] = max(vals) if vals else None
    out = []
    for r in rows:
        cells = {}
        for k in keys:
            text = _fmt(r.get(k), {"psnr": 2, "cosine": 6}.get(k, 4))
            quantized = r.get("method") != "FP16"
            cells[k] = f"**{text}**" if quantized and r.get(k) is not None and r[k] == best[k] else text
        out.append(cells)
    return out


def _markdown(res) -> str:
    keys = ["subject_consistency", "imaging_quality", "aesthetic_quality", *SIMILARITY]
    head = "| {} | Subject | Imaging | Aesthetic | Cosine | SSIM | PSNR |"
    lines = [f"Model `{res['model']}`, {res['prompts']} prompt(s), {res['steps']} steps, seed {res['seed']}. "
             f"VBench: {'run' if res['vbench'] else 'not run (–)'}. Best quantized value in bold.", "",
             f"**Table 2 — methods under the policy rules {res['policy_rules_table2']}**", "",
             head.format("Method"), "|" + " --- |" * 7]
    for r, cells in zip(res["table2"], _bold_best(res["table2"], keys)):
        lines.append(f"| {r['method']} | " + " | ".join(cells[k] for k in keys) + " |")
    lines += ["", "**Table 3 — sequential ablation, fully 4-bit**", "",
              "| Configuration | Hadamard | PNQ | UOS | Subject | Imaging | Aesthetic | Cosine | SSIM | PSNR |",
              "|" + " --- |" * 10]
    for r, cells in zip(res["table3"], _bold_best(res["table3"], keys)):
        lines.append(f"| {r['configuration']} | {r['hadamard']} | {r['pnq']} | {r['uos']} | "
                     + " | ".join(cells[k] for k in keys) + " |")
    return "\n".join(lines) + "\n"


def _plots(res, sims, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    for ax, key in zip(axes, SIMILARITY):
        for table, rows, label_key in (("T2", res["table2"][1:], "method"), ("T3", res["table3"], "configuration")):
            names = [f"{table}: {r[label_key]}" for r in rows]
            vals = [r[key] if not math.isinf(r[key]) else 0 for r in rows]
            ax.barh(names, vals, color="tab:blue" if table == "T2" else "tab:orange")
        ax.set_title(f"{key} vs FP16")
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
