"""The package's shape: dependencies run one way (model <- inputs/engine <- llm <- chat/serve), and the runtime
package holds the engine, not the workshop. Read from the source with `ast`, so a new import that breaks a rule
fails here by name."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nanomm"


def module_name(path: Path) -> str:
    if not path.is_relative_to(ROOT):
        return path.stem
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function: `from a.b import c` gives a.b and a.b.c."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def files_under(folder: str) -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py")) if (PACKAGE / folder).is_dir() else [PACKAGE / folder]


def violations(sources: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    return [f"{module_name(path)} imports {name}" for path in sources for name in sorted(imported_modules(path))
            if any(name == f or name.startswith(f + ".") for f in forbidden)]


# (what, the files it holds, the modules they may not import)
RULES = [
    ("the model takes tensors", "model", ("nanomm.inputs", "nanomm.engine", "nanomm.serve", "nanomm.llm")),
    ("the model knows nothing of its speed-ups", "model", ("nanomm.accel",)),
    ("the oracle does not lean on the engine", "reference.py", ("nanomm.engine", "nanomm.llm")),
    ("the server does not lean on the terminal chat", "serve", ("nanomm.chat",)),
    ("inputs are prepared without the engine", "inputs", ("nanomm.engine", "nanomm.serve", "nanomm.llm")),
    ("the engine serves no HTTP", "engine", ("nanomm.serve", "nanomm.chat", "nanomm.llm")),
    ("the fast paths sit below the API", "accel", ("nanomm.serve", "nanomm.chat", "nanomm.llm")),
    ("what travels between instances knows no engine", "transfer.py", ("nanomm.engine", "nanomm.serve", "nanomm.llm")),
] + [(f"{folder} never needs the emulated device", folder, ("nanomm.emulate",))  # LLM imports it when asked
     for folder in ("model", "inputs", "engine", "accel", "reference.py", "transfer.py", "planner.py")]
# accel/'s model and attention pieces stand on the model alone; only the engine's own fast paths (CUDA graphs and
# the memory profile, which run engine steps) import the engine.
ENGINE_FAST_PATHS = ("cuda_graphs.py", "memory_profile.py")


@pytest.mark.parametrize("rule", RULES, ids=[r[0] for r in RULES])
def test_dependencies_run_one_way(rule):
    what, folder, forbidden = rule
    assert not violations(files_under(folder), forbidden), what


def test_the_seam_s_model_pieces_stand_on_the_model_alone():
    pieces = [p for p in files_under("accel") if p.name not in ENGINE_FAST_PATHS]
    assert len(pieces) >= 6 and not violations(pieces, ("nanomm.engine", "nanomm.inputs"))


def test_nothing_under_nanomm_trains():
    """No optimizer, no backward pass, no workshop import anywhere in the runtime package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        found += violations([path], ("torch.optim", "workshop"))
        found += [f"{module_name(path)} calls backward()" for node in ast.walk(ast.parse(text))
                  if isinstance(node, ast.Attribute) and node.attr == "backward"]
    assert not found


def test_the_checks_see_a_violation(tmp_path):
    """The harness itself: an import inside a function, and a backward() call, are found."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f(loss):\n    from nanomm.engine.attention import PagedAttention\n    loss.backward()\n")
    assert imported_modules(bad) >= {"nanomm.engine.attention", "nanomm.engine.attention.PagedAttention"}
    assert violations([bad], ("nanomm.engine",)) and not violations([bad], ("nanomm.serve",))


def module_graph() -> dict[str, set[str]]:
    """Each runtime module -> the runtime modules it imports (at the top or inside a function)."""
    modules = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
    return {name: {m for m in imported_modules(path) if m in modules and m != name} for name, path in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles in an import graph, each once, from its smallest module (a depth-first walk)."""
    cycles, state = set(), {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                circle = path[path.index(nxt):]
                start = circle.index(min(circle))
                cycles.add(tuple(circle[start:] + circle[:start]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return [list(c) for c in sorted(cycles)]


def test_no_module_imports_back_up_the_layout():
    """No circle of imports, lazy ones inside functions included: sizing takes the memory profiler as a value
    from LLM, instead of importing accel/memory_profile.py, which imports accel/cuda_graphs.py, which imports
    sizing."""
    assert import_cycles(module_graph()) == []


def test_the_cycle_check_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]


def test_the_engine_class_reads_at_a_glance():
    """LLMEngine keeps to add_request / step / abort_request and the calls into its parts: the handoff
    (handoff.py), parallel sampling (parallel_sampling.py) and the rest live in their own components."""
    tree = ast.parse((ROOT / "nanomm" / "engine" / "engine.py").read_text())
    engine = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "LLMEngine")
    assert engine.end_lineno - engine.lineno + 1 <= 350
