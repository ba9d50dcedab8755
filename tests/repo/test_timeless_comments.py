"""The package's comments and docstrings say what the code does now, not what was measured last week.

Every comment (found with ``tokenize``) and docstring (found with ``ast``) of ``ms_deepseek/`` is read, and
fails on:

* a date (``2026-12-04``): history goes to the commit message, measurements to docs/measurements.md;
* a memory figure (``5.1 GiB``, ``1.68 GB``, ``481 MiB``): a measurement tied to a recipe, rank or depth is
  stale the day the code changes; it goes to docs/measurements.md, dated, with its command. A quoted size
  literal (``"5GB"``, the format a flag takes) and a bandwidth (``GB/s``) are not measurements;
* a citation of a design note that is not in the repository (``design.md``): cite the MindSpore / CANN
  source, a doc of this repository, or docs/measurements.md;
* a time figure (``31.5 s``, ``1-3 minutes``, ``0.6-0.7 s``): how long something took here is a measurement too.
  A log format's example (``| 62s``) is not;
* a before / now story (``before, SIGTERM left msrun running``, ``previously``, ``formerly``): the code says what
  it does; what it used to do is the commit message's.

The comments of ``recipes/*.yaml`` are held to the same three rules, except that a recipe quotes the
planner's figures (``N GB per NPU``: ``test_docs_figures.py`` checks each against ``plan``), so only
``GiB`` / ``MiB`` figures (MindSpore's accounting) fail there; ``tools/*.py`` to the date and design-note rules
(a tool's usage text gives sizes such as ``--size-gb 8``).

The comments and docstrings of ``tests/`` say the behaviour a test checks, so they fail on a citation of an issue
or of a defect by its number (``issue N``, ``issue #N``, ``issues N and M``, ``defect N``): the number says where a
test came from, which is the commit message's, and the reader of a failing test needs what it checks.
"""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from repo_paths import REPO

PACKAGE = REPO / "ms_deepseek"
RULES = {
    "a date": re.compile(r"\b(19|20)\d\d-\d\d-\d\d\b"),
    "a memory figure": re.compile(r"(?<![\"'\w.])\d+(?:\.\d+)?\s?(?:GiB|GB|MiB|TiB)(?![\w/])"),
    "a design note outside the repository": re.compile(r"\bdesign\.md\b|\bdesign note"),
    "a time figure": re.compile(
        r"(?<![\w.,])\d+(?:\.\d+)?(?:\s?-\s?\d+(?:\.\d+)?)?\s(?:s|ms|seconds|minutes)(?![-\w])"
    ),
    "a before / now story": re.compile(r"(?:^|[.;:(]\s*)(?:before|until now),\s|\b(?:previously|formerly)\b", re.I),
}


def comment_lines(source: str, joined: bool = True):
    """(line, text) of every comment and every line of every docstring of a module's source.

    A docstring is also given joined into one line (unless ``joined`` is false), so that a figure broken across two
    lines is seen."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node, clean=False)
        if doc is not None:
            start = node.body[0].lineno
            lines = doc.splitlines()
            yield from ((start + i, line) for i, line in enumerate(lines))
            if joined:
                yield start, " ".join(line.strip() for line in lines)


def offences(source: str):
    found = set()
    for lineno, text in comment_lines(source):
        for what, rule in RULES.items():
            m = rule.search(text)
            if m:
                found.add((lineno, what, m.group(0)))
    return sorted(found)


def test_the_rules_catch_what_they_guard_against():
    planted = '''"""Module.

