"""External attention backends a policy can name beside fp4video's own methods.

A rule names either an fp4video method (``method: mxattn``) or an external backend
(``backend: _flash_3``); the two keys keep them apart. External backends are

- every backend of the installed diffusers' attention dispatcher, by its diffusers name
  (``native``, ``_native_cudnn``, ``flash``, ``_flash_3``, ``_flash_3_hub``, ``sage``,
  ``_sage_qk_int8_pv_fp8_cuda_sm90``, ...; fp4video's own ``fp4video_*`` registrations excepted:
  those are methods), called through ``dispatch_attention_fn`` with their registered constraints
  checked on every call;
- the peers diffusers lacks, imported only when installed (:data:`PEERS`): FlashAttention-3 FP8
  with a per-(batch, head) e4m3 cast (``flash_attn_interface`` or the ``fa3-fwd`` wheel's
  ``fa3_fwd_interface``), SageAttention3 (``sageattn3.sageattn3_blackwell``, sm_120 / sm_121),
  FlashInfer's sm_120 NVFP4 attention.

:func:`resolve` makes a named backend ready for a model at install: a backend that is not
installed, or cannot run on the model's device and dtype, or runs but does not compute attention
(a probe call on small inputs, compared with an fp32 reference), is refused with the reason. At
each call :meth:`ExternalBackend.why_not` says whether it can take that call (mask, LSE, head dim,
dtype, context parallelism); the routing then follows the policy's fallback or raises.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import diffusers_api
from .dispatcher import PREFIX, AttentionCall

__all__ = ["PEERS", "ExternalBackend", "BackendUnavailable", "backend_names", "check_backend_name", "resolve",
           "fastest_exact", "EXACT_PREFERENCE", "is_exact"]

#: The largest finite float8_e4m3fn value (FlashAttention-3 FP8's per-tensor scale is amax / 448).
E4M3_MAX = 448.0

#: Module names FlashAttention-3's forward is published under (upstream, then the ``fa3-fwd`` wheel).
FA3_MODULES = ("flash_attn_interface", "fa3_fwd_interface")

#: Exact (unquantized) diffusers backends in the order ``fp16_backend: fastest`` tries them: on
#: Hopper FlashAttention-3 bf16 runs Wan 720p 1.2× cuDNN and cuDNN 1.6× flash SDPA (BENCHMARKS.md);
#: hub backends are left out (they download kernels: name one to use it).
EXACT_PREFERENCE = ("_flash_3", "_native_cudnn", "flash", "_native_flash", "xformers", "native")

#: diffusers backends that quantize (SageAttention's); every other diffusers backend is exact.
_QUANTIZED_DIFFUSERS = ("sage",)

#: Smallest cosine to an fp32 reference a backend's probe output may have (the FP4 peers reach
#: ~0.97 on Gaussian inputs; a wrong calling convention gives ~0).
PROBE_MIN_COSINE = 0.9


class BackendUnavailable(ValueError):
    """A backend a policy names cannot run here: not installed, not for this GPU or dtype."""


@dataclass(frozen=True)
class Peer:
    """A backend diffusers lacks: ``load()`` -> the call function (``fn(call) -> out``, (B, S, H, D))
    or raises ImportError; ``why_not(call)`` -> why it cannot take a call, or None."""

    name: str
    title: str
    load: Callable
    why_not: Callable


def _import_first(names):
    errors = []
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError as e:
            errors.append(f"import {name}: {str(e).splitlines()[0][:100] if str(e) else type(e).__name__}")
    raise ImportError("; ".join(errors))


def _plain_why_not(call: AttentionCall, *, head_dims=None, dtypes=(torch.bfloat16, torch.float16)) -> str | None:
    """Why a kernel computing softmax(q·kᵀ/√D)·v alone (no mask, no LSE, one GPU) cannot take ``call``."""
    q = call.query
    if call.unsupported_options():
        return f"has no {', '.join(call.unsupported_options())}"
    if call.attn_mask is not None:
        return "takes no attention mask"
    if call.return_lse:
        return "returns no LSE (ring attention needs it)"
    if call.parallel_config is not None:
        return "has no context parallelism"
    if q.device.type != "cuda":
        return f"runs on CUDA GPUs only (the call is on {q.device.type})"
    if q.dtype not in dtypes:
        return f"takes {' or '.join(str(d).removeprefix('torch.') for d in dtypes)}, not {str(q.dtype).removeprefix('torch.')}"
    if head_dims is not None and q.shape[-1] not in head_dims:
        return f"takes head dims {'/'.join(map(str, head_dims))}, not {q.shape[-1]}"
    if call.scale is not None and not math.isclose(call.scale, q.shape[-1] ** -0.5, rel_tol=1e-6):
        return "takes only the default softmax scale"
    return None


def _fp8_per_head(x: torch.Tensor):
    """(B, S, H, D) -> (float8_e4m3fn, scale (B, H) fp32): x ≈ x8 · scale, scale = amax / 448."""
    amax = x.detach().abs().amax(dim=(1, 3)).float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    x8 = (x.float() / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return x8, scale


def _load_fa3_fp8():
    func = _import_first(FA3_MODULES).flash_attn_func

    def fa3_fp8(call: AttentionCall):
        (q8, qs), (k8, ks), (v8, vs) = (_fp8_per_head(t) for t in (call.query, call.key, call.value))
        out = func(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        return out.to(call.query.dtype)

    return fa3_fp8


def _load_sage3():
    func = importlib.import_module("sageattn3").sageattn3_blackwell

    def sage3(call: AttentionCall):
        # (B, H, S, D) copies: the kernel takes HND and subtracts K's mean in place
        q, k, v = (t.transpose(1, 2).contiguous() for t in (call.query, call.key, call.value))
        return func(q, k, v, is_causal=False).transpose(1, 2).to(call.query.dtype)

    return sage3


def _load_flashinfer_nvfp4():
    module = importlib.import_module("flashinfer")
    missing = [n for n in ("nvfp4_attention_sm120_quantize_qkv", "nvfp4_attention_sm120_fwd") if not hasattr(module, n)]
    if missing:
        raise ImportError(f"this flashinfer ({getattr(module, '__version__', '?')}) has no {', '.join(missing)}")
    quantize, forward = module.nvfp4_attention_sm120_quantize_qkv, module.nvfp4_attention_sm120_fwd

    def flashinfer_nvfp4(call: AttentionCall):
        # (B, S, H, D) in, as flashinfer's prefill layout; the probe at install checks the output
        quantized = quantize(call.query.contiguous(), call.key.contiguous(), call.value.contiguous())
        out = forward(*quantized) if isinstance(quantized, (tuple, list)) else forward(quantized)
        out = out[0] if isinstance(out, (tuple, list)) else out
        return out.to(call.query.dtype)

    return flashinfer_nvfp4


#: The peers diffusers lacks, by the name a rule gives them (``backend: fa3_fp8``).
PEERS = {p.name: p for p in (
    Peer("fa3_fp8", "FlashAttention-3 FP8 (e4m3 Q, K, V with a per-(batch, head) scale, cast included)",
         _load_fa3_fp8, lambda c: _plain_why_not(c, head_dims=(64, 96, 128, 192, 256))),
    Peer("sage3_blackwell", "SageAttention3 (NVFP4, sageattn3_blackwell; sm_120 / sm_121)", _load_sage3,
         lambda c: _plain_why_not(c, head_dims=(64, 128))),
    Peer("flashinfer_nvfp4_sm120", "FlashInfer NVFP4 attention (sm_120 / sm_121)", _load_flashinfer_nvfp4,
         lambda c: _plain_why_not(c, head_dims=(128,))),
)}


def _diffusers_names() -> list[str]:
    """The names of every backend of the installed diffusers' dispatcher (fp4video's own excepted)."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    return [m.value for m in AttentionBackendName if not m.value.startswith(PREFIX)]


