"""Each workspace package declares exactly the workspace packages its source imports, and the
imports point one way (DESIGN.md: kernels <- parallel <- model <- spec <- engine; sampling stands
alone)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())
ORDER = ["kernels", "parallel", "model", "spec", "engine"]
"""The dependency chain: a package may import only packages to its left (and sampling)."""


def _dist_of(module: str) -> str | None:
    """The workspace distribution an imported top-level module belongs to, or None."""
    if module == "deepinfer":  # the user facade ships inside deepinfer-engine
        return "deepinfer-engine"
    if module.startswith("deepinfer_"):
        return "deepinfer-" + module.removeprefix("deepinfer_")
    return None


def imported_packages(package: Path) -> set[str]:
    """Workspace distributions that the package's source imports (absolute imports, at any
    depth, inside functions too), itself left out."""
    found: set[str] = set()
    for path in (package / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                dist = _dist_of(name.split(".")[0])
                if dist is not None:
                    found.add(dist)
    found.discard(package.name)
    return found


def declared_packages(package: Path) -> set[str]:
    meta = tomllib.loads((package / "pyproject.toml").read_text())
    deps = meta["project"].get("dependencies", [])
    names = {d.split(";")[0].split("[")[0].split(">")[0].split("=")[0].strip() for d in deps}
    return {n for n in names if n.startswith("deepinfer-")}


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_declared_workspace_dependencies_are_exactly_the_imported_ones(package):
    imported, declared = imported_packages(package), declared_packages(package)
    assert not imported - declared, f"{package.name} imports undeclared {imported - declared}"
    assert not declared - imported, f"{package.name} declares unused {declared - imported}"


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_imports_point_one_way(package):
    me = package.name.removeprefix("deepinfer-")
    for dist in imported_packages(package):
        other = dist.removeprefix("deepinfer-")
        if me == "sampling":
            raise AssertionError(f"deepinfer-sampling stands alone but imports {dist}")
        if other == "sampling":
            continue
        assert ORDER.index(other) < ORDER.index(me), f"{package.name} imports {dist}"


def test_the_scan_sees_imports_inside_functions(tmp_path):
    src = tmp_path / "deepinfer-x" / "src" / "deepinfer_x"
    src.mkdir(parents=True)
    (src / "a.py").write_text(
        "import deepinfer_kernels.ops\n"
        "def f():\n    from deepinfer_model.batch import ForwardBatch\n"
        "from .b import c\nimport deepinfer\n"
    )
    assert imported_packages(tmp_path / "deepinfer-x") == {
        "deepinfer-kernels", "deepinfer-model", "deepinfer-engine"
    }  # fmt: skip
