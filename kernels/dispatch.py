"""Which loop runs a call, and the call itself: the pre-pass, the input checks, the loop, the LSE
shift and the NaN policy, in that order. Every environment override of the kernels is read here:

======================  ==================================  ===============================================
variable                values                              effect
======================  ==================================  ===============================================
``FP4VIDEO_MX_KERNEL``  ``scaled`` | ``fp8`` | ``bf16``     the MXFP4 loop (default: ``scaled`` on sm_100
                                                            and sm_120, ``fp8`` on other sm_89+ GPUs and
                                                            in the interpreter, else ``bf16``)
``FP4VIDEO_MX_TMA``     ``0`` | ``1``                       the e4m3 loop's tiles (and on sm_100 the
                                                            dot_scaled loop's codes, which then also runs
                                                            without warp specialization) by pointer loads (0), or
                                                            TMA required (1; an error where it cannot run)
``FP4VIDEO_NV_KERNEL``  ``scaled`` | ``sm90`` | ``triton``  the NVFP4 loop (default: ``scaled`` — native
                                                            FP4 MMAs — on sm_100 and sm_120, ``sm90`` on
                                                            Hopper at head dims 128, else ``triton``)
======================  ==================================  ===============================================

Loops (one module each): :mod:`.loop_e4m3` (MXFP4 on e4m3 tensor cores, sm_89+),
:mod:`.loop_scaled` (MXFP4 and NVFP4 through ``tl.dot_scaled``: Blackwell's native FP4 MMAs),
:mod:`.loop_nvfp4` and :mod:`.loop_nvfp4_sm90` (NVFP4 on bf16 tensor cores; the Gluon ping-pong on
Hopper), :mod:`.loop_bf16` (``fp16``, and MXFP4 where nothing faster runs). Limits
(:func:`supports` reports them): key-padding masks ``(B|1, 1, 1, Sk|1)`` only.
"""

from __future__ import annotations

import os

import torch

from fp4video.formats import Format
from fp4video.recipe import AttentionRecipe
from fp4video.reference import poison_heads

from .checks import k_smoothing_mean, nonfinite_heads, smoothing_lse_shift
from .launch import arch_capability, device_arch, tma_unsupported_reason
from .loop_bf16 import attention_bf16
from .loop_e4m3 import E4M3_V_SPAN_LIMIT, FAST_LOGIT_BOUND, attention_e4m3, pointer_loop_unsupported_reason
from .loop_nvfp4 import attention_nvfp4
from .prepass import prepass, prepass_fp8_window, prepass_packed, prepass_tiles
from .tiles import work_dtype

#: every environment variable the kernels read, with the values each accepts
ENVIRONMENT = {
    "FP4VIDEO_MX_KERNEL": ("scaled", "fp8", "bf16"),
    "FP4VIDEO_MX_TMA": ("0", "1"),
    "FP4VIDEO_NV_KERNEL": ("scaled", "sm90", "triton"),
}


def _env(name: str) -> str | None:
    """The override ``name`` if set (checked against :data:`ENVIRONMENT`), else None."""
    value = os.environ.get(name) or None
    if value is not None and value not in ENVIRONMENT[name]:
        *rest, last = (repr(v) for v in ENVIRONMENT[name])
        allowed = f"{', '.join(rest)} or {last}"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return value


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def supports(recipe: AttentionRecipe, q: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[bool, str]:
    """Whether the kernels can run this call, and if not, why (for the error message)."""
    if not (q.is_cuda or interpreting()):
        return False, "the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)"
    if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1):
        # (B|1, 1, 1, Sk|1): one key-padding row per batch, broadcast over keys too
        # (:func:`key_padding` expands it), which is what the loops' ``key_alive`` (B, Sk) holds
        return False, (f"the Triton kernels take key-padding masks (B or 1, 1, 1, Sk or 1) only; this mask of shape "
                       f"{tuple(mask.shape)} varies over heads or queries")
    e4m3 = Format.E4M3 in (recipe.qk_format, recipe.pv_format)
    if e4m3 and recipe.qk_format is not Format.NVFP4 and mx_kernel(recipe, q.device) not in ("fp8", "scaled"):
        return False, (f"{recipe.name}: its E4M3 (FP8) operands run on e4m3 tensor cores (sm_89+), "
                       f"not on {_device_name(q.device)}")
    return True, ""


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return str(device)
    cap = torch.cuda.get_device_capability(device)
    return f"sm_{cap[0]}{cap[1]}"


