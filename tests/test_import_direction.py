"""The layers import one way (STYLE.md): server -> scheduler -> model -> pallas_kernels, and
nothing imports bench/ or tests/. Parsed from the source, every import, at any depth of a module
(imports inside functions and under TYPE_CHECKING count too)."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = ("server", "scheduler", "model", "pallas_kernels")  # each may import those after it


def _imported(path: pathlib.Path) -> set[str]:
    """The top-level packages a module imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("layer", LAYERS)
def test_a_layer_imports_only_the_layers_below_it(layer):
    below = set(LAYERS[LAYERS.index(layer) + 1:])
    refused = (set(LAYERS) - below - {layer}) | {"bench", "tests"}
    files = sorted((ROOT / layer).rglob("*.py"))
    assert files
    wrong = {str(f.relative_to(ROOT)): sorted(_imported(f) & refused) for f in files if _imported(f) & refused}
    assert not wrong, f"imports against the layers' direction: {wrong}"


def test_the_check_sees_an_import_against_the_direction(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from server.app import create_app\n    import bench.engine\n")
    assert _imported(module) == {"server", "bench"}
