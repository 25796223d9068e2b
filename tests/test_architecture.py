"""Imports flow one way: numerics <- kernels <- the attention API <- integration <- cli. The
numerics modules know nothing of the kernels, diffusers, the harness or the CLI; the kernels
import only torch, Triton and the numerics, form no import cycle, use no other kernel module's
private names, and read the environment in one place (the dispatch)."""

from __future__ import annotations

import ast
import functools
import os
import re
import textwrap
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


@pytest.mark.parametrize("path", sorted((ROOT / "fp4video" / "eval").glob("*.py")), ids=lambda p: p.name)
def test_eval_does_not_import_the_cli(path):
    """eval runs pipelines for the CLI's eval and the sweep script: it sits below the CLI."""
    bad = [m for m in _modules(path, "fp4video.eval") if m.startswith("fp4video.cli")]
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


# --- every module of the package, kernels/ included ------------------------------------------------

PACKAGE_FILES = sorted((ROOT / "fp4video").rglob("*.py")) + KERNELS
#: files outside the package that import its modules (tests, scripts, the lab tools)
#: (this file excepted: its probes of the checks below import private names on purpose)
OTHER_FILES = sorted(p for d in ("tests", "scripts", "tools") for p in (ROOT / d).rglob("*.py")
                     if p != Path(__file__).resolve())


def _module_name(path: Path) -> str:
    """The dotted name a package file is imported under (``kernels/x.py`` is ``fp4video.kernels.x``)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "kernels":
        parts = ["fp4video"] + parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_of(path: Path) -> str:
    """The package a file's relative imports resolve against (tests and scripts: none, ``fp4video``
    stands in and is never used by an absolute import)."""
    if path.parent == ROOT or path.relative_to(ROOT).parts[0] not in ("fp4video", "kernels"):
        return "fp4video"
    name = _module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


PACKAGE_MODULES = {_module_name(p): p for p in PACKAGE_FILES}


def _owner(dotted: str) -> str | None:
    """The package module ``dotted`` names or lies in (``fp4video.kernels.plan.plan`` -> ``fp4video.kernels.plan``)."""
    while dotted and dotted not in PACKAGE_MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def _import_graph() -> dict[str, set[str]]:
    """package module -> the package modules it imports, function-level imports included (a cycle
    of lazy imports is still a cycle: neither module can be understood, or moved, without the other)."""
    graph = {}
    for name, path in PACKAGE_MODULES.items():
        deps = set()
        for mod, names in _imports(path, _package_of(path)):
            if not mod.startswith("fp4video"):
                continue
            for n in names or [None]:
                target = f"{mod}.{n}" if n and f"{mod}.{n}" in PACKAGE_MODULES else mod
                if _owner(target):
                    deps.add(_owner(target))
        graph[name] = deps - {name}
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done, stack = set(), []

    def visit(node):
        if node in stack:
            return stack[stack.index(node):] + [node]
        if node in done:
            return None
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            found = visit(dep)
            if found:
                return found
        stack.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        found = visit(node)
        if found:
            return found
    return None


def test_no_module_of_fp4video_forms_an_import_cycle():
    """The layers only work one way if no two modules need each other, directly or around a loop:
    every module of fp4video and kernels/, each import counted wherever it stands."""
    cycle = _find_cycle(_import_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_the_cycle_check_sees_lazy_and_package_imports():
    """The check itself: a lazy import back into a module, or into a package from its submodule, is a cycle."""
    assert _find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert _find_cycle({"p": {"p.x"}, "p.x": {"q"}, "q": {"p"}}) == ["p", "p.x", "q", "p"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
    graph = _import_graph()
    assert "fp4video.cli.bench_shared" in graph["fp4video.cli.bench_sparse"], graph["fp4video.cli.bench_sparse"]
    assert "fp4video.kernels.plan" in graph["fp4video.kernels"]  # `from .plan import plan` inside supports()


#: ``from X import a, _b as c`` anywhere in a file's text: import statements and code in strings
#: (the scripts tests run in subprocesses) alike
_IMPORT_TEXT = re.compile(r"^[ \t]*from[ \t]+(\.*[\w.]*)[ \t]+import[ \t]+(?:\(([^)]*)\)|((?:[^\n\\#]|\\\n)*))",
                          re.MULTILINE)
#: a Sphinx cross-reference to a dotted name, as docstrings write them: :func:`.loop_x._y`
_CROSS_REFERENCE = re.compile(r":(?:func|class|data|attr|meth|obj|const):`~?\.?([\w.]+)`")


def _text_imports(path: Path, package: str | None = None):
    """(module, name) for every ``from module import name`` in ``path``'s text, relative modules
    resolved against the file's package."""
    package = package or _package_of(path)
    for m in _IMPORT_TEXT.finditer(path.read_text()):
        mod = m.group(1)
        if mod.startswith("."):
            level = len(mod) - len(mod.lstrip("."))
            base = package.split(".")[: len(package.split(".")) - (level - 1)]
            mod = ".".join(base + ([mod.lstrip(".")] if mod.lstrip(".") else []))
        for item in (m.group(2) or m.group(3)).replace("\\", " ").replace("\n", " ").split(","):
            words = item.split()
            if words:
                yield mod, words[0]


