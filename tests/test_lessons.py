"""Lessons are tests: every ```python block of every lesson and appendix runs, in order, in one namespace per file.

A ```python block that is immediately followed (blank lines aside) by a ```text block must print that text:
its stdout is captured and compared with the text block after `mask_output` has hidden what legitimately
varies from machine to machine (timings, rates, rounding noise). Counts, ids and shapes must match exactly.
"""

import contextlib
import difflib
import io
import os
import re
import sys
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COURSE = sorted((ROOT / "lessons").glob("[0-9][0-9]-*.md"))  # 01-..., 02-...: the lessons, read in this order
APPENDICES = sorted((ROOT / "lessons").glob("A[0-9]-*.md"))  # A1-..., A2-...: read after the course
LESSONS = COURSE + APPENDICES
LESSON_LINK = re.compile(r"\]\(((?:[0-9][0-9]|A[0-9])-[\w-]+\.md)\)|`lessons/((?:[0-9][0-9]|A[0-9])-[\w-]+\.md)`")
LESSON_MENTION = re.compile(r"\b[Ll]essons? ([0-9][0-9](?:(?:, | and | to |-)[0-9][0-9])*)")
APPENDIX_MENTION = re.compile(r"\b[Aa]ppendi(?:x|ces) (A[0-9](?:(?:, | and )A[0-9])*)")
FENCED_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", re.S | re.M)
CODE_PATH = re.compile(r"nanomm/[a-z0-9_/]+\.py")
PICTURE_LINK = re.compile(r"!\[[^\]]*\]\(pictures/([\w.-]+\.png)\)")

NUMBER = r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?"
SCIENTIFIC = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?e[-+]?\d+(?!\w)")
TIMING_OR_RATE = re.compile(NUMBER + r" ?(?:ms|µs|us|ns|s|tok/s|tokens/s|MB/s|GB/s|GiB/s|GFLOP/s)(?![\w/])")
SPEEDUP = re.compile(r"(?<![\w.])\d+\.\d+x(?!\w)")


def mask_output(text: str) -> str:
    """Hide what varies between machines and runs, so that printed output can be compared with a lesson's text.

    Rules, applied in this order:
    1. a float in scientific notation (rounding noise such as `1.2e-06`) becomes `<sci>`;
    2. a timing or a rate, a number followed by one of the units ms, µs, us, ns, s, tok/s, tokens/s, MB/s, GB/s,
       GiB/s or GFLOP/s (with or without a space before the unit), becomes `<time>`;
    3. a speed-up ratio, a number with a decimal point followed by `x` (`3.2x`), becomes `<time>`;
       a whole number followed by `x` (`5x the tokens`, `224x224`) is a count or a size and is kept;
    4. runs of spaces and tabs become one space, and trailing spaces and blank lines at either end are dropped,
       so that a number printed wider or narrower does not shift the comparison.
    Everything else (counts, token ids, block ids, shapes, hashes, percentages) is compared exactly.
    """
    text = SCIENTIFIC.sub("<sci>", text)
    text = TIMING_OR_RATE.sub("<time>", text)
    text = SPEEDUP.sub("<time>", text)
    lines = [re.sub(r"[ \t]+", " ", line).rstrip() for line in text.splitlines()]
    return "\n".join(lines).strip("\n")


def lesson_blocks(path: Path) -> list[tuple[str, str | None]]:
    """Every ```python block of a markdown file, with the ```text block that follows it (or None if none does)."""
    text = path.read_text(encoding="utf-8")
    fences = list(FENCED_BLOCK.finditer(text))
    blocks = []
    for fence, after in zip(fences, fences[1:] + [None]):
        if fence.group(1) != "python":
            continue
        follows = after is not None and after.group(1) == "text" and not text[fence.end():after.start()].strip()
        blocks.append((fence.group(2), after.group(2) if follows else None))
    return blocks


def python_blocks(path: Path) -> list[str]:
    return [code for code, _ in lesson_blocks(path)]


def check_printed(printed: str, expected: str, where: str) -> None:
    """Fail, with a diff of the masked texts, if a block printed something other than its ```text block."""
    want, got = mask_output(expected), mask_output(printed)
    if want != got:
        diff = difflib.unified_diff(want.splitlines(), got.splitlines(), "```text block", "printed", lineterm="")
        raise AssertionError(f"{where} printed something other than the ```text block after it "
                             f"(both masked by mask_output):\n" + "\n".join(diff))


def run_blocks(path: Path, namespace: dict) -> None:
    """Run a markdown file's python blocks in order in `namespace`, checking each printed ```text block."""
    for i, (code, expected) in enumerate(lesson_blocks(path)):
        where = f"{path.name} (python block {i + 1})"
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                exec(compile(code, where, "exec"), namespace)
        except AssertionError as e:  # pytest cannot show the source of exec'd code: name the failing line
            lineno = [frame.lineno for frame in traceback.extract_tb(e.__traceback__) if frame.filename == where][-1]
            raise AssertionError(f"{where}, line {lineno}: {code.splitlines()[lineno - 1].strip()}"
                                 + (f" ({e})" if str(e) else "")) from e
        finally:
            sys.stdout.write(printed.getvalue())  # pytest shows it when a test fails
        if expected is not None:
            check_printed(printed.getvalue(), expected, where)


def test_there_are_lessons():
    assert len(LESSONS) >= 3


