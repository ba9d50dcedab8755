"""What a newcomer meets on the first runs, tried the way a user does.

One LoRA fine-tune of a small model on a small SFT folder (``ms-deepseek train`` in a fresh
process, its output redirected to a pipe as in a scheduler's log) gives the run the tests read:
the folder's format is taken from its meta.json, the start line names LoRA and the trained /
frozen parameter counts, a warmup longer than the run is warned about, no progress-bar frame
reaches the log, the first record keeps the compile out of tokens/s. ``generate --chat`` on the
run prompts with prepare-data's SFT template.
"""

import io
import json

import pytest

import builders


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bars_draw_only_on_a_terminal(monkeypatch):
    from ms_deepseek.core.progress import progress_bar

    monkeypatch.delenv("MS_DEEPSEEK_QUIET", raising=False)
    log, tty = io.StringIO(), _Terminal()
    for stream in (log, tty):
        with progress_bar(total=3, file=stream, desc="x") as bar:
            bar.update(3)
    assert log.getvalue() == ""  # a redirected log gets no \r frames
    assert "\r" in tty.getvalue()  # a terminal still gets its bar
    off = _Terminal()
    with progress_bar(total=3, file=off, enabled=False) as bar:
        bar.update(3)
    assert off.getvalue() == ""


# ----------------------------------------------------------------------------- small data folders
@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from ms_deepseek.data.prepare import prepare_data

    from data_helpers import make_byte_tokenizer, write_jsonl

    root = tmp_path_factory.mktemp("friction")
    make_byte_tokenizer(root / "tok")
    write_jsonl(root / "pt.jsonl", [{"text": f"doc {i:03d} " + "abcdefg"[: i % 7]} for i in range(60)])
    prepare_data([root / "pt.jsonl"], root / "pt", root / "tok", seq_len=16, progress=False)
    # 120 short conversations: a 1% hold-out is 2 samples, fewer than one micro-batch of 4
    write_jsonl(
        root / "sft.jsonl",
        [{"system": "be brief", "prompt": f"q{i:03d}?", "response": "r" * (1 + i % 9)} for i in range(120)],
    )
    prepare_data([root / "sft.jsonl"], root / "sft", root / "tok", seq_len=48, fmt="sft", progress=False)
    return root


def test_an_sft_folder_needs_no_data_format(folders):
    from ms_deepseek.config.data import DataConfig, DataSource
    from ms_deepseek.core.errors import UserError
    from ms_deepseek.data.dataset import build_train_dataset

    ds = build_train_dataset(DataConfig(path=str(folders / "sft"), num_workers=1), batch_size=2)
    assert ds.format == "sft" and ds.buckets  # read from meta.json: one conversation per sample, length buckets
    assert build_train_dataset(DataConfig(path=str(folders / "pt"), num_workers=1), batch_size=2).format == "pretrain"
    # an explicit format still wins, and a mismatch is one line naming the key and the folder's format
    with pytest.raises(
        UserError,
        match=r"^data.format: 'pretrain' but .*sft was prepared as 'sft' "
        r"\(leave data.format out to use the folder's\)$",
    ):
        build_train_dataset(DataConfig(path=str(folders / "sft"), format="pretrain", num_workers=1), batch_size=2)
    # two folders of different formats do not mix, format given or not
    mixed = DataConfig(path=[DataSource(str(folders / "sft")), DataSource(str(folders / "pt"))], num_workers=1)
    with pytest.raises(
        UserError,
        match=r"^data.path\[1\]: .*pt was prepared as 'pretrain', data.path\[0\] "
        r".*sft as 'sft'; all folders must share one format$",
    ):
        build_train_dataset(mixed, batch_size=2)
    with pytest.raises(UserError, match=r"^data.bucket_boundaries: only used with SFT data, and .*pt was prepared"):
        build_train_dataset(DataConfig(path=str(folders / "pt"), bucket_boundaries=[8], num_workers=1), batch_size=2)


# the small training recipes' model (tests/helpers/builders.py), with capacity buffers that drop nothing
SMALL_MODEL = {**builders.SMALL_MODEL, "capacity_factor": 2.0}


