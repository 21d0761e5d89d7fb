"""Docs that cannot drift: the README's module map matches the package file for file and line for line, and every
nanomm file, function and class that a lesson or the README names exists."""

import ast
import builtins
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "lessons").glob("*.md")) + [ROOT / "README.md"]
MAP_ROW = re.compile(r"^\| `(nanomm/[a-z0-9_/]+\.py)` \| ([\d,]+) \|", re.M)
MAP_TOTAL = re.compile(r"^\| \*\*total\*\* \| \*\*([\d,]+)\*\* \|", re.M)
CODE_PATH = re.compile(r"nanomm/[a-z0-9_/]+\.py")
BACKTICKED = re.compile(r"`([^`\n]+)`")
SYMBOL = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(\(\))?")
FILE_SUFFIXES = (".json", ".py", ".md", ".txt", ".safetensors")
OUTSIDE_NAMES = {"Qwen2VLImageProcessorPil"}  # transformers' names that lessons compare against


def package_files() -> dict[str, int]:
    return {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
            for p in sorted((ROOT / "nanomm").rglob("*.py"))}


def test_module_map_lists_every_file_with_its_line_count():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    listed = {path: int(count.replace(",", "")) for path, count in MAP_ROW.findall(readme)}
    actual = package_files()
    assert sorted(listed) == sorted(actual), (f"README module map: missing {sorted(actual.keys() - listed.keys())}, "
                                              f"stale {sorted(listed.keys() - actual.keys())}")
    wrong = {path: (listed[path], n) for path, n in actual.items() if listed[path] != n}
    assert not wrong, f"README module map line counts (listed, actual): {wrong}"
    total = MAP_TOTAL.search(readme)
    assert total and int(total.group(1).replace(",", "")) == sum(actual.values())


def defined_names() -> tuple[set[str], dict[str, set[str]]]:
    """Every name the package defines (functions, classes, assignments, attributes, arguments, string keys such
    as the stats() names), and each class's own members."""
    names, members = set(), {}
    for path in (ROOT / "nanomm").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
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