Measured 2026-12-02 on rank 0: 5.1
GiB at 16 layers (design.md section 8)."""
X = 1  # level 1 held 481 MiB here
Y = "5GB"  # a size such as "5GB", 2 GB/s on the wire
Z = 2  # msrun exited 31.5 s after the kill
U = 4  # a compile takes ~1-3 minutes here
W = 3  # launch exits with 128 + the signal; before, SIGTERM left msrun running
T = 5  # formerly a bug
V = "| 62s"  # the log line ends with the run's seconds, e.g. "lr=1e-3 ms-deepseek"
'''
    got = {(what, text) for _, what, text in offences(planted)}
    assert ("a date", "2026-12-02") in got
    assert ("a memory figure", "5.1 GiB") in got  # across the docstring's line break
    assert ("a memory figure", "481 MiB") in got
    assert ("a design note outside the repository", "design.md") in got
    assert ("a time figure", "31.5 s") in got
    assert ("a time figure", "1-3 minutes") in got
    assert ("a before / now story", "; before, ") in got
    assert ("a before / now story", "formerly") in got
    assert not any("5GB" in text or "2 GB" in text for _, text in got), got
    assert not any(text in ("62s", "3 ms") for _, text in got), got


def modules():
    return sorted(PACKAGE.rglob("*.py"))


def test_the_package_has_modules():
    assert len(modules()) > 50


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_package_comments_are_timeless(path: Path):
    found = offences(path.read_text(encoding="utf-8"))
    assert not found, "\n".join(
        f"{path.relative_to(REPO)}:{line}: {what} in a comment or docstring ({text!r})" for line, what, text in found
    )


RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
MEASURED = re.compile(r"\d+(?:\.\d+)?\s?(?:GiB|MiB)\b")


def recipe_offences(text: str):
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        comment = line[line.index("#") :] if "#" in line else ""
        for what, rule in (("a date", RULES["a date"]), ("a MindSpore figure", MEASURED)):
            m = rule.search(comment)
            if m:
                found.append((lineno, what, m.group(0)))
        m = RULES["a design note outside the repository"].search(comment)
        if m:
            found.append((lineno, "a design note outside the repository", m.group(0)))
    return found


def test_recipe_rules_catch_a_planted_history():
    planted = "# Planner (planner of 2026-12-01): 46.6 GB per NPU; MindSpore: 9.94 GiB at 3 layers\nlora:\n  r: 16\n"
    assert {what for _, what, _ in recipe_offences(planted)} == {"a date", "a MindSpore figure"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_comments_are_timeless(path: Path):
    found = recipe_offences(path.read_text(encoding="utf-8"))
    assert not found, "\n".join(f"recipes/{path.name}:{line}: {what} ({text!r})" for line, what, text in found)


@pytest.mark.parametrize("path", sorted((REPO / "tools").glob("*.py")), ids=lambda p: p.name)
def test_tool_comments_have_no_dates_or_design_notes(path: Path):
    found = [o for o in offences(path.read_text(encoding="utf-8")) if o[1] != "a memory figure"]
    assert not found, "\n".join(f"tools/{path.name}:{line}: {what} ({text!r})" for line, what, text in found)


TESTS = REPO / "tests"
CITATION = re.compile(r"\b(?:issues?\s*#?\s*\d+|defect\s+\d+)", re.I)


def citations(source: str):
    """(line, text) of every issue or defect number cited in a comment or docstring of a test module's source.

    A citation broken across a docstring's lines is found in the joined docstring, at the docstring's first line."""

    def hits(joined):
        return {
            (n, " ".join(m.group(0).split()))
            for n, text in comment_lines(source, joined)
            for m in CITATION.finditer(text)
        }

    per_line = hits(False)
    return sorted(per_line | {hit for hit in hits(True) if hit[1] not in {text for _, text in per_line}})


def test_the_citation_rule_catches_issue_numbers():
    planted = '''"""Preemption (issue 21, defect 6): SIGTERM to train saves a checkpoint."""


def test_x():
    """Resume agreement, as in Issue #29 and
    issue
    47."""
    x = "issue 13"  # a string literal is not prose; but this comment cites issue 46
    y = 1  # issues 5 and 7 of the list
    z = 2  # an issue with the tokenizer, the bucket's issue size 4 MB
'''
    got = [text for _, text in citations(planted)]
    assert {"issue 21", "defect 6", "Issue #29", "issue 46", "issues 5"} <= set(got), got
    assert len(got) == len(set(got)), got  # a one-line citation is not reported again from the joined docstring
    assert got.count("issue 47") == 1, got  # across the docstring's line break, once
    assert "issue 13" not in got and not any("tokenizer" in t or "size" in t for t in got), got


def sources_of_tests():
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", sources_of_tests(), ids=lambda p: str(p.relative_to(TESTS)))
def test_test_comments_cite_no_issue_numbers(path: Path):
    found = citations(path.read_text(encoding="utf-8"))
    assert not found, "\n".join(
        f"{path.relative_to(REPO)}:{line}: an issue number in a comment or docstring ({text!r}); say what the test checks"
        for line, text in found
    )
