"""``fp4video check``: does fp4video compute the right thing on *this* GPU, and how fast?

For every method: the Triton kernel against the reference numerics on random and sharp inputs
(every row: the share of rows off by more than 5 % and the worst row; the LSE); where the method's
loop takes a key-tile selection (``Plan.sparse_reason``), a block-sparse call on a random selection
of about :data:`SPARSE_DENSITY` against the reference on the same selection, row by row (else the
reason it has none); the RoPE kernel the routing applies to Wan's and HunyuanVideo's queries and
keys against their stock operations, bit for bit; then one timing against SDPA and any peer that is
installed. Meant for GPUs this project has never run on
(Blackwell): a table on screen and a JSON report to send back.

The per-row bounds are those the GPU test suite asserts (``row_bounds``).
"""

from __future__ import annotations

import datetime
import platform
from dataclasses import asdict, dataclass, field

import torch

__all__ = ["row_bounds", "CHECK_DISTRIBUTIONS", "SPARSE_DENSITY", "MethodCheck", "random_selection", "run_check",
           "format_check"]

#: The robustness distributions the check runs (a subset of the harness's: one per failure mode).
CHECK_DISTRIBUTIONS = ("gaussian", "sharp (t=4)", "outlier channels", "attention sinks", "V outlier tokens")
#: A row is "off" when its relative error to the reference exceeds this.
ROW_OFF = 5e-2
#: The share of (query tile, key tile) pairs the block-sparse check's random selection visits.
SPARSE_DENSITY = 0.3
#: The block-sparse check's inputs (its bounds are this distribution's).
SPARSE_DISTRIBUTION = "gaussian"


def row_bounds(method: str, distribution: str) -> tuple[float, float]:
    """(largest share of rows off by > 5 %, bound on the worst row's relative error) of the kernel
    against the reference. On near-one-hot rows (outlier channels) the GPU's approximate exp2 and
    the fp8 MMA's shorter accumulation move a P̃ element across an E2M1 boundary in a few rows;
    E4M3 V with outlier tokens likewise."""
    from ..formats import Format
    from ..recipe import METHODS

    sharp = distribution in ("outlier channels", "all of them")
    fp8_v = METHODS[method].pv_format is Format.E4M3
    return (0.03, 0.5) if sharp or (fp8_v and distribution == "V outlier tokens") else (0.005, 0.2)


@dataclass
class MethodCheck:
    method: str
    loop: str | None = None  # the kernels' loop and its form (:meth:`Plan.form`; loop_scaled: native FP4 MMAs)
    accuracy: dict = field(default_factory=dict)  # distribution -> {rows_off, worst_row, lse_worst, ok}
    #: the block-sparse call: {density, rows_off, worst_row, lse_worst, ok, bounds}; None: not run
    sparse: dict | None = None
    sparse_reason: str | None = None  # why the method's loop takes no key-tile selection (None: it does)
    ms: float | None = None
    x_best_bf16: float | None = None
    #: the SM clock (MHz) over the timing and the share of it at the power cap (NVML; None: not sampled)
    sm_mhz: float | None = None
    power_capped: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and all(a["ok"] for a in self.accuracy.values()) and (
            self.sparse is None or self.sparse["ok"])


