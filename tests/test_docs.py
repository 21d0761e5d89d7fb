"""Docs that cannot drift: the package's module map (nanomm/README.md) matches the package file for file, the
README maps every folder and links the map, every nanomm file, function
and class that a lesson or the README names exists, and no doc reads as a diary (dates, sessions, "today")."""

import ast
import builtins
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULE_MAP = ROOT / "nanomm" / "README.md"
DOCS = sorted((ROOT / "lessons").glob("*.md")) + [ROOT / "README.md", MODULE_MAP]
PROSE_DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", MODULE_MAP] + sorted((ROOT / "lessons").glob("*.md"))
MAP_ROW = re.compile(r"^\| `(nanomm/[a-z0-9_/]+\.py)` \|", re.M)
CODE_PATH = re.compile(r"nanomm/[a-z0-9_/]+\.py")
BACKTICKED = re.compile(r"`([^`\n]+)`")
SYMBOL = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(\(\))?")
FILE_SUFFIXES = (".json", ".py", ".md", ".txt", ".safetensors")
OUTSIDE_NAMES = {"Qwen2VLImageProcessorPil"}  # transformers' names that lessons compare against


# A doc is documentation, not a journal: no dates, no sessions, no "today", no issue numbers. (A chat load's
# `--sessions` flag is a load generator's option, not a journal.)
DIARY = re.compile(r"\b(?:this session|next session|last session|(?<!--)sessions|was lent|were lent|not drawn|device time|"
                   r"yesterday|today|this morning|tonight|earlier today|issue #?\d+)\b|\b20\d\d-\d\d-\d\d\b",
                   re.I)


def package_files() -> set[str]:
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / "nanomm").rglob("*.py")}


def module_map_errors(readme: str, actual: set[str]) -> list[str]:
    """What is wrong with a module map: a package file without its row, a row for no file, a file listed twice."""
    listed = MAP_ROW.findall(readme)
    errors = [f"missing {path}" for path in sorted(actual - set(listed))]
    errors += [f"stale {path}" for path in sorted(set(listed) - actual)]
    errors += [f"listed twice {path}" for path in sorted({p for p in listed if listed.count(p) > 1})]
    return errors


@pytest.mark.parametrize("doc, limit", [("README.md", 250), ("BENCHMARKS.md", 545)])
def test_the_front_docs_stay_short(doc, limit):
    """The README is the front page and BENCHMARKS one current table per benchmark: neither may grow into a
    journal."""
    assert len((ROOT / doc).read_text(encoding="utf-8").splitlines()) <= limit


def test_module_map_lists_every_file():
    errors = module_map_errors(MODULE_MAP.read_text(encoding="utf-8"), package_files())
    assert not errors, f"nanomm/README.md's module map, one table row per nanomm/ file: {errors}"


def test_the_readme_maps_every_folder_and_links_the_file_map():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    folders = sorted(p.name for p in (ROOT / "nanomm").iterdir() if p.is_dir() and any(p.glob("*.py")))
    assert "](nanomm/README.md)" in readme
    assert len(folders) >= 10 and [f for f in folders if f"`nanomm/{f}/`" not in readme] == []


def test_the_module_map_check_catches_drift():
    readme = "| `nanomm/a.py` | one |\n| `nanomm/x/b.py` | two | 04 |\n| `nanomm/x/b.py` | again |\n"
    assert module_map_errors(readme, {"nanomm/a.py", "nanomm/x/b.py"}) == ["listed twice nanomm/x/b.py"]
    assert module_map_errors(readme, {"nanomm/a.py", "nanomm/c.py"}) == [
        "missing nanomm/c.py", "stale nanomm/x/b.py", "listed twice nanomm/x/b.py"]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks: a prompt in a lesson's code may say "today"."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append((number, line))
    return out


def diary_lines(text: str) -> list[str]:
    """Every prose line of a doc that reads as a diary entry, with its number and the words that give it away."""
    return [f"{number}: {', '.join(m.group(0) for m in DIARY.finditer(line))}: {line.strip()}"
            for number, line in prose_lines(text) if DIARY.search(line)]


