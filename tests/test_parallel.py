"""FP4 attention under diffusers' context parallelism, on CPU with gloo (two processes).

``enable_parallelism`` itself needs an accelerator in diffusers 0.42.1, so these tests drive the
templated ring / Ulysses attention directly with fp4video's forward op, the way the processors
do under ``enable_parallelism``, and compare with single-process results."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

WORLD = 2
B, S, H, D = 1, 256, 4, 64


def _cli(*args, cwd=None):
    """``python -m fp4video.cli.main ARGS`` in one process (compiled kernels, not the interpreter)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "fp4video.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=600, cwd=cwd)


def _cli_under_torchrun(*args, cwd=None):
    """``torchrun --nproc-per-node 2 -m fp4video.cli.main ARGS`` on a free rendezvous port; skips
    the test when no torchrun sits next to this python."""
    import os
    import shutil
    import socket
    import subprocess
    import sys

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun not found next to this python")
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([torchrun, "--nproc-per-node", str(WORLD), "--master-port", str(port), "-m",
                           "fp4video.cli.main", *args], capture_output=True, text=True, env=env, timeout=600, cwd=cwd)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, S, H, D, generator=g) for _ in range(3))


def _degrees(mode):
    return dict(ring_degree=WORLD, ulysses_degree=1) if mode == "ring" else dict(ring_degree=1, ulysses_degree=WORLD)


def _worker(rank, init_file, mode, method, backend, out_dir):
    import torch.distributed as dist

    from fp4video.integration.distributed import cpu_parallel_config
    from fp4video.integration.parallel import context_parallel_attention

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        config = cpu_parallel_config(**_degrees(mode))
        q, k, v = (x.chunk(WORLD, dim=1)[rank] for x in _inputs())  # as diffusers' _cp_plan splits tokens
        out = context_parallel_attention(q, k, v, method=method, parallel_config=config, backend=backend)
        torch.save(out, f"{out_dir}/out{rank}.pt")
        dist.barrier()  # both ranks done before the group goes
    finally:
        dist.destroy_process_group()


def _run(tmp_path, mode, method, backend):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(str(tmp_path / "init"), mode, method, backend, str(tmp_path)), nprocs=WORLD)
    return torch.cat([torch.load(tmp_path / f"out{r}.pt") for r in range(WORLD)], dim=1)


@pytest.mark.parametrize("method, backend", [("mxattn", "triton"), ("sage3", "reference")])
def test_ulysses_equals_single_process(tmp_path, method, backend):
    """Ulysses runs the full sequence for H/N heads per rank: the single-process blocks exactly."""
    from fp4video import fp4_attention

    got = _run(tmp_path, "ulysses", method, backend)
    want = fp4_attention(*_inputs(), method=method, layout="bshd", backend=backend)
    assert got.shape == want.shape and (got - want).abs().max() < 1e-6


@pytest.mark.parametrize("method, backend", [("mxattn", "triton"), ("nvfp4", "reference")])
def test_ring_equals_lse_merge_of_shards(tmp_path, method, backend):
    """Ring attention = FP4 attention per K/V shard merged with the kernel's LSE in fp32; close to,
    not equal to, single-process FP4 attention (each shard quantizes P̃ against its own running max)."""
    from fp4video import fp4_attention
    from fp4video.metrics import cossim

    q, k, v = _inputs()
    got = _run(tmp_path, "ring", method, backend)
    parts = [fp4_attention(q, kj, vj, method=method, layout="bshd", return_lse=True, backend=backend)
             for kj, vj in zip(k.chunk(WORLD, 1), v.chunk(WORLD, 1))]
    lse = torch.logsumexp(torch.stack([p[1] for p in parts]), dim=0)
    want = sum(torch.exp(lj - lse)[..., None] * oj for oj, lj in parts)
    assert (got - want).abs().max() < 1e-5
    single = fp4_attention(q, k, v, method=method, layout="bshd", backend=backend)
    assert cossim(got, single) > 0.995


#: MXAttention's policy shape: FP16 in block 0 (stock attention, except under ring: see the test)
BLOCK0_FP16 = {"method": "mxattn", "rules": [{"method": "fp16", "blocks": [0]}]}


def _wan_inputs():
    g = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(1, 16, 2, 16, 16, generator=g),  # 2·8·8 = 128 video tokens
                encoder_hidden_states=torch.randn(1, 12, 32, generator=g), timestep=torch.tensor([500.0]),
                return_dict=False)