#: Architectures whose native FP4 MMAs the ``scaled`` loop is compiled for and checked offline
#: (``tests/test_offline_compile.py``: ``tcgen05.mma kind::mxf4`` / ``kind::mxf4nvf4 … block16`` on
#: sm_100, ``mma.sync kind::mxf4nvf4`` on sm_120), with the oldest Triton that compiles it there:
#: Triton 3.6, 3.7 and 3.8 fail on sm_100 (``'ttng.tmem_alloc' op uninitialized alloc must have a
#: mutable memdesc type``; the NVFP4 form also in ``TritonGPUAccelerateMatmul``), 3.9 compiles it;
#: on sm_120 3.6 to 3.9 all do. Other Blackwell-generation GPUs
#: (sm_103, sm_110, sm_121), and these with an older Triton, run the e4m3 loop (MXFP4; its FP8 MMAs
#: every sm_89+ GPU has) or the bf16 NVFP4 loop until the native loop is checked there
#: (``FP4VIDEO_MX_KERNEL=scaled`` / ``FP4VIDEO_NV_KERNEL=scaled`` try it).
NATIVE_FP4_MIN_TRITON = {"sm_100": (3, 9), "sm_120": (3, 6)}
NATIVE_FP4_ARCHS = tuple(NATIVE_FP4_MIN_TRITON)


def triton_version() -> tuple[int, int]:
    """(major, minor) of the installed Triton."""
    import triton

    major, minor = triton.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


#: The oldest Triton that compiles the NVFP4 form of the dot_scaled loop where Triton emulates
#: ``dot_scaled`` (off Blackwell: sm_90 checked; 3.6 and 3.7 fail in ``TritonGPUAccelerateMatmul``)
NV_EMULATED_MIN_TRITON = (3, 8)


def native_fp4(arch: str | None) -> bool:
    """Whether the native FP4 loop runs by default on ``arch`` with the installed Triton
    (:data:`NATIVE_FP4_MIN_TRITON`)."""
    return arch in NATIVE_FP4_MIN_TRITON and triton_version() >= NATIVE_FP4_MIN_TRITON[arch]


def mx_kernel(recipe: AttentionRecipe, device: torch.device) -> str | None:
    """Which MXFP4 / FP8 loop runs this recipe on ``device``: :func:`mx_kernel_on` for its
    architecture (the CPU interpreter runs ``"fp8"``)."""
    if device.type != "cuda":
        return mx_kernel_on(recipe, "interpreter" if interpreting() else None)
    return mx_kernel_on(recipe, device_arch(device))


def mx_kernel_on(recipe: AttentionRecipe, arch: str | None) -> str | None:
    """Which MXFP4 / FP8 loop runs this recipe on ``arch`` (``"sm_90"``, ...; ``"interpreter"``;
    None: nothing runs the kernels): ``"scaled"`` (``tl.dot_scaled``: native FP4 MMAs on
    :data:`NATIVE_FP4_ARCHS` with a Triton that compiles it there, :func:`native_fp4`), ``"fp8"`` (e4m3 tensor cores: sm_89+, and the CPU interpreter) or
    None (the bf16 loop: not an MXFP4 recipe, or an older GPU). ``FP4VIDEO_MX_KERNEL`` overrides the
    choice (e.g. to run the Blackwell loop, emulated, on a Hopper GPU). Recipes with E4M3 (FP8) P and V
    run the e4m3 loop on every sm_89+ GPU, except that MXFP4-Q·K ones (``mxattn-pv8``) run ``"scaled"``
    (FP4 Q·K, FP8 P·V) where the native FP4 loop does."""
    fp8_tensor_cores = arch == "interpreter" or (arch is not None and arch_capability(arch) >= (8, 9))
    qk, pv = recipe.qk_format, recipe.pv_format
    if pv is Format.E4M3 and qk is Format.MXFP4:  # mxattn-pv8: Q·K on the native FP4 MMA where it runs
        if _env("FP4VIDEO_MX_KERNEL") == "scaled" or native_fp4(arch):
            return "scaled"
        return "fp8" if fp8_tensor_cores else None
    if pv is Format.E4M3 and qk is Format.E4M3:
        return "fp8" if fp8_tensor_cores else None
    if qk is not Format.MXFP4 or pv is not Format.MXFP4:
        return None
    forced = _env("FP4VIDEO_MX_KERNEL")
    if forced:
        return None if forced == "bf16" else forced
    if native_fp4(arch):
        return "scaled"
    return "fp8" if fp8_tensor_cores else None


