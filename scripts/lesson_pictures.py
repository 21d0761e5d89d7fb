"""Redraw the lessons' pictures (lessons/pictures/*.png) by running the lessons that draw them.

    python scripts/lesson_pictures.py            # every lesson that shows a picture
    python scripts/lesson_pictures.py 05 09      # only these lessons

Each picture is drawn by a python block of its lesson, into the folder that NANOMM_LESSON_PICTURES names
(the lesson's working folder when it is unset, which is what the test suite does). This script points it at
lessons/pictures and runs those lessons through the test suite's own runner (tests/test_lessons.py), so a
lesson whose printed output no longer matches its text fails here too. Needs the `lessons` extra
(matplotlib): pip install -e ".[lessons]". Timings in the pictures are this machine's.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PICTURES = ROOT / "lessons" / "pictures"
PICTURE_LINK = re.compile(r"!\[[^\]]*\]\(pictures/([\w.-]+\.png)\)")


def lessons_with_pictures(only: list[str]) -> list[Path]:
    lessons = sorted((ROOT / "lessons").glob("[0-9][0-9]-*.md")) + sorted((ROOT / "lessons").glob("A[0-9]-*.md"))
    chosen = [p for p in lessons if PICTURE_LINK.search(p.read_text(encoding="utf-8"))]
    return [p for p in chosen if not only or p.name[:2] in only]


def main(argv: list[str]) -> int:
    lessons = lessons_with_pictures(argv)
    if not lessons:
        print(f"no lesson with pictures matches {argv}", file=sys.stderr)
        return 2
    PICTURES.mkdir(exist_ok=True)
    selector = " or ".join(p.stem for p in lessons)
    env = {**os.environ, "NANOMM_LESSON_PICTURES": str(PICTURES)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", str(ROOT / "tests" / "test_lessons.py"),
                          "-k", f"test_lesson_runs and ({selector})"], cwd=ROOT, env=env)
    for lesson in lessons:
        for name in PICTURE_LINK.findall(lesson.read_text(encoding="utf-8")):
            print(f"{lesson.name}: lessons/pictures/{name}")
    return run.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