def _bound_modules(tree, package: str, is_module) -> dict[str, str]:
    """{local name: module} for every name an import binds to a module (``is_module(dotted)``)."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if is_module(a.name):
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([mod] if mod else []))
            for a in node.names:
                if is_module(f"{mod}.{a.name}"):
                    bound[a.asname or a.name] = f"{mod}.{a.name}"
    return bound


def _dotted(node) -> str | None:
    """``a.b.c`` for a chain of attribute accesses on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id] + parts[::-1])
    return None


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(path: Path, in_scope, is_module, *, own: str | None = None, package: str | None = None) -> list[str]:
    """Every private (``_x``) name of a module in scope (``in_scope(dotted)``; ``is_module(dotted)``
    says which dotted names are modules) that ``path`` uses, its own module ``own``'s excepted:
    imported (in code, or in a string of code), read as ``module._x`` or through getattr/setattr/
    hasattr/delattr, named by a docstring's cross-reference; and private modules imported."""
    text = path.read_text()
    tree = ast.parse(text)
    package = package or _package_of(path)
    found = []

    def foreign_module(dotted):
        return in_scope(dotted) and is_module(dotted) and dotted != own

    for mod, name in _text_imports(path, package):
        if in_scope(mod) and mod != own and _is_private(name):
            found.append(f"from {mod} import {name}")
    for mod, _ in _imports(path, package):
        if in_scope(mod) and mod != own and any(_is_private(part) for part in mod.split(".")):
            found.append(f"import of the private module {mod}")
    bound = _bound_modules(tree, package, lambda d: in_scope(d) and is_module(d))
    for node in ast.walk(tree):
        chain = name = None
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            chain, name = _dotted(node.value), node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _is_private(node.args[1].value)):
            chain, name = _dotted(node.args[0]), node.args[1].value
        if chain and chain.partition(".")[0] in bound:
            head, _, rest = chain.partition(".")
            module = ".".join(filter(None, (bound[head], rest)))
            if foreign_module(module):  # (an attribute of an object a module holds is that object's business)
                found.append(f"{module}.{name} (line {node.lineno})")
    for m in _CROSS_REFERENCE.finditer(text):
        mod, _, name = m.group(1).rpartition(".")
        if mod and _is_private(name):
            absolute = mod if mod.startswith("fp4video") else f"{package}.{mod}"
            if foreign_module(absolute):
                found.append(f"docstring reference {m.group(1)}")
    return found


def _in_package(dotted: str) -> bool:
    return _owner(dotted) is not None


def _is_package_module(dotted: str) -> bool:
    return dotted in PACKAGE_MODULES


