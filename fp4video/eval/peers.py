"""The attention kernels a Hopper user would pick instead of fp4video, found if installed.

fp4video never ships or builds them; it imports them when they are there (as diffusers does) so
``fp4video bench kernel`` can time them in the same process as its own kernels:

- FlashAttention-3 (``flash_attn_interface``, or the ``fa3-fwd`` wheel's ``fa3_fwd_interface``), in
  bf16 and in FP8 e4m3 with the per-tensor scale a user takes (amax / 448), timed with the cast
  included and as the kernel alone;
- SageAttention2 (``sageattention.sageattn``: INT8 Q·K, FP8 P·V, its own quantization inside the call);
- SpargeAttn (``spas_sage_attn``), the block-sparse peer: its kernel on a given selection
  (``block_sparse_sage2_attn_cuda`` on the same tiles, :func:`find_sparse_peers`) and its own top-k
  and cumulative selections (:func:`sparge_selection`).

:func:`sdpa_replaced_by` puts a peer in place of ``torch.nn.functional.scaled_dot_product_attention``
for a block of code (``fp4video bench pipeline --peers``: a whole diffusers forward with the peer as
its attention), counting the calls it took and those it left to SDPA, with the reason.

Every peer's ``fn`` takes what its ``prepare`` returns (``q, k, v`` when it has none) and returns
(B, H, S, D); inputs are (B, H, S, D) tensors (views of other layouts are fine). A peer that is not
installed, or cannot run a call (a key mask), is returned with the reason, never dropped.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["Peer", "find_peers", "SparsePeer", "find_sparse_peers", "sparge_selection", "E4M3_MAX", "fp8_per_tensor",
           "SdpaRoute", "sdpa_replaced_by"]

#: The largest finite float8_e4m3fn value (the per-tensor scale is amax / E4M3_MAX).
E4M3_MAX = 448.0

#: Module names FlashAttention-3's forward is published under (upstream, then the ``fa3-fwd`` wheel).
FA3_MODULES = ("flash_attn_interface", "fa3_fwd_interface")


@dataclass(frozen=True)
class Peer:
    """One peer kernel. ``fn`` is None when it cannot run here; ``missing`` then says why."""

    name: str
    precision: str  # "bf16" (a candidate for the best bf16 baseline) or what it quantizes to
    fn: Callable[..., torch.Tensor] | None
    missing: str | None = None
    #: ``prepare(q, k, v)`` -> the arguments of ``fn``: work done before the timed kernel (the FP8
    #: cast of the kernel-only row), or None (``fn(q, k, v)``).
    prepare: Callable | None = None
    #: whether it is a whole attention call (False: a kernel timed on prepared inputs), i.e. whether
    #: it can stand in for SDPA (:func:`sdpa_replaced_by`)
    whole_call: bool = True

    def args(self, q, k, v) -> tuple:
        return (q, k, v) if self.prepare is None else (self.prepare(q, k, v),)


def _import(names):
    """(module, None) for the first importable name, else (None, why)."""
    errors = []
    for name in names:
        try:
            return importlib.import_module(name), None
        except ImportError as e:  # a broken build raises ImportError subclasses too
            errors.append(f"import {name}: {str(e).splitlines()[0][:100] if str(e) else type(e).__name__}")
    return None, "; ".join(errors)


def fp8_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (B, H, S, D) as float8_e4m3fn with one scale per (batch, head) (what FlashAttention-3's
    ``*_descale`` arguments take, shape (B, H)): x ≈ x8 · scale, scale = amax / 448."""
    amax = x.detach().abs().amax(dim=(2, 3)).float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    x8 = (x.float() / scale[:, :, None, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return x8, scale


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _fa3_peers(module, missing: str | None) -> list[Peer]:
    names = ("FlashAttention-3 bf16", "FlashAttention-3 FP8 (cast included)", "FlashAttention-3 FP8 (kernel only)")
    if module is None:
        return [Peer(n, p, None, f"not installed ({missing})", whole_call=w)
                for n, p, w in zip(names, ("bf16", "fp8", "fp8"), (True, True, False))]
    func = module.flash_attn_func

    def bf16(q, k, v):  # FlashAttention-3 takes (B, S, H, D)
        return _first(func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))).transpose(1, 2)

    def cast(q, k, v):
        (q8, qs), (k8, ks), (v8, vs) = (fp8_per_tensor(t) for t in (q, k, v))
        return (q8, k8, v8), (qs, ks, vs)

    def fp8_kernel(prepared):
        (q8, k8, v8), (qs, ks, vs) = prepared
        out = func(q8.transpose(1, 2), k8.transpose(1, 2), v8.transpose(1, 2), q_descale=qs, k_descale=ks,
                   v_descale=vs)
        return _first(out).transpose(1, 2)

    def fp8(q, k, v):
        return fp8_kernel(cast(q, k, v))

    return [Peer(names[0], "bf16", bf16), Peer(names[1], "fp8", fp8),
            Peer(names[2], "fp8", fp8_kernel, prepare=cast, whole_call=False)]


