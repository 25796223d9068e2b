"""``FP4Processor``: one attention processor for the Wan (2.1 / 2.2, T2V and I2V) and HunyuanVideo
transformers of diffusers, for users who set processors themselves
(``transformer.set_attn_processor(FP4Processor(method=...))``). :func:`fp4video.install` does not
use it: it keeps the model's own processors and routes their dispatcher calls
(:mod:`fp4video.integration.routing`), which covers every family.

Processors do plumbing only (projections, norms, RoPE, the reshape to (B, S, H, D), the output
projection), reproducing diffusers' stock processors; the single numerics decision, which method a
call uses, comes from the :class:`~fp4video.integration.policy.Policy` and the
:class:`AttentionContext` (denoising step, expert) that :func:`fp4video.install` keeps current.
With method ``"fp16"`` the call goes to diffusers' own ``dispatch_attention_fn``, so the output is
the stock output.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from ..attention import BACKENDS, fp4_attention
from .parallel import uses_ring
from .policy import Policy, as_policy
from .rope import apply_rope

__all__ = ["FP4Processor", "AttentionContext", "sparse_summary"]

#: Wan's I2V processor splits its context at ``len - 512``: the text encoder's fixed length.
WAN_TEXT_CONTEXT = 512


@dataclass
class AttentionContext:
    """State shared by every processor of one installation (no process-global state)."""

    policy: Policy
    backend: str = "auto"
    step: int | None = None
    num_steps: int | None = None
    expert: str | None = None
    record: bool = True
    calls: list[dict] = field(default_factory=list)
    fallbacks: Counter = field(default_factory=Counter)
    #: {model.site: processor class} of block attention left as it was (not through the dispatcher)
    unrouted: dict = field(default_factory=dict)
    #: {name: ExternalBackend}: the external backends the policy names, resolved at install
    external: dict = field(default_factory=dict)
    #: the backend method ``fp16`` runs on (None: the processor's own, the stock output)
    fp16_exact: object = None
    #: ``observer(site=, kind=, call=, out=, ran=)`` after every routed call (calibration's measurements)
    observer: object = None
    #: ``override(site_name, block, kind) -> target or None``: a target that replaces the policy's for a call
    override: object = None

    def __post_init__(self):
        """The policy, backend and recording flag checked here, not at the first attention call
        (where a wrong backend under ``fallback: stock`` would only be counted)."""
        if not isinstance(self.policy, Policy):
            raise TypeError(f"AttentionContext.policy must be a fp4video Policy, got {type(self.policy).__name__}")
        check_backend(self.backend)
        if not isinstance(self.record, bool):
            raise TypeError(f"record must be True or False, got {type(self.record).__name__} {self.record!r:.40}")

    def method_for(self, block: int, kind: str, site: str | None = None) -> str:
        """The target of a call (the override's where it gives one, else the policy's)."""
        return self.route_for(block, kind, site)[0]

    def route_for(self, block: int, kind: str, site: str | None = None):
        """(the target of a call, its :class:`~fp4video.integration.policy.Sparsity` or None): the
        override's target (dense) where it gives one, else the policy's."""
        if self.override is not None:
            target = self.override(site, block, kind)
            if target is not None:
                return target, None
        return self.policy.route_for(block=block, step=self.step, num_steps=self.num_steps, kind=kind,
                                     expert=self.expert)

    def record_call(self, block: int, kind: str | None, method: str, parallel_config=None, **extra) -> None:
        """Append one attention call to :attr:`calls` (when recording): step, expert, block, kind,
        method, the context-parallel degrees where it ran split, and ``extra`` (e.g. the site; a
        block-sparse call's ``sparsity`` and ``density``, the latter a 0-d tensor on the GPU until
        :meth:`recorded_calls` reads it, so recording never waits for the GPU)."""
        if not self.record:
            return
        record = {"step": self.step, "expert": self.expert, "block": block, "kind": kind, "method": method, **extra}
        if parallel_config is not None:
            cp = parallel_config.context_parallel_config
            record["context_parallel"] = {"ring": cp.ring_degree, "ulysses": cp.ulysses_degree}
        self.calls.append(record)

    def recorded_calls(self) -> list[dict]:
        """:attr:`calls` with every tensor value (a sparse call's density) read back as a float, in
        one transfer."""
        tensors = [(i, key) for i, c in enumerate(self.calls) for key, v in c.items() if isinstance(v, torch.Tensor)]
        if not tensors:
            return list(self.calls)
        device = self.calls[tensors[0][0]][tensors[0][1]].device
        values = torch.stack([self.calls[i][key].float().reshape(()).to(device) for i, key in tensors]).tolist()
        out = [dict(c) for c in self.calls]
        for (i, key), value in zip(tensors, values):
            out[i][key] = round(value, 4)
        return out


def sparse_summary(calls: list[dict]) -> dict | None:
    """What the block-sparse calls among ``calls`` (:meth:`AttentionContext.recorded_calls`) kept, in
    one dict: how many there were (``calls``, ``share`` of all), their mean ``density`` (and the rules'
    own, ``density_before``), the exact mass their query tiles kept by their checks' sampled rows:
    ``kept_min`` (the worst query tile of any call), ``kept_q01`` (the worst call's 1% quantile),
    ``kept_mean`` (the mean over calls), ``kept_min_before`` (before sinks and repair), the mean
    share of query tiles ``repaired``; and what rows the repair did not read keep, estimated by leaving
    each sampled row out: ``unseen_min``, ``unseen_q01`` and the mean share of query tiles
    ``unseen_under_floor``. None without a sparse call."""
    sparse = [c for c in calls if "density" in c]
    if not sparse:
        return None
    checked = [c for c in sparse if "kept_min" in c]

    def mean(key, rows):
        return round(sum(c[key] for c in rows) / len(rows), 4)

    out = {"calls": len(sparse), "share": round(len(sparse) / len(calls), 4), "density": mean("density", sparse)}
    if checked:
        out.update(density_before=mean("density_before", checked), kept_min=min(c["kept_min"] for c in checked),
                   kept_q01=min(c["kept_q01"] for c in checked), kept_mean=mean("kept_mean", checked),
                   kept_min_before=min(c["kept_min_before"] for c in checked), repaired=mean("repaired", checked),
                   unseen_min=min(c["unseen_min"] for c in checked), unseen_q01=min(c["unseen_q01"] for c in checked),
                   unseen_under_floor=mean("unseen_under_floor", checked))
    return out


def check_backend(backend) -> str:
    """``backend`` if it names an FP4 attention backend, else a one-line ``ValueError``."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r:.60}")
    return backend


def _is_hunyuan_joint(attn, encoder_hidden_states, image_rotary_emb) -> bool:
    """HunyuanVideo's joint attention: dual-stream modules have ``add_q_proj``; single-stream ones
    are called with the text tokens (and RoPE) beside the video tokens."""
    return getattr(attn, "add_q_proj", None) is not None or encoder_hidden_states is not None or (
        image_rotary_emb is not None)


class FP4Processor:
    """FP4 attention for every attention module of Wan and HunyuanVideo transformers.

    ``FP4Processor(method="mxattn")`` (or ``policy="mxattn"``) applies one method everywhere;
    ``FP4Processor(policy=Policy(...))`` picks per block, step, kind and expert (block indices and
    steps are known once :func:`fp4video.integration.annotate` has tagged the model's blocks). With
    ``set_attn_processor`` alone, a policy may have kind rules only: one with block, step or expert
    rules raises at the first call, saying to use ``fp4video.install``.
    """

    _attention_backend = None  # read by diffusers' own code paths
    _parallel_config = None

    def __init__(self, method: str | None = None, policy: Policy | None = None, *,
                 context: AttentionContext | None = None):
        if context is not None:
            if not isinstance(context, AttentionContext):
                raise TypeError(f"context must be an AttentionContext, got {type(context).__name__}")
            if method is not None or policy is not None:
                raise ValueError("give context, or method / policy, not both (the context has its own policy)")
        else:
            if method is not None and policy is not None:
                raise ValueError("give method or policy, not both (a policy has its own default method)")
            if method is not None and not isinstance(method, str):
                raise TypeError(f"method must be a method name, got {type(method).__name__} {method!r:.40}")
            context = AttentionContext(policy=as_policy(policy if policy is not None else method))
        p = context.policy
        if p.external_backends() or p.fp16_backend != "stock" or not isinstance(p.fallback, str):
            raise ValueError("FP4Processor runs fp4video's own methods with fallback error or stock; a policy naming "
                             "external attention backends, an fp16_backend or a fallback target runs through "
                             "fp4video.install(pipe, policy)")
        self.context = context

    # --- the one numerics decision -----------------------------------------------------------

    # Opaque to torch.compile: which method a call runs depends on the block, the step and the
    # recorded state, which a compiled block would guard on (one graph per block and step, past
    # dynamo's recompile limit); the compiled graph breaks here and the kernels run as they are.
    @torch.compiler.disable
    def _attend(self, attn, q, k, v, mask, kind: str, parallel_config=None, replicated: int = 0):
        """q, k, v: (B, S, H, D). Returns (B, S, H, D) in q's dtype. ``replicated``: under context
        parallelism, the number of trailing tokens every rank holds in full (HunyuanVideo's text)."""
        ctx = self.context
        block = getattr(attn, "_fp4video_block", None)
        if block is None:
            if ctx.policy.needs_install:
                raise RuntimeError(
                    "this FP4Processor's policy has block / step / expert rules, but the model was not "
                    "set up by fp4video.install, so block indices, the denoising step and the Wan2.2 "
                    "expert are unknown and the rules could not apply. Call fp4video.install(pipe, policy) "
                    "instead of set_attn_processor (it covers both Wan2.2 experts); set_attn_processor("
                    "FP4Processor(method=...)) is for one method everywhere")
            block = -1
        method = ctx.method_for(block, kind)
        used = method
        if parallel_config is not None and replicated:
            from .parallel import joint_context_parallel_attention

            # stock attention has no such split; fp16 runs fp4video's unquantized attention here
            out = joint_context_parallel_attention(q, k, v, n_replicated=replicated, method=method,
                                                   parallel_config=parallel_config, attn_mask=mask, backend=ctx.backend)
        elif method == "fp16" and not uses_ring(parallel_config):
            out = self._stock(q, k, v, mask, parallel_config)
        else:
            try:
                if parallel_config is not None:  # context parallelism: this rank holds a shard of the tokens
                    # (fp16 under ring too: the ring merges partial results by their LSE, which
                    # diffusers' default native attention cannot return; fp4video's can)
                    from .parallel import context_parallel_attention

                    out = context_parallel_attention(q, k, v, method=method, parallel_config=parallel_config,
                                                     attn_mask=mask, backend=ctx.backend)
                else:
                    out = fp4_attention(q, k, v, method=method, layout="bshd", attn_mask=mask,
                                        backend=ctx.backend)
            except (ValueError, TypeError, NotImplementedError) as e:
                if ctx.policy.fallback != "stock":
                    raise
                ctx.fallbacks[f"{kind}: {e}"] += 1
                used = "stock-fallback"
                out = self._stock(q, k, v, mask, parallel_config)
        ctx.record_call(block, kind, used, parallel_config)
        return out

    def _stock(self, q, k, v, mask, parallel_config):
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        return dispatch_attention_fn(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False,
                                     backend=self._attention_backend, parallel_config=parallel_config)

    # --- plumbing ----------------------------------------------------------------------------------

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None, image_rotary_emb=None, **kwargs):
        from diffusers.models.transformers.transformer_wan import WanAttention

        if isinstance(attn, WanAttention):
            return self._wan(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        if _is_hunyuan_joint(attn, encoder_hidden_states, image_rotary_emb):
            return self._hunyuan(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        return self._plain(attn, hidden_states, encoder_hidden_states, attention_mask)

    def _plain(self, attn, hidden_states, encoder_hidden_states, attention_mask):
        """Plain self-attention modules that share a transformer with the joint ones (HunyuanVideo's
        token refiner): kept in full precision with diffusers' own processor, and recorded."""
        from diffusers.models.attention_processor import AttnProcessor2_0

        if self.context.policy.refiner:
            raise NotImplementedError("quantizing HunyuanVideo's token refiner is not supported yet (refiner: false)")
        out = AttnProcessor2_0()(attn, hidden_states, encoder_hidden_states, attention_mask)
        if self.context.record:
            c = self.context
            c.calls.append({"step": c.step, "expert": c.expert, "block": -1, "kind": "refiner", "method": "fp16"})
        return out

    def _wan(self, attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb):
        from .diffusers_api import wan_added_kv_projections, wan_qkv_projections

        context_img = None
        if attn.add_k_proj is not None:
            split = encoder_hidden_states.shape[1] - WAN_TEXT_CONTEXT
            context_img = encoder_hidden_states[:, :split]
            encoder_hidden_states = encoder_hidden_states[:, split:]
        q, k, v = wan_qkv_projections()(attn, hidden_states, encoder_hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        if rotary_emb is not None:
            q, k = apply_rope(q, k, *rotary_emb, "wan")
        out_img = None
        if context_img is not None:
            k_img, v_img = wan_added_kv_projections()(attn, context_img)
            k_img = attn.norm_added_k(k_img).unflatten(2, (attn.heads, -1))
            v_img = v_img.unflatten(2, (attn.heads, -1))
            out_img = self._attend(attn, q, k_img, v_img, None, "image").flatten(2, 3).type_as(q)
        kind = "self" if encoder_hidden_states is None else "cross"
        out = self._attend(attn, q, k, v, attention_mask, kind,
                           parallel_config=self._parallel_config if kind == "self" else None)
        out = out.flatten(2, 3).type_as(q)
        if out_img is not None:
            out = out + out_img
        return attn.to_out[1](attn.to_out[0](out))

    def _hunyuan(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb):
        """HunyuanVideo's dual-stream (text projected by ``add_*_proj``) and single-stream (text
        concatenated before ``to_q/k/v``) joint attention; RoPE on the video tokens only; the text
        padding mask (bool, True = attend) goes to the FP4 path unchanged."""
        single = attn.add_q_proj is None
        n_text = encoder_hidden_states.shape[1] if encoder_hidden_states is not None else 0
        if single and encoder_hidden_states is not None:
            hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)
        q, k, v = (proj(hidden_states).unflatten(2, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if image_rotary_emb is not None:  # on the video tokens, which come first
            cos, sin = image_rotary_emb
            video = q.shape[1] - (n_text if single else 0)
            if cos.shape[0] != video:
                raise ValueError(f"HunyuanVideo's RoPE tables have {cos.shape[0]} rows for {video} video tokens")
            q, k = apply_rope(q, k, cos, sin, "interleaved")
        if not single and encoder_hidden_states is not None:
            eq, ek, ev = (proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
                          for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            if attn.norm_added_q is not None:
                eq = attn.norm_added_q(eq)
            if attn.norm_added_k is not None:
                ek = attn.norm_added_k(ek)
            q, k, v = torch.cat([q, eq], 1), torch.cat([k, ek], 1), torch.cat([v, ev], 1)
        out = self._attend(attn, q, k, v, attention_mask, "self", parallel_config=self._parallel_config,
                           replicated=n_text)
        out = out.flatten(2, 3).to(q.dtype)
        if encoder_hidden_states is None:
            return out, None
        out, text = out[:, :-n_text], out[:, -n_text:]
        if getattr(attn, "to_out", None) is not None:
            out = attn.to_out[1](attn.to_out[0](out))
        if getattr(attn, "to_add_out", None) is not None:
            text = attn.to_add_out(text)
        return out, text
