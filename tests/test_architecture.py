"""Imports flow one way: numerics <- kernels <- the attention API <- integration <- cli. The
numerics modules know nothing of the kernels, diffusers, the harness or the CLI; the kernels
import only torch, Triton and the numerics, form no import cycle, use no other kernel module's
private names, and read the environment in one place (the dispatch)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NUMERICS = ["formats.py", "recipe.py", "rotation.py", "reference.py", "metrics.py"]
FORBIDDEN = {"diffusers", "transformers", "fp4video.harness", "fp4video.cli", "fp4video.integration",
             "fp4video.kernels", "fp4video.attention", "matplotlib", "rich", "tqdm"}
KERNELS = sorted((ROOT / "kernels").glob("*.py"))


def _imports(path: Path, package: str = "fp4video"):
    """(module, names) for every import in ``path``, relative imports resolved against ``package``."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:  # relative: `from ..x` climbs level - 1 packages from the file's own
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([mod] if mod else []))
            yield mod, [a.name for a in node.names]


def _modules(path, package="fp4video"):
    return [m for m, _ in _imports(path, package)]


@pytest.mark.parametrize("name", NUMERICS)
def test_numerics_do_not_import_upper_layers(name):
    bad = [m for m in _modules(ROOT / "fp4video" / name) if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert not bad, f"fp4video/{name} imports {bad}"


def test_the_attention_api_sits_on_the_kernels_not_above_them():
    """fp4video.attention (the public API) may use the kernels; the kernels never use it."""
    assert any(m.startswith("fp4video.kernels") or m == "fp4video" for m in _modules(ROOT / "fp4video" / "attention.py"))
    for path in KERNELS:
        assert not [m for m in _modules(path, "fp4video.kernels") if m.startswith("fp4video.attention")], path.name


@pytest.mark.parametrize("path", sorted((ROOT / "fp4video" / "integration").glob("*.py")), ids=lambda p: p.name)
def test_integration_does_not_import_the_cli_or_harness(path):
    bad = [m for m in _modules(path, "fp4video.integration") if m.startswith(("fp4video.cli", "fp4video.harness"))]
    assert not bad, f"{path.name} imports {bad}"


@pytest.mark.parametrize("path", sorted((ROOT / "fp4video" / "harness").glob("*.py")), ids=lambda p: p.name)
def test_the_harness_does_not_import_eval_or_the_cli(path):
    """eval's self-check uses the harness's robustness inputs, so the harness sits below eval."""
    bad = [m for m in _modules(path, "fp4video.harness") if m.startswith(("fp4video.eval", "fp4video.cli"))]
    assert not bad, f"{path.name} imports {bad}"


@pytest.mark.parametrize("path", KERNELS, ids=lambda p: p.name)
def test_kernels_import_only_torch_triton_and_numerics(path):
    for m in _modules(path, package="fp4video.kernels"):
        top = m.split(".")[0]
        # the offline compiler and its report are tools inside the package: they also read files and run ptxas
        tooling = {"argparse", "collections", "json", "re", "subprocess", "sys", "tempfile"} \
            if path.stem in ("offline", "report") else set()
        if path.stem == "__init__":  # hands a top-level ``kernels`` import over (sys.modules)
            tooling = {"sys"}
        assert top in {"torch", "triton", "fp4video", "__future__", "math", "functools", "os", "dataclasses",
                       "typing", "importlib", "warnings"} | tooling, f"{path.name} imports {m}"
        if top == "fp4video" and m != "fp4video":  # numerics only, never the API / harness / CLI
            assert m.split(".")[1] in {"formats", "recipe", "reference", "rotation", "sparse", "kernels"}, f"{path.name}: {m}"


def _kernel_graph():
    """kernel module -> the kernel modules it imports (by file stem)."""
    stems = {p.stem for p in KERNELS}
    graph = {}
    for path in KERNELS:
        deps = set()
        for m, names in _imports(path, "fp4video.kernels"):
            if m == "fp4video.kernels":  # `from . import x`
                deps |= {n for n in names if n in stems}
            elif m.startswith("fp4video.kernels."):
                deps.add(m.split(".")[2])
        graph[path.stem] = deps - {path.stem}
    return graph


def test_kernel_modules_form_no_import_cycle():
    graph, done, stack = _kernel_graph(), set(), []

    def visit(node):
        if node in stack:
            raise AssertionError(f"import cycle: {' -> '.join(stack[stack.index(node):] + [node])}")
        if node in done:
            return
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            visit(dep)
        stack.pop()
        done.add(node)

    for node in graph:
        visit(node)
    # the shared modules sit at the bottom
    assert graph["tiles"] <= {"key_order", "fp4_math"} and not graph["key_order"] and not graph["fp4_math"], graph


@pytest.mark.parametrize("path", KERNELS, ids=lambda p: p.name)
def test_kernel_modules_use_no_private_name_of_another(path):
    private = [(m, n) for m, names in _imports(path, "fp4video.kernels") if m.startswith("fp4video.kernels")
               for n in names if n.startswith("_") and n != "__future__"]
    assert not private, f"{path.name} imports private names {private}"


@pytest.mark.parametrize("path", KERNELS, ids=lambda p: p.name)
def test_only_the_plan_reads_the_environment(path):
    text = path.read_text()
    if path.name == "plan.py":
        return
    assert "os.environ" not in text and "getenv" not in text, f"{path.name} reads the environment"


def test_public_import_paths_keep_working():
    """What the README shows and what scripts import."""
    import importlib

    import fp4video
    from fp4video import METHODS, AttentionRecipe, fp4_attention  # noqa: F401
    from fp4video.formats import quantize, round_e2m1  # noqa: F401
    from fp4video.integration import FP4Processor, Policy, install, uninstall  # noqa: F401
    from fp4video.recipe import AttentionRecipe as Recipe  # noqa: F401

    assert fp4video.install is install and fp4video.Policy is Policy
    importlib.import_module("fp4video.integration.tiny")
    importlib.import_module("fp4video.integration.dispatcher")
    for name in ("sageattention3", "mxattention", "robustness", "report"):
        importlib.import_module(f"fp4video.harness.{name}")
    pytest.importorskip("triton")
    import torch

    from fp4video import kernels

    plan = importlib.import_module("fp4video.kernels.plan")  # (a submodule: an attribute once imported)
    assert callable(kernels.supports) and kernels.plan is plan and callable(plan.plan) and callable(plan.plan_on)
    dispatch = importlib.import_module("fp4video.kernels.dispatch")
    assert kernels.dispatch is dispatch and callable(dispatch.prepare) and callable(dispatch.run_loop)
    assert callable(torch.ops.fp4video.attention)  # the custom op, registered by importing the dispatch


def test_a_checkouts_kernels_folder_hands_over_to_an_installed_kernels_package(tmp_path):
    """``kernels/`` is fp4video.kernels; run from a checkout's root (``python -m pytest``, ``python
    -c``), it is also found as a top-level ``kernels`` and shadowed Hugging Face's ``kernels``, which
    transformers imports whenever it is installed (diffusers then failed to load its LoRA support).
    The top-level import gets the installed package instead."""
    import subprocess
    import sys

    site = tmp_path / "site" / "kernels"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("MARK = 'installed'\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    run = subprocess.run([sys.executable, "-c", "import kernels, fp4video.kernels as k; print(kernels.MARK, "
                          "k.__name__)"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.stdout.split() == ["installed", "fp4video.kernels"], run.stderr[-2000:]


def test_every_package_folder_is_installed():
    """A non-editable install ships only the packages pyproject.toml lists: every folder of the
    package holding an ``__init__.py`` is among them (else its imports fail only after install)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "fp4video").rglob("__init__.py")
             if "kernels" not in p.parent.relative_to(ROOT).parts}
    assert found <= listed, f"not in pyproject.toml's packages: {sorted(found - listed)}"
