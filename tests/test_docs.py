"""The README and docs/ say what is true: their Python snippets run as written, their links resolve,
and the README's quick start is the command CI runs.

The ```python blocks of one Markdown file run in order in one namespace of their own (like a doctest
session: a later block sees what an earlier one defined), from the repository root, as a user
pasting them into ``python`` would. The pages share one fresh interpreter (and so one classic Spark session,
which each page's ``getOrCreate()`` returns), apart from the pages that start a Spark Connect session, which
PySpark refuses beside a classic one: each of those has an interpreter of its own. Files are found when the tests
are collected, so a page added to docs/ is covered without touching this file.
"""

import json
import os
import re
import sys
from pathlib import Path

import pytest
from process_groups import run_in_own_group

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_PER_FILE = 300  # seconds a page's snippets may take, on average, in their interpreter (start-up included)
PYTHON_FENCES = {"python", "py", "python3"}  # every spelling GitHub highlights as Python runs: no way around the test
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\((?P<target>[^)\s]+)\)")

# Runs in a fresh interpreter: reads {page: [[line, code], ...]} from the file named in argv[1] and, page by page,
# executes a page's blocks in a namespace of the page's own, each compiled at its own lines of the Markdown file so
# that tracebacks point there; a page stops at its first failing block, and the next page runs all the same.
RUNNER = """
import json, sys, traceback
for name, blocks in json.load(open(sys.argv[1])).items():
    namespace = {"__name__": "__main__"}
    for index, (line, code) in enumerate(blocks):
        print(f"\\n@@ sparkdl-docs: {name} block {index} starts", flush=True)  # its own line, after Spark's bar
        try:
            exec(compile("\\n" * (line - 1) + code, name, "exec"), namespace)
        except BaseException:
            traceback.print_exc()
            print(f"@@ sparkdl-docs: {name} block {index} failed", flush=True)
            break
    else:
        print(f"@@ sparkdl-docs: {name} passed", flush=True)
"""


def markdown_pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def fenced_blocks(text: str) -> list[tuple[int, str, str]]:
    """Every fenced code block as (line number of its first code line, info string, code), dedented by its fence's indent."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        i += 1
        if not opening:
            continue
        indent, fence, first = len(opening["indent"]), opening["fence"], i + 1
        body = []
        while i < len(lines) and not _closes(FENCE.match(lines[i]), fence):
            body.append(lines[i][indent:] if not lines[i][:indent].strip() else lines[i].lstrip())
            i += 1
        blocks.append((first, opening["info"].strip(), "\n".join(body) + "\n"))
        i += 1
    return blocks


def _closes(match, fence: str) -> bool:
    """A closing fence: the opening one's character, at least as long, no info string."""
    return (
        bool(match)
        and match["fence"][0] == fence[0]
        and len(match["fence"]) >= len(fence)
        and not match["info"].strip()
    )


def python_blocks(text: str) -> list[tuple[int, str]]:
    return [
        (line, code)
        for line, info, code in fenced_blocks(text)
        if info.split()[:1] and info.split()[0].lower() in PYTHON_FENCES
    ]


def pages_with_python() -> list[Path]:
    return [page for page in markdown_pages() if python_blocks(page.read_text())]


def test_fenced_blocks_are_extracted_as_written():
    text = "\n".join(
        [
            "intro",
            "```python",
            "a = 1",
            "```",
            "```bash",
            "echo no",
            "```",
            "- a list item:",
            "  ```py",
            "  if a:",
            "      b = 2",
            "  ```",
            "````python",
            "s = '''",
            "```",
            "'''",
            "````",
            "~~~text",
            "not python",
            "~~~",
        ]
    )
    assert python_blocks(text) == [(3, "a = 1\n"), (10, "if a:\n    b = 2\n"), (14, "s = '''\n```\n'''\n")]
    assert [info for _, info, _ in fenced_blocks(text)] == ["python", "bash", "py", "python", "text"]