def nv_scaled_on(recipe: AttentionRecipe, arch: str | None) -> bool:
    """Whether the NVFP4 recipe (NVFP4 Q·K and P·V: ``nvfp4``, ``sage3``, ``sage3-hpnq``; NVFP4 Q·K and
    FP8 P·V: ``sage3-pv8``) runs the ``dot_scaled`` loop (native ``kind::mxf4nvf4`` MMAs for Q·K) on ``arch``: where :func:`native_fp4`,
    or anywhere Triton runs when ``FP4VIDEO_NV_KERNEL=scaled`` asks (emulated off Blackwell); never
    in the interpreter unless asked (its ``dot_scaled`` reads every scale as E8M0)."""
    if recipe.qk_format is not Format.NVFP4 or recipe.pv_format not in (Format.NVFP4, Format.E4M3):
        return False
    forced = _env("FP4VIDEO_NV_KERNEL")
    if forced:
        if forced == "scaled":
            _check_forced_nv_scaled(arch)
        return forced == "scaled"
    return native_fp4(arch)


def _check_forced_nv_scaled(arch: str | None) -> None:
    """``FP4VIDEO_NV_KERNEL=scaled`` where the loop would not compile, or (the interpreter) would
    compute wrong products, is an error saying so."""
    version = ".".join(map(str, triton_version()))
    if arch == "interpreter":
        from .loop_scaled import interpreter_reads_e4m3_scales

        if not interpreter_reads_e4m3_scales():
            raise ValueError("FP4VIDEO_NV_KERNEL=scaled: Triton's CPU interpreter reads dot_scaled's E4M3 scales "
                             "as E8M0, so the NVFP4 loop would compute wrong products here; unset it")
        return
    need = NATIVE_FP4_MIN_TRITON.get(arch, NV_EMULATED_MIN_TRITON)
    if arch is not None and triton_version() < need:
        raise ValueError(f"FP4VIDEO_NV_KERNEL=scaled: Triton {version} cannot compile the NVFP4 dot_scaled loop for "
                         f"{arch} (Triton {'.'.join(map(str, need))}+ can); unset it")


def nv_scaled(recipe: AttentionRecipe, device: torch.device) -> bool:
    """:func:`nv_scaled_on` for this device (the CPU interpreter: ``"interpreter"``)."""
    arch = device_arch(device) if device.type == "cuda" else "interpreter" if interpreting() else None
    return nv_scaled_on(recipe, arch)


def tma_loop(device: torch.device) -> bool:
    """Whether the e4m3 loop reads its K̂/V̂ᵀ tiles by TMA on this device: where it can
    (:func:`.launch.tma_unsupported_reason`), unless ``FP4VIDEO_MX_TMA=0`` asks for pointer loads
    (the pre-pass then keeps K̂ in key order). ``FP4VIDEO_MX_TMA=1`` where TMA cannot run is an error."""
    forced = _env("FP4VIDEO_MX_TMA")
    reason = tma_unsupported_reason(device)
    if forced == "1" and reason:
        raise ValueError(f"FP4VIDEO_MX_TMA=1, but the e4m3 loop cannot copy tiles by TMA here: {reason}")
    return forced != "0" and reason is None


def scaled_tma(device: torch.device) -> bool:
    """Whether the dot_scaled loop runs its warp-specialized TMA form here: where it has an MMA
    partition (:func:`.loop_scaled.warp_specialized`) and TMA is not turned off
    (``FP4VIDEO_MX_TMA=0``), the FP4-P and the FP8-P·V forms alike."""
    from .loop_scaled import warp_specialized

    return warp_specialized(device) and tma_loop(device)


def scaled_quad_order_on(recipe: AttentionRecipe, arch: str | None) -> bool:
    """Whether the dot_scaled loop reads K̂ in the quad key order on ``arch`` (``"sm_120"``, …;
    :func:`.key_order.quad_key_order`): its pointer-load loop with FP4 P·V on consumer Blackwell
    (sm_12x: ``mma.sync``, whose P̂ operand it then places without a shared-memory exchange).
    Elsewhere K̂ stays in key order: the warp-specialized loop of
    sm_10x passes P through tensor memory, and the FP8-P·V form's P̂ operand has another layout."""
    return (recipe.pv_format is not Format.E4M3 and arch not in (None, "interpreter")
            and arch_capability(arch)[0] == 12)


def scaled_quad_order(recipe: AttentionRecipe, device: torch.device) -> bool:
    """:func:`scaled_quad_order_on` for ``device`` (never in the interpreter, where tests ask for it)."""
    return device.type == "cuda" and scaled_quad_order_on(recipe, device_arch(device))


