"""What a training run will read, checked on this machine before anything starts.

The recipe schema (:mod:`ms_deepseek.config.recipe`) checks the recipe as text; this module checks
it against the machine: every data folder is prepared, the tokenizer fits the model's vocabulary,
a sharded LoRA run has its base checkpoint. ``train`` and ``launch`` call :func:`load_checked_recipe`
(``launch`` once, instead of failing in N workers); ``plan`` and ``convert --recipe`` read
recipes of jobs whose data and checkpoints are elsewhere, and call only the schema.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence, Union

from ms_deepseek.config.data import DataConfig
from ms_deepseek.config.recipe import Recipe, load_recipe
from ms_deepseek.core.errors import UserError
from ms_deepseek.data.tokenizer import load_tokenizer


def _tokenizer_vocab(data: DataConfig) -> Optional[tuple]:
    """(key, vocab size) of the tokenizer training will use."""
    if data.tokenizer is not None:
        try:
            return "data.tokenizer", load_tokenizer(data.tokenizer).vocab_size
        except UserError as exc:
            raise UserError(f"data.tokenizer: {exc}") from None
    if data.path is not None:
        folder = Path(data.primary_path).expanduser()  # a mixture's sources share it (checked at build)
        if not folder.is_dir():
            raise UserError(f"data.path: {folder} is not a folder (prepare one with `ms-deepseek prepare-data`)")
        try:
            return "data.path", load_tokenizer(folder).vocab_size
        except UserError as exc:
            raise UserError(f"data.path: {exc} (the prepared folder must hold its tokenizer)") from None
    return "data.embedded_vocab_size", data.embedded_vocab_size


def check_recipe(recipe: Recipe) -> Recipe:
    """Raise UserError naming the key when the run would not find what the recipe names."""
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
    key, vocab = _tokenizer_vocab(data)
    if vocab > cfg.vocab_size:
        raise UserError(
            f"{key}: the tokenizer has {vocab} tokens but the model's vocab_size is {cfg.vocab_size} "
            f"(raise model.overrides.vocab_size or use a smaller tokenizer)"
        )
    return recipe


def load_checked_recipe(path: Union[str, Path], overrides: Sequence[str] = ()) -> Recipe:
    """:func:`~ms_deepseek.config.recipe.load_recipe`, then :func:`check_recipe`; errors start with the path."""
    recipe = load_recipe(path, overrides)
    try:
        return check_recipe(recipe)
    except UserError as exc:
        raise UserError(f"{path}: {exc}") from None