@pytest.mark.parametrize("doc", PROSE_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_doc_reads_as_a_diary(doc):
    hits = diary_lines(doc.read_text(encoding="utf-8"))
    assert not hits, f"{doc.name} reads as a diary (say what the code does, not when or by whom):\n" + "\n".join(hits)


def test_the_diary_check_catches_a_diary():
    diary = ("Fixed today, after issue 42 (see issue #7).\nMeasured on 2026-12-04 in this session.\n"
             "The GPU was lent for 15 minutes of device time; next session: the int8 path.\nTODAY: nothing.")
    assert [line.split(":")[0] for line in diary_lines(diary)] == ["1", "2", "3", "4"]
    assert [line.split(":")[0] for line in diary_lines("```\ntoday\n```\nDone today.")] == ["4"]
    assert diary_lines(diary)[0].startswith("1: today, issue 42, issue #7: Fixed today")
    # Whole words only, and prose only: none of these is a diary entry.
    assert not diary_lines("A todays_date variable, a 2026-12 version and tissue 42 are not diary words.\n"
                           "Sessionless servers, a lent-out GPU and open issues are fine.\n"
                           "```python\nllm.generate('How are you today?')\n```")


def defined_names() -> tuple[set[str], dict[str, set[str]]]:
    """Every name the package defines (functions, classes, assignments, attributes, arguments, string keys such
    as the stats() names), and each class's own members."""
    names, members = set(), {}
    for path in (ROOT / "nanomm").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            if isinstance(node, ast.ClassDef):
                members.setdefault(node.name, set()).update(_member_names(node))
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            if isinstance(node, ast.arg):
                names.add(node.arg)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                names.add(node.value)
    return names, members


def _member_names(cls: ast.ClassDef) -> set[str]:
    out = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.FunctionDef):
            out.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
    return out


def text_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of every paragraph and every list item."""
    blocks, start, lines = [], 1, []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("- "):
            if lines:
                blocks.append((start, " ".join(lines)))
            start, lines = number, []
        if line.strip():
            lines.append(line)
    if lines:
        blocks.append((start, " ".join(lines)))
    return blocks


def named_symbols(text: str) -> list[tuple[int, str]]:
    """(line, symbol) for every backticked code name in a paragraph or list item that names a nanomm file."""
    out = []
    for number, block in text_blocks(text):
        if not CODE_PATH.search(block):
            continue
        for token in BACKTICKED.findall(block):
            token = token.strip()
            if token.endswith(FILE_SUFFIXES) or not SYMBOL.fullmatch(token):
                continue
            if "_" in token or "." in token or token.endswith("()") or token[0].isupper():
                out.append((number, token.removesuffix("()")))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_code_exists(doc):
    text = doc.read_text(encoding="utf-8")
    for path in set(CODE_PATH.findall(text)):
        assert (ROOT / path).is_file(), f"{doc.name} names {path}, which does not exist"
    names, members = defined_names()
    missing = []
    for number, symbol in named_symbols(text):
        owner, _, member = symbol.rpartition(".")
        if symbol in OUTSIDE_NAMES or hasattr(builtins, symbol) or (
                owner and owner.split(".")[0] not in names | members.keys()):
            continue  # Python's or another library's name (TypeError, PIL's Image.MAX_IMAGE_PIXELS, nn.Linear)
        found = member in members[owner] if owner in members else member in names
        if not found:
            missing.append(f"{doc.name}:{number}: {symbol}")
    assert not missing, f"named in the docs but not defined in nanomm/: {missing}"


def test_the_checks_catch_drift():
    names, members = defined_names()
    assert "step" in members["LLMEngine"] and "process" not in members["InputProcessor"]
    text = "see `nanomm/inputs/prompt.py`: `InputProcessor.process`,\n  `smart_resize()` and `tiny`\n\n`not_here`"
    assert [s for _, s in named_symbols(text)] == ["InputProcessor.process", "smart_resize"]