def nv_kernel(qh: torch.Tensor, vh: torch.Tensor, launch_given: bool) -> str:
    """Which NVFP4 loop runs these pre-pass outputs: ``"sm90"`` (the Gluon ping-pong, the faster
    one on Hopper) where it can run, for its ``DEFAULT_SHAPES``, when no launch options
    (``block_m``, ...: the Triton loop's) are given; else ``"triton"``. ``FP4VIDEO_NV_KERNEL``
    forces one; a forced ``sm90`` raises where it cannot run (or where this Triton has no Gluon)."""
    forced = _env("FP4VIDEO_NV_KERNEL")
    if forced in ("triton", "scaled"):  # ("scaled": the dot_scaled loop, chosen before the pre-pass)
        return "triton"
    sm90 = _gluon_nvfp4()
    reason = "this Triton has no Gluon Hopper API (3.5+)" if sm90 is None else sm90.unsupported_reason(qh, vh)
    if forced == "sm90":
        if reason or launch_given:
            raise ValueError(f"FP4VIDEO_NV_KERNEL=sm90: {reason or 'it takes no launch options (block_m, ...)'}")
        return "sm90"
    default_shape = sm90 is not None and (qh.shape[-1], vh.shape[-1]) in sm90.DEFAULT_SHAPES
    return "sm90" if reason is None and not launch_given and default_shape else "triton"


def _gluon_nvfp4():
    """:mod:`.loop_nvfp4_sm90`, or None where this Triton has no Gluon Hopper API (< 3.5)."""
    try:
        from . import loop_nvfp4_sm90
    except ImportError:
        return None
    return loop_nvfp4_sm90


def prepare(q, k, v, recipe: AttentionRecipe, key_alive, mean=None):
    """The pre-pass for this recipe and device: a ``(path, tensors)`` pair :func:`attention_prepared`
    takes. ``mean``: K's smoothing mean (:func:`.checks.k_smoothing_mean`) when the caller has it."""
    return _prepare_checked(q, k, v, recipe, key_alive, mean, None)[0]


def _prepare_checked(q, k, v, recipe: AttentionRecipe, key_alive, mean, bad, ranges=None):
    """:func:`prepare`, whether any head is ``bad`` (holds a NaN/Inf; True where unknown), and the
    values of ``ranges`` (:func:`fp4video.reference.range_summary`, a 1-D device tensor, or None) as
    floats (None when not given or unknown). Every decision here reads the GPU's answer back in
    **one** transfer: whether V fits the e4m3 loop's window (else the exact bf16 loop runs), whether
    heads need poisoning, and the input ranges the finite-output guarantee checks. While a CUDA graph
    is captured nothing can be read back: the window check is skipped, heads are always poisoned,
    and the ranges are neither checked nor rescaled (inputs beyond them may give NaN/Inf there)."""
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    got_ranges = None

    def read_back(*flags):
        """(whether any head is bad, *flags) in one transfer, with ``ranges`` (into ``got_ranges``);
        True / None for what is unknown or cannot be read back."""
        nonlocal got_ranges
        wanted = ([bad.any()] if bad is not None else []) + list(flags)
        if capturing or not (wanted or ranges is not None):
            return (True, *[None] * len(flags))
        parts = [torch.stack([f.to(torch.float64) for f in wanted])] if wanted else []
        if ranges is not None:
            parts.append(ranges.to(torch.float64).flatten())
        values = torch.cat(parts).tolist()
        if ranges is not None:
            got_ranges = values[len(wanted):]
        values = values[:len(wanted)]
        return (bool(values.pop(0)) if bad is not None else True, *[int(x) for x in values])

    path = mx_kernel(recipe, q.device)
    if path == "fp8":  # (…, Sk, whether K̂'s rows are in tile key order: where the loop uses TMA)
        tiled = tma_loop(q.device)
        if not tiled and (reason := pointer_loop_unsupported_reason(q.device, recipe)):
            why = "FP4VIDEO_MX_TMA=0" if _env("FP4VIDEO_MX_TMA") == "0" else tma_unsupported_reason(q.device)
            raise ValueError(f"{recipe.name} cannot run here ({why}): {reason}")
        tensors, v_span = prepass_fp8_window(q, k, v, recipe, key_alive, k_tile_order=tiled, mean=mean)
        if recipe.pv_format is Format.E4M3:  # V is E4M3 by definition: no window to check
            return ("fp8", (*tensors, k.shape[-2], tiled)), read_back()[0], got_ranges
        if bad is not None:  # heads with a NaN/Inf become NaN anyway: their V does not count
            v_span = v_span.masked_fill(bad[..., None], 0)
        has_bad, widest = read_back(v_span.max())
        if widest is None or widest <= E4M3_V_SPAN_LIMIT:
            return ("fp8", (*tensors, k.shape[-2], tiled)), has_bad, got_ranges
        return ("work", prepass(q, k, v, recipe, key_alive, work_dtype(q), mean)), has_bad, got_ranges
    if path == "scaled" or nv_scaled(recipe, q.device):
        prepared = ("scaled", prepass_packed(q, k, v, recipe, key_alive, mean,
                                             quad_order=scaled_quad_order(recipe, q.device)))
    elif recipe.pv_format is Format.NVFP4 or (recipe.qk_format, recipe.pv_format) == (Format.NVFP4, Format.E4M3):
        # the NVFP4 loops read K̂, V̂ in tile key order, whole tiles
        prepared = ("nvfp4", (*prepass_tiles(q, k, v, recipe, key_alive, work_dtype(q), mean), k.shape[-2]))
    elif recipe.quantized:
        prepared = ("work", prepass(q, k, v, recipe, key_alive, work_dtype(q), mean))
    elif not q.is_cuda and q.dtype != torch.float32:  # the CPU interpreter's 16-bit dots are wrong: fp32 (exact)
        prepared = ("work", (q.float(), k.float(), v.float()))
    else:
        prepared = ("work", (q, k, v))  # the inputs as they are: no copy, any strides
    return prepared, read_back()[0], got_ranges


