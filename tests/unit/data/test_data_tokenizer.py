"""Tokenizer wrapper (tokenizer.json and sentencepiece) and the DeepSeek-V2-Chat template."""

import json

import pytest

from ms_deepseek.core.errors import UserError
from ms_deepseek.data.chat import IGNORE_INDEX, encode_chat, render_chat
from ms_deepseek.data.tokenizer import load_tokenizer

from data_helpers import BOS, BOS_ID, EOS, EOS_ID, PAD_ID, byte_ids, make_byte_tokenizer, make_sentencepiece

# chat_template of deepseek-ai/DeepSeek-V2-Chat's tokenizer_config.json (the reference for render_chat).
RELEASED_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ 'User: ' + message['content'] + '\n\n' }}{% elif message['role'] == 'assistant' %}"
    "{{ 'Assistant: ' + message['content'] + eos_token }}{% elif message['role'] == 'system' %}"
    "{{ message['content'] + '\n\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


@pytest.fixture(scope="module")
def byte_tok_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bytetok")
    make_byte_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    return make_sentencepiece(tmp_path_factory.mktemp("sp") / "tokenizer.model")


def test_hf_tokenizer_from_file_and_folder(byte_tok_dir):
    for path in (byte_tok_dir, byte_tok_dir / "tokenizer.json"):
        tok = load_tokenizer(path)
        assert (tok.kind, tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == ("hf", BOS_ID, EOS_ID, PAD_ID, 259)
    text = "def f(x):\n    return 'é'\n"
    assert tok.encode(text) == byte_ids(text)
    assert tok.encode(text, add_bos=True) == [BOS_ID] + byte_ids(text)
    assert tok.encode_batch([text, "ab"]) == [byte_ids(text), byte_ids("ab")]
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([BOS_ID] + byte_ids("ab") + [EOS_ID]) == "ab"
    assert tok.decode([BOS_ID] + byte_ids("ab"), skip_special_tokens=False) == BOS + "ab"


def test_hf_tokenizer_special_tokens_fall_back_to_known_names(byte_tok_dir, tmp_path):
    folder = tmp_path / "noconfig"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((byte_tok_dir / "tokenizer.json").read_bytes())
    tok = load_tokenizer(folder)
    assert (tok.bos_id, tok.eos_id) == (BOS_ID, EOS_ID)
    assert tok.pad_id == PAD_ID  # "<｜▁pad▁｜>" is DeepSeek's pad token name


def test_sentencepiece_tokenizer(sp_model):
    tok = load_tokenizer(sp_model.parent)
    assert (tok.kind, tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == ("sentencepiece", 1, 2, 3, 400)
    text = "def function_7(value):\n\treturn ünïcode  spaces\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text  # byte fallback: nothing is unknown, whitespace kept
    assert tok.encode_batch([text]) == [ids]
    assert tok.decode([1] + ids + [2], skip_special_tokens=False) == "<s>" + text + "</s>"


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "missing.json", "tokenizer not found"),
        (lambda d: d, "no tokenizer.json or tokenizer.model"),
        (lambda d: _write(d / "tokenizer.json", "{not json"), "not a readable tokenizer.json"),
        (lambda d: _write(d / "tokenizer.model", "garbage"), "not a readable sentencepiece model"),
    ],
)
def test_bad_tokenizer_paths_name_the_path(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(UserError, match=message) as err:
        load_tokenizer(path)
    assert str(path) in str(err.value)


def test_tokenizer_config_naming_an_unknown_token(byte_tok_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((byte_tok_dir / "tokenizer.json").read_bytes())
    _write(tmp_path / "tokenizer_config.json", json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(UserError, match=r"tokenizer_config.json: eos_token '<nope>' is not in tokenizer.json"):
        load_tokenizer(tmp_path)


def _write(path, text):
    path.write_text(text)
    return path


def test_render_chat_matches_the_released_template():
    import jinja2  # requirements-test.txt: the reference renderer of the released template

    template = jinja2.Environment().from_string(RELEASED_TEMPLATE)
    for gen in (False, True):
        msgs = CONVERSATION[:4] if gen else CONVERSATION
        expected = template.render(messages=msgs, bos_token=BOS, eos_token=EOS, add_generation_prompt=gen)
        assert render_chat(msgs, BOS, EOS, add_generation_prompt=gen) == expected


def test_chat_token_and_label_layout_exact(byte_tok_dir):
    tok = load_tokenizer(byte_tok_dir)
    ids, labels = encode_chat(tok, CONVERSATION)
    prompt1 = byte_ids("Be brief.\n\nUser: hi\n\nAssistant:")
    reply1 = byte_ids(" yo")
    prompt2 = byte_ids("User: 2+2?\n\nAssistant:")
    reply2 = byte_ids(" 4")
    assert ids == [BOS_ID] + prompt1 + reply1 + [EOS_ID] + prompt2 + reply2 + [EOS_ID]
    m = IGNORE_INDEX
    assert labels == [m] + [m] * len(prompt1) + reply1 + [EOS_ID] + [m] * len(prompt2) + reply2 + [EOS_ID]
    # Same ids as tokenizing the whole rendered conversation (what HF does).
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(byte_tok_dir / "tokenizer.json"))
    assert ids == raw.encode(render_chat(CONVERSATION, BOS, EOS), add_special_tokens=False).ids


def test_chat_generation_prompt(byte_tok_dir):
    tok = load_tokenizer(byte_tok_dir)
    ids, labels = encode_chat(tok, CONVERSATION[:2], add_generation_prompt=True)
    assert ids == [BOS_ID] + byte_ids("Be brief.\n\nUser: hi\n\nAssistant:")
    assert set(labels) == {IGNORE_INDEX}


def test_chat_targets_with_sentencepiece(sp_model):
    tok = load_tokenizer(sp_model)
    ids, labels = encode_chat(
        tok, [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "general kenobi"}]
    )
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    targets = [t for t in labels if t != IGNORE_INDEX]
    assert targets[-1] == tok.eos_id
    assert tok.decode(targets[:-1]) == " general kenobi"
    assert tok.decode(ids[1 : len(ids) - len(targets)]) == "User: hello there\n\nAssistant:"