def _sage_peer(module, missing: str | None) -> Peer:
    name = "SageAttention2 sageattn (INT8 QK, FP8 PV)"
    if module is None or not hasattr(module, "sageattn"):
        return Peer(name, "int8/fp8", None, f"not installed ({missing or 'sageattention has no sageattn'})")
    sageattn = module.sageattn
    return Peer(name, "int8/fp8", lambda q, k, v: _first(sageattn(q, k, v, tensor_layout="HND")))


def find_peers(*, key_mask: bool = False) -> list[Peer]:
    """Every peer fp4video knows, installed or not (``fn`` None, ``missing`` saying why). With
    ``key_mask`` (the call has a key-padding mask), peers without a mask argument are marked as not
    applicable rather than run without it."""
    fa3, fa3_missing = _import(FA3_MODULES)
    sage, sage_missing = _import(("sageattention",))
    peers = [*_fa3_peers(fa3, fa3_missing), _sage_peer(sage, sage_missing)]
    if key_mask:
        peers = [p if p.fn is None else Peer(p.name, p.precision, None, "takes no key-padding mask",
                                             whole_call=p.whole_call) for p in peers]
    return peers


@dataclass(frozen=True)
class SparsePeer:
    """A block-sparse peer kernel: ``fn(q, k, v, tiles)`` with (B, H, S, D) inputs and fp4video's
    selection bitmap ``tiles`` (B|1, H|1, ceil(Sq/128), ceil(Sk/128)) returns (B, H, S, D); None with
    ``missing`` when it cannot run here."""

    name: str
    fn: Callable | None
    missing: str | None = None


