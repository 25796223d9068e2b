"""The one module that uses diffusers' private (``_x``) API.

diffusers has no public way to add an attention backend (its backend names are a closed enum and
the registry is private), to ask whether a backend's package is installed, or to run a
context-parallel attention with another kernel; fp4video does all three, and reuses Wan's
projection helpers. Every such name is listed in :data:`PRIVATE_API` with how fp4video calls it,
checked against each diffusers release named in :data:`CHECKED`, and reached only through this
module's functions, which check the names they use first: a diffusers release that drops or
changes one fails on first use with one line naming the release and the name
(:class:`DiffusersAPIChanged`), not deep inside a call. ``tests/test_diffusers_adapter.py`` checks
the whole table against the installed diffusers; ``tests/test_architecture.py`` that no other
module names a private diffusers attribute.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass

__all__ = ["SUPPORTED", "CHECKED", "PRIVATE_API", "PrivateName", "DiffusersAPIChanged", "diffusers_version",
           "problems", "require", "recheck", "backend_enum", "add_backend_name", "register_backend", "registered_function",
           "active_backend", "set_active_backend", "check_backend_requirements", "download_hub_kernel",
           "backend_arg_names", "backend_constraints", "backend_supports_context_parallel",
           "templated_context_parallel_attention", "wan_qkv_projections", "wan_added_kv_projections",
           "context_parallel_input", "context_parallel_output"]

#: The diffusers releases pyproject.toml accepts.
SUPPORTED = ">=0.42,<0.50"
#: The releases :data:`PRIVATE_API` was checked against (``tests/test_diffusers_adapter.py``).
CHECKED = ("0.42.1",)

_DISPATCH = "diffusers.models.attention_dispatch"
_WAN = "diffusers.models.transformers.transformer_wan"
_PARALLEL = "diffusers.models._modeling_parallel"


@dataclass(frozen=True)
class PrivateName:
    """A private name of diffusers as fp4video uses it: ``name`` in module ``module``; a callable is
    called with ``positional`` positional arguments and the keywords ``keywords`` (its signature must
    take exactly such a call); a class must have the attributes ``attributes``, and its methods in
    ``methods`` ({method: (positional, keywords)}) must take such calls."""

    module: str
    name: str
    positional: int | None = None
    keywords: tuple[str, ...] = ()
    attributes: tuple[str, ...] = ()
    methods: tuple[tuple[str, int, tuple[str, ...]], ...] = ()

    @property
    def qualname(self) -> str:
        return f"{self.module.removeprefix('diffusers.')}.{self.name}"


#: Every private name of diffusers fp4video uses, with the calls it makes (``AttentionBackendName``
#: is public; the enum tables a new member goes into are not).
PRIVATE_API = (
    PrivateName(_DISPATCH, "AttentionBackendName", attributes=("_member_map_", "_value2member_map_",
                                                                "_member_names_")),
    PrivateName(_DISPATCH, "_AttentionBackendRegistry",
                attributes=("_backends", "_constraints", "_supported_arg_names", "_supports_context_parallel",
                            "_active_backend"),
                methods=(("register", 1, ("supports_context_parallel",)), ("set_active_backend", 1, ()),
                         ("_is_context_parallel_available", 1, ()))),
    PrivateName(_DISPATCH, "_check_attention_backend_requirements", positional=1),
    PrivateName(_DISPATCH, "_maybe_download_kernel_for_backend", positional=1),
    PrivateName(_DISPATCH, "_templated_context_parallel_attention", positional=9,
                keywords=("forward_op", "backward_op", "_parallel_config")),
    PrivateName(_WAN, "_get_qkv_projections", positional=3),
    PrivateName(_WAN, "_get_added_kv_projections", positional=2),
    PrivateName(_PARALLEL, "ContextParallelInput", keywords=("split_dim", "expected_dims", "split_output")),
    PrivateName(_PARALLEL, "ContextParallelOutput", keywords=("gather_dim", "expected_dims")),
)

_BY_NAME = {p.name: p for p in PRIVATE_API}


class DiffusersAPIChanged(RuntimeError):
    """The installed diffusers lacks, or changed, a private name fp4video uses."""


def diffusers_version() -> str:
    import diffusers

    return diffusers.__version__


def _takes(fn, positional: int, keywords: tuple[str, ...]) -> str | None:
    """Why ``fn`` cannot take ``positional`` positional arguments and ``keywords``, or None."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return "has no readable signature"
    try:
        sig.bind(*([None] * positional), **dict.fromkeys(keywords))
    except TypeError as e:
        return f"its signature {sig} does not take fp4video's call ({e})"
    return None


def _problem(entry: PrivateName) -> str | None:
    """What is wrong with ``entry`` in the installed diffusers, or None."""
    try:
        module = importlib.import_module(entry.module)
    except ImportError as e:
        return f"module {entry.module} does not import ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    if not hasattr(module, entry.name):
        return "is missing"
    obj = getattr(module, entry.name)
    missing = [a for a in entry.attributes if not hasattr(obj, a)]
    if missing:
        return f"has no attribute {', '.join(missing)}"
    for method, positional, keywords in entry.methods:
        if not hasattr(obj, method):
            return f"has no method {method}"
        why = _takes(getattr(obj, method), positional, keywords)
        if why:
            return f"method {method}: {why}"
    if entry.positional is not None or entry.keywords:
        return _takes(obj, entry.positional or 0, entry.keywords)
    return None