def backend_names() -> list[str]:
    """Every name a rule's ``backend:`` takes: diffusers' backends, then the peers."""
    return _diffusers_names() + list(PEERS)


def check_backend_name(name) -> str:
    """``name`` when a rule may name it as ``backend:``, else a one-line ``ValueError`` listing the names."""
    if not isinstance(name, str):
        raise ValueError(f"a backend is named by a string, got {type(name).__name__} {name!r:.40}")
    if name.startswith(PREFIX):
        raise ValueError(f"{name!r} is fp4video's own method {name.removeprefix(PREFIX)!r} registered with diffusers: "
                         "name it as `method:`")
    try:
        names = backend_names()
    except ImportError as e:
        raise ValueError(f"backend {name!r}: external backends need diffusers, which did not import ({e})") from None
    if name not in names:
        raise ValueError(f"unknown backend {name!r}; backends: {', '.join(names)} (fp4video's methods go in `method:`)")
    return name


def is_exact(name: str) -> bool:
    """Whether a backend computes attention unquantized (its output is the FP16 tier's)."""
    return name not in PEERS and not any(name.startswith(p) or name.startswith("_" + p) for p in _QUANTIZED_DIFFUSERS)


@dataclass
class ExternalBackend:
    """A named backend ready to run: ``run(call)`` returns (B, S, H, D) (and the LSE when asked),
    ``why_not(call)`` says why it cannot take a call (None: it can)."""

    name: str
    title: str
    exact: bool
    _run: Callable
    _why_not: Callable

    @property
    def label(self) -> str:
        """How a rule, a recorded call and a report name it."""
        return f"backend:{self.name}"

    def why_not(self, call: AttentionCall) -> str | None:
        return self._why_not(call)

    def run(self, call: AttentionCall):
        return self._run(call)


