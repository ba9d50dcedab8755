"""``ms-deepseek generate PATH``: generate from a checkpoint with the latent KV cache.

PATH is a HuggingFace folder, a converted ms_deepseek folder, a training checkpoint
(``RUN_DIR/checkpoints/step_N/``) or a run folder (its newest complete checkpoint).
The prompt is text (``--prompt``, through the checkpoint's tokenizer, bos first when the
tokenizer has one, as in training) or ids (``--prompt-ids 1,2,3``). ``--chat`` puts the text
in the chat template as one user turn (after ``--system TEXT``, a system message) followed by
the assistant prefix: the ids ``prepare-data --format sft`` gives that conversation up to the
reply (:func:`ms_deepseek.data.chat.encode_chat`), so a chat fine-tune is prompted as it was trained.

The tokenizer is ``--tokenizer``, else ``tokenizer.json`` / ``tokenizer.model`` in the
checkpoint folder or the two folders above it (a run folder), else the tokenizer of the
data named by the checkpoint's ``recipe.yaml`` (``data.tokenizer``, ``data.path``, or the
embedded default corpus, which is rebuilt in the cache if it was deleted since training).

``--mode graph`` (default) decodes through compiled graphs: the decode step (a prompt of up to
64 tokens goes through it token by token) and, for a longer prompt, a prefill padded to a bucket
(128, 256, ... tokens), with the latent cache sized to one (16, 32, 64, ... rows;
:func:`ms_deepseek.generate.graph_shapes`), so another prompt or ``--max-new-tokens`` in the same
buckets runs the same graphs. Their compile is paid once per machine: MindSpore's
compile cache (``MS_COMPILER_CACHE_ENABLE`` / ``MS_COMPILER_CACHE_PATH``) keeps them in
``$MS_DEEPSEEK_CACHE/compiled/`` (``~/.cache/ms_deepseek/compiled/``), one folder per key
(:func:`compile_cache_key`). MindSpore indexes a cache folder's graphs by the order in which the
process compiled them and checks only the hash of the entry script, not the shapes or the
package's code (``compile_cache_manager.cc``: ``compile_cache_<N>.mindir``, ``CheckDepFilesHashConsistency``):
hence one folder per sequence of graphs, keyed by everything that shapes them, written under a
private name and renamed into place complete, and used only by a process that runs this one
command (``ms-deepseek generate``, ``python -m ms_deepseek.cli generate``; not ``cli.main([...])``
called in a process that may have compiled other graphs). ``--mode pynative`` runs op by op with
no compile.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import List, Optional

from ms_deepseek.core.errors import UserError
from ms_deepseek.core.safe_io import yaml_load

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="checkpoint folder (HuggingFace, ms_deepseek, training step_N) or a run folder")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs a tokenizer)")
    src.add_argument("--prompt-ids", help="prompt token ids, comma separated, e.g. 1,2,3")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="wrap --prompt in the chat template (one user turn, then the assistant prefix), as "
        "prepare-data --format sft renders conversations",
    )
    parser.add_argument("--system", metavar="TEXT", help="with --chat: a system message before the user turn")
    parser.add_argument("--tokenizer", help="tokenizer file or folder (default: found next to the checkpoint)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    parser.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="HuggingFace rule; 1 = off")
    parser.add_argument(
        "--no-cache", action="store_true", help="recompute the full forward for every token (reference path, slow)"
    )
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at the config's eos ids")
    parser.add_argument("--no-bos", action="store_true", help="do not put the tokenizer's bos id before --prompt")
    parser.add_argument(
        "--mode",
        choices=("graph", "pynative"),
        default="graph",
        help="graph (default): decode through compiled graphs (the decode step, which also reads a prompt of up "
        "to 64 tokens; a longer prompt's prefill padded to 128, 256... tokens; the latent cache sized to 16, 32, "
        "64... rows, so nearby lengths share them), compiled once per machine and kept in MindSpore's compile "
        "cache under "
        "$MS_DEEPSEEK_CACHE/compiled/ (default ~/.cache/ms_deepseek/compiled/; one folder per MindSpore "
        "version, package code, model shape and bucket; delete the folder to clear it); "
        "pynative: op by op, no compile, slower per token",
    )
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument(
        "--compile-cache",
        metavar="DIR",
        help="graph mode: keep the compiled graphs in DIR instead of $MS_DEEPSEEK_CACHE/compiled/ (the cache "
        "serves the command run as its own process, not cli.main() called from Python)",
    )
    cache.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="graph mode without MindSpore's compile cache: compile in this process, read and write nothing",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object (ids, text, cache figures)")


# ------------------------------------------------------------------ locating things
def find_tokenizer(checkpoint: Path, explicit: Optional[str] = None):
    """The tokenizer for ``checkpoint`` (see the module docstring for the search order), or None."""
    from ms_deepseek.data.tokenizer import load_tokenizer

    if explicit:
        return load_tokenizer(explicit)
    folders = [checkpoint, *list(checkpoint.resolve().parents)[:2]]
    for folder in folders:
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                return load_tokenizer(folder / name)
    for folder in folders:
        if (folder / "recipe.yaml").is_file():
            return _recipe_tokenizer(folder / "recipe.yaml")
    return None


def _recipe_tokenizer(recipe_path: Path):
    """The tokenizer of the data a training run used, from its recipe.yaml."""
    import yaml

    from ms_deepseek.config.data import DataConfig
    from ms_deepseek.core.schema import from_dict
    from ms_deepseek.data.tokenizer import load_tokenizer

    try:
        recipe = yaml_load(recipe_path.read_text(encoding="utf-8"), recipe_path) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"{recipe_path}: unreadable recipe ({str(exc).splitlines()[0]})") from None
    section = recipe.get("data") if isinstance(recipe, dict) else None
    try:
        data = from_dict(DataConfig, section or {}, "data")
    except UserError as exc:
        raise UserError(f"{recipe_path}: {exc}") from None
    if data.tokenizer:
        return load_tokenizer(data.tokenizer)
    if data.path:
        folder = Path(data.primary_path).expanduser()
        if not folder.is_dir():
            return None
        return load_tokenizer(folder)
    if data.embedded_default:
        from ms_deepseek.data.sources import resolve_data_dir

        return load_tokenizer(resolve_data_dir(data, progress=False))  # built once, cached
    return None


def parse_prompt_ids(text: str) -> List[int]:
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise UserError(f"--prompt-ids {text!r}: expected comma-separated integers, e.g. 1,2,3")
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise UserError(f"--prompt-ids {text!r}: expected comma-separated integers, e.g. 1,2,3") from None


# ------------------------------------------------------------------ entry points
def generate_from_checkpoint(
    path,
    prompt: Optional[str] = None,
    prompt_ids: Optional[List[int]] = None,
    *,
    tokenizer: Optional[str] = None,
    max_new_tokens: int = 64,
    add_bos: bool = True,
    ignore_eos: bool = False,
    chat: bool = False,
    system: Optional[str] = None,
    compile_cache=None,
    **kwargs,
):
    """Load a checkpoint (or a run's newest) and generate; returns a GenerationResult with ``text`` filled
    when a tokenizer was found. ``chat``: the prompt as one user turn of the chat template (after a
    ``system`` message when given). ``compile_cache``: a folder for MindSpore's compile cache (graph mode;
    :class:`CompileCache`; it must be this process's first compile). ``kwargs`` go to
    :func:`ms_deepseek.generate.generate`."""
    from ms_deepseek.generate import check_length, check_prompts, generate

    _check_request(prompt, prompt_ids, chat, system, kwargs)  # fail before loading anything
    from ms_deepseek.checkpoint.training import GENERATE, resolve_checkpoint

    folder = resolve_checkpoint(path, GENERATE)
    from ms_deepseek.config.model import DeepseekV2Config

    cfg = DeepseekV2Config.from_json(folder / "config.json")
    from ms_deepseek.core.runtime import allow_graph_depth

    allow_graph_depth(cfg.num_hidden_layers)  # the decoding graphs nest with depth too (the training step: ~16)
    tok = find_tokenizer(folder, tokenizer)
    if prompt is not None:
        prompt_ids = _encode_prompt(folder, tok, cfg, prompt, chat=chat, system=system, add_bos=add_bos)
    check_prompts([prompt_ids], cfg.vocab_size)  # everything the call can check, before the weights are read
    check_length(len(prompt_ids), max_new_tokens, cfg)
    model = _load_model(folder, kwargs.get("progress", False))
    cache = None
    if compile_cache is not None:
        from ms_deepseek.generate import graph_shapes

        shapes = graph_shapes(cfg, 1, len(prompt_ids), max_new_tokens)
        shapes.update(penalty=kwargs.get("repetition_penalty", 1.0) != 1.0, use_cache=kwargs.get("use_cache", True))
        cache = CompileCache(Path(compile_cache), model, shapes)
    try:
        result = generate(model, prompt_ids, max_new_tokens, eos_ids=() if ignore_eos else None, **kwargs)
        if cache is not None:
            cache.commit()
    finally:
        if cache is not None:
            cache.close()
    if tok is not None:
        result.text = tok.decode(result.ids)
        result.completion = tok.decode(result.new_ids)
    return result


def _check_request(prompt, prompt_ids, chat: bool, system: Optional[str], kwargs) -> None:
    """The prompt options and the sampling settings, checked before anything is loaded."""
    from ms_deepseek.generate import check_sampling

    if (prompt is None) == (prompt_ids is None):
        raise UserError("give exactly one of a text prompt or prompt ids")
    if system is not None and not chat:
        raise UserError("--system: a system message is part of the chat template; add --chat")
    if chat and prompt is None:
        raise UserError("--chat: the template wraps text; give --prompt TEXT (--prompt-ids are used as given)")
    check_sampling(
        kwargs.get("temperature", 0.0),
        kwargs.get("top_k", 0),
        kwargs.get("top_p", 1.0),
        kwargs.get("repetition_penalty", 1.0),
    )


def _encode_prompt(folder: Path, tok, cfg, prompt: str, *, chat: bool, system: Optional[str], add_bos: bool):
    """The token ids of a text prompt (as one chat turn with ``chat``), by the checkpoint's tokenizer."""
    if tok is None:
        raise UserError(
            f"{folder}: no tokenizer found for a text prompt (no tokenizer.json / tokenizer.model "
            f"here or in the folders above, no recipe.yaml naming one); pass --tokenizer PATH "
            f"or use --prompt-ids"
        )
    if tok.vocab_size > cfg.vocab_size:
        raise UserError(
            f"tokenizer {tok.files[0]}: {tok.vocab_size} tokens, more than the model's vocab_size "
            f"{cfg.vocab_size} (wrong tokenizer for this checkpoint?)"
        )
    prompt_ids = _chat_ids(tok, prompt, system, add_bos) if chat else tok.encode(prompt, add_bos=add_bos)
    if not prompt_ids:
        raise UserError("--prompt: the text encodes to no tokens")
    return prompt_ids


def _load_model(folder: Path, progress: bool):
    from ms_deepseek import DeepseekV2ForCausalLM
    from ms_deepseek.checkpoint.opener import open_checkpoint

    if open_checkpoint(folder).lora is not None:  # a LoRA run: its base with the checkpoint's adapters
        from ms_deepseek.model.lora_export import model_with_adapters

        return model_with_adapters(folder, show_progress=progress)
    return DeepseekV2ForCausalLM.from_pretrained(folder, show_progress=progress)


# ------------------------------------------------------------------ compile cache
COMPILED = "compiled"


def default_compile_cache() -> Path:
    """``$MS_DEEPSEEK_CACHE/compiled`` (``~/.cache/ms_deepseek/compiled``)."""
    from ms_deepseek.data.sources import default_cache_dir

    return default_cache_dir() / COMPILED


def source_digest() -> str:
    """sha256 of every file of the installed package (its kernel sources included): MindSpore's own check
    skips modules on sys.path, so a changed model file would otherwise load a stale graph."""
    import ms_deepseek

    root = Path(ms_deepseek.__file__).resolve().parent
    digest = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root, followlinks=True)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if not name.endswith(".pyc"):
                path = Path(folder) / name
                digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _file_digest(path: str) -> str:
    """``path`` and the sha256 of its bytes (MindSpore checks the entry script's content)."""
    try:
        return f"{path} {hashlib.sha256(Path(path).read_bytes()).hexdigest()}"
    except OSError:
        return path


