"""The package's shape: dependencies run one way (model <- inputs/engine <- llm <- chat/serve, with accel/ the
speed-up seam below the engine), and the runtime package holds the engine, not the workshop. Read from the source
with `ast`, so a new import that breaks a rule fails here by name."""

import ast
import re
import subprocess
import sys
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
    ("the fast paths sit below the engine", "accel", ("nanomm.engine", "nanomm.inputs", "nanomm.serve", "nanomm.chat",
                                                     "nanomm.llm")),
    ("the emulated device knows no server", "emulate", ("nanomm.serve", "nanomm.chat")),
    ("what travels between instances knows no engine", "transfer.py", ("nanomm.engine", "nanomm.serve", "nanomm.llm")),
] + [(f"{folder} never needs the emulated device", folder, ("nanomm.emulate",))  # LLM imports it when asked
     for folder in ("model", "inputs", "engine", "accel", "reference.py", "transfer.py", "planner.py")]
@pytest.mark.parametrize("rule", RULES, ids=[r[0] for r in RULES])
def test_dependencies_run_one_way(rule):
    what, folder, forbidden = rule
    assert not violations(files_under(folder), forbidden), what


def test_the_seam_stands_on_the_model_alone():
    """accel/ holds the model's speed-ups and the batched attention; the fast paths that run engine steps (CUDA
    graphs, the GPU memory profile) are the engine's own."""
    pieces = files_under("accel")
    assert len(pieces) >= 6 and not violations(pieces, ("nanomm.engine", "nanomm.inputs"))
    assert (PACKAGE / "engine" / "cuda_graphs.py").is_file() and (PACKAGE / "engine" / "memory_profile.py").is_file()


def test_the_checks_see_a_violation(tmp_path):
    """The harness itself: an import inside a function, and a backward() call, are found."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f(loss):\n    from nanomm.engine.attention import PagedAttention\n    loss.backward()\n")
    assert imported_modules(bad) >= {"nanomm.engine.attention", "nanomm.engine.attention.PagedAttention"}
    assert violations([bad], ("nanomm.engine",)) and not violations([bad], ("nanomm.serve",))


def module_graph() -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports (at the top or inside a function)."""
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
    from LLM, instead of importing engine/memory_profile.py, which imports engine/cuda_graphs.py, which imports
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


# -- folders ----------------------------------------------------------------------------------------------------
# The package's floors, bottom first. A node is a folder of nanomm/ or a top-level module ("nanomm" is the
# package's own __init__.py, the public API); each imports only nodes on the floors below its own, never one beside
# or above it. A new folder or module gets a floor here before it can land (test_every_node_has_a_floor). sim, bench
# and workshop sit on top: nothing in the runtime imports them.
FLOORS = (
    ("errors", "topology"),  # topology: the one grammar of cluster shapes, standard library only
    ("structured_params",),  # loaded by sampling when a request asks for a shape
    ("model", "sampling", "outputs"),
    ("accel", "inputs"),  # accel: the speed-up seam, on the model alone
    ("transfer", "reference", "tools"),
    ("engine", "demo"),
    ("planner",),
    ("emulate",),
    ("llm",),
    ("nanomm",),
    ("chat", "serve"),
    ("sim", "workshop"),
    ("bench",),  # drives the simulators, the servers and the workshop's counters
)


