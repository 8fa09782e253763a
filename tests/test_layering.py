"""The engine's layers import only downward, the engine never imports the app, and no module-level
imports form a circle (engine/__init__.py lists the layers)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("runtime", "decoding", "drafters", "session", "tools")  # lowest first


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(("speclens", *parts))


def imports(path: Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("speclens"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("speclens"))
    return found


def layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] == ["speclens", "app"]:
        return len(LAYERS)
    if parts[:2] == ["speclens", "engine"] and len(parts) > 2 and parts[2] in LAYERS:
        return LAYERS.index(parts[2])
    return None


def upward_imports(files: list[Path]) -> list[str]:
    bad = []
    for path in files:
        mine = layer(module_name(path))
        for imported in sorted(imports(path, top_level_only=False)):
            theirs = layer(imported)
            if mine is not None and theirs is not None and theirs > mine:
                bad.append(f"{module_name(path)} imports {imported}")
    return bad


def circles(files: list[Path]) -> list[list[str]]:
    modules = {module_name(p): p for p in files}
    graph = {m: {i for i in imports(p, top_level_only=True) if i in modules and i != m} for m, p in modules.items()}
    found, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                found.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return found


def package_files() -> list[Path]:
    return sorted((ROOT / "engine").rglob("*.py")) + sorted((ROOT / "app").rglob("*.py"))


def test_layers_import_only_downward_and_without_circles():
    files = package_files()
    assert len(files) > 30
    assert upward_imports(files) == []
    assert circles(files) == []


def test_a_planted_upward_import_and_a_circle_are_caught(tmp_path, monkeypatch):
    for folder in ("engine/runtime", "engine/decoding"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "engine/runtime/cache.py").write_text("from speclens.engine.decoding.tree import DraftTree\n")
    (tmp_path / "engine/decoding/tree.py").write_text("from speclens.engine.runtime.cache import CachedModel\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    files = sorted(tmp_path.rglob("*.py"))
    assert upward_imports(files) == ["speclens.engine.runtime.cache imports speclens.engine.decoding.tree",
                                     "speclens.engine.runtime.cache imports speclens.engine.decoding.tree.DraftTree"]
    assert circles(files) == [["speclens.engine.decoding.tree", "speclens.engine.runtime.cache",
                               "speclens.engine.decoding.tree"]]


def test_the_readme_diagram_shows_the_layers_in_their_order():
    """resources/docs/architecture.svg (the README's picture) draws the layers top to bottom, highest
    first: the same order this test enforces, so the picture cannot drift from the code."""
    import re

    svg = (ROOT / "resources" / "docs" / "architecture.svg").read_text()
    drawn = re.findall(r'font-weight="bold" fill="#222">([a-z/._]+)</text>', svg)
    folders = {"session": "engine/session.py"}
    expected = ["app/"] + [folders.get(name, f"engine/{name}/") for name in reversed(LAYERS)]
    assert drawn == expected
    assert "resources/docs/architecture.svg" in (ROOT / "README.md").read_text()