def compile_cache_key(model, shapes: dict) -> dict:
    """What the compiled graphs of a generation depend on: MindSpore's version and device, this package's
    code, the entry script (MindSpore's own check), the model's config and parameters (names, shapes,
    dtypes; LoRA and quantised models differ here), the mode and ``shapes`` (batch, buckets, penalty)."""
    from dataclasses import asdict

    import mindspore as ms

    import ms_deepseek

    params = [(p.name, tuple(p.shape), str(p.dtype)) for p in model.get_parameters()]
    return {
        "mindspore": ms.__version__,
        "ms_deepseek": ms_deepseek.__version__,
        "device": str(ms.get_context("device_target")),
        "mode": "graph",
        "sources": source_digest(),
        "entry_script": _file_digest(os.path.realpath(sys.argv[0])),
        "config": hashlib.sha256(json.dumps(asdict(model.config), sort_keys=True, default=str).encode()).hexdigest(),
        "parameters": hashlib.sha256(json.dumps(params).encode()).hexdigest(),
        "shapes": shapes,
    }


class CompileCache:
    """MindSpore's compile cache for this process, in ``root/<mindspore version>/<key>/``.

    A complete folder is read (MindSpore loads its graphs and skips the front-end compile); otherwise the
    graphs are written into a private ``.partial-<pid>`` sibling and :meth:`commit` renames it into place
    after the generation (a process that loses the race drops its copy). MindSpore reads the path once per
    process, at its first compile (``GetCompileCacheDir`` keeps it in a static): call this before any."""

    def __init__(self, root: Path, model, shapes: dict):
        import mindspore as ms

        key = compile_cache_key(model, shapes)
        name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        self.folder = root / ms.__version__ / name
        self.hit = (self.folder / "key.json").is_file()
        self.work = self.folder if self.hit else self.folder.with_name(f".{name}.partial-{os.getpid()}")
        if not self.hit:
            try:
                shutil.rmtree(self.work, ignore_errors=True)
                self.work.mkdir(parents=True)
                (self.work / "key.json").write_text(json.dumps(key, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            except OSError as exc:
                raise UserError(
                    f"compile cache {root}: cannot write there ({exc.strerror}); pass --compile-cache DIR or "
                    f"--no-compile-cache"
                ) from None
        os.environ["MS_COMPILER_CACHE_ENABLE"] = "1"
        os.environ["MS_COMPILER_CACHE_PATH"] = str(self.work)

    def commit(self) -> None:
        """Install the graphs this process compiled (no-op on a hit)."""
        if self.hit:
            return
        from ms_deepseek.core.atomic import fsync_tree

        fsync_tree(self.work)
        try:
            os.rename(self.work, self.folder)
        except OSError:  # another process installed the same key first
            shutil.rmtree(self.work, ignore_errors=True)
        self.hit = True

    def close(self) -> None:
        """Compile nothing more into the cache (MindSpore reads MS_COMPILER_CACHE_ENABLE at each compile); a
        private folder left by a failed generation is removed."""
        os.environ.pop("MS_COMPILER_CACHE_ENABLE", None)
        os.environ.pop("MS_COMPILER_CACHE_PATH", None)
        if not self.hit:
            shutil.rmtree(self.work, ignore_errors=True)


def _chat_ids(tok, prompt: str, system: Optional[str], add_bos: bool) -> List[int]:
    """One user turn (after a system message) and the assistant prefix, as prepare-data's SFT rows start."""
    from ms_deepseek.data.chat import encode_chat

    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": prompt}
    ]
    ids, _ = encode_chat(tok, messages, add_generation_prompt=True)
    if not add_bos and tok.bos_id is not None and ids[:1] == [tok.bos_id]:
        ids = ids[1:]  # --no-bos
    return ids


def sample_text(path, prompt: str = "def ", max_new_tokens: int = 40) -> str:
    """A short greedy sample from a checkpoint or run folder (the quickstart's last line)."""
    result = generate_from_checkpoint(path, prompt, max_new_tokens=max_new_tokens)
    return result.text


def run(args) -> int:
    import mindspore as ms

    mode = ms.get_context("mode")
    try:
        code = _run(args)
    finally:
        ms.set_context(mode=mode)  # called in-process (tests, notebooks): the caller's mode again
    if getattr(args, "owns_process", False):
        # The answer is printed and every file written (the compile cache renamed into place, fsynced): end the
        # process here, skipping the interpreter's and MindSpore's teardown (its C++ runtime's destructors),
        # which takes a large share of a short generation's wall time and has nothing left to save.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _run(args) -> int:
    import mindspore as ms

    from ms_deepseek.core.runtime import use_device

    device = use_device()  # the device train would use (MS_DEEPSEEK_DEVICE, else Ascend when present)
    ms.set_context(mode=ms.GRAPH_MODE if args.mode == "graph" else ms.PYNATIVE_MODE)
    compile_cache = None
    # MindSpore's compile cache is per-process state (its folder is fixed at the first cached compile, graphs
    # are numbered by compile order): only a process that runs this one command starts with nothing compiled.
    if args.mode == "graph" and not args.no_compile_cache and getattr(args, "owns_process", False):
        compile_cache = Path(args.compile_cache).expanduser() if args.compile_cache else default_compile_cache()
    if args.mode == "pynative" and device == "CPU":
        ms.runtime.launch_blocking()  # synchronous launch: several times faster op by op on a CPU host
    prompt_ids = parse_prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None
    result = generate_from_checkpoint(
        args.path,
        args.prompt,
        prompt_ids,
        tokenizer=args.tokenizer,
        max_new_tokens=args.max_new_tokens,
        add_bos=not args.no_bos,
        ignore_eos=args.ignore_eos,
        chat=args.chat,
        system=args.system,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        repetition_penalty=args.repetition_penalty,
        use_cache=not args.no_cache,
        progress=not args.json,
        compile_cache=compile_cache,
    )
    if args.json:
        print(json.dumps(result.as_dict()))
        return 0
    print(result.text if result.text is not None else ",".join(map(str, result.ids)))
    t = result.timings
    tps = t.get("steady_tokens_per_s") or t.get("decode_tokens_per_s")
    speed = f", {tps:.1f} tokens/s" if tps else ""
    print(
        f"[{len(result.new_ids)} new tokens ({result.finish_reason}), {result.mode}, "
        f"{'latent cache' if result.use_cache else 'no cache'}{speed}]",
        file=sys.stderr,
    )
    if result.cache:
        print(f"[{result.cache['summary']}]", file=sys.stderr)
    return 0