def _wan_forward(method, degrees=None):
    """A tiny Wan transformer with fp4video installed after context parallelism was enabled with
    ``degrees`` (the config reaches the processors through install; diffusers' own _cp_plan)."""
    from fp4video.integration import distributed, install
    from fp4video.integration.tiny import tiny_wan_transformer

    model = tiny_wan_transformer(0, 32)
    if degrees is not None:
        distributed.enable_context_parallel(model, **degrees, device=torch.device("cpu"))
    from fp4video.integration import Policy

    policy = Policy.model_validate(BLOCK0_FP16) if method == "block0-fp16" else method
    ctx = install(model, policy, backend="reference")
    with torch.no_grad():
        out = model(**_wan_inputs())[0]
    return out, ctx


def _wan_worker(rank, init_file, mode, method, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        out, ctx = _wan_forward(method, _degrees(mode))
        torch.save({"out": out, "calls": ctx.calls}, f"{out_dir}/wan{rank}.pt")
        dist.barrier()  # both ranks done before the group goes
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode,method", [("ulysses", "mxattn"), ("ring", "mxattn"), ("ulysses", "block0-fp16"),
                                         ("ring", "block0-fp16")])
def test_wan_transformer_under_context_parallelism(tmp_path, mode, method):
    """Both ranks get the whole output (the plan gathers it); Ulysses equals the single-process
    forward, ring is close (shard-wise P quantization; see fp4video.integration.parallel). With an
    FP16 block under ring (diffusers' native attention cannot return the LSE the ring merge
    needs), fp4video's unquantized attention runs it."""
    import torch.multiprocessing as mp

    from fp4video.metrics import cossim

    mp.spawn(_wan_worker, args=(str(tmp_path / "init"), mode, method, str(tmp_path)), nprocs=WORLD)
    results = [torch.load(tmp_path / f"wan{r}.pt") for r in range(WORLD)]
    single, _ = _wan_forward(method)
    assert torch.equal(results[0]["out"], results[1]["out"])
    calls = results[0]["calls"]
    degrees = {"ring": WORLD, "ulysses": 1} if mode == "ring" else {"ring": 1, "ulysses": WORLD}
    assert {c["method"] for c in calls} == ({"mxattn"} if method == "mxattn" else {"mxattn", "fp16"})
    if method != "mxattn":
        assert {c["method"] for c in calls if c["block"] == 0} == {"fp16"}
    # self-attention ran context-parallel; cross-attention (local queries, whole text) did not
    assert all(c.get("context_parallel") == (degrees if c["kind"] == "self" else None) for c in calls)
    if mode == "ulysses":
        assert (results[0]["out"] - single).abs().max() < 1e-4
    else:
        assert cossim(results[0]["out"], single) > 0.99


def test_generate_under_torchrun_equals_single_process(tmp_path):
    """`torchrun --nproc-per-node 2 ... generate --ulysses-degree 2` on CPU (gloo): one video and one
    sidecar (rank 0), the FP4 self-attention context-parallel, frames equal to a one-process run
    up to uint8 rounding."""
    import json

    import imageio.v3 as iio
    import numpy as np

    two = _cli_under_torchrun("generate", "--model", "tiny", "--ulysses-degree", "2", "--output", str(tmp_path / "two.mp4"), cwd=tmp_path)
    assert two.returncode == 0, two.stderr[-2000:]
    one = _cli("generate", "--model", "tiny", "--output", str(tmp_path / "one.mp4"), cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-2000:]
    sidecar = json.loads((tmp_path / "two.json").read_text())
    assert sidecar["processes"] == 2 and sidecar["config"]["parallel"] == {"ring_degree": 1, "ulysses_degree": 2}
    self_calls = [c for c in sidecar["attention_calls"] if c["kind"] == "self"]
    assert self_calls and all(c["context_parallel"] == {"ring": 1, "ulysses": 2} for c in self_calls)
    a = iio.imread(tmp_path / "two.mp4").astype(np.int16)
    b = iio.imread(tmp_path / "one.mp4").astype(np.int16)
    assert a.shape == b.shape and np.abs(a - b).max() <= 2


