"""Docs that cannot rot: every python and bash block of README.md and docs/*.md runs (see tests/docs_blocks.py).

One test per page runs its blocks in order in a fresh folder; a block that fails names its page and line
with its output. The pages start with the session (tests/conftest.py), one at a time in the cores the other
tests leave idle while they wait for the processes they launch, and two at a time once their tests, which
run last, are reached. Fragments are skipped and counted, and there may be only a few.
Links between pages and file names of the repository must lead somewhere.
"""
from __future__ import annotations

import contextlib
import faulthandler
import io
from concurrent.futures import Future
import multiprocessing
import multiprocessing.connection
import os
import pathlib
import re
import subprocess
import sys
import threading
import traceback
from typing import Any

import pytest

from docs_blocks import BENCHMARK, ROOT, Block, DocsFormatError, blocks_of, pages, prose

MAX_FRAGMENTS = 12  # deliberate fragments in all pages together: a signature, the shape of a loop
README_LINES = 220  # the front page stays a front page (about 200 lines)
CHECKOUT = ("examples", "benchmarks", "scripts", "tests")  # what a page's folder links to, as a checkout has it
BLOCK_TIMEOUT = 600.0  # a hang catcher: a benchmark's quick form on a slower, busy machine took over 300 s
STACKS_BEFORE = 30.0  # a python block still running this long before its timeout writes every thread's stack
INTERPRETER_LOG = "interpreter.log"  # in the page's folder: what a page's Python wrote outside its blocks
CONCURRENT_PAGES = 2  # a page mostly waits for the processes it starts: two pages at a time fill two cores
BACKGROUND_PAGES = 1  # while the other tests run (see Pages)
PAGE_TEST = "test_every_block_of_the_page_runs"
_SHELL = dict(os.environ)  # the environment the session started in, before any test changed os.environ


def _environment() -> dict[str, str]:
    env = dict(_SHELL)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a page starts outside any launch, as a user's shell does
    return env


def _interpreter(conn: Any, folder: str, env: dict[str, str], stacks_after: float) -> None:
    """The page's Python: runs each block it is sent in one namespace, replies (ok, output).

    What escapes the blocks' redirection (a crash, a native library's output) goes to INTERPRETER_LOG in the
    page's folder, and so do all its threads' stacks if a block is still running after ``stacks_after`` s.
    """
    log = open(os.path.join(folder, INTERPRETER_LOG), "w", buffering=1)  # noqa: SIM115 - lives as the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.enable(log)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(folder)
    sys.path.insert(0, folder)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    while True:
        message = conn.recv()
        if message is None:
            return
        code, where = message
        faulthandler.dump_traceback_later(stacks_after, file=log)
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                exec(compile(code, where, "exec"), namespace)  # noqa: S102 - the docs' own code
            conn.send((True, out.getvalue()))
        except BaseException:  # noqa: BLE001 - everything goes back to the test
            conn.send((False, out.getvalue() + traceback.format_exc()))
        faulthandler.cancel_dump_traceback_later()


