"""Every figure the docs and the recipes quote from the planner is what ``ms-deepseek plan`` prints now.

Where a planner figure is found (README.md, docs/*.md, the comments of recipes/*.yaml), and which ``plan``
command it belongs to:

* a table row: the ``plan ARGS`` of its ``<!-- plan ARGS -->`` marker, else ``plan --recipe recipes/R.yaml``
  when the row names one recipe ``R``; each cell under a column this test knows (``per NPU``, ``total``,
  ``tokens/s/NPU``, ``base weights``, ``adapters``, ... :data:`COLUMNS`) is compared;
* prose (a paragraph; a recipe's comment is one): ``N GB per NPU``, ``N GB by the planner``, ``of N GB
  usable``, ``LOW-HIGH tokens/s`` and ``MFU A%-B%`` belong to the nearest backquoted ``ms-deepseek plan ...``
  command or recipe name before them in the paragraph (in a recipe's comment, to the recipe itself when none);
* a ``bash`` block: the figures in the trailing comment of an ``ms-deepseek plan ...`` line are that line's.

A planner figure that belongs to no command fails too: a figure the test cannot check is one that goes
stale. A backquoted ``plan --compile`` / ``--simulate`` / ``--execute`` command is not the planner: figures
after it belong to nothing and fail (MindSpore's measurements go to docs/measurements.md, dated).

Not read: docs/measurements.md (a dated log: its figures are history, not claims about today).

``plan`` runs in-process (``ms_deepseek.cli.main``, ``--json``), once per distinct command.
"""

import contextlib
import functools
import io
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from ms_deepseek.cli import main

from repo_paths import REPO

DOCS = [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "measurements.md")]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
RECIPE_NAMES = sorted((p.stem for p in RECIPES), key=len, reverse=True)
NOT_READ: Dict[str, Tuple[str, ...]] = {}  # doc -> the sections (their headings) this test skips
NOT_PLANNER = ("--compile", "--simulate", "--execute", "--memory")


# ------------------------------------------------------------------ what plan prints
@functools.lru_cache(maxsize=None)
def plan(args: Tuple[str, ...]) -> Dict[str, object]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", *args, "--json"])
    assert code in (0, 1), f"ms-deepseek plan {shlex.join(args)}: exit {code}: {err.getvalue().strip()}"
    return json.loads(out.getvalue())


def headline(d) -> float:
    """The "FITS: X GB per NPU" figure: the training step or, when higher, the validation graph."""
    memory = d["memory_gb"]
    return max(memory["total"], memory.get("eval_total", 0.0))


def mem(*keys: str) -> Callable:
    return lambda d: sum(d["memory_gb"].get(k, 0.0) for k in keys)


GB = headline
RATE = "rate"  # a LOW-HIGH range: tokens_per_s_per_npu_range, in whole tokens
# table columns (header cell, lower case) -> the planner's figure
COLUMNS: Dict[str, object] = {
    "per npu": GB,
    "planner per npu": GB,
    "total": GB,
    "gb per npu": GB,
    "tokens/s/npu": RATE,
    "planner tokens/s/npu (low-high)": RATE,
    "base weights": mem("weights"),
    "weights": mem("weights"),
    "casts": mem("weight_copies"),
    "scales": mem("scales"),
    "dequant.": mem("dequant_workspace"),
    "adapters": mem("gradients", "optimizer"),
    "activations": mem("activations"),
    "working set": mem("working_set"),
    "buffers": mem("comm_buffers", "hccl_buffers", "workspace"),
}
PROSE = [  # (pattern, what) in prose and comments
    (re.compile(r"(\d+\.\d) GB per NPU"), GB),
    (re.compile(r"(\d+\.\d) GB by the planner"), GB),
    (re.compile(r"of (\d+\.\d) GB usable"), lambda d: d["memory_gb"]["usable"]),
    (re.compile(r"(\d+)-(\d+) tokens/s"), RATE),
    (re.compile(r"MFU (\d+\.\d)%-(\d+\.\d)%"), "mfu"),
    # traffic per NPU per step, per kind, and its ratio to the layout's minimum
    *(
        (re.compile(rf"{kind} (\d+\.\d) GB"), lambda d, kind=kind: d["communication_gb_per_step"][kind])
        for kind in ("tp_allreduce", "ep_alltoall", "dp_sync", "pp_p2p")
    ),
    (
        re.compile(r"(\d+\.\d+) x the layout's minimum"),
        lambda d: sum(d["communication_gb_per_step"].values()) / sum(d["communication_minimum_gb_per_step"].values()),
    ),
]


@dataclass
class Quote:
    where: str
    text: str  # the figure as quoted
    args: Optional[Tuple[str, ...]]  # the plan command it belongs to (None: none)
    what: object
    numbers: Tuple[str, ...]


def recipe_args(name: str) -> Tuple[str, ...]:
    return ("--recipe", str(REPO / "recipes" / f"{name}.yaml"))


