"""What a training run will read, checked on this machine before anything starts.

The recipe schema (:mod:`ms_deepseek.config.recipe`) checks the recipe as text; this module checks
it against the machine: every data folder is prepared, the tokenizer fits the model's vocabulary,
a sharded LoRA run has its base checkpoint. Its data checks are made on the run's one resolution of
the data (``data.sources.ResolvedData``: the sources, their checked metadata, the one tokenizer), which
it hands on: ``train`` calls :func:`load_run_inputs` and gives the trainer that resolution for its
batches and validation sets; ``launch`` calls :func:`load_checked_recipe` (once, instead of failing in N
workers); ``plan`` and ``convert --recipe`` read recipes of jobs whose data and checkpoints are
elsewhere, and call only the schema.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence, Tuple, Union

from ms_deepseek.config.data import DataConfig
from ms_deepseek.config.recipe import Recipe, load_recipe
from ms_deepseek.core.errors import UserError
from ms_deepseek.data.sources import ResolvedData, resolve_data
from ms_deepseek.data.tokenizer import load_tokenizer


def _tokenizer(data: DataConfig) -> Tuple[str, Any, int]:
    """(key, tokenizer, vocab size) of the tokenizer training will use: ``data.tokenizer``, else the prepared
    folder's, loaded once here (the tokenizer None for the embedded default, built later)."""
    if data.tokenizer is not None:
        try:
            tok = load_tokenizer(data.tokenizer)
        except UserError as exc:
            raise UserError(f"data.tokenizer: {exc}") from None
        return "data.tokenizer", tok, tok.vocab_size
    if data.path is not None:
        folder = Path(data.primary_path).expanduser()  # a mixture's sources share it (checked in resolve_data)
        if not folder.is_dir():
            raise UserError(f"data.path: {folder} is not a folder (prepare one with `ms-deepseek prepare-data`)")
        try:
            tok = load_tokenizer(folder)
        except UserError as exc:
            raise UserError(f"data.path: {exc} (the prepared folder must hold its tokenizer)") from None
        return "data.path", tok, tok.vocab_size
    return "data.embedded_vocab_size", None, data.embedded_vocab_size


def check_recipe(recipe: Recipe, progress: bool = False) -> ResolvedData:
    """Raise UserError naming the key when the run would not find what the recipe names; the run's data as
    resolved for these checks (:func:`~ms_deepseek.data.sources.resolve_data`, the embedded default built when
    ``data.path`` is unset, with a progress line when ``progress``)."""
    cfg = recipe.model_config
    if recipe.lora is not None and recipe.parallel.uses_semi_auto and recipe.weights_folder is None:
        # every rank reads only its slices of the frozen base; a random base (written whole to
        # RUN_DIR/base by one process) is for single-device and data-parallel runs
        raise UserError(
            f"lora: a sharded LoRA run ({recipe.parallel.describe()}) adapts the weights of model.source, "
            f"and {recipe.model.source!r} is not a checkpoint folder on this machine; set model.source "
            "to the base checkpoint (a random base is for single-device and data-parallel runs)"
        )
    data = recipe.data
    # every folder the run will read exists
    folders = [(f"data.path[{i}]", s.path) for i, s in enumerate(data.sources)] if isinstance(data.path, list) else []
    if data.validation is not None and data.validation.path is not None:
        folders.append(("data.validation.path", data.validation.path))
    for key, folder in folders:
        if not (Path(folder).expanduser() / "meta.json").is_file():
            raise UserError(
                f"{key}: {folder} is not a prepared folder (no meta.json; prepare it with `ms-deepseek prepare-data`)"
            )
    key, tok, vocab = _tokenizer(data)
    if vocab > cfg.vocab_size:
        raise UserError(
            f"{key}: the tokenizer has {vocab} tokens but the model's vocab_size is {cfg.vocab_size} "
            f"(raise model.overrides.vocab_size or use a smaller tokenizer)"
        )
    bounds = dict(max_positions=cfg.max_position_embeddings, vocab_size=cfg.vocab_size)
    return resolve_data(data, progress=progress, tokenizer=tok, **bounds)


def load_run_inputs(
    path: Union[str, Path], overrides: Sequence[str] = (), progress: bool = False
) -> Tuple[Recipe, ResolvedData]:
    """:func:`~ms_deepseek.config.recipe.load_recipe`, then :func:`check_recipe`: the recipe and its data resolved
    once, for the run to take; errors start with the path."""
    recipe = load_recipe(path, overrides)
    try:
        return recipe, check_recipe(recipe, progress)
    except UserError as exc:
        raise UserError(f"{path}: {exc}") from None


def load_checked_recipe(path: Union[str, Path], overrides: Sequence[str] = ()) -> Recipe:
    """The recipe of :func:`load_run_inputs` (checked; its data resolved and left to the workers)."""
    return load_run_inputs(path, overrides)[0]
