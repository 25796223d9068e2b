"""Imports flow one way: numerics <- kernels <- integration <- cli. The numerics modules know
nothing of diffusers, the harness or the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NUMERICS = ["formats.py", "recipe.py", "rotation.py", "reference.py", "metrics.py", "attention.py"]
FORBIDDEN = {"diffusers", "transformers", "fp4video.harness", "fp4video.cli", "matplotlib", "rich", "tqdm"}


def _imports(path: Path, package: str = "fp4video"):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:  # relative: `from ..x` climbs level - 1 packages from the file's own
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([mod] if mod else []))
            yield mod


@pytest.mark.parametrize("name", NUMERICS)
def test_numerics_do_not_import_upper_layers(name):
    bad = [m for m in _imports(ROOT / "fp4video" / name) if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert not bad, f"fp4video/{name} imports {bad}"


@pytest.mark.parametrize("path", sorted((ROOT / "fp4video" / "integration").glob("*.py")), ids=lambda p: p.name)
def test_integration_does_not_import_the_cli_or_harness(path):
    bad = [m for m in _imports(path, "fp4video.integration") if m.startswith(("fp4video.cli", "fp4video.harness"))]
    assert not bad, f"{path.name} imports {bad}"


def test_kernels_import_only_torch_triton_and_numerics():
    for path in (ROOT / "kernels").rglob("*.py"):
        for m in _imports(path, package="fp4video.kernels"):
            top = m.split(".")[0]
            assert top in {"torch", "triton", "fp4video", "__future__", "math", "functools", "os", "dataclasses",
                           "typing", "importlib"}, f"{path.name} imports {m}"
            if top == "fp4video" and m != "fp4video":  # numerics only, never the API / harness / CLI
                assert m.split(".")[1] in {"formats", "recipe", "reference", "rotation", "kernels"}, f"{path.name}: {m}"