def test_readme_opens_with_the_two_commands_ci_runs():
    """The first block of the README is the quick start: one command runs the main job, one the tests."""
    line, info, code = fenced_blocks((REPO / "README.md").read_text())[0]
    commands = code.strip().splitlines()
    assert info == "bash" and len(commands) == 2, f"README.md:{line}: expected two commands, got {commands}"
    job, tests = commands
    assert job.startswith("python3.11 -m venv .venv && ") and job.endswith("jobs/train.py"), job
    assert tests.startswith("python3.11 -m venv .venv && ") and "pytest" in tests, tests
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert ci_runs(job, ci), f".ci/run does not run the README's job command, one command a line: {job}"
    assert ci_runs(tests, ci), f".ci/run does not run the README's test command, one command a line: {tests}"
    slow = [
        code.strip()
        for _, info, code in fenced_blocks((REPO / "README.md").read_text())
        if info == "bash" and "-m slow" in code
    ]
    assert slow and ci_runs(slow[0], ci), f".ci/run does not run the README's command for the slow tests: {slow}"
    horovod = [
        code.strip()
        for _, info, code in fenced_blocks((REPO / "docs" / "horovod.md").read_text())
        if info == "bash" and "-m horovod" in code
    ]
    assert horovod and ci_runs(horovod[0], ci), f".ci/run does not run docs/horovod.md's test command: {horovod}"


def test_ci_installs_what_the_readme_says_the_slow_tests_need_before_running_them():
    """The README's install of what the emulated hosts' tests need (iptables) is what .ci/run runs, right before the
    slow tests."""
    installs = [
        code.strip()
        for _, info, code in fenced_blocks((REPO / "README.md").read_text())
        if info == "bash" and "apt-get install" in code
    ]
    assert len(installs) == 1 and "iptables" in installs[0], installs
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    steps = installs[0].split(" && ")
    slow = ci.index(".venv/bin/python -m pytest -q -m slow tests")
    assert ci[slow - len(steps) : slow] == steps, f".ci/run does not run {installs[0]!r} right before the slow tests"


def test_ci_runs_the_lint_checks_contributing_shows_before_the_tests():
    """CONTRIBUTING.md's check line (ruff, mypy) is what .ci/run runs, and it runs before the first test."""
    blocks = [code.strip() for _, info, code in fenced_blocks((REPO / "CONTRIBUTING.md").read_text()) if info == "bash"]
    assert blocks and "ruff check" in blocks[0] and "mypy" in blocks[0], blocks
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert ci_runs(blocks[0], ci), f".ci/run does not run CONTRIBUTING.md's checks, one command a line: {blocks[0]}"
    first_test = next(i for i, line in enumerate(ci) if "pytest" in line)
    assert ci_runs(blocks[0], ci[:first_test]), ".ci/run must run the checks before the tests"