def command_args(cmd: str) -> Optional[Tuple[str, ...]]:
    """``plan ARGS`` of a quoted command, recipes/ paths made absolute; None if not the planner."""
    words = [w for w in shlex.split(cmd) if w != "..."]
    if any(w in NOT_PLANNER for w in words):
        return None
    return tuple(str(REPO / w) if w.startswith("recipes/") else w for w in words)


def check(q: Quote) -> Optional[str]:
    """None when the quote is what plan prints, else the failure."""
    if q.args is None:
        return f"{q.where}: {q.text!r} is a planner figure that belongs to no `ms-deepseek plan` command"
    d = plan(q.args)
    cmd = "ms-deepseek plan " + shlex.join(a.replace(str(REPO) + "/", "") for a in q.args)
    if q.what is RATE:
        got = tuple(str(round(x)) for x in d["tokens_per_s_per_npu_range"])
        want = q.numbers
    elif q.what == "mfu":
        got = tuple(f"{x * 100:.1f}" for x in d["mfu_range"])
        want = q.numbers
    else:
        decimals = len(q.numbers[0].partition(".")[2])
        got = (f"{q.what(d):.{decimals}f}",)
        want = q.numbers
    if got != want:
        return f"{q.where}: quotes {q.text!r}, `{cmd}` prints {'-'.join(got)}"
    return None


# ------------------------------------------------------------------ where the figures are
def sections(rel: str, text: str):
    """(first line number, lines) of each section of a doc that this test reads."""
    skip = NOT_READ.get(rel, ())
    out, start, lines, reading = [], 1, [], True
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.startswith("## "):
            if reading:
                out.append((start, lines))
            start, lines, reading = lineno, [], not line.startswith(skip)
        lines.append(line)
    if reading:
        out.append((start, lines))
    return out


def recipes_named(text: str) -> List[Tuple[int, str]]:
    """(position, name) of each recipe the text names, longest name first where two overlap."""
    found, taken = [], set()
    for name in RECIPE_NAMES:
        for m in re.finditer(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text):
            if not taken & set(range(m.start(), m.end())):
                taken |= set(range(m.start(), m.end()))
                found.append((m.start(), name))
    return sorted(found)


def anchors(text: str) -> List[Tuple[int, Optional[Tuple[str, ...]]]]:
    """(position, plan args) of each recipe name and backquoted plan command in the text."""
    out = [(pos, recipe_args(name)) for pos, name in recipes_named(text)]
    for m in re.finditer(r"`ms-deepseek plan ([^`]*)`", text):
        out.append((m.start(), command_args(m.group(1))))
    # a recipe path inside a command is the command's, not an anchor of its own
    commands = [(m.start(), m.end()) for m in re.finditer(r"`ms-deepseek plan [^`]*`", text)]
    out = [(p, a) for p, a in out if not any(s < p < e for s, e in commands)]
    return sorted(out, key=lambda x: x[0])


def prose_quotes(where: str, text: str, default: Optional[Tuple[str, ...]] = None) -> List[Quote]:
    marks = anchors(text)
    quotes = []
    for pattern, what in PROSE:
        for m in pattern.finditer(text):
            before = [a for p, a in marks if p < m.start()]
            args = before[-1] if before else default
            quotes.append(Quote(where, m.group(0), args, what, m.groups()))
    return quotes


def table_quotes(where: str, header: str, row: str) -> List[Quote]:
    names = [c.strip().lower() for c in header.strip().strip("|").split("|")]
    marker = re.search(r"<!--\s*plan\s+(.*?)\s*-->", row)
    body = row[: marker.start()] if marker else row
    cells = [c.strip() for c in body.strip().strip("|").split("|")]
    if marker:
        args = command_args(marker.group(1))
    else:
        named = {name for _, name in recipes_named(body)}
        args = recipe_args(named.pop()) if len(named) == 1 else None
    quotes = []
    for name, cell in zip(names, cells):
        what = COLUMNS.get(name)
        if what is None:
            continue
        if what is RATE:
            m = re.search(r"(\d+)-(\d+)", cell)
        else:
            m = re.search(r"(\d+\.\d+)", cell)
        if m:
            quotes.append(Quote(f"{where} ({name})", m.group(0), args, what, m.groups()))
    return quotes