def _sparge_blocks(tiles: torch.Tensor, b: int, h: int, sq: int, major: int) -> torch.Tensor:
    """fp4video's 128 × 128 bitmap as SpargeAttn's ``mask_id`` (int32 0/1): 64 queries × 128 keys on
    sm_90, 128 × 64 on sm_80 / sm_89 (each of its blocks visits what its fp4video tile visits)."""
    t = tiles.expand(b, h, *tiles.shape[2:])
    if major == 9:
        t = t.repeat_interleave(2, dim=2)[:, :, : -(-sq // 64)]
    else:
        t = t.repeat_interleave(2, dim=3)
    return t.to(torch.int32).contiguous()


def find_sparse_peers() -> list[SparsePeer]:
    """SpargeAttn's block-sparse SageAttention2 kernel on a given selection (installed or not)."""
    module, missing = _import(("spas_sage_attn",))
    name = "SpargeAttn block_sparse_sage2_attn_cuda (same tiles)"
    if module is None or not hasattr(module, "block_sparse_sage2_attn_cuda"):
        return [SparsePeer(name, None, f"not installed ({missing or 'no block_sparse_sage2_attn_cuda'})")]
    kernel = module.block_sparse_sage2_attn_cuda

    def fn(q, k, v, tiles):
        blocks = _sparge_blocks(tiles, q.shape[0], q.shape[1], q.shape[2], torch.cuda.get_device_capability(q.device)[0])
        return _first(kernel(q, k, v, mask_id=blocks, tensor_layout="HND"))

    return [SparsePeer(name, fn)]


def sparge_selection(q: torch.Tensor, k: torch.Tensor, *, topk: float | None = None, cdf: float | None = None):
    """SpargeAttn's own selection of key blocks for (B, H, S, D) ``q``, ``k`` (K smoothed by its mean,
    as its attention entry points do): top-k (a share of key blocks per query block, its similarity
    gate off as in its top-k entry point) or cumulative (``cdf``, its default similarity gate 0.6).
    (B, H, ceil(Sq/64), ceil(Sk/128)) bool on Hopper's blocks; ValueError where SpargeAttn is not
    installed."""
    utils, missing = _import(("spas_sage_attn.utils",))
    if utils is None:
        raise ValueError(f"SpargeAttn is not installed ({missing})")
    if (topk is None) == (cdf is None):
        raise ValueError("give exactly one of topk and cdf")
    km = k.mean(dim=-2, keepdim=True)
    qh, kh = q.to(torch.float16).contiguous(), (k - km).to(torch.float16).contiguous()
    if topk is not None:
        return utils.get_block_map_meansim(qh, kh, BLKQ=64, BLKK=128, simthreshd1=-0.1, cdfthreshd=None, topk=topk)
    return utils.get_block_map_meansim(qh, kh, BLKQ=64, BLKK=128, simthreshd1=0.6, cdfthreshd=cdf, topk=None)


@dataclass
class SdpaRoute:
    """What :func:`sdpa_replaced_by` did: the calls the peer ran, and those left to SDPA by reason."""

    peer: str
    routed: int = 0
    left: Counter = field(default_factory=Counter)

    @property
    def calls(self) -> int:
        return self.routed + sum(self.left.values())

    def reasons(self, per: int = 1) -> str:
        """The calls left to SDPA (divided by ``per``, e.g. per forward) by reason: "3 with a mask, ..."."""
        return ", ".join(f"{n / per:g} {why}" for why, n in self.left.most_common())

    def summary(self, per: int = 1) -> str:
        """One line: the calls (divided by ``per``, e.g. per forward) the peer ran, and why the rest did not."""
        rest = self.reasons(per)
        return (f"{self.peer}: {self.routed / per:g} of {self.calls / per:g} attention calls"
                + (f"; the rest on SDPA ({rest})" if rest else ""))


def _why_not(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, dtypes, devices) -> str | None:
    """Why a peer (which computes softmax(q·kᵀ/√D)·v on (B, H, S, D) and nothing else) cannot take
    this SDPA call, or None."""
    if attn_mask is not None:
        return "with a mask"
    if is_causal:
        return "causal"
    if dropout_p:
        return "with dropout"
    if enable_gqa:
        return "grouped-query"
    if not (q.dim() == k.dim() == v.dim() == 4) or not (q.shape[:2] == k.shape[:2] == v.shape[:2]) or not (
            q.shape[-1] == k.shape[-1] == v.shape[-1]) or k.shape[2] != v.shape[2]:
        return "other shapes"
    if scale is not None and not math.isclose(scale, q.shape[-1] ** -0.5, rel_tol=1e-6):
        return "another scale"
    if q.dtype not in dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"in {q.dtype}"
    if q.device.type not in devices:
        return f"on {q.device.type}"
    return None


@contextlib.contextmanager
def sdpa_replaced_by(peer: Peer, *, dtypes=(torch.bfloat16, torch.float16), devices=("cuda",)):
    """Within the block, ``torch.nn.functional.scaled_dot_product_attention`` runs ``peer`` for
    every call it can take (no mask, not causal, no dropout, the default scale, q, k, v of one head
    dim and one of ``dtypes`` on one of ``devices``) and the original SDPA for the rest; yields an
    :class:`SdpaRoute` that counts both. The original is restored on exit, also after an error.
    Only whole calls (``Peer.whole_call``: no ``prepare`` step) can stand in for SDPA. The replacement
    is hidden from torch.compile (a compiled block breaks its graph there and runs the peer as it
    is, as fp4video's own attention does): traced, its counters would count compilations, not calls,
    and the route's state would be guarded on, one graph per call past dynamo's recompile limit."""
    if peer.fn is None:
        raise ValueError(f"{peer.name} cannot run here: {peer.missing}")
    if not peer.whole_call or peer.prepare is not None:
        raise ValueError(f"{peer.name} times its kernel on prepared inputs; it cannot stand in for SDPA")
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention
    route = SdpaRoute(peer.name)

    def replacement(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        why = _why_not(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, dtypes, devices)
        if why is not None:
            route.left[why] += 1
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        route.routed += 1
        return peer.fn(query, key, value).to(query.dtype)

    functional.scaled_dot_product_attention = torch.compiler.disable(replacement)
    try:
        yield route
    finally:
        functional.scaled_dot_product_attention = original