def key_padding(mask, b: int, sk: int):
    """A key-padding mask (B|1, 1, 1, Sk|1) as the kernels' ``key_alive`` (B, Sk), or None: a mask
    broadcast over batches or keys is expanded, so every key it covers counts (in K's smoothing mean
    too: :func:`.checks.k_smoothing_mean`)."""
    return None if mask is None else mask.expand(b, 1, 1, sk)[:, 0, 0, :]


def attention(q, k, v, *, recipe: AttentionRecipe, mask, scale: float, **launch):
    """q, k, v: (B, H, S, D) views, any strides. Returns (out (B, H, Sq, Dv) in q's dtype, lse fp32)."""
    return attention_with_key_alive(q, k, v, recipe=recipe, key_alive=key_padding(mask, q.shape[0], k.shape[-2]),
                                    scale=scale, **launch)


def attention_with_key_alive(q, k, v, *, recipe: AttentionRecipe, key_alive, scale: float, **launch):
    """:func:`attention` with the key-padding mask as ``key_alive`` (B, Sk) bool or None.

    The finite-output guarantee (:data:`fp4video.reference.LOGIT_BOUND`): the inputs' ranges are
    read back with the NaN/Inf check, in the one transfer of :func:`_prepare_checked`; a call beyond
    the logit bound raises, and one whose Q, K or V need an exact power-of-two rescaling
    (:func:`fp4video.reference.plan_ranges`: magnitudes near fp32's limit, rare) runs the pre-pass
    again on the rescaled inputs (a second transfer, on that path only)."""
    from fp4video.reference import input_ranges, plan_ranges, range_summary, rescale_inputs, rescale_output

    bad = nonfinite_heads(q, k, v, key_alive)  # the NaN/Inf policy: those heads' outputs become NaN
    alive = None if key_alive is None else key_alive[:, None, :]
    # nothing is read back while a CUDA graph is captured: the ranges are not even computed there
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    ranges = None if capturing else input_ranges(q, k, v, alive, bad)
    mean = k_smoothing_mean(k, key_alive) if recipe.smooth_k else None
    prepared, has_bad, summary = _prepare_checked(q, k, v, recipe, key_alive, mean, bad,
                                                  None if ranges is None else range_summary(ranges, scale, q.shape[-1]))
    v_factor = None
    if summary is not None and (plan := plan_ranges(summary, scale, q.dtype)).needed:
        q, k, v, scale, v_factor = rescale_inputs(q, k, v, ranges, plan, scale)
        mean = k_smoothing_mean(k, key_alive) if recipe.smooth_k else None
        prepared, has_bad, _ = _prepare_checked(q, k, v, recipe, key_alive, mean, bad)
    # the e4m3 loop's fast exponents where the logits are known to be bounded (always while a CUDA
    # graph is captured, when nothing is read back)
    exact = summary is not None and not summary[3] <= FAST_LOGIT_BOUND
    out, lse = attention_prepared(prepared, key_alive, recipe=recipe, scale=scale, out_dtype=q.dtype,
                                  dv=v.shape[-1], exact=exact, **launch)
    out = rescale_output(out, v_factor)
    if mean is not None:  # the loops' LSE is of the smoothed logits: back to the unsmoothed ones
        lse = lse + smoothing_lse_shift(q, mean, scale)
    if has_bad:  # a pass over the output only where some head holds a NaN/Inf
        poison_heads(out, lse, bad)
    return out, lse