def ci_runs(command: str, ci: list[str]) -> bool:
    """Whether ``ci`` (.ci/run's lines) runs ``command`` (the documents' ``a && b && c``) as consecutive lines a, b, c:
    a failure inside an ``&&`` list does not stop a ``set -e`` script (tests/test_ci.py)."""
    steps = command.split(" && ")
    return any(ci[i : i + len(steps)] == steps for i in range(len(ci)))


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda page: str(page.relative_to(REPO)))
def test_relative_links_resolve(page):
    """Links between the pages (and to files of the repository) point at files and headings that exist."""
    broken = []
    for match in LINK.finditer("\n".join(prose_lines(page.read_text()))):
        target = match["target"]
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        relative = file.relative_to(REPO).as_posix() if file.is_relative_to(REPO) else str(file)
        if not file.exists():
            broken.append(f"{target}: no file {relative}")
        elif anchor and file.suffix == ".md" and anchor not in heading_anchors(file.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {relative}")
    assert not broken, f"{page.relative_to(REPO)} has broken links:\n" + "\n".join(broken)


def heading_anchors(text: str) -> set[str]:
    """The anchors a code host gives the headings: lower case, punctuation dropped, each space a hyphen."""
    headings = [line.lstrip("#").strip() for line in prose_lines(text) if re.match(r"#{1,6} ", line)]
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, inside = [], None
    for line in text.splitlines():
        fence = FENCE.match(line)
        if inside is None and fence:
            inside = fence["fence"]
        elif inside is not None:
            inside = None if _closes(fence, inside) else inside
        else:
            lines.append(line)
    return lines


def starts_spark_connect(page: Path) -> bool:
    return any(".remote(" in code for _, code in python_blocks(page.read_text()))


@pytest.fixture(scope="module")
def snippet_runs(tmp_path_factory) -> dict[str, str]:
    """Every page's snippets run as described above; each page's output (Spark's and the blocks'), by page name."""
    pages = pages_with_python()
    groups = [[page for page in pages if not starts_spark_connect(page)]]
    groups += [[page] for page in pages if starts_spark_connect(page)]
    env = dict(
        os.environ,
        PYSPARK_PYTHON=sys.executable,
        SPARK_LOCAL_IP="127.0.0.1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    outputs = {}
    for number, group in enumerate(groups):
        directory = tmp_path_factory.mktemp(f"snippets-{number}")
        names = [str(page.relative_to(REPO)) for page in group]
        blocks = {name: python_blocks(page.read_text()) for name, page in zip(names, group)}
        (directory / "blocks.json").write_text(json.dumps(blocks))
        log = directory / "output.txt"
        returncode = run_in_own_group(
            [sys.executable, "-c", RUNNER, str(directory / "blocks.json")],
            cwd=REPO,
            env=env,
            log=log,
            timeout=TIMEOUT_PER_FILE * len(group),
        )
        output = log.read_text()
        for name in names:
            # a page's output runs from its first block's marker to the next page's (Spark's lines between included)
            start = output.find(f"@@ sparkdl-docs: {name} block 0 starts")
            later = [
                output.find(f"@@ sparkdl-docs: {other} block 0 starts") for other in names[names.index(name) + 1 :]
            ]
            end = min([i for i in later if i > start] or [len(output)])
            outputs[name] = output[start:end] if start >= 0 else ""
            if returncode is None:
                outputs[name] += f"\n@@ the interpreter did not finish within {TIMEOUT_PER_FILE * len(group)} s"
    return outputs


@pytest.mark.slow  # a Python process and Spark of their own: the slow command
@pytest.mark.timeout(TIMEOUT_PER_FILE * len(pages_with_python()))  # the first page's test waits for every page
@pytest.mark.parametrize("page", pages_with_python(), ids=lambda page: str(page.relative_to(REPO)))
def test_python_snippets_run(page, snippet_runs):
    name = str(page.relative_to(REPO))
    blocks = python_blocks(page.read_text())
    output = snippet_runs[name]
    if f"@@ sparkdl-docs: {name} passed" in output:
        return
    started = re.findall(rf"^@@ sparkdl-docs: {re.escape(name)} block (\d+) starts$", output, re.MULTILINE)
    line, code = blocks[int(started[-1]) if started else 0]
    if not started:
        why = "did not run"
    elif f"@@ sparkdl-docs: {name} block {started[-1]} failed" in output:
        why = "failed"
    else:
        why = "did not finish"
    pytest.fail(
        f"{name}: the ```python block at line {line} ({code.splitlines()[0]!r}) {why}; "
        f"its output (the last 4000 characters):\n{output[-4000:]}",
        pytrace=False,
    )


def _table_rows(page: str) -> dict[str, str]:
    """A Markdown page's table rows by their first cell's code name: ``| `name` | ...`` -> the whole row."""
    rows = re.finditer(r"^\| `([a-z_]+)` \|.*$", (REPO / page).read_text(), re.MULTILINE)
    return {row.group(1): row.group(0) for row in rows}


def test_the_prose_that_lists_modes_and_options_names_every_registered_one():
    """The guide's table of fit's arguments has a row for every option a mode declares and names every mode in its
    ``mode`` row; the modes page has a row for every mode; ``help(sparkdl.fit)`` lists every mode and option."""
    import sparkdl
    from sparkdl.modes.registry import MODES, declared_options

    guide = _table_rows("docs/guide.md")
    assert set(declared_options()) - set(guide) == set()
    assert [name for name in MODES if f'`"{name}"`' not in guide["mode"]] == []
    assert set(MODES) - set(_table_rows("docs/modes.md")) == set()
    assert [name for name in MODES if f'``"{name}"``: ' not in sparkdl.fit.__doc__] == []
    assert [name for name in declared_options() if f"\n        {name} (" not in sparkdl.fit.__doc__] == []