def test_generate_refuses_a_parallel_config_without_torchrun(tmp_path):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "fp4video.cli.main", "generate", "--ulysses-degree", "2",
                          "--output", str(tmp_path / "x.mp4")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "torchrun" in run.stderr and not (tmp_path / "x.mp4").exists()


def _hunyuan_inputs():
    g = torch.Generator().manual_seed(2)
    mask = torch.zeros(1, 24, dtype=torch.bool)
    mask[:, :17] = True  # 17 valid text tokens of 24
    return dict(hidden_states=torch.randn(1, 4, 2, 16, 16, generator=g),  # 2·8·8 = 128 video tokens
                encoder_hidden_states=torch.randn(1, 24, 16, generator=g), encoder_attention_mask=mask,
                pooled_projections=torch.randn(1, 8, generator=g), timestep=torch.tensor([500.0]),
                guidance=torch.tensor([6000.0]), return_dict=False)


def _hunyuan_worker(rank, init_file, mode, method, out_dir):
    import torch.distributed as dist

    from fp4video.integration import distributed, install
    from fp4video.integration.tiny import tiny_hunyuan_transformer

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        model = tiny_hunyuan_transformer(0, 32)
        distributed.enable_context_parallel(model, **_degrees(mode), device=torch.device("cpu"))
        ctx = install(model, method, backend="reference")
        with torch.no_grad():
            out = model(**_hunyuan_inputs())[0]
        torch.save({"out": out, "calls": ctx.calls}, f"{out_dir}/hy{rank}.pt")
        dist.barrier()  # both ranks done before the group goes
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
@pytest.mark.parametrize("method", ["fp16", "mxattn"])
def test_hunyuan_transformer_under_context_parallelism(tmp_path, mode, method):
    """fp4video's HunyuanVideo plan: video tokens split, text replicated, the text padding mask
    honoured. Ulysses (one attention over [video; text] per head shard) and fp16 equal the
    single-process forward; FP4 under ring is close to it (merged per shard with the LSE: block
    boundaries and running maxima differ)."""
    import torch.multiprocessing as mp

    from fp4video.integration import install
    from fp4video.integration.tiny import tiny_hunyuan_transformer
    from fp4video.metrics import cossim

    mp.spawn(_hunyuan_worker, args=(str(tmp_path / "init"), mode, method, str(tmp_path)), nprocs=WORLD)
    got = [torch.load(tmp_path / f"hy{r}.pt") for r in range(WORLD)]
    model = tiny_hunyuan_transformer(0, 32)
    install(model, method, backend="reference")
    with torch.no_grad():
        single = model(**_hunyuan_inputs())[0]
    assert got[0]["out"].shape == single.shape
    joint = [c for c in got[0]["calls"] if c["kind"] == "joint" and c["block"] >= 0]
    assert joint and all(c["context_parallel"] for c in joint)
    if method == "fp16" or mode == "ulysses":  # Ulysses keeps the single-GPU key order: the same blocks
        assert (got[0]["out"] - single).abs().max() < 1e-4
    else:
        assert cossim(got[0]["out"], single) > 0.99


def test_bench_parallel_smoke_under_torchrun(tmp_path):
    """`bench parallel` (the 2×GPU scaling command) end to end on CPU with the tiny transformer:
    rank 0 prints one row per method, and the split forward matches the one-process forward."""
    run = _cli_under_torchrun("bench", "parallel", "--tiny", "--methods", "fp16", "mxattn", "--reps", "1",
                              "--out", str(tmp_path / "bench.md"))
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in (tmp_path / "bench.md").read_text().splitlines() if line.startswith("| fp16") or
            line.startswith("| mxattn")]
    assert len(rows) == 2  # written once, by rank 0
    assert all(float(r.strip("| ").split(" | ")[-1]) > 0.999 for r in rows)


def test_generate_hunyuan_under_torchrun_ulysses_equals_single_process(tmp_path):
    """The HunyuanVideo plan end to end (text encoders, refiner, VAE): with Ulysses the 2-process
    video is the 1-process video (fully 4-bit mxattn config; equal here, up to 2/255 allowed for
    thread-count-dependent float summation in the rest of the model)."""
    import os

    import imageio.v3 as iio
    import numpy as np

    config = os.path.join(os.path.dirname(__file__), "..", "configs", "hunyuan_mxattn.yaml")
    common = ["generate", "--config", config, "--model", "tiny"]
    two = _cli_under_torchrun(*common, "--ulysses-degree", "2", "--output", str(tmp_path / "two.mp4"))
    assert two.returncode == 0, two.stderr[-2000:]
    one = _cli(*common, "--output", str(tmp_path / "one.mp4"))
    assert one.returncode == 0, one.stderr[-2000:]
    a, b = iio.imread(tmp_path / "two.mp4").astype(np.int16), iio.imread(tmp_path / "one.mp4").astype(np.int16)
    assert a.shape == b.shape and np.abs(a - b).max() <= 2