@pytest.mark.parametrize("path", PACKAGE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_uses_another_modules_private_names(path):
    """A module's ``_x`` names are its own: no other module of fp4video or kernels/ imports them,
    reads them as ``module._x``, names them in a string of code or a docstring's cross-reference.
    (The kernels' own check above reads import statements of kernel modules only: it missed private
    names reached any other way, and every module outside kernels/.)"""
    found = _private_uses(path, _in_package, _is_package_module, own=_module_name(path))
    assert not found, f"{path.relative_to(ROOT)} uses private names of other modules: {found}"


@pytest.mark.parametrize("path", OTHER_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_tests_scripts_and_tools_import_no_private_name_of_the_package(path):
    """What they import from fp4video (in code, or in code they run in a subprocess) is public."""
    found = [f"from {m} import {n}" for m, n in _text_imports(path) if _in_package(m) and _is_private(n)]
    assert not found, f"{path.relative_to(ROOT)} imports private names: {found}"


def test_the_private_name_check_sees_every_way_in(tmp_path):
    """The check itself, on a module that reaches other modules' private names each way it can."""
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent('''
        """Uses :func:`.routing._hidden`, :func:`.routing.public` and :func:`._own`."""
        import fp4video.kernels.plan as plan_module
        from fp4video.kernels import loop_e4m3
        from . import routing
        from ..formats import _quantize_blocks
        SCRIPT = """
        from fp4video.kernels.report import _loop
        """
        plan_module._TRITON_AVAILABLE
        loop_e4m3._e4m3_attn_fwd
        getattr(routing, "_ROUTED")
        routing.public._attribute_of_an_object
        routing.__name__
    '''))
    found = _private_uses(probe, _in_package, _is_package_module, own="fp4video.integration.probe",
                          package="fp4video.integration")
    assert sorted(found) == sorted([
        "from fp4video.formats import _quantize_blocks", "from fp4video.kernels.report import _loop",
        "fp4video.kernels.plan._TRITON_AVAILABLE (line 10)", "fp4video.kernels.loop_e4m3._e4m3_attn_fwd (line 11)",
        "fp4video.integration.routing._ROUTED (line 12)", "docstring reference routing._hidden"]), found


# --- diffusers' private API: one adapter module ----------------------------------------------------

ADAPTER = ROOT / "fp4video" / "integration" / "diffusers_api.py"


def _in_diffusers(dotted: str) -> bool:
    return dotted == "diffusers" or dotted.startswith("diffusers.")


@functools.cache
def _is_diffusers_module(dotted: str) -> bool:
    import importlib.util

    try:
        return _in_diffusers(dotted) and importlib.util.find_spec(dotted) is not None
    except (ImportError, ValueError):
        return False


def _diffusers_private_uses(path: Path, package: str | None = None) -> list[str]:
    found = _private_uses(path, _in_diffusers, _is_diffusers_module, package=package)
    return sorted({f.split(" (line")[0] for f in found})


@pytest.mark.parametrize("path", [p for p in PACKAGE_FILES if p != ADAPTER], ids=lambda p: str(p.relative_to(ROOT)))
def test_only_the_diffusers_adapter_names_private_diffusers_attributes(path):
    """diffusers' private names (``_AttentionBackendRegistry``, ``_check_attention_backend_requirements``,
    private modules, ...) change without notice: fp4video reaches them through
    ``integration/diffusers_api.py`` alone, which checks each against the installed release."""
    pytest.importorskip("diffusers")
    rel = str(path.relative_to(ROOT))
    found = _diffusers_private_uses(path)
    assert not found, f"{rel} names private diffusers attributes {found}: use fp4video.integration.diffusers_api"


def test_the_diffusers_check_sees_imports_and_module_attributes(tmp_path):
    """The check itself: private names imported or read off a diffusers module, and private modules."""
    pytest.importorskip("diffusers")
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent('''
        import diffusers.models.attention_dispatch as dispatch
        from diffusers.models import attention_dispatch
        from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
        from diffusers.models._modeling_parallel import ContextParallelInput
        dispatch._check_attention_backend_requirements
        getattr(attention_dispatch, "_maybe_download_kernel_for_backend")
        dispatch.dispatch_attention_fn
        dispatch.AttentionBackendName._value2member_map_
    '''))
    assert _diffusers_private_uses(probe, package="fp4video.integration") == [
        "diffusers.models.attention_dispatch._check_attention_backend_requirements",
        "diffusers.models.attention_dispatch._maybe_download_kernel_for_backend",
        "from diffusers.models.attention_dispatch import _AttentionBackendRegistry",
        "import of the private module diffusers.models._modeling_parallel"]