class Page:
    """A page's folder, its interpreter (started at its first python block) and its environment."""

    def __init__(self, folder: pathlib.Path) -> None:
        self.folder, self.env = folder, _environment()
        for name in CHECKOUT:
            (folder / name).symlink_to(ROOT / name)
        self.conn: Any = None
        self.process: Any = None

    def python(self, block: Block) -> None:
        if self.process is None:
            ctx = multiprocessing.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.process = ctx.Process(target=_interpreter, args=(child, str(self.folder), self.env, max(BLOCK_TIMEOUT - STACKS_BEFORE, 1.0)),
                                       daemon=True)
            self.process.start()
            child.close()  # the child's end lives in the child only: its death ends the wait below
        self.conn.send((block.code, block.where))
        reply = self._reply()
        if reply is None:
            self.process.join(timeout=5)  # a death closes the pipe a moment before the exit code is known
            code = self.process.exitcode
            why = (f"did not finish within {BLOCK_TIMEOUT:.0f} s" if code is None
                   else f"was not answered: the page's interpreter died (exit code {code})")
            self.close()
            pytest.fail(f"{block.where}: the python block {why}; the interpreter's log:\n{self._log()}")
        ok, output = reply
        if not ok:
            pytest.fail(f"{block.where}: the python block failed:\n{output}")

    def _reply(self) -> tuple[bool, str] | None:
        """The interpreter's answer; None if it died or did not answer within BLOCK_TIMEOUT."""
        if not multiprocessing.connection.wait([self.conn, self.process.sentinel], BLOCK_TIMEOUT):
            return None
        try:
            return self.conn.recv() if self.conn.poll() else None
        except (EOFError, OSError):
            return None

    def _log(self) -> str:
        path = self.folder / INTERPRETER_LOG
        return path.read_text(errors="replace")[-8000:] if path.exists() else "(none: it did not start)"

    def command(self, block: Block, argv: list[str]) -> None:
        try:
            done = subprocess.run(argv, cwd=self.folder, env=self.env, capture_output=True, text=True,
                                  timeout=BLOCK_TIMEOUT)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"{block.where}: did not finish within {BLOCK_TIMEOUT:.0f} s:\n{exc.stdout}\n{exc.stderr}")
        if done.returncode != 0:
            pytest.fail(f"{block.where}: the {block.language} block exited with status {done.returncode}:\n"
                        f"{done.stdout[-6000:]}\n{done.stderr[-6000:]}")

    def run(self, block: Block) -> None:
        if block.file is not None:
            target = self.folder / block.file
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.code)
        elif not block.runs:
            return
        elif block.language == "bash":
            self.command(block, ["bash", "-e", "-o", "pipefail", "-c", block.command])
        elif block.ranks is not None:
            script = self.folder / f"block_at_line_{block.line}.py"
            script.write_text(block.code)
            self.command(block, [sys.executable, "-m", "autodist", "run", "-n", str(block.ranks), script.name])
        else:
            self.python(block)

    def close(self) -> None:
        if self.process is not None:
            with contextlib.suppress(OSError):  # an interpreter that died has closed its end
                self.conn.send(None)
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.kill()
            self.process = None


def _all_blocks() -> list[Block]:
    return [b for page in pages() for b in blocks_of(page)]


def _run_page(page: str, folder: pathlib.Path) -> str | None:
    """Run the page's blocks in order; None, or why a block failed."""
    runner = Page(folder)
    try:
        for block in blocks_of(ROOT / page):
            runner.run(block)
    except pytest.fail.Exception as failure:
        return str(failure)
    finally:
        runner.close()
    return None


def _launches(page: str) -> int:
    """Roughly how many processes a page starts: its slow ones go first."""
    return sum(2 * (b.ranks is not None) + 2 * len(BENCHMARK.findall(b.command)) + (b.language == "bash")
               for b in blocks_of(ROOT / page) if b.runs)


class Pages:
    """The selected pages' runs, slow pages first, each one's outcome a Future (None, or why a block failed).

    They start with the session (the fixture ``docs_pages`` of tests/conftest.py), BACKGROUND_PAGES at a time
    while the other tests run: those mostly wait for the processes they launch, and a page fills the core
    they leave idle. When the pages' own tests are reached (they run last), CONCURRENT_PAGES at a time.
    """

    def __init__(self, pages: list[str], tmp_path_factory: pytest.TempPathFactory) -> None:
        self._queue = [(page, tmp_path_factory.mktemp(re.sub(r"\W", "-", page)))
                       for page in sorted(dict.fromkeys(pages), key=_launches, reverse=True)]
        self.outcomes: dict[str, Future] = {page: Future() for page, _ in self._queue}
        self._allowed, self._running = BACKGROUND_PAGES, 0
        self._turn = threading.Condition()
        self._threads = [threading.Thread(target=self._work, name=f"docs-page-{i}", daemon=True)
                         for i in range(CONCURRENT_PAGES)]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while True:
            with self._turn:
                while self._queue and self._running >= self._allowed:
                    self._turn.wait()
                if not self._queue:
                    return
                page, folder = self._queue.pop(0)
                self._running += 1
            outcome = self.outcomes[page]
            try:
                outcome.set_result(_run_page(page, folder))
            except BaseException as error:  # noqa: BLE001 - goes to the page's test
                outcome.set_exception(error)
            finally:
                with self._turn:
                    self._running -= 1
                    self._turn.notify_all()

    def all_at_once(self) -> dict[str, Future]:
        """From now on CONCURRENT_PAGES at a time; every page's outcome."""
        with self._turn:
            self._allowed = CONCURRENT_PAGES
            self._turn.notify_all()
        return self.outcomes

    def close(self) -> None:
        """Pages not started are dropped (the session ended early); the running ones are waited for."""
        with self._turn:
            for page, _ in self._queue:
                self.outcomes[page].cancel()
            self._queue.clear()
            self._turn.notify_all()
        for thread in self._threads:
            thread.join()


