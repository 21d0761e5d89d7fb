"""Lessons are tests: every ```python block of every lesson runs, in order, in one namespace per lesson."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]-*.md"))
CODE_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
CODE_PATH = re.compile(r"nanomm/[a-z0-9_/]+\.py")


def python_blocks(lesson: Path) -> list[str]:
    return CODE_BLOCK.findall(lesson.read_text(encoding="utf-8"))


def test_there_are_lessons():
    assert len(LESSONS) >= 3


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_lesson_runs(lesson, tmp_path, monkeypatch):
    blocks = python_blocks(lesson)
    assert blocks, f"{lesson.name} has no python blocks"
    monkeypatch.chdir(tmp_path)  # lessons write their checkpoints and images here
    namespace = {"__name__": f"lesson_{lesson.stem.replace('-', '_')}"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{lesson.name} (python block {i + 1})", "exec"), namespace)


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_lesson_names_code_that_exists(lesson):
    paths = set(CODE_PATH.findall(lesson.read_text(encoding="utf-8")))
    assert paths, f"{lesson.name} does not name the nanomm file it explains"
    for path in paths:
        assert (ROOT / path).is_file(), f"{lesson.name} names {path}, which does not exist"


def test_harness_runs_blocks_in_one_namespace(tmp_path):
    fake = tmp_path / "99-fake.md"
    fake.write_text("text\n```python\nx = 2\n```\nmore text\n```python\nassert x == 2\ny = x + 1\n```\n")
    namespace = {}
    for block in python_blocks(fake):
        exec(block, namespace)
    assert namespace["y"] == 3
    broken = tmp_path / "98-broken.md"
    broken.write_text("```python\nraise RuntimeError('lesson is broken')\n```\n")
    with pytest.raises(RuntimeError):
        for block in python_blocks(broken):
            exec(block, {})


def test_readme_examples_run(tmp_path, monkeypatch):
    blocks = python_blocks(ROOT / "README.md")
    assert blocks
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "readme"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md (python block {i + 1})", "exec"), namespace)
