"""No import circles: the package's imports (a lazy import inside a function counts too:
it only hides the circle) form a DAG (core/lsgd reads
top-down: config -> comm/means/compressors -> protocol -> registry -> algorithms ->
catalog), and core/ never imports training/."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "megatron_lsgd")


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def import_graph():
    modules = {}
    for dirpath, _dirs, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                modules[_module_name(path)] = path
    graph = {}
    for mod, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(open(path).read())):  # also imports hidden inside functions
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import sub` needs the submodule, not the rest of pkg/__init__
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
                targets = subs if len(subs) == len(node.names) else subs + [node.module]
            deps |= {t for t in targets if t in modules and t != mod}
        graph[mod] = deps
    return graph


def find_cycle(graph):
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_package_has_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_core_does_not_import_training():
    offenders = [(m, d) for m, deps in import_graph().items() if m.startswith("megatron_lsgd.core")
                 for d in deps if d.startswith("megatron_lsgd.training")]
    assert not offenders, offenders