@pytest.fixture(scope="module")
def page_outcomes(docs_pages: Pages) -> dict[str, Future]:
    """The selected pages' outcomes; the pages not done yet now run CONCURRENT_PAGES at a time."""
    return docs_pages.all_at_once()


@pytest.mark.parametrize("page", [pytest.param(name, marks=() if name == "README.md" else pytest.mark.slow)
                                  for name in (str(p.relative_to(ROOT)) for p in pages())])  # the front page: quick
def test_every_block_of_the_page_runs(page, page_outcomes):
    failure = page_outcomes[page].result()
    if failure is not None:
        pytest.fail(failure, pytrace=False)


def test_every_fence_is_understood_and_fragments_are_few():
    blocks = _all_blocks()
    fragments = [b.where for b in blocks if b.fragment]
    ran = [b for b in blocks if b.runs]
    print(f"doc blocks: {len(ran)} run ({sum(b.ranks is not None for b in ran)} on ranks, "
          f"{sum(b.quick for b in ran)} benchmark smoke runs), "
          f"{sum(b.file is not None for b in blocks)} saved as files, {len(fragments)} fragments: {fragments}")
    assert ran, "no block runs: is the collector reading the pages?"
    assert len(fragments) <= MAX_FRAGMENTS, f"{len(fragments)} fragments (at most {MAX_FRAGMENTS}): {fragments}"


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_LINES, f"README.md has {lines} lines; move the detail to a page of docs/"


REPOSITORY_FILE = re.compile(  # a file of the repository named in a page: `autodist/dp/data.py`
    r"(?<![\w/.])((?:autodist|tests|benchmarks|examples|scripts|docs)/[\w./-]*\w\.(?:py|md|sh))\b")


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings (outside code blocks): lower case, punctuation dropped, spaces to
    hyphens, and -1, -2, ... after a repeated one."""
    seen: dict[str, int] = {}
    for line in prose(text):
        heading = re.match(r"#{1,6} (.+)$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
            if seen[slug]:
                seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def test_links_and_file_names_lead_somewhere():
    broken = []
    for page in pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a web address: not ours to check
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
        for named in set(REPOSITORY_FILE.findall(page.read_text())):  # `autodist/dp/data.py` in the text
            if not (ROOT / named).exists():
                broken.append(f"{page.relative_to(ROOT)}: {named} (no such file in the repository)")
    assert broken == []


def test_anchors_are_githubs_and_skip_code():
    text = "# Two words\n```bash\n# not a heading\n```\n## Two words\n### What `x` does!\n"
    assert anchors(text) == {"two-words", "two-words-1", "what-x-does"}


def test_the_collector_refuses_what_it_cannot_place(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n```python ranks=2\nprint(1)\n```\n````bash fragment\ngit clone URL\n````\n"
                    "```bash quick\npython benchmarks/bench_dp.py --steps 3   # about 70 s\n```\n")
    first, second, third = blocks_of(page, tmp_path)
    assert third.command == "python benchmarks/bench_dp.py --quick --steps 3   # about 70 s\n"
    page.write_text("```bash quick\nX=0 python benchmarks/a.py && time python3 benchmarks/b.py\n```\n")
    assert blocks_of(page, tmp_path)[0].command == \
        "X=0 python benchmarks/a.py --quick && time python3 benchmarks/b.py --quick\n"
    assert (first.language, first.ranks, first.line, first.runs) == ("python", 2, 2, True)
    assert (second.language, second.fragment, second.runs, second.code) == ("bash", True, False, "git clone URL\n")
    for fence, says in [("```\nx\n```", "must name python, bash or text"), ("```py\nx\n```", "found 'py'"),
                        ("```python fragmnt\nx\n```", "unknown option 'fragmnt'"),
                        ("```bash ranks=2\nx\n```", "are for python blocks"), ("```python\nx\n", "never closed"),
                        ("```bash quick\necho\n```", "must run a benchmark"),
                        ("```bash quick\npython benchmarks/a.py\nbash -c benchmarks/b.py\n```", "would run in full")]:
        page.write_text(fence + "\n")
        with pytest.raises(DocsFormatError, match=says):
            blocks_of(page, tmp_path)