def _diffusers_backend(name: str) -> ExternalBackend:
    import diffusers.models.attention_dispatch as dispatch

    member = diffusers_api.backend_enum()(name)
    try:
        diffusers_api.check_backend_requirements(member)
    except diffusers_api.DiffusersAPIChanged:
        raise
    except RuntimeError as e:
        raise BackendUnavailable(f"backend {name!r} is not installed: {e}") from None
    if diffusers_api.registered_function(member) is None:
        raise BackendUnavailable(f"backend {name!r} has no function in diffusers' registry")
    if name.endswith("_hub"):
        try:
            diffusers_api.download_hub_kernel(member)
        except diffusers_api.DiffusersAPIChanged:
            raise
        except Exception as e:  # a download or a kernel load that fails: the reason, on one line
            raise BackendUnavailable(f"backend {name!r}: its hub kernel did not load ({type(e).__name__}: "
                                     f"{str(e).splitlines()[0][:120] if str(e) else ''})") from None
    args = diffusers_api.backend_arg_names(member)
    constraints = diffusers_api.backend_constraints(member)
    cp = diffusers_api.backend_supports_context_parallel(member)

    def why_not(call: AttentionCall) -> str | None:
        if call.return_lse and "return_lse" not in args:
            return "returns no LSE (ring attention needs it)"
        if call.parallel_config is not None and not cp:
            return "has no context parallelism in diffusers"
        if call.attn_mask is not None and "attn_mask" not in args:
            return "takes no attention mask"
        kwargs = dict(query=call.query, key=call.key, value=call.value, attn_mask=call.attn_mask,
                      dropout_p=call.dropout_p, is_causal=call.is_causal, scale=call.scale, enable_gqa=call.enable_gqa,
                      _parallel_config=call.parallel_config)
        for check in constraints:  # diffusers runs these only with DIFFUSERS_ATTN_CHECKS set: here always
            try:
                check(**kwargs)
            except ValueError as e:
                return f"fails diffusers' check ({str(e).rstrip('.')})"
        return None

    def run(call: AttentionCall):
        return dispatch.dispatch_attention_fn(call.query, call.key, call.value, **call.dispatch_kwargs(),
                                              backend=member)

    return ExternalBackend(name, f"diffusers' {name} backend", is_exact(name), run, why_not)


def _peer_backend(name: str) -> ExternalBackend:
    peer = PEERS[name]
    try:
        fn = peer.load()
    except ImportError as e:
        raise BackendUnavailable(f"backend {name!r} ({peer.title}) is not installed: {e}") from None
    return ExternalBackend(name, peer.title, False, fn, peer.why_not)


def resolve(name: str, *, device, dtype) -> ExternalBackend:
    """The backend ``name`` ready to run on ``device`` in ``dtype`` (the model's), after a probe
    call on small inputs; :class:`BackendUnavailable` with the reason otherwise."""
    check_backend_name(name)
    backend = _peer_backend(name) if name in PEERS else _diffusers_backend(name)
    _probe(backend, torch.device(device), dtype)
    return backend


def _probe(backend: ExternalBackend, device: torch.device, dtype) -> None:
    """Run ``backend`` once on (1, 128, 2, 64) Gaussian inputs; refuse it where it cannot take such a
    call or its output is not attention's."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 128, 2, 64, generator=g).to(device=device, dtype=dtype) for _ in range(3))
    call = AttentionCall(q, k, v)
    why = backend.why_not(call)
    if why is not None:
        raise BackendUnavailable(f"backend {backend.name!r} cannot run this model's attention on {device} in "
                                 f"{str(dtype).removeprefix('torch.')}: it {why}")
    try:
        out = backend.run(call)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # a build without this GPU's architecture, a kernel refusing it: the reason
        raise BackendUnavailable(f"backend {backend.name!r} failed on {_device_name(device)} ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:160] if str(e) else ''})") from None
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v)))
    ref = ref.transpose(1, 2)
    if not torch.is_tensor(out) or out.shape != ref.shape:
        raise BackendUnavailable(f"backend {backend.name!r} returned {type(out).__name__} "
                                 f"{tuple(getattr(out, 'shape', ()))} for (1, 128, 2, 64) inputs: not attention's output")
    cos = float(torch.nn.functional.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0))
    if not cos >= PROBE_MIN_COSINE:
        raise BackendUnavailable(f"backend {backend.name!r} runs on {_device_name(device)} but its output is not "
                                 f"attention's (cosine {cos:.3f} to an fp32 reference)")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"
    return str(device)


def fastest_exact(*, device, dtype) -> tuple[ExternalBackend, dict[str, str]]:
    """The first backend of :data:`EXACT_PREFERENCE` that runs here, and {name: why not} for those
    before it."""
    refused = {}
    for name in EXACT_PREFERENCE:
        try:
            return resolve(name, device=device, dtype=dtype), refused
        except BackendUnavailable as e:
            refused[name] = str(e)
    raise BackendUnavailable("no exact attention backend runs here: " + "; ".join(refused.values()))
