"""``ms-deepseek export-lora RUN_OR_CHECKPOINT OUT [--merge BASE]``: a LoRA run -> PEFT / merged HF folder.

Without ``--merge``: OUT is a PEFT adapter folder (adapter_config.json, adapter_model.safetensors
with PEFT's names for the HF DeepseekV2 model, per-expert tensors in expert order), loadable by
transformers + PEFT, vLLM's LoRA serving and ``DeepseekV2ForCausalLM.from_pretrained(base, adapter=OUT)``.
With ``--merge BASE``: OUT is a full HF checkpoint folder, BASE's weights with the adapters folded in
(streamed one tensor at a time, each tensor keeps its dtype; untouched tensors are copied as bytes).
RUN_OR_CHECKPOINT may be whole or sharded (a tp / pp / ep run's rank_*/ slices, put together here),
or a PEFT adapter folder (to merge an adapter trained elsewhere).
"""

from __future__ import annotations

import tempfile
from pathlib import Path


def add_arguments(parser) -> None:
    parser.add_argument(
        "source",
        metavar="RUN_OR_CHECKPOINT",
        help="a LoRA run folder (its newest checkpoint), a checkpoint folder (whole or sharded), "
        "or a PEFT adapter folder",
    )
    parser.add_argument("out", metavar="OUT", help="the folder to write")
    parser.add_argument(
        "--merge",
        metavar="BASE",
        default=None,
        help="write a full HF folder: BASE (an HF checkpoint folder) with the adapters folded in",
    )
    parser.add_argument(
        "--base",
        metavar="FOLDER",
        default=None,
        help="base_model_name_or_path to record (default: the run's base folder)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")


def run(args) -> int:
    from ms_deepseek.model import lora_export
    from ms_deepseek.model.lora_peft import CONFIG_NAME

    src = Path(args.source)
    from ms_deepseek.core.atomic import check_apart

    # OUT replaced with --overwrite must never be (or hold, or lie in) what this command reads
    check_apart(Path(args.out), [src, args.merge and Path(args.merge), args.base and Path(args.base)], "output folder")
    if args.merge is None:
        if (src / CONFIG_NAME).is_file():
            from ms_deepseek.core.errors import UserError

            raise UserError(f"{src}: already a PEFT adapter folder; pass --merge BASE to fold it into a base")
        out = lora_export.export_adapter(src, args.out, base=args.base, overwrite=args.overwrite)
        print(f"wrote PEFT adapter {out}")
        from ms_deepseek.checkpoint.safetensors_io import read_header
        from ms_deepseek.model.lora_peft import WEIGHTS_NAME

        for note in lora_export.compatibility_notes(read_header(out / WEIGHTS_NAME).tensors):
            print(note)
        return 0
    if (src / CONFIG_NAME).is_file():
        out = lora_export.merge(src, Path(args.merge), Path(args.out), overwrite=args.overwrite)
    else:
        with tempfile.TemporaryDirectory(prefix="ms_deepseek_lora_") as tmp:
            adapter = lora_export.export_adapter(src, Path(tmp) / "adapter", base=args.base or args.merge)
            out = lora_export.merge(adapter, Path(args.merge), Path(args.out), overwrite=args.overwrite)
    print(f"wrote merged HF checkpoint {out}")
    copied = _carry_tokenizer(src, Path(out))
    if copied:
        print(f"with the run's tokenizer ({copied}), so `ms-deepseek generate {out} --prompt ...` reads it")
    return 0


def _carry_tokenizer(src: Path, out: Path):
    """A merged folder is a model to sample from: when the base had no tokenizer (a random base, RUN_DIR/base),
    copy in the one the run trained with (found as ``generate`` finds it from the run: beside it or through its
    recipe.yaml's data, e.g. the embedded corpus's cached tokenizer). Returns its source file, or None."""
    import shutil

    from ms_deepseek.cli.generate import TOKENIZER_FILES, find_tokenizer

    if any((out / name).is_file() for name in TOKENIZER_FILES):
        return None  # the base's, copied with its other files
    from ms_deepseek.core.errors import UserError

    try:
        tok = find_tokenizer(src)
    except UserError:  # a run whose data is gone: nothing to carry, the export itself is done
        return None
    if tok is None:
        return None
    for file, name in zip(tok.files, tok.saved_names()):
        shutil.copyfile(file, out / name)
    return tok.files[0]
