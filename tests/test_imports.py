"""The package's import graph, drawn from its source: every import statement, at module level or inside a
function, is an edge; importing `a.b.c` first runs the packages `a` and `a.b`, so those are edges too (except a
package above the importing module, which Python has already started); so is an import only for type
checking. A cycle is a set of modules that cannot
be imported in any order without one of them seeing another half-initialised (issue 26)."""

from __future__ import annotations

import ast
from pathlib import Path

import pipeline

PACKAGE = Path(pipeline.__file__).parent


def module_files() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def import_nodes(tree: ast.AST):
    """Every import in TREE, at any depth; those under `if TYPE_CHECKING:` too: a module that needs another's
    types to be read depends on it as much as one that runs it."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def imported(module: str, is_package: bool, node, modules: dict) -> set[str]:
    """The package's modules that NODE, in MODULE, makes Python run."""
    if isinstance(node, ast.Import):
        named = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        named = [source] + [f"{source}.{alias.name}" for alias in node.names]
    runs = set()
    for name in named:
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            target = ".".join(parts[:depth])
            if target in modules and not (module + ".").startswith(target + ".") and target != module:
                runs.add(target)
    return runs


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: set().union(*(imported(name, path.name == "__init__.py", node, modules)
                                for node in import_nodes(ast.parse(path.read_text()))))
            for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_cycle_finder_finds_a_cycle_through_a_package_init():
    graph = {"p": {"p.a"}, "p.a": set(), "q": set(), "q.b": {"p.a", "p"}, "p.c": {"q.b"}}
    assert cycles(graph) == []
    graph["p"].add("p.c")   # p's __init__ imports p.c, which imports q.b, which runs p
    assert cycles(graph) == [["p", "p.c", "q.b"]]


def test_an_import_of_a_module_runs_the_packages_above_it():
    modules = {"pipeline": 0, "pipeline.plan": 0, "pipeline.plan.schema": 0, "pipeline.backends": 0,
               "pipeline.backends.base": 0}
    node = ast.parse("from ..plan.schema import Plan").body[0]
    assert imported("pipeline.backends.base", False, node, modules) == {"pipeline.plan", "pipeline.plan.schema"}
    inner = ast.parse("from . import base").body[0]
    assert imported("pipeline.backends", True, inner, modules) == {"pipeline.backends.base"}


def test_the_package_import_graph_has_no_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def backend_name_compares(tree: ast.AST) -> list[int]:
    """Lines comparing something's `backend` with a backend's name (a literal or `names`' constant)."""
    from pipeline.backends.names import NAMES

    constants = {"ENGINE", "REFERENCE", "REFERENCE_ONNX", "PYTORCH", "REFERENCE_LLMAPI"}

    def is_name(node) -> bool:
        return (isinstance(node, ast.Constant) and node.value in NAMES) or (
            isinstance(node, ast.Name) and node.id in constants)

    def is_backend(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "backend") or (
            isinstance(node, ast.Name) and node.id == "backend")

    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
            and isinstance(node.ops[0], (ast.Eq, ast.NotEq)) and len(node.comparators) == 1
            and ((is_backend(node.left) and is_name(node.comparators[0]))
                 or (is_name(node.left) and is_backend(node.comparators[0])))]


def test_outside_backends_a_backend_is_asked_for_its_capabilities_not_compared_by_name():
    """docs/architecture.md's rule (issue 26): `backend_for(plan.backend).builds_engine`, never `== ENGINE`."""
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}" for name, path in module_files().items()
             if not name.startswith("pipeline.backends")
             for line in backend_name_compares(ast.parse(path.read_text()))]
    assert not found, found


def test_the_name_compare_finder_sees_one():
    tree = ast.parse('if plan.backend == ENGINE or "engine" != backend or plan.backend == other: pass')
    assert backend_name_compares(tree) == [1, 1]


def test_the_registry_locates_every_backend_name_and_each_is_the_backend_it_names():
    from pipeline.backends import LOCATIONS, registry
    from pipeline.backends.names import NAMES

    assert tuple(LOCATIONS) == NAMES
    assert [backend.name for backend in registry().values()] == list(NAMES)


def test_the_tables_of_what_runs_where_import_only_the_vocabulary():
    """Layers below the backends may ask the capability table and the runtime images because they import nothing
    but the vocabulary, the recorded LLM API lists and each other."""
    graph = import_graph()
    vocabulary = {"pipeline", "pipeline.backends", "pipeline.backends.names", "pipeline.errors", "pipeline.precisions",
                  "pipeline.targets"}
    assert {t for t in graph["pipeline.backends.capabilities"] if t.startswith("pipeline")} <= vocabulary
    assert {t for t in graph["pipeline.backends.runtime_images"] if t.startswith("pipeline")} <= vocabulary | {
        "pipeline.backends.capabilities", "pipeline.backends.llm_api_args"}
    assert {t for t in graph["pipeline.backends.llm_api_args"] if t.startswith("pipeline")} <= vocabulary | {
        "pipeline.package_data"}


def test_layers_below_the_backends_name_them_only_through_names_and_the_registry():
    """The plan's schema and rules, the model families, the checkpoint and the runtime sit below `backends/`: they
    may import `pipeline.backends` (the lazy registry), `pipeline.backends.names` and the two tables of what runs
    where (`capabilities`, `runtime_images`), never a backend's module, and the function that makes a plan from a
    request and a backend (`pipeline.planner`) is above them."""
    graph = import_graph()
    below = ("pipeline.plan", "pipeline.model", "pipeline.runtime", "pipeline.arch", "pipeline.checkpoint")
    allowed = {"pipeline.backends", "pipeline.backends.names", "pipeline.backends.capabilities",
               "pipeline.backends.runtime_images"}
    found = {module: sorted(t for t in targets if t.startswith("pipeline.backends") and t not in allowed)
             for module, targets in graph.items() if module.startswith(below)}
    assert not {m: t for m, t in found.items() if t}
    assert not any(module.startswith(below) for module, targets in graph.items() if "pipeline.planner" in targets)
    assert not [m for m, targets in graph.items()
                if m.startswith("pipeline.backends") and "pipeline.planner" in targets]
