"""``ms-deepseek generate``: training checkpoints and run folders, tokenizer lookup, JSON output, errors.

Training checkpoints are written with the trainer's own ``CheckpointManager`` (model
tensors under the model's names, stacked experts), from the ``lite`` fixture's weights.
"""

import json
import os
import shutil
import string
import subprocess
import sys
from pathlib import Path

import mindspore as ms
import pytest

from repo_paths import FIXTURES, REPO

sys.path.insert(0, str(FIXTURES))
from load_reference import FIXTURES_DIR  # noqa: E402

from ms_deepseek import DeepseekV2ForCausalLM, cli  # noqa: E402
from ms_deepseek.checkpoint.training import (  # noqa: E402
    GENERATE,
    CheckpointManager,  # noqa: E402
    resolve_checkpoint,
)
from ms_deepseek.cli.generate import find_tokenizer, sample_text  # noqa: E402
from ms_deepseek.data.tokenizer import load_tokenizer  # noqa: E402
from ms_deepseek.generate import generate  # noqa: E402

LITE = FIXTURES_DIR / "lite"


def _char_tokenizer(path: Path) -> Path:
    """A character-level HF tokenizer.json (bos 0, eos 1), small enough for the lite vocabulary (256)."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<s>": 0, "</s>": 1}
    for c in string.ascii_lowercase + string.digits + " ():=,\n":
        vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<s>", "</s>"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def _save_step(manager: CheckpointManager, step: int, model, recipe_yaml: str = "data: {}\n") -> Path:
    tensors = {n: p for n, p in model.parameters_and_names() if not n.endswith("expert_placement")}
    return manager.save(
        step, tensors, {"global_step": ms.Tensor([step], ms.int32)}, model.config, {"step": step}, recipe_yaml
    )


@pytest.fixture(scope="module")
def lite_model():
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.runtime.launch_blocking()
    return DeepseekV2ForCausalLM.from_pretrained(LITE, show_progress=False)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, lite_model):
    """RUN_DIR with an older random-weight checkpoint (step 3), the lite weights at step 7, tokenizer.json."""
    root = tmp_path_factory.mktemp("run")
    manager = CheckpointManager(root / "checkpoints", keep_last=3)
    _save_step(manager, 3, DeepseekV2ForCausalLM(lite_model.config))
    _save_step(manager, 7, lite_model)
    _char_tokenizer(root / "tokenizer.json")
    return root


def _main(argv, capsys):
    rc = cli.main(["generate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_run_dir_text_prompt_json(run_dir, lite_model, capsys):
    rc, out, err = _main(
        [str(run_dir), "--prompt", "def f(x)", "--max-new-tokens", "6", "--ignore-eos", "--json"], capsys
    )
    assert rc == 0, err
    result = json.loads(out)
    tok = load_tokenizer(run_dir / "tokenizer.json")
    prompt = [tok.bos_id] + tok.encode("def f(x)")
    assert result["prompt_ids"] == prompt and len(result["ids"]) == len(prompt) + 6
    # The newest checkpoint (step 7) holds the lite weights: same ids as generating from the fixture directly.
    assert result["ids"] == generate(lite_model, prompt, 6, eos_ids=()).ids
    assert result["text"] == tok.decode(result["ids"]) and result["completion"] == tok.decode(result["new_ids"])
    cfg = lite_model.config
    assert result["cache"]["latent_bytes_per_token"] == cfg.num_hidden_layers * (cfg.kv_lora_rank + 8) * 4
    assert result["cache"]["full_kv_bytes_per_token"] > result["cache"]["latent_bytes_per_token"]
    assert result["use_cache"] is True and result["mode"] == "graph"  # the default: compiled decode step


def test_checkpoint_folder_and_prompt_ids(run_dir, lite_model, capsys):
    step7 = run_dir / "checkpoints" / "step_00000007"
    assert (
        resolve_checkpoint(run_dir, GENERATE) == step7
        and resolve_checkpoint(run_dir / "checkpoints", GENERATE) == step7
    )
    rc, out, err = _main(
        [str(step7), "--prompt-ids", "63,167,89,141,229", "--max-new-tokens", "4", "--ignore-eos", "--no-cache"], capsys
    )
    assert rc == 0, err
    ids = generate(lite_model, [63, 167, 89, 141, 229], 4, eos_ids=()).ids
    tok = load_tokenizer(run_dir / "tokenizer.json")
    assert out.strip() == tok.decode(ids).strip()  # the tokenizer two folders up decodes the text
    assert "no cache" in err


def test_sample_text_for_the_quickstart(run_dir):
    text = sample_text(run_dir, "def ", max_new_tokens=5)
    assert isinstance(text, str) and text.startswith("def ")


def test_tokenizer_from_recipe_data_section(tmp_path, lite_model):
    data = tmp_path / "prepared"
    _char_tokenizer(data / "tokenizer.json")
    manager = CheckpointManager(tmp_path / "deep" / "run" / "checkpoints")
    step = _save_step(manager, 1, lite_model, recipe_yaml=f"model: {{source: tiny}}\ndata:\n  path: {data}\n")
    tok = find_tokenizer(step)
    assert tok is not None and tok.files[0] == data / "tokenizer.json"
    explicit = _char_tokenizer(tmp_path / "other" / "tokenizer.json")
    assert find_tokenizer(step, str(explicit)).files[0] == explicit


@pytest.fixture
def bare_checkpoint(tmp_path):
    """The lite fixture copied where no tokenizer or recipe can be found above it."""
    folder = tmp_path / "a" / "b" / "ckpt"
    shutil.copytree(LITE, folder)
    return folder


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", "def "], "no tokenizer found for a text prompt"),
        (["--prompt-ids", "1,x"], "--prompt-ids '1,x': expected comma-separated integers"),
        (["--prompt-ids", "1,2,999"], "prompt token id 999 at position 2 is outside the model's vocabulary [0, 256)"),
        (["--prompt-ids", "1,2", "--repetition-penalty", "0"], "repetition penalty must be > 0"),
        (["--prompt-ids", "1,2", "--max-new-tokens", "4095"], "prompt length 2 + max_new_tokens 4095 = 4097 exceeds"),
        (["--prompt-ids", "1,2", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    ],
)
def test_cli_errors_are_one_line(bare_checkpoint, argv, message, capsys):
    rc, out, err = _main([str(bare_checkpoint), *argv], capsys)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ms-deepseek generate: error:"), err
    assert message in lines[0]


def test_cli_errors_for_paths(tmp_path, capsys):
    rc, _, err = _main([str(tmp_path / "missing"), "--prompt-ids", "1"], capsys)
    assert rc == 2 and "no such checkpoint folder" in err
    (tmp_path / "empty_run" / "checkpoints").mkdir(parents=True)
    rc, _, err = _main([str(tmp_path / "empty_run"), "--prompt-ids", "1"], capsys)
    assert rc == 2 and "no complete step_NNNNNNNN checkpoint" in err and len(err.strip().splitlines()) == 1


def _own_process(argv, cwd):
    """``ms-deepseek generate`` as a user runs it: its own process (where the compile cache is used)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLOG_v", "MS_SUBMODULE_LOG_v")}  # --verbose shows all
    env["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "ms_deepseek.cli", "generate", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_compile_cache_reused_across_processes_and_buckets(tmp_path, lite_model):
    """The first process compiles into the cache; a second one with another prompt length in the same buckets
    loads the same graphs (MindSpore says so with --verbose); a longer generation gets a folder of its own."""
    cache = tmp_path / "compiled"
    common = [str(LITE), "--ignore-eos", "--json", "--compile-cache", str(cache)]
    first, _ = _own_process([*common, "--prompt-ids", "63,167,89", "--max-new-tokens", "4"], tmp_path)
    folders = [p for p in (cache / ms.__version__).iterdir()]
    assert len(folders) == 1 and not folders[0].name.startswith("."), folders  # complete, renamed into place
    key = json.loads((folders[0] / "key.json").read_text())
    assert key["shapes"] == {"batch": 1, "prompt_rows": 0, "rows": 16, "penalty": False, "use_cache": True}
    assert list((folders[0] / "rank_0" / "graph_cache").glob("compile_cache_*.mindir"))
    second, err = _own_process(
        [*common, "--prompt-ids", "5,9,200,17,3", "--max-new-tokens", "6", "--verbose"], tmp_path
    )
    assert "Use the compilation cache" in err  # MindSpore loaded the graph instead of compiling it
    assert [p.name for p in (cache / ms.__version__).iterdir()] == [folders[0].name]
    assert first["mode"] == second["mode"] == "graph"
    assert first["ids"] == generate(lite_model, [63, 167, 89], 4, eos_ids=()).ids
    assert second["ids"] == generate(lite_model, [5, 9, 200, 17, 3], 6, eos_ids=()).ids
    _own_process([*common, "--prompt-ids", "63,167,89", "--max-new-tokens", "20"], tmp_path)  # 23 tokens: 32 rows
    assert len(list((cache / ms.__version__).iterdir())) == 2
