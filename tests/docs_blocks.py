"""The fenced code blocks of README.md and docs/*.md, and how tests/test_docs.py runs them.

Every fence names what it holds; its info string is the language, then options:

    ```python                 run in the page's interpreter: one process per page, blocks in order,
                              one namespace (a later block sees what an earlier one defined)
    ```python ranks=2         a whole script, run on 2 ranks under `autodist run -n 2`
    ```python file=train.py   not run: saved as train.py for the blocks after it (a bash block runs it)
    ```bash                   run by bash -e
    ```bash quick             run by bash -e, each ``python benchmarks/NAME.py`` command with ``--quick`` added
                              (the benchmark's smoke run: the command works, nothing is timed)
    ```python fragment        not run, counted: deliberately incomplete (a signature, a shape of a loop)
    ```text                   output or a diagram, never run

Each page runs in a fresh folder that looks like a checkout (examples/, benchmarks/, scripts/, tests/ are
links to the repository's), with ``python`` and ``autodist`` of the interpreter running the tests first on
PATH, so a command reads as a user types it in a checkout.
"""
from __future__ import annotations

import dataclasses
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
LANGUAGES = {"python", "bash", "text"}
OPTIONS = re.compile(r"^(fragment|quick|ranks=[1-9]\d*|file=[\w./-]+)$")
BENCHMARK = re.compile(r"(?<![\w/.-])(python3? benchmarks/[\w/]+\.py)(?=[\s;&|)]|$)")  # anywhere in a line
SCRIPT = re.compile(r"benchmarks/[\w/]+\.py")
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


class DocsFormatError(ValueError):
    """A fence the collector does not understand: what was found, and what to write instead."""


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # relative to the repository: "README.md", "docs/launching.md"
    line: int  # of the opening fence, from 1
    language: str
    code: str
    fragment: bool = False
    quick: bool = False
    ranks: int | None = None
    file: str | None = None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def command(self) -> str:
        """The code as it runs: with ``quick``, each benchmark command gets ``--quick``."""
        return BENCHMARK.sub(r"\1 --quick", self.code) if self.quick else self.code

    @property
    def runs(self) -> bool:
        return self.language in ("python", "bash") and not self.fragment and self.file is None


def pages(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _fences(lines: list[str], page: str) -> list[tuple[int, int, list[str]]]:
    """(index of the opening fence, index of the closing one, the info string's words) of each fenced block."""
    spans, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start, fence = i, m.group("fence")
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence) and lines[i].strip().strip(fence[0]) == ""):
            i += 1
        if i == len(lines):
            raise DocsFormatError(f"{page}:{start + 1}: the fence opened here is never closed")
        spans.append((start, i, m.group("info").split()))
        i += 1
    return spans


def blocks_of(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[Block]:
    """The fenced blocks of one page, in order; raises :class:`DocsFormatError` on a fence it cannot place."""
    page, lines = str(path.relative_to(root)), path.read_text().split("\n")
    return [_block(page, start + 1, words, "\n".join(lines[start + 1:end]) + "\n")
            for start, end, words in _fences(lines, page)]


def prose(text: str, page: str = "page") -> list[str]:
    """The lines of a page outside its fenced blocks (where its headings are)."""
    lines = text.split("\n")
    inside = {i for start, end, _ in _fences(lines, page) for i in range(start, end + 1)}
    return [line for i, line in enumerate(lines) if i not in inside]


def _block(page: str, line: int, words: list[str], code: str) -> Block:
    where = f"{page}:{line}"
    if not words or words[0] not in LANGUAGES:
        found = words[0] if words else "nothing"
        raise DocsFormatError(f"{where}: a fence must name python, bash or text (text: output, never run); "
                              f"found {found!r}")
    language, options = words[0], words[1:]
    for option in options:
        if not OPTIONS.match(option) or language == "text":
            raise DocsFormatError(f"{where}: unknown option {option!r} for a {language} block; the options are "
                                  f"fragment, ranks=N and file=NAME (python), fragment and quick (bash)")
    values = dict(o.split("=", 1) if "=" in o else (o, "") for o in options)
    if len(values) > 1:
        raise DocsFormatError(f"{where}: one option at most (fragment, quick, ranks=N or file=NAME), got {options}")
    if language == "bash" and ("ranks" in values or "file" in values):
        raise DocsFormatError(f"{where}: ranks= and file= are for python blocks; run a script from bash instead")
    if language == "python" and "quick" in values:
        raise DocsFormatError(f"{where}: quick is for bash blocks that run benchmarks/")
    if "quick" in values and not BENCHMARK.search(code):
        raise DocsFormatError(f"{where}: a quick block must run a benchmark (python benchmarks/NAME.py ...)")
    if "quick" in values and len(SCRIPT.findall(code)) != len(BENCHMARK.findall(code)):
        raise DocsFormatError(f"{where}: a quick block runs each benchmark as `python benchmarks/NAME.py ...` so that "
                              f"--quick can be added; one here is started another way and would run in full")
    return Block(page, line, language, code, fragment="fragment" in values, quick="quick" in values,
                 ranks=int(values["ranks"]) if "ranks" in values else None, file=values.get("file"))