def random_selection(batch: int, heads: int, sq: int, sk: int, *, density: float = SPARSE_DENSITY,
                     key_alive=None, seed: int = 0, device=None):
    """A random :class:`~fp4video.sparse.BlockSelection` per batch entry and head: each query tile
    visits ``max(1, round(density · n_key_tiles))`` key tiles drawn at random, one of them holding a
    live key (``key_alive``: (Sk,) bool or None, every key live), so every row sees a key."""
    from ..sparse import KEY_TILE, QUERY_TILE, BlockSelection

    nq, nk = -(-sq // QUERY_TILE), -(-sk // KEY_TILE)
    g = torch.Generator(device="cpu").manual_seed(seed)
    score = torch.rand(batch, heads, nq, nk, generator=g)
    live = torch.ones(nk, dtype=torch.bool)
    if key_alive is not None:
        alive = torch.nn.functional.pad(key_alive.cpu(), (0, nk * KEY_TILE - sk))
        live = alive.reshape(nk, KEY_TILE).any(-1)
    # a live tile first (the best-scored one), then the others by score
    first = torch.where(live, score, -1.0).argmax(-1, keepdim=True)
    score = score.scatter(-1, first, 2.0)
    n = max(1, round(density * nk))
    tiles = torch.zeros_like(score, dtype=torch.bool).scatter(-1, score.topk(n, dim=-1).indices, True)
    return BlockSelection(tiles.to(device), sq, sk)


def _accuracy(method, q, k, v, mask, sparsity=None):
    from ..attention import fp4_attention
    from ..harness.robustness import row_relative_error

    kw = {} if sparsity is None else {"sparsity": sparsity}
    got, lse = fp4_attention(q, k, v, method=method, attn_mask=mask, return_lse=True, backend="triton", **kw)
    want, lse_ref = fp4_attention(q, k, v, method=method, attn_mask=mask, return_lse=True, backend="reference", **kw)
    finite = bool(torch.isfinite(got).all())
    err = row_relative_error(got.float(), want.float())
    alive = torch.isfinite(lse_ref)
    lse_err = ((lse - lse_ref).abs() / (1.0 + lse_ref.abs()))[alive]
    return finite, float((err > ROW_OFF).double().mean()), float(err.max()), float(lse_err.max()) if lse_err.numel() else 0.0


def run_check(methods, *, device="cuda", heads: int = 4, sq: int = 1000, sk: int = 2100, head_dim: int = 128,
              timing_seq: int | None = 16384, timing_heads: int = 24, progress=None) -> dict:
    """The check's report as a dict (JSON-ready). ``timing_seq`` None skips the timing."""
    import triton

    from ..attention import fp4_attention
    from ..harness.robustness import DISTRIBUTIONS, make_inputs
    from .peers import find_peers

    dev = torch.device(device)
    checks = [MethodCheck(m) for m in methods]
    mask = (torch.arange(sk, device=dev) < sk - sk // 20)[None, None, None]  # key padding, as HunyuanVideo's text
    steps = [(c, d) for c in checks for d in CHECK_DISTRIBUTIONS]
    for c, dist in (progress(steps, "accuracy") if progress else steps):
        if c.error:
            continue
        q, k, v = make_inputs(DISTRIBUTIONS[dist], heads=heads, sq=sq, sk=sk, head_dim=head_dim, device=dev,
                              dtype=torch.bfloat16)
        try:
            if c.loop is None:
                from ..kernels.plan import plan
                from ..recipe import get_recipe

                c.loop = plan(get_recipe(c.method), q, v, mask).form()
            finite, off, worst, lse = _accuracy(c.method, q, k, v, mask)
        except Exception as e:  # a kernel that cannot compile or launch here: the report must say so
            c.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            continue
        share, bound = row_bounds(c.method, dist)
        c.accuracy[dist] = {"finite": finite, "rows_off": off, "worst_row": worst, "lse_worst": lse,
                            "ok": finite and off <= share and worst < bound and lse < 2e-2,
                            "bounds": {"rows_off": share, "worst_row": bound, "lse_worst": 2e-2}}
    for c in (progress(checks, "block-sparse") if progress else checks):
        if c.error:
            continue
        try:
            _sparse_check(c, dev, heads, sq, sk, head_dim)
        except Exception as e:  # a sparse kernel that cannot compile or launch here: the report says so
            c.error = f"block-sparse: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    rope = _rope_check(dev, heads, sq, head_dim)
    timing = {}
    if timing_seq:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from .power import ClockSampler

        sampler = ClockSampler.for_device(dev.index if dev.index is not None else torch.cuda.current_device())
        clock = {}

        def bench(fn, name=None):
            """Median ms; the SM clock and power over the timing go to ``clock[name]``."""
            with sampler:
                t = triton.testing.do_bench(fn, warmup=25, rep=400, return_mode="median")
            if name is not None:
                r = sampler.result
                clock[name] = None if r is None else {"mhz": r.mhz, "watts": r.watts, "capped": r.capped}
            return t

        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(1, timing_heads, timing_seq, head_dim, device=dev, dtype=torch.bfloat16, generator=g)
                   for _ in range(3))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        for name, backend in (("cuDNN SDPA bf16", SDPBackend.CUDNN_ATTENTION),
                              ("flash SDPA bf16", SDPBackend.FLASH_ATTENTION), ("SDPA default bf16", None)):
            try:
                if backend is None:
                    timing[name] = bench(lambda: sdpa(q, k, v), name)
                else:
                    with sdpa_kernel(backend):
                        timing[name] = bench(lambda: sdpa(q, k, v), name)
            except RuntimeError:
                timing[name] = None
        peers = find_peers()
        for p in peers:
            if p.fn is not None:
                try:
                    a = p.args(q, k, v)
                    timing[p.name] = bench(lambda: p.fn(*a), p.name)
                except Exception:  # noqa: BLE001 - a peer's own failure is reported, not ours
                    timing[p.name] = None
        best = min((t for n, t in timing.items() if t is not None and ("bf16" in n)), default=None)
        for c in (progress(checks, "timing") if progress else checks):
            if c.error:
                continue
            try:
                c.ms = bench(lambda: fp4_attention(q, k, v, method=c.method, backend="triton"), c.method)
                c.x_best_bf16 = best / c.ms if best else None
                if clock.get(c.method):
                    c.sm_mhz, c.power_capped = clock[c.method]["mhz"], clock[c.method]["capped"]
            except Exception as e:
                c.error = f"timing: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        timing = {"shape": f"B=1 H={timing_heads} S={timing_seq} D={head_dim}, bf16", "ms": timing,
                  "peers_missing": {p.name: p.missing for p in peers if p.fn is None},
                  # SM clock and power over each timing: a power-capped GPU slows a kernel that draws more
                  "clock": clock, "clock_missing": sampler.why}
    return {"device": _device_info(dev), "date": datetime.date.today().isoformat(),
            "accuracy_shape": f"B=1 H={heads} Sq={sq} Sk={sk} D={head_dim}, bf16, last {sk // 20} keys masked",
            "sparse_shape": f"B=1 H={heads} Sq={sq} Sk={_sparse_sk(sk)} D={head_dim}, bf16, last {_sparse_sk(sk) // 20} "
                            f"keys masked, {SPARSE_DISTRIBUTION}",
            "methods": [dict(asdict(c), ok=c.ok) for c in checks], "rope": rope, "timing": timing,
            "ok": all(c.ok for c in checks) and all(r["ok"] for r in rope.values())}