def _hunyuan_stock_worker(rank, init_file, out_dir):
    import torch.distributed as dist

    from fp4video.integration import distributed
    from fp4video.integration.tiny import tiny_hunyuan_transformer

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        model = tiny_hunyuan_transformer(0, 32)
        distributed.enable_context_parallel(model, ring_degree=1, ulysses_degree=WORLD, device=torch.device("cpu"))
        try:
            with torch.no_grad():
                model(**_hunyuan_inputs())
            message = "ran"
        except RuntimeError as e:
            message = str(e)
        torch.save(message, f"{out_dir}/msg{rank}.pt")
        dist.barrier()  # both ranks done before the group goes
    finally:
        dist.destroy_process_group()


def test_hunyuan_plan_refuses_stock_processors(tmp_path):
    """Stock joint attention under fp4video's HunyuanVideo plan would count the replicated text
    once per rank: the forward stops with an error that says to install fp4video's processors."""
    import torch.multiprocessing as mp

    mp.spawn(_hunyuan_stock_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD)
    message = torch.load(tmp_path / "msg0.pt")
    assert "fp4video.install" in message, message


# --- every method, shards of different statistics -------------------------------------------------


def _skewed_inputs():
    """Two token shards that differ: the second half of K has a channel mean (what K smoothing
    removes, per shard: the LSE must carry it back) and twice the spread, V's second half an offset,
    and the second half of the queries is sharper."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, S, H, D, generator=g) for _ in range(3))
    half = S // 2
    k[:, half:] = 2 * k[:, half:] + 3 * torch.randn(1, 1, H, D, generator=g)
    v[:, half:] += 2.0
    q[:, half:] *= 3
    return q, k, v


def _every_method_worker(rank, init_file, mode, out_dir):
    import torch.distributed as dist

    from fp4video.integration.distributed import cpu_parallel_config
    from fp4video.integration.parallel import context_parallel_attention
    from fp4video.recipe import METHODS

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        config = cpu_parallel_config(**_degrees(mode))
        q, k, v = (x.chunk(WORLD, dim=1)[rank] for x in _skewed_inputs())
        outs = {m: context_parallel_attention(q, k, v, method=m, parallel_config=config, backend="reference")
                for m in METHODS}
        torch.save(outs, f"{out_dir}/every{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_every_method_under_context_parallelism_with_skewed_shards(tmp_path, mode):
    """Every method, two gloo processes, shards of different statistics. Ulysses = the
    single-process result exactly; ring = the LSE merge of the per-shard results, and as close to
    fp64 attention as the single-process result (the smooth-K methods too: their LSE carries the
    shard's K mean back)."""
    import torch.multiprocessing as mp

    from fp4video import fp4_attention
    from fp4video.metrics import cossim
    from fp4video.recipe import METHODS

    mp.spawn(_every_method_worker, args=(str(tmp_path / "init"), mode, str(tmp_path)), nprocs=WORLD)
    shards = [torch.load(tmp_path / f"every{r}.pt") for r in range(WORLD)]
    q, k, v = _skewed_inputs()
    truth = torch.nn.functional.scaled_dot_product_attention(*(t.double().transpose(1, 2) for t in (q, k, v)))
    truth = truth.transpose(1, 2)
    for m in METHODS:
        got = torch.cat([s[m] for s in shards], dim=1)
        single = fp4_attention(q, k, v, method=m, layout="bshd", backend="reference")
        assert torch.isfinite(got).all(), m
        if mode == "ulysses":
            assert (got - single).abs().max() < 1e-6, m
            continue
        parts = [fp4_attention(q, kj, vj, method=m, layout="bshd", return_lse=True, backend="reference")
                 for kj, vj in zip(k.chunk(WORLD, 1), v.chunk(WORLD, 1))]
        lse = torch.logsumexp(torch.stack([p[1] for p in parts]), dim=0)
        merged = sum(torch.exp(lj - lse)[..., None] * oj for oj, lj in parts)
        assert (got - merged).abs().max() < 1e-5, m
        assert cossim(got, truth) > cossim(single, truth) - 0.01, (m, cossim(got, truth), cossim(single, truth))


# --- LTX-Video: a family reached through the dispatcher, with diffusers' own plan ------------------


def _ltx_forward(method, degrees=None, padded=False):
    from fp4video.integration import distributed, install
    from fp4video.integration.tiny import tiny_ltx_pipeline

    model = tiny_ltx_pipeline().transformer
    if degrees is not None:
        distributed.enable_context_parallel(model, **degrees, device=torch.device("cpu"))
    ctx = install(model, method, backend="reference")
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(1, 12, dtype=torch.long)
    if padded:
        mask[:, 9:] = 0  # text padding: the model passes it to the cross-attention as an additive mask
    with torch.no_grad():
        out = model(hidden_states=torch.randn(1, 2 * 8 * 8, 8, generator=g), encoder_hidden_states=torch.randn(
            1, 12, 32, generator=g), timestep=torch.tensor([500]), encoder_attention_mask=mask, num_frames=2, height=8,
            width=8, return_dict=False)[0]
    return out, ctx


def _ltx_worker(rank, init_file, mode, method, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        padded, padded_ctx = _ltx_forward(method, _degrees(mode), padded=True)
        out, ctx = _ltx_forward(method, _degrees(mode))
        plain = [torch.from_numpy(t.numpy().copy()) for t in (out, padded)]  # plain tensors (the plan gathers into async collective ones)
        torch.save({"out": plain[0], "padded": plain[1], "calls": ctx.calls, "padded_calls": padded_ctx.calls},
                   f"{out_dir}/ltx{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_ltx_transformer_under_context_parallelism(tmp_path, mode):
    """LTX-Video under diffusers' own context-parallel plan (it splits the text and its mask with
    the video tokens), its processors stock and routed by fp4video: self- and cross-attention run
    context-parallel; Ulysses equals one process, ring is close. With padded text (the plan splits
    the mask with the text tokens) the masked cross-attention gathers keys and mask from every rank
    and equals one process under both; a test that fails if a rank used its share of the mask for
    keys it does not hold, or dropped the mask."""
    import torch.multiprocessing as mp

    from fp4video.metrics import cossim

    mp.spawn(_ltx_worker, args=(str(tmp_path / "init"), mode, "mxattn", str(tmp_path)), nprocs=WORLD)
    results = [torch.load(tmp_path / f"ltx{r}.pt") for r in range(WORLD)]
    single, _ = _ltx_forward("mxattn")
    assert torch.equal(results[0]["out"], results[1]["out"]) and results[0]["out"].shape == single.shape
    degrees = {"ring": WORLD, "ulysses": 1} if mode == "ring" else {"ring": 1, "ulysses": WORLD}
    calls = results[0]["calls"]
    assert {c["kind"] for c in calls} == {"self", "cross"}
    assert all(c.get("context_parallel") == degrees for c in calls), calls
    padded, _ = _ltx_forward("mxattn", padded=True)
    assert torch.equal(results[0]["padded"], results[1]["padded"])
    assert (results[0]["padded"] - padded).abs().max() < 1e-4 if mode == "ulysses" else cossim(results[0]["padded"], padded) > 0.99
    # the padding matters (dropping three text tokens changes the output), and the gathered
    # cross-attention honours it: padded, the split run is as far from one process as unpadded
    # (ring: its shard-wise FP4 rounding of the self-attention), and much closer to the padded one
    # process than the padding moves the output
    effect = (padded - single).abs().max()
    err_padded = (results[0]["padded"] - padded).abs().max()
    err_plain = (results[0]["out"] - single).abs().max()
    assert effect > 1e-2 and err_padded < effect / 3 and err_padded < 2 * err_plain + 1e-4, (effect, err_padded, err_plain)
    assert all(c.get("context_parallel") == degrees for c in results[0]["padded_calls"])
    if mode == "ulysses":
        assert (results[0]["out"] - single).abs().max() < 1e-4
    else:
        assert cossim(results[0]["out"], single) > 0.99
