"""What a calibration chooses from: the default candidates, the checks of a candidate's name and
of the budget, and the block-sparse candidates ``sparse=`` names."""

from __future__ import annotations

import math

from ..integration.policy import backend_of
from .plan import DEFAULT_RELATIVE_COST, Budget, is_exact_target, sparse_target, split_target

__all__ = ["DEFAULT_CANDIDATES", "DEFAULT_SPARSE", "OPTIONAL_BACKENDS", "as_target", "as_budget", "check_match",
           "sparse_targets", "sparse_spec_target"]

#: fp4video's methods a calibration tries by default (fp16 is always a candidate).
DEFAULT_CANDIDATES = ("fp16", "fp8", "mxattn-pv8", "mxattn")

#: The block-sparse selections ``sparse=True`` tries on the fastest method candidate: the dynamic
#: selection at τ 0.9 and 0.95, the sampled estimate at τ 0.9 with sinks and a floor of 0.9, and
#: the static window of ``configs/wan22_mxattn_pv8_sparse.yaml`` without and with sinks (radial; it
#: applies where the latent grid is known: self and joint attention of a video transformer's input).
#: A selection is admitted at a site only where its check kept the budget's ``min_kept``.
DEFAULT_SPARSE = ("dynamic:0.9", "dynamic:0.95", "dynamic:0.9,sampled,sinks,floor=0.9", "static:4,45,80,radial",
                  "static:4,45,80,radial,sinks")

#: Quantized external backends tried by default where they run (each refused one is reported).
OPTIONAL_BACKENDS = ("fa3_fp8", "sage", "_sage_qk_int8_pv_fp8_cuda_sm90", "sage3_blackwell", "flashinfer_nvfp4_sm120")


def as_target(c) -> str:
    """``c`` as a candidate name: an fp4video method, ``backend:<name>`` (a backend a policy can
    name) or a block-sparse method ``METHOD+SELECTION``; a one-line ValueError (TypeError for a
    non-string) otherwise."""
    from ..recipe import METHODS

    if not isinstance(c, str):
        raise TypeError(f"a candidate is a method name or 'backend:<name>', got {type(c).__name__} {c!r:.40}")
    if c in METHODS:
        return c
    name = backend_of(c)
    if name is not None:
        from ..integration.backends import check_backend_name

        check_backend_name(name)
        return c
    base, sparsity = split_target(c)
    if sparsity is not None:
        if base not in METHODS or base == "fp16":
            raise ValueError(f"block-sparse candidate {c!r}: {base!r} is not one of fp4video's quantized methods")
        return sparse_target(base, sparsity)
    raise ValueError(f"unknown candidate {c!r}: give an fp4video method ({', '.join(METHODS)}) or 'backend:<name>'")


def as_budget(budget) -> Budget:
    """``budget`` as a :class:`Budget` (a number is its ``rel_l2``)."""
    if isinstance(budget, Budget):
        return budget
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"budget must be a number (relative L2 per site) or a Budget, got {type(budget).__name__}")
    if not (math.isfinite(budget) and budget > 0):
        raise ValueError(f"budget must be a relative L2 error greater than 0 and finite, got {budget}")
    return Budget(rel_l2=float(budget))


def check_match(budget: Budget) -> None:
    """A budget matching an exact backend is refused: it has no error to match."""
    if budget.match is None:
        return
    if is_exact_target(as_target(budget.match)):
        raise ValueError(f"the budget matches {budget.match}, an exact backend: it has no error to match (every "
                         "candidate would have to be exact); give a relative L2 budget instead")


def sparse_spec_target(spec, method: str | None) -> str:
    """The candidate one ``sparse=`` entry names: a whole name (``mxattn+dynamic:0.95``) as it is,
    a selection alone (``dynamic:0.9``, ``static:1,8,8,radial``) on ``method``."""
    if not isinstance(spec, str):
        raise TypeError(f"a sparse candidate is a string (dynamic:0.9, static:1,8,8 or method+dynamic:0.9), got "
                        f"{type(spec).__name__} {spec!r:.40}")
    if "+" in spec:
        return as_target(spec)
    if method is None:
        raise ValueError(f"sparse candidate {spec!r}: no fp4video method among the candidates to run it")
    return sparse_target(method, spec)


def sparse_targets(sparse, targets: list) -> list:
    """The block-sparse candidates ``sparse`` names: None or False none; True
    :data:`DEFAULT_SPARSE`; else a list of specs (``dynamic:0.9``, ``static:1,8,8,radial``) for the
    fastest fp4video method among ``targets`` (by :data:`DEFAULT_RELATIVE_COST`) or whole candidate
    names (``mxattn+dynamic:0.95``)."""
    if sparse is None or sparse is False:
        return []
    specs = DEFAULT_SPARSE if sparse is True else [sparse] if isinstance(sparse, str) else list(sparse)
    methods = [t for t in targets if backend_of(t) is None and t != "fp16" and split_target(t)[1] is None]
    fastest = min(methods, key=lambda t: DEFAULT_RELATIVE_COST.get(t, math.inf)) if methods else None
    return [sparse_spec_target(spec, fastest) for spec in specs]
