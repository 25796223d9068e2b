"""Block-sparse attention: which key tiles each query tile visits, and what that drops.

A selection is a bool bitmap ``tiles`` (B|1, H|1, n_query_tiles, n_key_tiles) over tiles of
``query_tile`` query rows and ``key_tile`` keys (:class:`BlockSelection`). The reference
(:func:`fp4video.reference.attention_tiled` with ``key_tiles=``) computes a method's exact numerics
over the visited tiles only; a block-sparse kernel honours the same bitmap (the contract is
:class:`BlockSelection`'s docstring). Rules choose the tiles per call:

**Dynamic** (:func:`dynamic_selection`, :class:`DynamicSparsity`), the design of SpargeAttn (Zhang
et al., "SpargeAttn: Accurate Sparse Attention Accelerating Any Model Inference", ICML 2025): an
estimate of every (query tile, key tile) block's attention mass — from mean-pooled Q and K
(``pooled``: SpargeAttn's; a tile whose tokens point in too many directions for their mean to stand
for them is kept instead) or from the exact attention of a few sampled rows per query tile
(``sampled``: MInference's estimate from a few queries) — then each query tile keeps its always-kept
tiles (its own and neighbouring tokens, as Sparse VideoGen's spatial heads and Radial Attention's
diagonal band; global tokens such as the text of joint attention; leading sink tiles), its ``topk``
share of key tiles of largest estimated mass (SpargeAttn's top-k mode), and key tiles in descending
estimated mass until a share τ of its estimated mass is kept (SpargeAttn's cumulative rule).

**Static** (:func:`static_selection`, :class:`StaticSparsity`): a spatio-temporal window on the
latent grid (frames × height × width, flattened frame-major as Wan and HunyuanVideo flatten their
latents), optionally narrowing with frame distance as in Radial Attention (Li et al., "Radial
Attention: O(n log n) Sparse Attention with Energy Decay for Long Video Generation", 2025). Text
tokens, first or last, are global. **Hybrid** (:class:`HybridSparsity`): a window and a dynamic rule
together.

**The check** (:func:`check_selection`), run by every rule's calls: a few query rows per tile,
spread over the tile's queries (:func:`covering_rows`: k-center greedy from the tile's first and last
rows), get their exact softmax mass over every key tile (MInference's sampled queries; a GPU kernel,
:mod:`fp4video.kernels.row_mass`); weighted by the rows each stands for, they estimate each query
tile's kept share of its true mass and a one-sided confidence bound on it. From it, optionally: key
tiles heavy for most query tiles become global (attention sinks: Xiao et al., StreamingLLM, 2023;
mean pooling and static windows miss them), and a query tile whose bound is under the rule's
``floor`` visits more key tiles, in descending estimated mass, until the bound reaches the floor. The
selection carries what was measured (:class:`SelectionCheck`).

Everything is computed with tensor operations only: no value is read back to the host, so a CUDA
graph can capture the selection and its check with the call.
"""

from __future__ import annotations

from .check import (CHECK_CONFIDENCE, CHECK_ROWS, MEASURE_ROWS, SINK_MASS, check_rows_for, check_selection, row_shares,
                    sink_columns, student_t_quantile)
from .dynamic import ESTIMATE_ROWS, ESTIMATES, dynamic_selection
from .estimate import (MIN_SIMILARITY, BlockEstimate, covering_rows, estimate_block_mass, row_block_mass, sample_rows,
                       tile_pool)
from .rules import DynamicSparsity, HybridSparsity, StaticSparsity, resolve_sparsity
from .selection import KEY_TILE, QUERY_TILE, BlockSelection, SelectionCheck, tile_lists
from .static import static_selection, static_token_window

__all__ = [
    "QUERY_TILE",
    "KEY_TILE",
    "MIN_SIMILARITY",
    "CHECK_ROWS",
    "MEASURE_ROWS",
    "check_rows_for",
    "CHECK_CONFIDENCE",
    "SINK_MASS",
    "ESTIMATES",
    "ESTIMATE_ROWS",
    "BlockSelection",
    "SelectionCheck",
    "tile_lists",
    "BlockEstimate",
    "estimate_block_mass",
    "tile_pool",
    "sample_rows",
    "covering_rows",
    "row_block_mass",
    "dynamic_selection",
    "static_selection",
    "static_token_window",
    "check_selection",
    "row_shares",
    "sink_columns",
    "student_t_quantile",
    "DynamicSparsity",
    "StaticSparsity",
    "HybridSparsity",
    "resolve_sparsity",
]