def test_every_lesson_file_is_collected_and_numbered_in_order():
    """A lesson whose name matched neither pattern would silently never run; numbers have no gaps or repeats."""
    files = sorted(p.name for p in (ROOT / "lessons").glob("*.md") if p.name != "README.md")
    assert files == sorted(p.name for p in LESSONS), f"not collected: {sorted(set(files) - {p.name for p in LESSONS})}"
    assert [p.name[:2] for p in COURSE] == [f"{i:02d}" for i in range(1, len(COURSE) + 1)]
    assert [p.name[:2] for p in APPENDICES] == [f"A{i}" for i in range(1, len(APPENDICES) + 1)]


def test_index_lists_the_course_then_the_appendices():
    index = (ROOT / "lessons" / "README.md").read_text(encoding="utf-8")
    listed = [m.group(1) for m in re.finditer(r"^\| \S+ \| \[[^\]]+\]\(([\w-]+\.md)\)", index, re.M)]
    assert listed == [p.name for p in LESSONS]


@pytest.mark.parametrize("doc", LESSONS + [ROOT / "lessons" / "README.md"], ids=lambda p: p.stem)
def test_cross_references_point_at_lessons_that_exist(doc):
    """Links (`](05-continuous-batching.md)`, `lessons/05-...md`) name an existing file; "lesson 05" and
    "appendix A3" name an existing number."""
    text = doc.read_text(encoding="utf-8")
    names = {p.name for p in LESSONS}
    linked = [name for pair in LESSON_LINK.findall(text) for name in pair if name]
    assert all(name in names for name in linked), f"{doc.name} links to {sorted(set(linked) - names)}"
    numbers = {p.name[:2] for p in LESSONS}
    mentioned = {n for m in LESSON_MENTION.findall(text) for n in re.findall(r"[0-9][0-9]", m)}
    mentioned |= {n for m in APPENDIX_MENTION.findall(text) for n in re.findall(r"A[0-9]", m)}
    assert mentioned <= numbers, f"{doc.name} mentions lessons {sorted(mentioned - numbers)}, which do not exist"


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_lesson_runs(lesson, tmp_path, monkeypatch):
    assert python_blocks(lesson), f"{lesson.name} has no python blocks"
    monkeypatch.chdir(tmp_path)  # lessons write their checkpoints and images here
    run_blocks(lesson, {"__name__": f"lesson_{lesson.stem.replace('-', '_')}"})
    pictures = Path(os.environ.get("NANOMM_LESSON_PICTURES", tmp_path))
    for name in PICTURE_LINK.findall(lesson.read_text(encoding="utf-8")):  # its own code drew each picture it shows
        assert (pictures / name).is_file(), f"{lesson.name} shows pictures/{name}, but its code did not draw it"


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_lesson_pictures_are_committed_and_drawn_by_the_lesson(lesson):
    text = lesson.read_text(encoding="utf-8")
    code = "\n".join(python_blocks(lesson))
    for name in PICTURE_LINK.findall(text):
        assert (ROOT / "lessons" / "pictures" / name).is_file(), f"lessons/pictures/{name} is not committed"
        assert f'"{name}"' in code, f"{lesson.name} shows {name} but no python block of it saves that file"


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
    run_blocks(fake, namespace)
    assert namespace["y"] == 3
    broken = tmp_path / "98-broken.md"
    broken.write_text("```python\nraise RuntimeError('lesson is broken')\n```\n")
    with pytest.raises(RuntimeError):
        run_blocks(broken, {})
    wrong_claim = tmp_path / "94-claim.md"
    wrong_claim.write_text("```python\nblocks = 3\nassert blocks == 4\n```\n")
    with pytest.raises(AssertionError, match=r"94-claim.md \(python block 1\), line 2: assert blocks == 4"):
        run_blocks(wrong_claim, {})


def test_harness_checks_printed_output(tmp_path):
    code = "```python\nprint(f'{2 + 2} blocks, {0.0123:.1f} ms')\n```\n"
    good = tmp_path / "97-good.md"
    good.write_text(code + "\n```text\n4 blocks, 9.9 ms\n```\n")
    run_blocks(good, {})  # the timing is masked, the count matches
    wrong = tmp_path / "96-wrong.md"
    wrong.write_text(code + "\n```text\n5 blocks, 0.0 ms\n```\n")
    with pytest.raises(AssertionError, match="printed something other than"):
        run_blocks(wrong, {})
    prose_between = tmp_path / "95-prose.md"  # only a text block right after the code is its output
    prose_between.write_text(code + "It prints something like:\n```text\n5 blocks\n```\n")
    run_blocks(prose_between, {})
    assert [expected for _, expected in lesson_blocks(good)] == ["4 blocks, 9.9 ms\n"]


def test_mask_output_hides_timings_but_not_counts():
    printed = "prefill 21 steps,  12.3 ms (3.10x); 1,190 tok/s at 49.3 GB/s, diff 1.2e-06, 224x224 in 5x less"
    other_machine = "prefill 21 steps, 104.7 ms (0.95x); 87 tok/s at 7.0 GB/s, diff 0.0e+00, 224x224 in 5x less"
    assert mask_output(printed) == mask_output(other_machine)
    assert mask_output(printed) != mask_output(printed.replace("21 steps", "22 steps"))  # a count off by one
    assert mask_output(printed) != mask_output(printed.replace("5x less", "6x less"))  # a whole-number ratio
    assert mask_output("a  b   \n\n") == "a b"


def test_readme_examples_run(tmp_path, monkeypatch):
    blocks = python_blocks(ROOT / "README.md")
    assert blocks
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "readme"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md (python block {i + 1})", "exec"), namespace)