def problems(entries=PRIVATE_API) -> dict[str, str]:
    """{qualified name: what is wrong} for ``entries`` in the installed diffusers (empty: all fine)."""
    return {e.qualname: why for e in entries if (why := _problem(e)) is not None}


def _message(entry: PrivateName, why: str) -> str:
    return (f"diffusers {diffusers_version()}: {entry.qualname} {why}; fp4video uses this private part of "
            f"diffusers, checked with diffusers {', '.join(CHECKED)} (pip install diffusers=={CHECKED[-1]})")


@functools.cache
def _checked(name: str):
    entry = _BY_NAME[name]
    why = _problem(entry)
    if why is not None:
        raise DiffusersAPIChanged(_message(entry, why))
    return getattr(importlib.import_module(entry.module), name)


def recheck() -> None:
    """Forget which names were checked (each is checked once, on first use): after diffusers is
    replaced or patched in this process."""
    _checked.cache_clear()


def require(name: str):
    """diffusers' private object ``name`` (a :data:`PRIVATE_API` entry), checked first:
    :class:`DiffusersAPIChanged` in one line when the installed diffusers lacks or changed it."""
    try:
        import diffusers  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"fp4video's diffusers integration needs diffusers, which did not import: {e}") from e
    return _checked(name)


# --- the attention-backend registry ---------------------------------------------------------------

def backend_enum():
    """diffusers' ``AttentionBackendName`` (a public name)."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    return AttentionBackendName


def add_backend_name(value: str):
    """The ``AttentionBackendName`` member for ``value``, added to diffusers' closed enum if missing
    (through the enum's own tables, as ``enum`` builds members)."""
    enum_cls = require("AttentionBackendName")
    if value in enum_cls._value2member_map_:
        return enum_cls._value2member_map_[value]
    member = str.__new__(enum_cls, value)
    member._name_, member._value_ = value.upper(), value
    member.__objclass__ = enum_cls
    enum_cls._member_map_[member._name_] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(member._name_)
    return member


def registered_function(member):
    """The function registered for backend ``member`` (None: none)."""
    return require("_AttentionBackendRegistry")._backends.get(member)


def register_backend(member, fn, *, supports_context_parallel: bool = True) -> None:
    """Register ``fn`` as the function of backend ``member``."""
    require("_AttentionBackendRegistry").register(member, supports_context_parallel=supports_context_parallel)(fn)


def active_backend():
    """The process-wide active backend (``attention_backend`` context manager's, or
    ``DIFFUSERS_ATTN_BACKEND``)."""
    return require("_AttentionBackendRegistry")._active_backend


def set_active_backend(member) -> None:
    """Make ``member`` the process-wide active backend."""
    require("_AttentionBackendRegistry").set_active_backend(member)


def check_backend_requirements(member) -> None:
    """diffusers' check that backend ``member``'s package is installed (RuntimeError: it is not)."""
    require("_check_attention_backend_requirements")(member)


def download_hub_kernel(member) -> None:
    """Load (downloading if needed) the hub kernel of a ``*_hub`` backend."""
    require("_maybe_download_kernel_for_backend")(member)


def backend_arg_names(member):
    """The argument names backend ``member``'s function takes (as diffusers' dispatcher reads them)."""
    return require("_AttentionBackendRegistry")._supported_arg_names[member]


def backend_constraints(member) -> list:
    """The checks diffusers registered for backend ``member`` (each raises ValueError on a call it refuses)."""
    return list(require("_AttentionBackendRegistry")._constraints.get(member, []))


def backend_supports_context_parallel(member) -> bool:
    return bool(require("_AttentionBackendRegistry")._is_context_parallel_available(member))


# --- context parallelism and Wan's projections ----------------------------------------------------

def templated_context_parallel_attention():
    """diffusers' ``_templated_context_parallel_attention(query, key, value, attn_mask, dropout_p,
    is_causal, scale, enable_gqa, return_lse, *, forward_op, backward_op, _parallel_config)``: a
    context-parallel attention (ring or Ulysses) around any forward op."""
    return require("_templated_context_parallel_attention")


def wan_qkv_projections():
    """diffusers' Wan ``_get_qkv_projections(attn, hidden_states, encoder_hidden_states)``."""
    return require("_get_qkv_projections")


def wan_added_kv_projections():
    """diffusers' Wan ``_get_added_kv_projections(attn, encoder_hidden_states_img)``."""
    return require("_get_added_kv_projections")


def context_parallel_input(**kwargs):
    """diffusers' ``ContextParallelInput(split_dim=, expected_dims=, split_output=)`` of a plan."""
    return require("ContextParallelInput")(**kwargs)


def context_parallel_output(**kwargs):
    """diffusers' ``ContextParallelOutput(gather_dim=, expected_dims=)`` of a plan."""
    return require("ContextParallelOutput")(**kwargs)


# --- pipelines' own state ------------------------------------------------------------------------

def progress_bar_config(pipe) -> dict:
    """The configuration a pipeline's ``set_progress_bar_config`` was last given (diffusers keeps
    it as ``pipe._progress_bar_config``; absent: never set, the same as ``{}``), to put back through
    the public setter."""
    return dict(getattr(pipe, "_progress_bar_config", None) or {})
