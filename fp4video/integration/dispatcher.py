"""fp4video's methods as diffusers attention backends, for users of ``set_attention_backend``:

    import fp4video.integration.dispatcher as fd
    fd.register_attention_backends()                 # "fp4video_mxattn", "fp4video_sage3", ...
    pipe.transformer.set_attention_backend("fp4video_mxattn")

``reset_attention_backend(model)`` undoes it (diffusers' own ``model.reset_attention_backend()``
leaves the process-wide active backend set, so the model would keep running fp4video's).

One method everywhere the model's processors call diffusers' dispatcher (no per-block or per-step
policy: use :func:`fp4video.install` for that), context parallelism included. diffusers 0.42 has
no public way to add a backend: its backend names are a closed enum and the registry is private.
This module extends both through :mod:`.diffusers_api`, the one module that touches diffusers'
private names; it checks them first and says what to do instead when a diffusers release changes
them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..recipe import METHODS
from . import diffusers_api

__all__ = ["register_attention_backends", "register_backend", "backend_name", "reset_attention_backend",
           "active_backend", "set_active_backend", "AttentionCall", "diffusers_backend"]

PREFIX = "fp4video_"


def backend_name(method: str) -> str:
    """The diffusers backend name of a method: ``"fp4video_" + method`` with ``-`` as ``_``."""
    return PREFIX + method.replace("-", "_")


@dataclass(frozen=True)
class AttentionCall:
    """One call of a diffusers attention backend, as the dispatcher makes it: ``query``, ``key``,
    ``value`` (B, S, H, D), and the options every backend function receives."""

    query: object
    key: object
    value: object
    attn_mask: object = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False
    return_lse: bool = False
    parallel_config: object = None

    def unsupported_options(self) -> list[str]:
        """The options set on this call that softmax(q·kᵀ·scale)·v with a key mask does not cover."""
        return ([f"dropout_p={self.dropout_p}"] if self.dropout_p else []) + (["is_causal"] if self.is_causal else []) + (
            ["enable_gqa"] if self.enable_gqa else [])

    def dispatch_kwargs(self) -> dict:
        """The call as ``dispatch_attention_fn``'s keyword arguments (its LSE asked for through
        ``attention_kwargs``, as diffusers' context-parallel code asks for it)."""
        kw = dict(attn_mask=self.attn_mask, dropout_p=self.dropout_p, is_causal=self.is_causal, scale=self.scale,
                  enable_gqa=self.enable_gqa, parallel_config=self.parallel_config)
        if self.return_lse:
            kw["attention_kwargs"] = {"return_lse": True}
        return kw


def diffusers_backend(fn, *, opaque: bool = False):
    """``fn(call: AttentionCall)`` as a function with the signature diffusers' dispatcher calls
    backends with (it passes only the arguments a backend's signature names): the one place where
    that signature is adapted; ``opaque``: hidden from torch.compile (see below)."""

    def backend(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False, _parallel_config=None):
        return fn(AttentionCall(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                                _parallel_config))

    # (not functools.wraps: diffusers reads the accepted arguments from inspect.signature, which
    # would follow __wrapped__ to fn's)
    backend.__name__, backend.__qualname__, backend.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
    # ``opaque``: hidden from torch.compile (a compiled block breaks its graph here and runs the
    # call as it is), for a backend whose kernel depends on the block, the step and the call's
    # routing, which a compiled block would otherwise guard on, one graph per block past dynamo's
    # recompile limit. A one-method backend stays traceable (its kernel is one custom op, so
    # fullgraph compiles and CUDA graphs keep it). The wrapper's __wrapped__ is ``backend``, whose
    # signature diffusers reads.
    return torch.compiler.disable(backend) if opaque else backend


def _backend_fn(method: str):
    from ..attention import fp4_attention
    from .parallel import context_parallel_attention

    def attention(call: AttentionCall):
        if call.unsupported_options():
            raise ValueError(f"the {backend_name(method)} backend has no dropout, causal mask or GQA "
                             f"(got {', '.join(call.unsupported_options())})")
        if call.parallel_config is not None:
            return context_parallel_attention(call.query, call.key, call.value, method=method,
                                              parallel_config=call.parallel_config, attn_mask=call.attn_mask,
                                              scale=call.scale, return_lse=call.return_lse)
        return fp4_attention(call.query, call.key, call.value, method=method, layout="bshd", attn_mask=call.attn_mask,
                             scale=call.scale, return_lse=call.return_lse)

    attention.__name__ = attention.__qualname__ = f"{backend_name(method)}_attention"
    return diffusers_backend(attention)


def register_backend(name: str, fn):
    """Register ``fn`` as the diffusers attention backend ``name`` (context parallelism supported;
    calling again with the same function is harmless). Returns its ``AttentionBackendName`` member."""
    member = diffusers_api.add_backend_name(name)
    if diffusers_api.registered_function(member) is not fn:
        diffusers_api.register_backend(member, fn, supports_context_parallel=True)
    return member


def active_backend():
    """The process-wide backend that runs the attention of processors naming none (the
    ``attention_backend`` context manager's, or ``DIFFUSERS_ATTN_BACKEND``)."""
    return diffusers_api.active_backend()


def set_active_backend(member) -> None:
    """Make ``member`` the process-wide active backend (:func:`active_backend`)."""
    diffusers_api.set_active_backend(member)


def register_attention_backends(methods=None) -> list[str]:
    """Register ``fp4video_<method>`` diffusers attention backends (all methods by default; calling
    again is harmless). Returns their names."""
    names = []
    for method in methods or list(METHODS):
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; known methods: {', '.join(METHODS)}")
        names.append(register_backend(backend_name(method), _backend_fn(method)).value)
    return names


def reset_attention_backend(model) -> None:
    """``model.reset_attention_backend()`` plus diffusers' process-wide default backend restored."""
    import diffusers.models.attention_dispatch as dispatch

    model.reset_attention_backend()
    default = getattr(dispatch, "DIFFUSERS_ATTN_BACKEND", "native")
    diffusers_api.set_active_backend(diffusers_api.backend_enum()(default))
