"""What the documentation's tests share: the marked shell blocks of the README and docs/."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import ROOT

#: a fenced bash block right after a line `<!-- runnable -->` (or `<!-- runnable ray -->`: it needs
#: the `flower` extra) is executed by test_runnable_blocks.py
RUNNABLE = re.compile(r"^<!-- runnable(?: (?P<tier>ray))? -->\n```bash\n(?P<code>.*?)^```$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int
    tier: str  # "subprocess" or "ray"
    code: str

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """The README, then every page under docs/ (the benchmarks template is not a page)."""
    docs = sorted(path for path in (ROOT / "docs").rglob("*.md") if "templates" not in path.parts)
    return [ROOT / "README.md", *docs]


def runnable_blocks() -> list[Block]:
    found = []
    for path in pages():
        text = path.read_text()
        for match in RUNNABLE.finditer(text):
            found.append(Block(str(path.relative_to(ROOT)), text.count("\n", 0, match.start()) + 2,
                               match["tier"] or "subprocess", match["code"]))
    return found
