"""The package keeps its layers: read from the source's import statements (any depth)."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "sglang_admin"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the sglang_admin modules it imports, top-level or inside functions."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        if name.startswith("sglang_admin.pb"):
            continue  # generated
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.startswith("sglang_admin"):
                    deps.add(node.module)
                    deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("sglang_admin"))
        graph[name] = deps
    known = set(graph) | {"sglang_admin.pb.common_pb2", "sglang_admin.pb.common_pb2_grpc"}
    return {m: {d for d in deps if d in known and d != m} for m, deps in graph.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else parts[-1]


def test_lower_layers_never_import_the_server_or_the_client() -> None:
    for module, deps in import_graph().items():
        if _layer(module) in ("model", "scheduler", "messages", "config", "tracing"):
            bad = sorted(d for d in deps if _layer(d) in ("server", "client", "cli"))
            assert not bad, f"{module} imports {bad}"


def test_only_server_and_client_import_the_generated_stubs() -> None:
    for module, deps in import_graph().items():
        if any(d.startswith("sglang_admin.pb") for d in deps):
            assert _layer(module) in ("server", "client"), module


def test_no_import_cycles() -> None:
    graph = import_graph()
    # a package __init__ that re-exports its modules is not a cycle with them
    edges = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)


def test_the_graph_sees_the_known_edges() -> None:
    graph = import_graph()
    assert "sglang_admin.scheduler.scheduler" in graph["sglang_admin.scheduler.rank.builder"]
    assert "sglang_admin.pb.common_pb2" in graph["sglang_admin.server.servicer"]


def _imports_outside_type_checking(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements a module runs (those under ``if TYPE_CHECKING:`` never run)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def test_the_batching_policy_imports_no_torch() -> None:
    """scheduler/scheduler.py and every module it imports, at any depth, run without torch
    (so the policy is tested with a fake model): none of them imports torch or numpy."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    seen: set[str] = set()
    todo = ["sglang_admin.scheduler.scheduler"]
    while todo:
        name = todo.pop()
        if name in seen or name not in modules:
            continue
        seen.add(name)
        for node in _imports_outside_type_checking(ast.parse(modules[name].read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names])
            for imported in names:
                assert imported.split(".")[0] not in ("torch", "numpy"), (
                    f"{name} imports {imported}")
            if isinstance(node, ast.ImportFrom) and node.module:
                todo.append(node.module)
                todo += [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                todo += [a.name for a in node.names]
    # the policy's own modules were walked
    assert {"sglang_admin.scheduler.step_plan", "sglang_admin.scheduler.postprocess",
            "sglang_admin.scheduler.kv_memory", "sglang_admin.scheduler.request"} <= seen


SCHEDULER = "sglang_admin.scheduler"
FEATURE_FOLDERS = ("speculative", "ops", "tp", "profiling", "rank")
MAX_FLOORS = 8


def _folder(module: str) -> str:
    """The scheduler folder a module lives in: '' for the batching core, else its feature."""
    first = module[len(SCHEDULER) + 1:].split(".")[0]
    return first if first in FEATURE_FOLDERS else ""


def _runtime_graph() -> dict[str, set[str]]:
    """module -> the sglang_admin modules it imports when it runs (TYPE_CHECKING left out)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in _imports_outside_type_checking(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in modules and d != name
                       and not name.startswith(d + ".")}
    return graph


def floors(graph: dict[str, set[str]], keep: Callable[[str], bool]) -> dict[str, int]:
    """A module's import floor among the modules ``keep`` accepts: 1 for one that imports none
    of them, else one more than the highest it imports."""
    memo: dict[str, int] = {}

    def floor(module: str) -> int:
        if module not in memo:
            memo[module] = 1 + max((floor(d) for d in graph[module] if keep(d)), default=0)
        return memo[module]

    return {m: floor(m) for m in graph if keep(m)}


def test_each_feature_has_its_folder() -> None:
    """Each feature of a rank is one folder under scheduler/: its modules live there."""
    graph = import_graph()
    for folder in FEATURE_FOLDERS:
        assert f"{SCHEDULER}.{folder}" in graph, f"scheduler/{folder}/ is not a package"
    expected = {
        "speculative": ("policy", "draft_drafter", "draft_model", "verify"),
        "ops": ("control", "quiesce", "cache_control", "generation_control", "lora_control",
                "weight_control", "weight_sync_control"),
        "tp": ("worker", "weights", "profile"),
        "profiling": ("profiler", "export", "trace_export", "trace_join", "control"),
        "rank": ("entry", "process", "heartbeat", "lifetime"),
    }
    for folder, modules in expected.items():
        for module in modules:
            assert f"{SCHEDULER}.{folder}.{module}" in graph, f"scheduler/{folder}/{module}.py"
    # nothing speculative, TP or profiling left in the core or in model/
    for module in graph:
        leaf = module.rsplit(".", 1)[-1]
        if module.startswith(f"{SCHEDULER}.") and _folder(module) == "":
            assert not leaf.startswith(("spec", "draft", "tp_", "profile", "trace_")), module
            assert not leaf.endswith("_control"), module
        if module.startswith("sglang_admin.model."):
            assert not leaf.startswith(("spec", "draft")), module


def test_the_batching_core_imports_no_feature_folder_but_speculative() -> None:
    """The core (scheduler/*.py) sits beneath the ops, TP, profiling and the rank's loop:
    it never imports them (speculative decoding's policy is part of a step, so it may)."""
    for module, deps in import_graph().items():
        if module.startswith(f"{SCHEDULER}.") and _folder(module) == "":
            above = sorted(d for d in deps if d.startswith(f"{SCHEDULER}.")
                           and _folder(d) in ("ops", "tp", "profiling", "rank"))
            assert not above, f"{module} imports {above}"


def test_each_scheduler_folder_is_at_most_eight_floors_deep() -> None:
    """Within each scheduler folder (the core, and each feature's), the chain of run-time
    imports between its own modules is at most MAX_FLOORS long."""
    graph = _runtime_graph()
    for folder in ("", *FEATURE_FOLDERS):
        prefix = f"{SCHEDULER}.{folder}." if folder else f"{SCHEDULER}."

        def inside(module: str, folder: str = folder, prefix: str = prefix) -> bool:
            return module.startswith(prefix) and _folder(module) == folder

        deepest = max(floors(graph, inside).values())
        assert deepest <= MAX_FLOORS, f"scheduler/{folder} is {deepest} import floors deep"


def test_floors_count_a_chain() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": set(), "d": {"c"}}
    assert floors(graph, lambda m: True) == {"a": 3, "b": 2, "c": 1, "d": 2}
    assert floors(graph, lambda m: m != "b") == {"a": 1, "c": 1, "d": 2}