def doc_quotes(rel: str, text: str) -> List[Quote]:
    """The planner figures of one doc (``rel``: its path in the repository, for the report)."""
    quotes = []
    for start, lines in sections(rel, text):
        paragraph, para_line, in_code, code_lang, i = [], start, False, "", 0
        blocks = []  # (line, kind, payload)
        while i < len(lines):
            line, lineno = lines[i], start + i
            if line.startswith("```"):
                if not in_code:
                    in_code, code_lang = True, line[3:].strip()
                else:
                    in_code = False
                i += 1
                continue
            if in_code:
                if code_lang == "bash":
                    m = re.match(r"\s*ms-deepseek plan (.*?)\s+#\s(.*)$", line)
                    if m:
                        blocks.append((lineno, "bash", (command_args(m.group(1)), m.group(2))))
                i += 1
                continue
            if line.lstrip().startswith("|"):
                header = line
                j = i + 2 if i + 1 < len(lines) and re.match(r"\s*\|[-| :]+\|?\s*$", lines[i + 1]) else i + 1
                while j < len(lines) and lines[j].lstrip().startswith("|"):
                    blocks.append((start + j, "row", (header, lines[j])))
                    j += 1
                i = j
                continue
            if line.strip():
                if not paragraph:
                    para_line = lineno
                paragraph.append(line)
            elif paragraph:
                blocks.append((para_line, "prose", " ".join(paragraph)))
                paragraph = []
            i += 1
        if paragraph:
            blocks.append((para_line, "prose", " ".join(paragraph)))
        for lineno, kind, payload in blocks:
            where = f"{rel}:{lineno}"
            if kind == "prose":
                quotes += prose_quotes(where, payload)
            elif kind == "row":
                quotes += table_quotes(where, *payload)
            else:
                args, comment = payload
                for q in prose_quotes(where, comment):
                    q.args = args
                    quotes.append(q)
    return quotes


def recipe_quotes(recipe: Path) -> List[Quote]:
    comment = " ".join(
        line.strip()[1:].strip() for line in recipe.read_text(encoding="utf-8").splitlines() if line.startswith("#")
    )
    return prose_quotes(f"recipes/{recipe.name}", comment, default=recipe_args(recipe.stem))


def all_quotes() -> List[Quote]:
    out = []
    for doc in DOCS:
        out += doc_quotes(str(doc.relative_to(REPO)), doc.read_text(encoding="utf-8"))
    for recipe in RECIPES:
        out += recipe_quotes(recipe)
    return out


QUOTES = all_quotes()


# ------------------------------------------------------------------ the tests
def test_the_docs_quote_planner_figures():
    assert len(QUOTES) >= 40
    assert {q.where.split(":")[0].split(" ")[0] for q in QUOTES} >= {"README.md", "docs/planner.md", "docs/lora.md"}
    assert sum(q.where.startswith("recipes/") for q in QUOTES) >= 2 * sum("npu" in r.stem for r in RECIPES)


def test_every_quoted_planner_figure_is_what_plan_prints():
    failures = [f for f in map(check, QUOTES) if f]
    assert not failures, "\n".join(failures)


PLANTED_DOC = """# A doc

| recipe | per NPU | tokens/s/NPU |
|---|---|---|
| `v2-qlora-8npu` | 42.2 GB | 224-624 |

`recipes/v2-lite-lora-1npu.yaml` needs 42.2 GB per NPU by the planner, and
`ms-deepseek plan --recipe recipes/v2-qlora-8npu.yaml` prints 46.6 GB per NPU of 61.0 GB usable.

A planner figure of nothing: 44.6 GB by the planner.

```bash
ms-deepseek plan --recipe recipes/v2-qlora-8npu.yaml              # FITS: 42.2 GB per NPU of 61.0
```
"""


def test_planted_stale_figures_fail():
    """Stale figures planted in a doc (42.2 GB for v2-qlora-8npu in a table row, in prose,
    in a plan line's comment; 42.2 for v2-lite-lora-1npu): each fails naming what plan prints; the figures
    that are right pass; a figure without a command fails."""
    verdicts = {(q.where.split(" ")[0], q.text): check(q) for q in doc_quotes("planted.md", PLANTED_DOC)}
    assert "46.6" in verdicts[("planted.md:5", "42.2")]  # the table row
    assert verdicts[("planted.md:5", "224-624")] is None
    assert "45.6" in verdicts[("planted.md:7", "42.2 GB per NPU")]
    assert verdicts[("planted.md:7", "46.6 GB per NPU")] is None
    assert verdicts[("planted.md:7", "of 61.0 GB usable")] is None
    assert "belongs to no" in verdicts[("planted.md:10", "44.6 GB by the planner")]
    assert "46.6" in verdicts[("planted.md:13", "42.2 GB per NPU")]


def test_a_figure_after_a_compile_command_belongs_to_no_plan():
    text = "`ms-deepseek plan --recipe recipes/v2-qlora-8npu.yaml --compile --memory`: 44.6 GB by the planner"
    (quote,) = prose_quotes("x", text)
    assert quote.args is None and "belongs to no" in check(quote)


def test_a_recipe_comment_without_a_command_is_the_recipe_s():
    (quote,) = prose_quotes(
        "recipes/v2-qlora-8npu.yaml", "FITS at 46.6 GB per NPU", default=recipe_args("v2-qlora-8npu")
    )
    assert check(quote) is None
