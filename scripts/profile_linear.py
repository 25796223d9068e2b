#!/usr/bin/env python3
"""Where the time of low-precision linear layers goes in a Wan2.2-A14B-shaped transformer at 720p
(one H200: under 4 minutes; random bf16 weights, as ``fp4video bench pipeline`` builds them).

    python scripts/profile_linear.py --out /tmp/linear                 # 40 blocks, fp8-rowwise
    python scripts/profile_linear.py --out /tmp/linear --layers 8      # fewer blocks
    python scripts/profile_linear.py --out /tmp/smoke --smoke          # CPU: the tiny model, mxfp8 emulated

Two parts, each result written under ``--out`` as it is measured (``results.jsonl``, one JSON object
a line; the profiler tables as text), a short table printed at the end (and ``table.md``):

1. **Shapes**: the transformer's three linear shapes at 720p (75,600 tokens: q/k/v/o 5120 -> 5120,
   FFN up 5120 -> 13824, FFN down 13824 -> 5120): the bf16 layer; the quantized layer in eager mode;
   its two parts on their own (the activations' quantization, ``Float8Tensor.from_hp``, and
   ``torch._scaled_mm`` on operands cast beforehand); for FFN up, the quantized layer and the
   quantization alone under ``torch.compile``.
2. **Forward**: one transformer forward (stock attention, batch 1, 512 text tokens): bf16; the
   method in eager mode; the method with regional compilation of the blocks
   (:class:`fp4video.integration.linear.LinearPolicy`'s ``compile``); bf16 with the same
   compilation (what compilation gives without quantization). Peak memory and the memory the
   weights hold. ``torch.profiler`` of the eager bf16 and quantized forwards: every op's count and
   CUDA time in both (``profile_ops.txt``: the ops the quantized forward adds are its activations'
   quantization), and the top CUDA kernels (``profile_kernels_*.txt``).

Eager timings: a forward on a few tokens first (CUDA and cuBLAS set-up), then one timed forward.
Compiled: the first forward compiles (its time is reported), the second is timed. The method's
original weights wait in host memory (the GPU holds what a user's would). ``--budget-s``: a stage
that would end past it is skipped and recorded as skipped; the stages run most telling first.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from fp4video.cli.bench import LATENTS, WAN22_A14B
from fp4video.integration.linear import (LinearPolicy, install_linear, installed_linear, measure_linear, torchao_config,
                                         uninstall_linear)

#: The transformer's linear shapes at 720p: (name, tokens, in_features, out_features).
SHAPES = [("q/k/v/o 5120->5120", 75600, 5120, 5120), ("FFN up 5120->13824", 75600, 5120, 13824),
          ("FFN down 13824->5120", 75600, 13824, 5120)]
SMOKE_SHAPES = [("q/k/v/o 128->128", 300, 128, 128), ("FFN up 128->256", 300, 128, 256),
                ("FFN down 256->128", 300, 256, 128)]


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for results.jsonl, the profiler tables and table.md")
    p.add_argument("--layers", type=int, default=None, help="transformer blocks (default: the real model's 40)")
    p.add_argument("--method", default="fp8-rowwise", choices=["fp8-rowwise", "fp8-tensor", "mxfp8", "nvfp4"])
    p.add_argument("--emulate", action="store_true", help="mxfp8 through torchao's emulation (any device)")
    p.add_argument("--reps", type=int, default=10, help="timed calls per shape measurement (median)")
    p.add_argument("--budget-s", type=float, default=225.0,
                   help="skip a stage that would end later than this many seconds after the start")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile's backend")
    p.add_argument("--smoke", action="store_true",
                   help="the tiny test transformer on the CPU, tiny shapes, mxfp8 emulated, compile backend eager "
                        "(checks this script's code paths; its numbers mean nothing)")
    args = p.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        p.error(f"--layers must be >= 1, got {args.layers}")
    if args.reps < 1:
        p.error(f"--reps must be >= 1, got {args.reps}")
    if args.smoke:
        args.method, args.emulate, args.compile_backend = "mxfp8", True, "eager"
    elif not torch.cuda.is_available():
        p.error("needs a CUDA GPU (--smoke runs the code paths on the CPU)")
    return args


class Run:
    """Results written as they come (``results.jsonl``), the stages' clock and budget."""

    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.out / "results.jsonl"
        self.jsonl.write_text("")
        self.start = time.perf_counter()
        self.rows: list[dict] = []
        self.device = torch.device("cpu" if args.smoke else "cuda")

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def record(self, **row):
        row = {"t_s": round(self.elapsed(), 1), **row}
        self.rows.append(row)
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"  [{row['t_s']:6.1f} s] " + ", ".join(f"{k}={v}" for k, v in row.items() if k != "t_s"),
              file=sys.stderr, flush=True)

    def stage(self, name: str, cost_s: float, fn):
        """Run ``fn`` unless it would end past the budget; an error is recorded, not raised."""
        if self.elapsed() + cost_s > self.args.budget_s:
            self.record(stage=name, skipped=f"budget: {self.elapsed():.0f} s spent + ~{cost_s:.0f} s > "
                                             f"--budget-s {self.args.budget_s:g}")
            return None
        try:
            return fn()
        except Exception as e:  # a stage's failure is a result: the others still run
            (self.out / f"error_{name.replace(' ', '_')}.txt").write_text(traceback.format_exc())
            self.record(stage=name, error=f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
            return None

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def seconds(self, fn) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0

    def peak_reset(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def memory(self) -> dict:
        if self.device.type != "cuda":
            return {}
        return {"peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                "resident_gib": round(torch.cuda.memory_allocated() / 2**30, 2)}


def environment(run: Run) -> dict:
    import torchao

    env = {"torch": torch.__version__, "torchao": getattr(torchao, "__version__", "?"),
           "cuda": torch.version.cuda, "mslk": importlib.util.find_spec("mslk") is not None,
           "device": torch.cuda.get_device_name() if run.device.type == "cuda" else "cpu",
           "method": run.args.method, "emulate": run.args.emulate}
    (run.out / "env.json").write_text(json.dumps(env, indent=1) + "\n")
    return env


# --- 1. the shapes -----------------------------------------------------------------------------------


def median_ms(run: Run, fn, reps: int) -> float:
    with torch.no_grad():
        for _ in range(2):
            fn()
        times = []
        for _ in range(reps):
            times.append(run.seconds(fn) * 1000)
    return sorted(times)[len(times) // 2]


def shapes(run: Run):
    from torchao.quantization import quantize_

    args = run.args
    config = torchao_config(args.method, emulate=args.emulate)
    for i, (name, m, k, n) in enumerate(SMOKE_SHAPES if args.smoke else SHAPES):
        torch.manual_seed(i)
        layer = torch.nn.Linear(k, n, device=run.device, dtype=torch.bfloat16)
        x = torch.randn(1, m, k, device=run.device, dtype=torch.bfloat16)
        measure = measure_linear(layer, x[:, : min(m, 4096)], args.method, emulate=args.emulate, reps=1)
        q = torch.nn.Linear(k, n, device=run.device, dtype=torch.bfloat16)
        q.load_state_dict(layer.state_dict())
        quantize_(q, config)
        row = {"part": "shapes", "shape": name, "tokens": m, "rel_l2": round(measure.rel_l2, 5),
               "bf16_ms": median_ms(run, lambda: layer(x), args.reps),
               f"{args.method}_eager_ms": median_ms(run, lambda: q(x), args.reps)}
        if args.method.startswith("fp8"):
            from torchao.quantization import Float8Tensor

            granularity = q.weight.block_size  # the weight's (1, K): per row; (N, K): per tensor
            act = lambda: Float8Tensor.from_hp(x, granularity=_granularity(args.method))  # noqa: E731
            xq = act()
            a_scale = xq.scale.reshape(-1, 1) if xq.scale.numel() > 1 else xq.scale.reshape(1, 1)
            w_scale = q.weight.scale.reshape(1, -1) if q.weight.scale.numel() > 1 else q.weight.scale.reshape(1, 1)
            x2, wt = xq.qdata.reshape(-1, k), q.weight.qdata.t()
            mm = lambda: torch._scaled_mm(x2, wt, scale_a=a_scale, scale_b=w_scale, bias=layer.bias,  # noqa: E731
                                          out_dtype=torch.bfloat16, use_fast_accum=True)
            with torch.no_grad():  # the GEMM timed alone is the layer's own
                row["scaled_mm_is_the_layers"] = torch.equal(mm().reshape(1, m, n), q(x))
            row["act_quant_eager_ms"] = median_ms(run, act, args.reps)
            row["scaled_mm_ms"] = median_ms(run, mm, args.reps)
            row["weight_block"] = list(granularity)
            if i == 1:  # FFN up: the compiled forms
                compiled = torch.compile(q, backend=args.compile_backend)
                quant = torch.compile(act, backend=args.compile_backend)
                row[f"{args.method}_compiled_ms"] = median_ms(run, lambda: compiled(x), args.reps)
                row["act_quant_compiled_ms"] = median_ms(run, quant, args.reps)
        run.record(**row)
        del layer, q, x
        if run.device.type == "cuda":
            torch.cuda.empty_cache()


def _granularity(method):
    from torchao.quantization import PerRow, PerTensor

    return PerRow() if method == "fp8-rowwise" else PerTensor()


# --- 2. the forward ----------------------------------------------------------------------------------


def build(run: Run):
    """(model, full-size inputs, a few-token input for warm-ups, description)."""
    if run.args.smoke:
        from fp4video.integration.tiny import tiny_wan_transformer

        model = tiny_wan_transformer(0, 64).to(torch.bfloat16)
        g = torch.Generator().manual_seed(1)
        kw = dict(hidden_states=torch.randn(1, 16, 2, 16, 16, generator=g).bfloat16(),
                  encoder_hidden_states=torch.randn(1, 24, 32, generator=g).bfloat16(),
                  timestep=torch.tensor([500.0]), return_dict=False)
        small = dict(kw, hidden_states=kw["hidden_states"][:, :, :1, :4, :4])
        return model, kw, small, "tiny Wan transformer (smoke)"
    from diffusers import WanTransformer3DModel

    layers = run.args.layers or WAN22_A14B["num_layers"]
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(run.device):
            model = WanTransformer3DModel(**{**WAN22_A14B, "num_layers": layers}).eval()
    finally:
        torch.set_default_dtype(default)
    g = torch.Generator(device=run.device).manual_seed(1)
    f, h, w = LATENTS["720p"]
    rand = lambda *s: torch.randn(*s, device=run.device, dtype=torch.bfloat16, generator=g)  # noqa: E731
    kw = dict(hidden_states=rand(1, 16, f, h, w), encoder_hidden_states=rand(1, 512, 4096),
              timestep=torch.tensor([500.0], device=run.device), return_dict=False)
    small = dict(kw, hidden_states=kw["hidden_states"][:, :, :1, :4, :4].contiguous())
    return model, kw, small, f"Wan2.2-A14B-shaped transformer ({layers} of 40 blocks), 720p, 75,600 tokens"


def weights_gib(model) -> float:
    """The bytes the parameters hold (a torchao tensor's data and scales), GiB."""
    total = 0
    for p in model.parameters():
        parts = [getattr(p, a) for a in ("qdata", "scale", "per_tensor_scale") if isinstance(getattr(p, a, None),
                                                                                               torch.Tensor)]
        total += sum(t.nbytes for t in parts) if parts else p.nbytes
    return round(total / 2**30, 2)


def timed_forward(run: Run, model, kw, small, label: str, *, compiled: bool):
    with torch.no_grad():
        if compiled:
            first = run.seconds(lambda: model(**kw))
        else:
            model(**small)
            first = None
        run.peak_reset()
        secs = run.seconds(lambda: model(**kw))
    row = {"part": "forward", "config": label, "s": round(secs, 3), "weights_gib": weights_gib(model), **run.memory()}
    if first is not None:
        row["first_s_with_compile"] = round(first, 1)
    run.record(**row)
    return secs


def profile_forward(run: Run, model, kw, label: str) -> dict:
    """{op: (calls, CUDA ms)} of one forward; the top kernels and the whole table to files."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.device.type == "cuda" else [])
    with torch.no_grad(), profile(activities=activities) as prof:
        model(**kw)
        run.sync()
    events = prof.key_averages()
    key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    sort = "self_cuda_time_total" if run.device.type == "cuda" else "self_cpu_time_total"
    tag = label.replace(" ", "_")
    try:
        (run.out / f"profile_table_{tag}.txt").write_text(events.table(sort_by=sort, row_limit=60))
    except Exception:  # the table's sort key name differs across torch releases
        (run.out / f"profile_table_{tag}.txt").write_text(events.table(row_limit=60))
    ops, kernels = {}, []
    for e in events:
        t = getattr(e, key, 0) / 1000 if run.device.type == "cuda" else e.self_cpu_time_total / 1000
        if "::" in e.key:  # an op (aten::, torchao's custom ops); kernels and CUDA runtime calls have no "::"
            ops[e.key] = (e.count, round(t, 3))
        elif str(getattr(e, "device_type", "")).endswith("CUDA"):
            kernels.append((t, e.count, e.key))
    kernels.sort(reverse=True)
    lines = [f"top CUDA kernels, one {label} forward: ms, calls, kernel"]
    lines += [f"{t:10.2f} {c:6d}  {k[:150]}" for t, c, k in kernels[:40]]
    (run.out / f"profile_kernels_{tag}.txt").write_text("\n".join(lines) + "\n")
    run.record(part="profile", config=label, ops=len(ops), kernels_ms=round(sum(t for t, _, _ in kernels), 1),
               top_kernel=kernels[0][2][:80] if kernels else None)
    return ops


#: aten ops of torchao's eager activation quantization (Float8Tensor.from_hp): |x|, its row max,
#: scale = max / 448, x in float32, divided by the scale, clamped, cast to e4m3
QUANT_OPS = ("aten::abs", "aten::amax", "aten::div", "aten::clamp", "aten::_to_copy", "aten::copy_")


def compare_profiles(run: Run, base: dict, quant: dict):
    names = sorted(set(base) | set(quant), key=lambda n: -abs(quant.get(n, (0, 0))[1] - base.get(n, (0, 0))[1]))
    lines = ["ops of one bf16 forward and one quantized (eager) forward: calls and self CUDA ms; Δ = quantized - bf16",
             f"{'op':44s} {'bf16 calls':>10s} {'bf16 ms':>9s} {'q calls':>8s} {'q ms':>9s} {'Δ ms':>9s}"]
    for n in names:
        (bc, bt), (qc, qt) = base.get(n, (0, 0.0)), quant.get(n, (0, 0.0))
        if bc or qc:
            lines.append(f"{n[:44]:44s} {bc:10d} {bt:9.2f} {qc:8d} {qt:9.2f} {qt - bt:9.2f}")
    (run.out / "profile_ops.txt").write_text("\n".join(lines) + "\n")
    gemm_b = sum(base.get(n, (0, 0))[1] for n in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul"))
    gemm_q = sum(quant.get(n, (0, 0))[1] for n in ("aten::_scaled_mm", "aten::mm", "aten::addmm", "aten::bmm"))
    added = {n: (quant.get(n, (0, 0))[0] - base.get(n, (0, 0))[0],
                 round(quant.get(n, (0, 0))[1] - base.get(n, (0, 0))[1], 1)) for n in QUANT_OPS}
    run.record(part="profile", config="compare", gemm_bf16_ms=round(gemm_b, 1), gemm_quantized_ms=round(gemm_q, 1),
               scaled_mm_calls=quant.get("aten::_scaled_mm", (0, 0))[0],
               quant_op_calls_added=sum(c for c, _ in added.values()),
               quant_ops_added_ms=round(sum(t for _, t in added.values()), 1),
               quant_ops={n: list(v) for n, v in added.items() if v[0] or v[1]})


def forward(run: Run):
    """bf16 eager; the method eager and compiled (one installation: its compiled blocks run their eager
    code under the ``force_eager`` stance); the profiles; bf16 compiled: most telling first."""
    args = run.args
    model, kw, small, desc = build(run)
    run.record(part="forward", config="model", description=desc, weights_gib=weights_gib(model))
    est = {}  # measured seconds, for the budget of later stages

    def bf16_eager():
        est["bf16"] = timed_forward(run, model, kw, small, "bf16 eager", compiled=False)

    run.stage("bf16 eager", 30, bf16_eager)
    fwd = est.get("bf16", 15.0)
    method = args.method
    policy = LinearPolicy(method=method, emulate=args.emulate, compile=True, originals="cpu")

    def install_method():
        report = install_linear(model, policy, compile_backend=args.compile_backend)
        run.record(part="forward", config=f"install {method}", summary=report.summary(), runs=report.runs,
                   kept=len(report.plan.kept))
        return report

    quant = None
    if run.stage(f"install {method}", 20, install_method) is not None:
        with torch.compiler.set_stance("force_eager"):  # the compiled blocks run their eager code
            run.stage(f"{method} eager", fwd + 5,
                      lambda: timed_forward(run, model, kw, small, f"{method} eager", compiled=False))
        run.stage(f"{method} compiled", 60 + 2 * fwd,
                  lambda: timed_forward(run, model, kw, small, f"{method} regional compile", compiled=True))
        with torch.compiler.set_stance("force_eager"):
            quant = run.stage(f"{method} profile", 1.3 * fwd + 5,
                              lambda: profile_forward(run, model, kw, f"{method} eager"))
        run.stage(f"uninstall {method}", 20, lambda: uninstall_linear(model))
    if installed_linear(model) is not None:
        return
    base = run.stage("bf16 profile", 1.3 * fwd + 5, lambda: profile_forward(run, model, kw, "bf16 eager"))
    if base and quant:
        compare_profiles(run, base, quant)

    def bf16_compiled():
        install_linear(model, LinearPolicy(method="bf16", compile=True), compile_backend=args.compile_backend)
        try:
            timed_forward(run, model, kw, small, "bf16 regional compile", compiled=True)
        finally:
            uninstall_linear(model)

    run.stage("bf16 compiled", 60 + 2 * fwd, bf16_compiled)


def table(run: Run, env: dict) -> str:
    lines = [f"### profile_linear: {env['device']}, torch {env['torch']}, torchao {env['torchao']}, "
             f"mslk {'yes' if env['mslk'] else 'no'}, method {env['method']}", "",
             "| shape | bf16 ms | eager ms | act. quant ms | _scaled_mm ms | compiled ms | rel. L2 |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    m = run.args.method
    fmt = lambda v: "" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))  # noqa: E731
    for r in run.rows:
        if r.get("part") == "shapes":
            lines.append(f"| {r['shape']} | {fmt(r['bf16_ms'])} | {fmt(r.get(f'{m}_eager_ms'))} | "
                         f"{fmt(r.get('act_quant_eager_ms'))} | {fmt(r.get('scaled_mm_ms'))} | "
                         f"{fmt(r.get(f'{m}_compiled_ms'))} | {fmt(r['rel_l2'])} |")
    lines += ["", "| forward | s | × bf16 eager | peak GiB | weights GiB | first call s |", "| --- | --- | --- | --- | --- | --- |"]
    fwd = [r for r in run.rows if r.get("part") == "forward" and "s" in r]
    base = next((r["s"] for r in fwd if r["config"] == "bf16 eager"), None)
    for r in fwd:
        ratio = f"{base / r['s']:.2f}" if base else ""
        lines.append(f"| {r['config']} | {r['s']:.2f} | {ratio} | {fmt(r.get('peak_gib'))} | {fmt(r.get('weights_gib'))} "
                     f"| {fmt(r.get('first_s_with_compile'))} |")
    cmp = next((r for r in run.rows if r.get("config") == "compare"), None)
    if cmp:
        lines += ["", f"Profile (eager): GEMMs {cmp['gemm_bf16_ms']} ms in bf16, {cmp['gemm_quantized_ms']} ms "
                      f"quantized ({cmp['scaled_mm_calls']} _scaled_mm); the quantized forward adds "
                      f"{cmp['quant_op_calls_added']} calls of {', '.join(QUANT_OPS)} taking {cmp['quant_ops_added_ms']} ms "
                      f"(profile_ops.txt)."]
    notes = [r for r in run.rows if "skipped" in r or "error" in r]
    lines += [f"- {r['stage']}: {r.get('skipped') or r.get('error')}" for r in notes]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse(argv)
    run = Run(args)
    env = environment(run)
    print(f"profile_linear: {env}", file=sys.stderr, flush=True)
    shape_cost = 10 if args.smoke else 40
    run.stage("shapes", shape_cost, lambda: shapes(run))
    run.stage("forward", 60, lambda: forward(run))
    text = table(run, env)
    (run.out / "table.md").write_text(text)
    print(text)
    print(f"profile_linear: {run.elapsed():.0f} s; results in {run.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
