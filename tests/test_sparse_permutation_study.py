"""scripts/sparse_permutation_study.py at tiny sizes: k-means orders known clusters contiguously, a
permutation that is the identity changes no number of the study, and on a content head whose clusters
are known the permuted order lets the oracle keep far more of every row's mass than the tokens' own
order at density 0.2."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from fp4video.harness.video_heads import VideoGrid, video_heads

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("sparse_permutation_study",
                                                  ROOT / "scripts" / "sparse_permutation_study.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _content_head(tokens: int = 512, clusters: int = 4, dim: int = 32, seed: int = 0):
    """(q, k, labels): a head whose tokens each attend to the tokens of their own cluster (equal
    clusters of ``tokens // clusters``, scattered over the sequence) and to nothing else."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randperm(tokens, generator=gen) % clusters  # every cluster spread over every tile
    emb = torch.randn(clusters, dim, generator=gen)
    emb = emb / emb.norm(dim=-1, keepdim=True) * 4.0 * dim ** 0.25  # logit 16 within a cluster
    q = emb[labels] + 0.05 * torch.randn(tokens, dim, generator=gen)
    k = emb[labels] + 0.05 * torch.randn(tokens, dim, generator=gen)
    return q[None, None], k[None, None], labels


def test_kmeans_orders_known_clusters_contiguously(study):
    _, k, labels = _content_head()
    perms = study.permutations(k, k, k.shape[2], clusters=(4,), iters=5)
    for p in perms[1:]:
        for order in (p["key"][0], p["query"][0]):
            runs = labels[order]
            assert int((runs[1:] != runs[:-1]).sum()) == 3, p["name"]  # 4 runs: one per cluster
            assert sorted(order.tolist()) == list(range(k.shape[2]))  # a permutation


def test_identity_permutation_changes_no_number(study):
    """One cluster orders the tokens as they are: every measure equals the unpermuted one exactly."""
    grid = VideoGrid(2, 8, 16, text=8)
    q, k, _ = video_heads(grid, ("spatial", "content"), dim=32, seed=1)
    perms = study.permutations(q, k, grid.video, clusters=(1,), iters=3)
    ident = torch.arange(grid.tokens).expand(2, -1)
    assert all(torch.equal(p[x], ident) for p in perms for x in ("key", "query"))
    rows = study.measure(q, k, perms, densities=(0.2, 0.5), global_tokens=((grid.video, grid.tokens),),
                         video=grid.video)
    base = {r["head"]: r for r in rows if r["permutation"] == "none"}
    others = [r for r in rows if r["permutation"] != "none"]
    assert len(others) == 4
    for r in others:
        b = base[r["head"]]
        for part in ("oracle", "aligned", "dynamic"):
            for key, val in r[part].items():
                for name, x in val.items():
                    y = b[part][key][name]
                    assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, (r["permutation"], part, name)


def test_permutation_raises_the_oracle_on_a_content_head(study):
    """Clusters scattered over every tile: in the tokens' own order no key tile holds a query tile's
    heavy keys (one tile of four keeps about a quarter); grouped by cluster, one key tile holds them."""
    q, k, _ = _content_head()
    perms = study.permutations(q, k, q.shape[2], clusters=(4,), iters=5)
    rows = study.measure(q, k, perms, densities=(0.2,))
    kept = {r["permutation"]: r["oracle"][0.2] for r in rows}
    assert kept["none"]["tile_kept"].mean() < 0.4
    for name in ("K k-means C=4, Q k-means", "K k-means C=4, Q → K centroid"):
        assert kept[name]["tile_kept"].min() > 0.95 and kept[name]["row_min"] > 0.9, (name, kept[name])
        assert kept[name]["density"] == kept["none"]["density"] == 0.25


def test_bad_options_stop_with_one_line_before_any_work(study, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        study.main(["--out", str(tmp_path / "x"), "--densities", "0.2", "0"])
    assert e.value.code == 2
    assert "--densities" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