def sft_recipe(folders, **sections):
    """A LoRA fine-tune of a small random model on the SFT folder; no data.format (the folder has it)."""
    import yaml

    recipe = {
        "model": {"source": "tiny", "overrides": dict(SMALL_MODEL)},
        "data": {"path": str(folders / "sft"), "num_workers": 1},
        "train": {"steps": 3, "micro_batch_size": 4, "seed": 3},
        "optim": {"lr": 3e-3, "warmup_steps": 20, "schedule": "cosine", "min_lr": 3e-4},
        "checkpoint": {"save_interval": 0, "keep_last": 1},
        "logging": {"log_interval": 2, "tensorboard": False},
        "lora": {"r": 4, "target_modules": ["q_b_proj", "kv_b_proj", "o_proj"]},
    }
    for key, value in sections.items():
        recipe[key].update(value)
    path = folders / f"recipe-{len(list(folders.glob('recipe-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_a_too_small_hold_out_names_the_set_that_fixes_it(folders, tmp_path, capsys):
    import re

    from ms_deepseek import cli
    from ms_deepseek.config.recipe import load_recipe
    from ms_deepseek.data.validation import build_validation

    recipe = sft_recipe(folders, data={"validation": {"fraction": 0.01}})
    rc = cli.main(["train", str(recipe), "--output", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    # 120 samples, 1% held out: 2, fewer than one micro-batch of 4; 4 / 120 = 0.0333 -> 0.034
    assert "0.01 of the training data held out holds 2 samples, fewer than one batch per worker (4 x 1" in err
    fix = re.search(r"--set (data\.validation\.fraction=[0-9.]+)", err)
    assert fix and fix.group(1) == "data.validation.fraction=0.034", err
    assert "--set 'data.validation={path: DIR}'" in err
    # what the line says works: that fraction holds one batch out, and the folder form is a valid --set
    fixed = load_recipe(recipe, [fix.group(1)])
    assert build_validation(fixed.data, 4, 0, 1, 8).used_samples == 4
    assert load_recipe(recipe, [f"data.validation={{path: {folders / 'sft'}}}"]).data.validation.path == str(
        folders / "sft"
    )


def test_a_warmup_longer_than_the_run_is_one_warning_line(folders):
    from ms_deepseek.config.recipe import load_recipe, recipe_warnings

    recipe = sft_recipe(folders)
    assert recipe_warnings(load_recipe(recipe)) == [
        "optim.warmup_steps: 20 warmup steps but train.steps is 3: the learning rate never reaches optim.lr=0.003 "
        "(lower it, e.g. --set optim.warmup_steps=0)"
    ]
    assert recipe_warnings(load_recipe(recipe, ["train.steps=21"])) == []


def test_a_qlora_start_line_names_the_base_bits(folders):
    from ms_deepseek.config.recipe import load_recipe
    from ms_deepseek.train.lora_run import describe

    line = describe(load_recipe(sft_recipe(folders), ["quant.bits=4", "quant.group_size=8"]))
    assert line.startswith("LoRA r=4 alpha=16 on ") and line.endswith("frozen; int4 base, groups of 8"), line
    assert describe(load_recipe(sft_recipe(folders), ["quant.bits=8"])).endswith("; int8 base, per channel")


# ----------------------------------------------------------------------------- one LoRA SFT run
@pytest.fixture(scope="module")
def run(folders):
    """``ms-deepseek train`` in a fresh process, output to a pipe (not a terminal), as a scheduler logs it."""
    import os
    import subprocess
    import sys

    from repo_paths import REPO as repo

    env = {k: v for k, v in os.environ.items() if k != "MS_DEEPSEEK_QUIET"}
    env["PYTHONPATH"] = str(repo) + os.pathsep + env.get("PYTHONPATH", "")
    run_dir = folders / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "ms_deepseek.cli", "train", str(sft_recipe(folders)), "--output", str(run_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return run_dir, proc.returncode, proc.stdout + proc.stderr


def _numel(path):
    from ms_deepseek.checkpoint.safetensors_io import read_header

    total = 0
    for info in read_header(path).tensors.values():
        n = 1
        for d in info.shape:
            n *= d
        total += n
    return total


def test_an_sft_run_reads_its_format_and_says_it_is_lora(run):
    import re

    run_dir, rc, out = run
    assert rc == 0, out[-3000:]  # no --set data.format=sft: the folder's meta.json says it
    line = next((ln for ln in out.splitlines() if ln.startswith("LoRA ")), None)
    assert line is not None, out[-3000:]
    m = re.fullmatch(
        r"LoRA r=4 alpha=16 on (\d+) modules \(3 targets\): trains ([\d,]+) parameters "
        r"\(\d+\.\d\d%\), ([\d,]+) frozen",
        line,
    )
    assert m, line
    modules, trained, frozen = int(m.group(1)), int(m.group(2).replace(",", "")), int(m.group(3).replace(",", ""))
    assert modules == 2 * 3  # 2 layers x (q_b_proj, kv_b_proj, o_proj)
    # what the run saved: its checkpoint holds the trained tensors, RUN_DIR/base the frozen ones
    ckpt = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    assert trained == _numel(ckpt / "model.safetensors")
    assert frozen == _numel(run_dir / "base" / "model.safetensors")


def test_the_run_warns_about_its_warmup(run):
    _, rc, out = run
    assert rc == 0, out[-3000:]
    warnings = [ln for ln in out.splitlines() if ln.startswith("warning: ")]
    assert warnings == [
        "warning: optim.warmup_steps: 20 warmup steps but train.steps is 3: the learning rate "
        "never reaches optim.lr=0.003 (lower it, e.g. --set optim.warmup_steps=0)"
    ]


def test_the_run_writes_no_bar_frames_into_its_log(run):
    _, rc, out = run
    assert rc == 0, out[-3000:]
    assert "\r" not in out and "train:" not in out  # the output is a pipe: no progress-bar frames


def test_the_compile_is_out_of_tokens_per_s(run):
    run_dir, rc, out = run
    assert rc == 0, out[-3000:]
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 3]
    first, last = records
    assert first["compile_s"] > 0 and "compile_s" not in last
    # step 2's throughput alone (the compile step is excluded): faster than the compile step's own
    tokens_per_step = 4 * 48  # micro_batch_size x the one SFT length bucket these samples fill
    assert first["tokens_per_s"] > tokens_per_step / first["compile_s"]
    assert "compile " in next(ln for ln in out.splitlines() if ln.startswith("step 2/3"))


def test_generate_chat_prompts_as_prepare_data_encodes(run, folders, capsys):
    from ms_deepseek import cli
    from ms_deepseek.data.chat import IGNORE_INDEX

    from data_helpers import read_rows

    run_dir, rc, out = run
    assert rc == 0, out[-3000:]
    argv = ["generate", str(run_dir), "--max-new-tokens", "2", "--ignore-eos"]
    assert cli.main(argv + ["--chat", "--system", "be brief", "--prompt", "q007?", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    prompt = result["prompt_ids"]
    # the SFT row of that conversation: its untrained prefix (bos, system, user turn, "Assistant:") is the prompt
    rows = [r for r in read_rows(folders / "sft") if r["input_ids"][: len(prompt)].tolist() == prompt]
    assert len(rows) == 1
    labels = rows[0]["labels"]
    assert (labels[: len(prompt)] == IGNORE_INDEX).all() and labels[len(prompt)] != IGNORE_INDEX
    # --system without --chat: one line
    assert cli.main(argv + ["--system", "be brief", "--prompt", "q007?"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "ms-deepseek generate: error: --system: a system message is part of the chat template; add --chat"


def test_generate_writes_no_bar_frames_into_a_log(run, capsys):
    from ms_deepseek import cli

    run_dir, rc, out = run
    assert rc == 0, out[-3000:]
    assert cli.main(["generate", str(run_dir), "--max-new-tokens", "3", "--ignore-eos", "--prompt", "q"]) == 0
    captured = capsys.readouterr()
    assert "new tokens" in captured.err and "\r" not in captured.err + captured.out


def test_a_merged_folder_carries_the_runs_tokenizer(run, folders, capsys):
    """An `export-lora --merge` folder carries the run's tokenizer (a random base has none) and says so, and
    `generate` runs on it."""
    from ms_deepseek import cli

    run_dir, rc, out = run
    assert rc == 0, out[-3000:]
    merged = folders / "merged"
    assert cli.main(["export-lora", str(run_dir), str(merged), "--merge", str(run_dir / "base")]) == 0
    said = capsys.readouterr().out
    assert "with the run's tokenizer" in said and (merged / "tokenizer.json").is_file(), said
    assert cli.main(["generate", str(merged), "--max-new-tokens", "2", "--ignore-eos", "--prompt", "q"]) == 0
    assert "new tokens" in capsys.readouterr().err