def _rope_check(dev, heads: int, tokens: int, head_dim: int) -> dict:
    """{style: {values, differing, ok[, error]}}: :func:`fp4video.kernels.rope.rope_pairs` against the
    stock operations (:func:`fp4video.integration.rope.stock_rope`) on random bf16 queries and keys with
    fp32 tables, Wan's style and HunyuanVideo's (a tenth of the tokens after the tables', as its text)."""
    from ..integration.rope import stock_rope
    from ..kernels.rope import rope_pairs

    g = torch.Generator().manual_seed(0)
    out = {}
    for style in ("wan", "interleaved"):
        rows = tokens - (tokens // 10 if style == "interleaved" else 0)
        q, k = (torch.randn(2, tokens, heads, head_dim, generator=g).mul(4).to(dev, torch.bfloat16) for _ in range(2))
        angle = torch.rand(rows, head_dim // 2, generator=g, dtype=torch.float64) * 100
        cos, sin = (f(angle).repeat_interleave(2, -1).float().to(dev) for f in (torch.cos, torch.sin))
        if style == "wan":
            cos, sin = cos.view(1, rows, 1, head_dim), sin.view(1, rows, 1, head_dim)
        try:
            got = rope_pairs(q, k, cos, sin, style)
        except Exception as e:  # a kernel that cannot compile or launch here: the report says so
            out[style] = {"values": 0, "differing": None, "ok": False,
                          "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
            continue
        differing = sum(int((a != stock_rope(x, cos, sin, style)).sum()) for a, x in zip(got, (q, k)))
        out[style] = {"values": 2 * q.numel(), "differing": differing, "ok": differing == 0}
    return out


def _sparse_sk(sk: int) -> int:
    """The block-sparse check's key count: at least 7 key tiles, the last one partial, so that a
    random selection's density comes near :data:`SPARSE_DENSITY`."""
    from ..sparse import KEY_TILE

    return max(sk, 6 * KEY_TILE + 2)


def _sparse_check(c: MethodCheck, dev, heads, sq, sk, head_dim) -> None:
    """The block-sparse call of ``c``'s method (:data:`SPARSE_DISTRIBUTION`'s inputs, the last
    twentieth of the keys masked as in the dense checks, a random selection of about
    :data:`SPARSE_DENSITY`) against the reference on the same selection, or ``c.sparse_reason``
    where the plan's loop takes no selection."""
    from ..harness.robustness import DISTRIBUTIONS, make_inputs
    from ..kernels.plan import plan
    from ..recipe import get_recipe

    sk = _sparse_sk(sk)
    mask = (torch.arange(sk, device=dev) < sk - sk // 20)[None, None, None]
    q, k, v = make_inputs(DISTRIBUTIONS[SPARSE_DISTRIBUTION], heads=heads, sq=sq, sk=sk, head_dim=head_dim,
                          device=dev, dtype=torch.bfloat16)
    why = plan(get_recipe(c.method), q, v, mask).sparse_reason
    if why is not None:
        c.sparse_reason = why
        return
    sel = random_selection(q.shape[0], heads, sq, sk, key_alive=mask.reshape(-1), device=dev)
    finite, off, worst, lse = _accuracy(c.method, q, k, v, mask, sparsity=sel)
    share, bound = row_bounds(c.method, SPARSE_DISTRIBUTION)
    # the check every rule's call runs: its kernel against the reference on these inputs, and what it
    # measured of this (random) selection
    from ..kernels.covering import covering_rows as kernel_placement
    from ..kernels.row_mass import row_block_mass as kernel_row_mass
    from ..kernels.row_mass import row_shares as kernel_shares
    from ..sparse import check_selection, row_block_mass

    measured = check_selection(sel, q, k, attn_mask=mask, row_mass=kernel_row_mass, placement=kernel_placement,
                               shares=kernel_shares)
    rows_ = torch.arange(0, sq, 64, device=dev)
    kernel_off = float((kernel_row_mass(q, k, rows_, attn_mask=mask) - row_block_mass(q, k, rows_, attn_mask=mask))
                       .abs().max())
    kept = {key: round(float(v), 4) for key, v in measured.check.summary().items() if key.startswith("kept")}
    c.sparse = {"density": float(sel.density()), "finite": finite, "rows_off": off, "worst_row": worst,
                "lse_worst": lse, "kept": kept, "row_mass_kernel_max_abs_diff": kernel_off,
                "ok": finite and off <= share and worst < bound and lse < 2e-2 and kernel_off < 1e-4,
                "bounds": {"rows_off": share, "worst_row": bound, "lse_worst": 2e-2,
                           "row_mass_kernel_max_abs_diff": 1e-4}}


def _device_info(dev) -> dict:
    import triton

    from .. import __version__

    info = {"fp4video": __version__, "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version()}
    if dev.type == "cuda":
        info.update(name=torch.cuda.get_device_name(dev), capability=".".join(map(str, torch.cuda.get_device_capability(dev))),
                    cuda=torch.version.cuda)
    else:
        info.update(name="CPU (Triton interpreter)")
    return info


def _clock_cell(mhz, capped) -> str:
    """'1728 (100%)': the SM clock and the share of the timing at the power cap; '' if not sampled."""
    if mhz is None:
        return ""
    return f"{mhz:.0f}" + ("" if capped is None else f" ({capped:.0%})")


def format_check(report: dict) -> str:
    """The report as a markdown table (one row per method)."""
    d = report["device"]
    lines = [f"fp4video check: {d['name']} (capability {d.get('capability', '-')}), torch {d['torch']}, "
             f"triton {d['triton']}, fp4video {d['fp4video']}, {report['date']}",
             f"accuracy: kernel vs reference, {report['accuracy_shape']}; per distribution: share of rows off by "
             f"> {ROW_OFF:.0%} / worst row",
             f"block-sparse: kernel vs reference on one random selection, {report.get('sparse_shape', '')}; share of "
             "rows off / worst row at the selection's density", ""]
    dists = list(CHECK_DISTRIBUTIONS)
    timing = report.get("timing") or {}
    lines.append("| method | loop | " + " | ".join(dists) + " | block-sparse | ms | × best bf16 | SM MHz (power-capped) "
                 "| ok |")
    lines.append("|" + " --- |" * (len(dists) + 7))
    for m in report["methods"]:
        cells = []
        for dist in dists:
            a = m["accuracy"].get(dist)
            cells.append("–" if a is None else f"{a['rows_off']:.1%} / {a['worst_row']:.3f}" + ("" if a["ok"] else " ✗"))
        sp = m.get("sparse")
        cells.append(f"{sp['rows_off']:.1%} / {sp['worst_row']:.3f} at {sp['density']:.2f}"
                     + (f", kept ≥ {sp['kept']['kept_min']:.2f}" if sp.get("kept") else "") + ("" if sp["ok"] else " ✗")
                     if sp else "no selection" if m.get("sparse_reason") else "–")
        ms = "" if m["ms"] is None else f"{m['ms']:.2f}"
        x = "" if m["x_best_bf16"] is None else f"{m['x_best_bf16']:.2f}"
        lines.append(f"| {m['method']} | {m.get('loop') or '–'} | " + " | ".join(cells)
                     + f" | {ms} | {x} | {_clock_cell(m.get('sm_mhz'), m.get('power_capped'))} | "
                     + f"{'yes' if m['ok'] else 'NO'} |")
        if m["error"]:
            lines.append(f"|  |  | error: {m['error']} |" + " |" * (len(dists) + 4))
        if m.get("sparse_reason"):
            lines.append(f"|  |  | block-sparse: {m['sparse_reason']} |" + " |" * (len(dists) + 4))
    if timing:
        clock = timing.get("clock") or {}

        def at(n):
            c = clock.get(n)
            return "" if not c else f" at {c['mhz']:.0f} MHz, {c['capped']:.0%} of it power-capped"

        lines += ["", f"timing ({timing['shape']}):"]
        lines += [f"- {n}: {'failed' if t is None else f'{t:.2f} ms'}{at(n)}" for n, t in timing["ms"].items()]
        if timing.get("clock_missing"):
            lines.append(f"- SM clock and power cap not sampled: {timing['clock_missing']}")
        lines += [f"- {n}: not timed, {why}" for n, why in timing["peers_missing"].items()]
    for style, r in (report.get("rope") or {}).items():
        name = {"wan": "Wan's", "interleaved": "HunyuanVideo's"}[style]
        lines.append(f"RoPE kernel ({name}) against the stock operations: " + (
            f"failed to run ({r['error']}) ✗" if r.get("error") else
            f"bit for bit on {r['values']:,} values" if r["ok"] else f"{r['differing']:,} of {r['values']:,} values differ ✗"))
    lines += ["", "all methods pass" if report["ok"] else "SOME CHECKS FAILED (✗): please send the JSON report"]
    return "\n".join(lines) + "\n"
