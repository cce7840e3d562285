"""No import circles among the modules of the ``rocdraft`` namespace (every folder setup.py maps
into it: ``rocdraft/``, ``backends/``, ``drafter/``, ``models/``, ``hip_kernels/``), read from
the source with ``ast``: imports at module level must form no cycle, nor may imports inside
functions close one (a lazy import only hides a circle), and the CLI modules must not reach
each other (``rocdraft generate`` must not load the bench or the server, and they share
``cli_options`` instead)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "rocdraft"
# setup.py's FOLDERS: import package -> folder.
FOLDERS = {"rocdraft": "rocdraft", "rocdraft.backends": "backends",
           "rocdraft.drafter": "drafter", "rocdraft.models": "models",
           "rocdraft.hip_kernels": "hip_kernels"}
CLI_MODULES = ("rocdraft.entrypoints.cli", "rocdraft.bench.bench_cli", "rocdraft.bench.serve_bench",
               "rocdraft.serve.command")


def module_files(root: Path = ROOT, package: str = "rocdraft") -> dict[str, Path]:
    """rocdraft/entrypoints/cli.py -> {"rocdraft.entrypoints.cli": path}; rocdraft/serve/__init__.py -> "rocdraft.serve"."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join([package, *parts])] = path
    return modules


def namespace_files() -> dict[str, Path]:
    """Every module of the namespace, across the folders setup.py maps into it."""
    modules = {}
    for package, folder in FOLDERS.items():
        modules.update(module_files(REPO / folder, package))
    return modules


def imports_of(name: str, path: Path, known: set[str], top_level_only: bool) -> set[str]:
    """The known modules ``name`` imports: ``from rocdraft.x import y`` counts as rocdraft.x.y
    when that is a module, else rocdraft.x; relative imports are resolved against ``name``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # module level includes if/try blocks, not function or class bodies
        nodes = [n for stmt in tree.body for n in _module_level(stmt)]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _module_level(stmt: ast.stmt):
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return
    yield stmt
    for child in ast.iter_child_nodes(stmt):
        if isinstance(child, ast.stmt):
            yield from _module_level(child)


def import_graph(modules: dict[str, Path], top_level_only: bool) -> dict[str, set[str]]:
    known = set(modules)
    return {name: imports_of(name, path, known, top_level_only) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None. {a: {b}, b: {a}} -> [a, b, a]."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_find_cycle_on_small_graphs():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]


def test_imports_of_resolves_from_relative_and_lazy_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n\ndef f():\n    import pkg.c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from .. import a\nfrom . import missing\n")
    (pkg / "c.py").write_text("try:\n    from pkg.a import f\nexcept ImportError:\n    pass\n")
    modules = module_files(pkg, "pkg")
    assert import_graph(modules, top_level_only=True) == {
        "pkg": set(), "pkg.a": {"pkg.sub.b"}, "pkg.c": {"pkg.a"}, "pkg.sub": set(),
        "pkg.sub.b": {"pkg.a", "pkg.sub"}}
    assert import_graph(modules, top_level_only=False)["pkg.a"] == {"pkg.sub.b", "pkg.c"}


def test_namespace_covers_every_mapped_folder():
    modules = namespace_files()
    for name in ("rocdraft.engine.llm_engine", "rocdraft.backends.kv_compact",
                 "rocdraft.hip_kernels.dispatch", "rocdraft.drafter.eagle",
                 "rocdraft.models.llama"):
        assert name in modules


@pytest.mark.parametrize("top_level_only", [True, False], ids=["module-level", "with-lazy"])
def test_no_import_cycle(top_level_only):
    cycle = find_cycle(import_graph(namespace_files(), top_level_only=top_level_only))
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_cli_modules_do_not_import_each_other():
    """Not even lazily: each subcommand's module reaches the shared ones (cli_options, the
    engine), never another subcommand's module."""
    graph = import_graph(module_files(), top_level_only=False)
    for name in CLI_MODULES:
        if name not in graph:
            continue  # rocdraft.serve is another module's work; checked once it exists
        others = reachable(graph, name) & (set(CLI_MODULES) - {name})
        assert not others, f"{name} imports {sorted(others)}"
    assert "rocdraft.entrypoints.cli_options" in graph["rocdraft.bench.bench_cli"]
    assert "rocdraft.entrypoints.cli_options" in graph["rocdraft.entrypoints.cli"]


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_a_subcommand_loads_only_its_own_module(command):
    """In a fresh interpreter, parsing ``rocdraft generate`` imports neither the bench, the
    server nor fastapi; ``rocdraft bench`` imports its module but not the server's."""
    code = ("import sys; from rocdraft.entrypoints.cli import build_parser, COMMANDS\n"
            f"build_parser({command!r}).parse_args([{command!r}])\n"
            "print(sorted(m for m in ('rocdraft.bench.bench_cli', 'rocdraft.bench.serve_bench', "
            "'rocdraft.serve.command', 'fastapi', 'httpx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == ("[]" if command == "generate" else "['rocdraft.bench.bench_cli']")
