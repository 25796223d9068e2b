"""diffusers' private API, which fp4video reaches through integration/diffusers_api.py alone: every
name it uses exists in the installed diffusers with the call fp4video makes, the installed release
is one the table was checked with, and a release that drops or changes a name fails on first use in
one line naming the release and the name."""

from __future__ import annotations

import re

import pytest

diffusers = pytest.importorskip("diffusers")

from fp4video.integration import diffusers_api  # noqa: E402


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


@pytest.fixture(autouse=True)
def _fresh_checks():
    diffusers_api.recheck()  # (a test below patches diffusers; the next sees it as installed)
    yield
    diffusers_api.recheck()


@pytest.mark.parametrize("entry", diffusers_api.PRIVATE_API, ids=lambda e: e.qualname)
def test_each_private_name_exists_with_the_call_fp4video_makes(entry):
    assert diffusers_api.problems([entry]) == {}, f"diffusers {diffusers.__version__}"


def test_the_installed_release_is_supported_and_was_checked():
    """pyproject.toml's range and the adapter's agree; the installed release's minor version is one
    the table was checked with (an upgrade fails here until the table is checked against it)."""
    tomllib = pytest.importorskip("tomllib")
    from pathlib import Path

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    deps = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [Requirement(d).specifier for d in deps if Requirement(d).name == "diffusers"]
    assert spec == SpecifierSet(diffusers_api.SUPPORTED), (spec, diffusers_api.SUPPORTED)
    assert all(Version(v) in spec for v in diffusers_api.CHECKED), diffusers_api.CHECKED
    installed = diffusers.__version__
    assert Version(installed) in spec, f"diffusers {installed} is outside pyproject.toml's {spec}"
    assert _release(installed) in {_release(v) for v in diffusers_api.CHECKED}, (
        f"diffusers {installed}: check diffusers_api.PRIVATE_API against it, then add it to CHECKED")


def test_a_missing_private_name_fails_in_one_line_naming_the_release_and_the_name(monkeypatch):
    """Regression (private_diffusers_api_drift): a diffusers without
    ``_check_attention_backend_requirements`` made resolving any diffusers backend raise a bare
    AttributeError from deep inside; now the first use names the release and the name."""
    import diffusers.models.attention_dispatch as dispatch

    from fp4video.integration.backends import resolve

    monkeypatch.delattr(dispatch, "_check_attention_backend_requirements")
    with pytest.raises(diffusers_api.DiffusersAPIChanged) as e:
        resolve("native", device="cpu", dtype=__import__("torch").float32)
    text = str(e.value)
    assert "\n" not in text
    assert f"diffusers {diffusers.__version__}" in text and "attention_dispatch._check_attention_backend_requirements" in text
    assert "is missing" in text


def test_a_changed_signature_fails_naming_the_call(monkeypatch):
    """A registry whose ``register`` no longer takes ``supports_context_parallel``: registering
    fp4video's backends says so, naming the release and the name, before touching the registry."""
    import diffusers.models.attention_dispatch as dispatch

    from fp4video.integration.dispatcher import register_attention_backends

    class Registry(dispatch._AttentionBackendRegistry):
        @classmethod
        def register(cls, backend):  # the keyword fp4video passes is gone
            raise AssertionError("called")

    monkeypatch.setattr(dispatch, "_AttentionBackendRegistry", Registry)
    with pytest.raises(diffusers_api.DiffusersAPIChanged,
                       match=rf"^diffusers {re.escape(diffusers.__version__)}: models\.attention_dispatch\._AttentionBackendRegistry "
                             r"method register: its signature .* does not take fp4video's call"):
        register_attention_backends(["mxattn"])


def test_problems_lists_every_broken_name(monkeypatch):
    import diffusers.models.transformers.transformer_wan as wan

    monkeypatch.setattr(wan, "_get_qkv_projections", lambda attn: None)
    monkeypatch.delattr(wan, "_get_added_kv_projections")
    assert set(diffusers_api.problems()) == {"models.transformers.transformer_wan._get_qkv_projections",
                                             "models.transformers.transformer_wan._get_added_kv_projections"}