def node_of(module: str) -> str:
    """nanomm.engine.scheduler -> engine; nanomm.llm -> llm; nanomm -> nanomm."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def folder_graph(graph: dict[str, set[str]]) -> dict[str, dict[str, list[str]]]:
    """The module graph seen from above: node -> the other nodes it imports -> the module imports that say so."""
    folders: dict[str, dict[str, list[str]]] = {node_of(m): {} for m in graph}
    for module, imported in sorted(graph.items()):
        for other in sorted(imported):
            if node_of(other) != node_of(module):
                folders[node_of(module)].setdefault(node_of(other), []).append(f"{module} imports {other}")
    return folders


def upward_imports(folders: dict[str, dict[str, list[str]]], floors=FLOORS) -> list[str]:
    """Each import of a node on the same floor or one above (a node with no floor counts as above everything)."""
    floor = {node: level for level, nodes in enumerate(floors) for node in nodes}
    return [why for node, imported in sorted(folders.items()) for other, whys in sorted(imported.items())
            if floor.get(other, len(floors)) >= floor.get(node, len(floors)) for why in whys]


def test_every_node_has_a_floor():
    floor = {node for nodes in FLOORS for node in nodes}
    assert sorted(set(folder_graph(module_graph())) - floor) == []
    assert len(floor) == sum(len(nodes) for nodes in FLOORS)  # each node on one floor


def test_no_circle_between_modules():
    """No module of the package imports one that imports it back, however far round (lazy imports included)."""
    graph = module_graph()
    assert len(graph) > 100 and import_cycles(graph) == []


def test_no_circle_between_folders():
    """The folders (and top-level modules) import each other without a circle, lazy imports included."""
    folders = folder_graph(module_graph())
    assert import_cycles({node: set(imported) for node, imported in folders.items()}) == []


def test_no_folder_imports_a_folder_above_it():
    assert upward_imports(folder_graph(module_graph())) == []


def test_the_floor_check_sees_an_upward_import():
    graph = {"nanomm.accel.a": {"nanomm.engine.b"}, "nanomm.engine.b": {"nanomm.accel.c"}, "nanomm.accel.c": set(),
             "nanomm.serve.d": {"nanomm.chat"}, "nanomm.chat": set(), "nanomm.new.e": {"nanomm.errors"},
             "nanomm.errors": set()}
    folders = folder_graph(graph)
    assert folders["accel"] == {"engine": ["nanomm.accel.a imports nanomm.engine.b"]}
    assert upward_imports(folders) == ["nanomm.accel.a imports nanomm.engine.b", "nanomm.serve.d imports nanomm.chat"]
    assert import_cycles({node: set(imported) for node, imported in folders.items()}) == [["accel", "engine"]]


# -- the workbench: nanomm/sim and nanomm/bench, nanomm/workshop, and the scripts beside the package ----------------

SCRIPTS = ROOT / "scripts"
# What the simulator's own files may import from nanomm: the models' data (the emulated device's cost model, the
# engine's configuration for the twin's limits, smart_resize for visual tokens, the autoscaling policies Ray runs),
# never the engine's runtime, the server or the drivers.
SIM_MAY_IMPORT = ("nanomm.sim", "nanomm.topology", "nanomm.emulate", "nanomm.engine.config", "nanomm.inputs.image",
                  "nanomm.serve.autoscaling", "nanomm.serve.app_spec", "nanomm.serve.affinity")
NOT_IN_THE_SIMULATOR = ("socket", "subprocess", "httpx", "ray", "starlette", "uvicorn", "asyncio", "threading")
WORKBENCH = ("nanomm.sim", "nanomm.bench", "nanomm.workshop")


def nanomm_imports(path: Path) -> set[str]:
    return {name for name in imported_modules(path) if name == "nanomm" or name.startswith("nanomm.")}


def test_the_simulator_is_a_model_not_a_client():
    """nanomm/sim imports no socket, subprocess, HTTP client or Ray, and of nanomm only the models' data."""
    sources = files_under("sim")
    assert len(sources) >= 7
    assert not violations(sources, NOT_IN_THE_SIMULATOR)
    reached = [f"{module_name(p)} imports {name}" for p in sources for name in sorted(nanomm_imports(p))
               if name != "nanomm" and not any(name == a or name.startswith(a + ".") for a in SIM_MAY_IMPORT)]
    assert not reached


def test_the_simulator_loads_without_the_server_stacks():
    """The same, transitively: with HTTP clients, the web stack and Ray made unimportable, every simulator module
    imports (a module that reached one of them would fail here)."""
    blocked = ("httpx", "ray", "starlette", "uvicorn", "prometheus_client")
    script = (f"import sys\nfor name in {blocked!r}:\n    sys.modules[name] = None\n"
              "import importlib, pkgutil, nanomm.sim\n"
              "for m in pkgutil.iter_modules(nanomm.sim.__path__, 'nanomm.sim.'):\n    importlib.import_module(m.name)\n"
              "print('ok')")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_the_runtime_never_imports_the_workbench():
    runtime = [p for p in PACKAGE.rglob("*.py") if not module_name(p).startswith(WORKBENCH)]
    assert len(runtime) > 60 and not violations(runtime, WORKBENCH)


def test_only_the_workshop_trains():
    """No optimizer and no backward pass anywhere under nanomm/ but the workshop, which makes the demo model."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if module_name(path).startswith("nanomm.workshop"):
            continue
        found += training_in(path)
    assert not found
    assert all(training_in(PACKAGE / "workshop" / "trainer.py"))  # the rule has a subject, and sees it


def training_in(path: Path) -> list[str]:
    """An optimizer (imported, or reached as torch.optim) or a backward() call in a file."""
    found = violations([path], ("torch.optim",))
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Attribute) and node.attr == "backward":
            found.append(f"{module_name(path)} calls backward()")
        elif isinstance(node, ast.Attribute) and node.attr == "optim" and getattr(node.value, "id", None) == "torch":
            found.append(f"{module_name(path)} uses torch.optim")
    return found


def test_tests_and_lessons_import_the_package_only():
    """No sys.path surgery in the tests or the lessons' code: what they use is installed with the package."""
    texts = {p.relative_to(ROOT).as_posix(): p.read_text("utf-8")
             for p in [*sorted((ROOT / "tests").glob("*.py")), *sorted((ROOT / "lessons").glob("*.md"))]}
    offenders = [name for name, text in texts.items() if re.search(r"sys\.path\.(insert|append)", text)]
    assert len(texts) > 60 and not offenders


def test_scripts_are_leaves():
    """No script imports another script, or a module beside the scripts: what two scripts share is in the package."""
    scripts = sorted(SCRIPTS.rglob("*.py"))
    local = {p.stem for p in scripts} | {"workshop"}
    leaning = [f"{p.relative_to(ROOT)} imports {name}" for p in scripts for name in sorted(imported_modules(p))
               if name.split(".")[0] in local]
    leaning += [f"{p.relative_to(ROOT)} edits sys.path" for p in scripts
                if re.search(r"sys\.path\.(insert|append)", p.read_text("utf-8"))]
    assert len(scripts) > 15 and not leaning
