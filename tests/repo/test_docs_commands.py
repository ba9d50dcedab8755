"""The documented path runs as written.

1. Every ``ms-deepseek`` command in the fenced ``bash`` blocks of README.md and docs/*.md runs here, in a
   scratch folder holding the repository's recipes/, and exits 0. Not run: a block preceded by a
   ``<!-- ascend-only -->`` (or ``<!-- not-in-tests: why -->``) comment or whose first line is
   ``# ascend-only``. Documented substitutions, so the suite stays small:

   * ``ms-deepseek train ...`` gets ``TRAIN_FAST`` appended (2 steps, pynative, micro-batch 2: the
     same recipe, model and data, run briefly; a later ``--set`` wins over the doc's);
   * placeholders: ``RUN_DIR`` is a LoRA run of ``recipes/tiny-lora-cpu.yaml`` made the same way,
     ``step_N`` its checkpoint, ``BASE`` its base, ``OUT`` a fresh folder per command, ``PEFT_FOLDER``
     the first ``OUT`` an ``export-lora`` wrote, ``QBASE`` one scratch folder (a quantized base) and
     ``QLORA_RUN`` one scratch run folder (a QLoRA run).

2. The figures the docs and the recipes quote from ``plan`` are checked in ``test_docs_figures.py``.
"""

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from ms_deepseek.cli import main

from repo_paths import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TRAIN_FAST = [
    "--set",
    "train.steps=2",
    "--set",
    "train.mode=pynative",
    "--set",
    "train.micro_batch_size=2",
    "--set",
    "logging.log_interval=1",
    "--set",
    "train.eval_batches=1",
]
SKIP_MARK = re.compile(r"<!--\s*(ascend-only|not-in-tests)\b")


def bash_blocks(text: str):
    """(line number, body) of every ```bash block that is not marked as not run here."""
    out = []
    for m in re.finditer(r"^```bash\n(.*?)^```", text, re.S | re.M):
        before = text[: m.start()].rstrip().splitlines()[-1:] or [""]
        body = m.group(1)
        if SKIP_MARK.search(before[0]) or body.lstrip().startswith("# ascend-only"):
            continue
        out.append((text[: m.start()].count("\n") + 1, body))
    return out


def commands(body: str):
    """The ms-deepseek command lines of a block (continuations joined, trailing comments dropped)."""
    joined = re.sub(r"\\\n\s*", " ", body)
    out = []
    for line in joined.splitlines():
        line = re.split(r"\s#\s", line, maxsplit=1)[0].strip()
        if line.startswith("ms-deepseek "):
            out.append(shlex.split(line)[1:])
    return out


def documented_commands():
    cases = []
    for doc in DOCS:
        for lineno, body in bash_blocks(doc.read_text(encoding="utf-8")):
            for argv in commands(body):
                cases.append((f"{doc.relative_to(REPO)}:{lineno}", argv))
    return cases


def _run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    root = tmp_path_factory.mktemp("docs")
    (root / "recipes").symlink_to(REPO / "recipes")
    return root


class Placeholders:
    def __init__(self, root: Path):
        self.root, self.n, self.peft, self.lora_run = root, 0, None, None

    def run_dir(self):
        if self.lora_run is None:
            self.lora_run = self.root / "runs" / "docs-lora"
            code, _, err = _run(["train", "recipes/tiny-lora-cpu.yaml", "--output", self.lora_run, *TRAIN_FAST])
            assert code == 0, err
        return self.lora_run

    def apply(self, argv):
        out = []
        for word in argv:
            if "RUN_DIR" in word or "step_N" in word:
                word = word.replace("RUN_DIR", str(self.run_dir())).replace("step_N", "step_00000002")
            elif word == "BASE":
                word = str(self.run_dir() / "base")
            elif word == "OUT":
                self.n += 1
                word = str(self.root / f"out-{self.n}")
            elif "QLORA_RUN" in word:
                word = word.replace("QLORA_RUN", str(self.root / "runs" / "docs-qlora"))
            elif "QBASE" in word:  # also in --set model.source=QBASE
                word = word.replace("QBASE", str(self.root / "qbase"))
            elif word == "PEFT_FOLDER":
                assert self.peft is not None, "PEFT_FOLDER before any export-lora"
                word = self.peft
            out.append(word)
        if out[0] == "export-lora" and "--merge" not in out:
            self.peft = self.peft or out[2]
        if out[0] == "train":
            out += TRAIN_FAST
        return out


CASES = documented_commands()


def test_the_docs_hold_commands():
    assert len(CASES) >= 8 and {argv[0] for _, argv in CASES} >= {"train", "launch", "export-lora", "plan"}


@pytest.mark.slow
def test_every_documented_command_runs(scratch, monkeypatch):
    monkeypatch.chdir(scratch)
    monkeypatch.setenv("MS_DEEPSEEK_QUIET", "1")
    places = Placeholders(scratch)
    failures = []
    for where, argv in CASES:
        concrete = places.apply(argv)
        code, out, err = _run(concrete)
        if code != 0:
            failures.append(
                f"{where}: ms-deepseek {shlex.join(map(str, concrete))} -> exit {code}: "
                f"{(err.strip().splitlines() or [''])[-1]}"
            )
    assert not failures, "\n".join(failures)


def test_the_qlora_block_makes_what_it_reads():
    """docs/lora.md's QLoRA block: each placeholder it reads (such as BASE) is written by a command before it in
    the block, and the quantized base QBASE it makes is trained over (a train line with --set
    model.source=QBASE)."""
    text = (REPO / "docs" / "lora.md").read_text(encoding="utf-8")
    section = text[text.index("## A quantized frozen base (QLoRA)") :]
    _, body = bash_blocks(section)[0]
    made = set()
    for argv in commands(body):
        outputs = {
            "train": lambda a: [a[a.index("--output") + 1]],
            "convert": lambda a: [a[3]],
            "export-lora": lambda a: [a[2]],
        }[argv[0]](argv)
        inputs = [w.split("=", 1)[-1] for w in argv[1:] if w not in outputs]
        for word in inputs:
            root = word.split("/", 1)[0]
            if root.isupper() and root not in ("OUT",):
                assert root in made, f"{shlex.join(argv)}: reads {root}, which no earlier command of the block made"
        made.update(w.split("/", 1)[0] for w in outputs)
    assert "QBASE" in made
    assert any(argv[0] == "train" and "model.source=QBASE" in argv for argv in commands(body)), (
        "the quantized base is made but no train line uses it"
    )


def test_the_readme_gives_the_quickstart_time_it_takes():
    """The README says how long the quickstart takes ("a few minutes on two cores") and where the measured
    timings are; every timing docs/measurements.md gives in its "The quickstart" section is a few minutes, so the
    README's promise holds each measurement (a promise of "about two minutes" against a measured 3.3 fails)."""
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    m = re.search(
        r"tiny-cpu\.yaml` \([^)]*\) in a few minutes on two cores \(docs/measurements\.md, \"The quickstart\"", readme
    )
    assert m, "the README gives no time for the quickstart, or no pointer to its measurements"
    log = (REPO / "docs" / "measurements.md").read_text(encoding="utf-8")
    section = log[log.index("## The quickstart") :]
    section = section[: section.index("\n## ", 1)]
    minutes = [float(x) for x in re.findall(r"([\d.]+) minutes", section)] + [
        float(x) for x in re.findall(r"~([\d.]+) when", section)
    ]
    assert minutes, "docs/measurements.md's quickstart section gives no timing in minutes"
    assert all(1 <= x <= 6 for x in minutes), f"a quickstart timing outside 'a few minutes': {minutes}"