def attention_prepared(prepared, key_alive, *, recipe: AttentionRecipe, scale: float, out_dtype, dv: int,
                       block_m: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                       tma: bool | None = None, exact: bool = True):
    """The attention loop alone, on :func:`prepare`'s output; ``dv``: the value head dim. Launch
    values override the loop's own (``tma``: the e4m3 loop, :func:`.loop_e4m3.attention_e4m3`, and the
    dot_scaled loop, :func:`.loop_scaled.attention_packed`). ``exact``: the e4m3 loop's exponent form
    (False only where every logit lies within :data:`.loop_e4m3.FAST_LOGIT_BOUND` nats; the other
    loops have one form)."""
    path, tensors = prepared
    if tma is not None and path not in ("fp8", "scaled"):
        raise ValueError(f"tma: an option of the e4m3 loop and of the dot_scaled loop, not of the {path!r} path")
    launch = dict(block_m=block_m, num_warps=num_warps, num_stages=num_stages)
    if path == "scaled":
        from .loop_scaled import attention_packed

        if tma is None:
            tma = scaled_tma(tensors[0].device)
        return attention_packed(*tensors, key_alive=key_alive, recipe=recipe, scale=scale, out_dtype=out_dtype, dv=dv,
                                tma=tma, quad_order=scaled_quad_order(recipe, tensors[0].device), **launch)
    if path == "fp8":
        return attention_e4m3(*tensors, key_alive, recipe=recipe, scale=scale, out_dtype=out_dtype, dv=dv, tma=tma,
                              exact=exact, **launch)
    if path == "nvfp4":
        qh, kh, vh, sk = tensors
        if _nv_loop(recipe, qh, vh, any(launch.values())) == "loop_nvfp4_sm90":
            return _gluon_nvfp4().attention_nvfp4_sm90(qh, kh, vh, key_alive, sk=sk, recipe=recipe, scale=scale,
                                                       out_dtype=out_dtype)
        return attention_nvfp4(qh, kh, vh, key_alive, sk=sk, recipe=recipe, scale=scale, out_dtype=out_dtype, **launch)
    qh, kh, vh = tensors
    return attention_bf16(qh, kh, vh, key_alive, recipe=recipe, scale=scale, out_dtype=out_dtype, **launch)


def _nv_loop(recipe: AttentionRecipe, qh, vh, launch_given: bool) -> str:
    """The NVFP4 16-bit loop for these pre-pass outputs: the Gluon ping-pong or the Triton one."""
    if recipe.pv_format is not Format.E4M3 and nv_kernel(qh, vh, launch_given=launch_given) == "sm90":
        return "loop_nvfp4_sm90"
    return "loop_nvfp4"


#: the loop module of each pre-pass path (the NVFP4 path: :func:`_nv_loop`)
LOOP_OF_PATH = {"scaled": "loop_scaled", "fp8": "loop_e4m3", "work": "loop_bf16"}


def loop_module(q, k, v, recipe: AttentionRecipe, key_alive=None) -> str:
    """Which loop module (``kernels/loop_*.py``) the dispatch runs this call with: runs the
    pre-pass to know (whether V fits the e4m3 loop's window depends on the data)."""
    path, tensors = prepare(q, k, v, recipe, key_alive)
    if path == "nvfp4":
        return _nv_loop(recipe, tensors[0], tensors[2], False)
    if path == "scaled" and scaled_tma(tensors[0].device):
        return "loop_scaled (warp-specialized, TMA)"
    if path == "scaled" and scaled_quad_order(recipe, tensors[0].device):
        return "loop_scaled (quad key order)"
    return LOOP_OF_PATH[path]


def uses_fp8(recipe: AttentionRecipe, device: torch.device) -> bool:
    """Whether this recipe's Q·K and P·V run on e4m3 tensor cores on ``device``."""
    return mx_kernel(recipe, device) == "fp8"
