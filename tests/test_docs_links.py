"""The README and docs/ link only to files that exist (the reference moves between them),
and the README keeps the test command CI runs (.ci/run reads the block after its marker)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    found = [m.group(1) for m in LINK.finditer(text)]
    return [t for t in found if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_readme_and_docs_link_to_files_that_exist() -> None:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = [
        f"{page.relative_to(REPO)}: {target}"
        for page in pages
        for target in relative_links(page)
        if not (page.parent / target.split("#")[0]).exists()
    ]
    assert broken == []


def test_readme_keeps_the_test_command_marker() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    after = text.split("<!-- test-command -->\n", 1)[1]
    assert after.startswith("```bash\n") and "python -m pytest" in after.split("```")[1]
