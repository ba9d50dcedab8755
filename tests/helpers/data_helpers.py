"""Tiny tokenizers built on the fly for the data tests (no downloads).

``make_byte_tokenizer``: a HuggingFace tokenizer.json in the DeepSeek-V2 style
(byte-level BPE, bos/eos named in tokenizer_config.json) with no merges, so every
byte is one token and ids can be written down by hand:

    0 = <｜begin▁of▁sentence｜>, 1 = <｜end▁of▁sentence｜>, 2 + b = byte b, 258 = <｜▁pad▁｜>
"""

import json
from pathlib import Path

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
BOS_ID, EOS_ID, PAD_ID = 0, 1, 258


def byte_ids(text: str):
    """Expected ids of ``text`` under make_byte_tokenizer."""
    return [2 + b for b in text.encode("utf-8")]


def _bytes_to_unicode():
    """GPT-2's printable stand-ins for the 256 byte values (what ByteLevel uses)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def make_byte_tokenizer(folder: Path) -> Path:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    chars = _bytes_to_unicode()
    vocab = {BOS: BOS_ID, EOS: EOS_ID}
    vocab.update({chars[b]: 2 + b for b in range(256)})
    vocab[PAD] = PAD_ID
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (BOS, EOS, PAD)])
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": {"__type": "AddedToken", "content": BOS},
        "eos_token": {"__type": "AddedToken", "content": EOS},
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return folder / "tokenizer.json"


def make_sentencepiece(path: Path, vocab_size: int = 400) -> Path:
    from ms_deepseek.data.tokenizer import train_sentencepiece

    lines = [f"def function_{i}(value):\n    return value * {i} + len('text {i}')\n" for i in range(300)]
    lines += ["User: hello there\n\nAssistant: general kenobi\n"] * 50
    path.parent.mkdir(parents=True, exist_ok=True)
    train_sentencepiece(lines, vocab_size, path)
    return path


def write_jsonl(path: Path, records) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def read_rows(folder):
    """All rows of a prepared folder in reading order (MindDataset, no shuffle)."""
    import mindspore.dataset as ds

    from ms_deepseek.data.storage import load_meta, shard_paths

    meta = load_meta(folder)
    pipe = ds.MindDataset(shard_paths(folder, meta), columns_list=["input_ids", "labels", "length"], shuffle=False)
    return list(pipe.create_dict_iterator(num_epochs=1, output_numpy=True))
