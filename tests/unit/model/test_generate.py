"""Generation with the MLA latent KV cache against the transformers reference generations.

* greedy and repetition-penalty (1.3) generations equal ``reference.json`` for every
  fixture variant, with the latent cache and with the uncached reference path;
* decode-step logits (absorbed weights, cache reads) equal the full forward's logits;
* the cache holds exactly [c_kv (after kv_a_layernorm) | rotated k_pe] per token;
* graph mode gives the same ids; batches, EOS, sampling and the cache figures.

PyNative runs with ``launch_blocking`` (synchronous op launch), which on a busy
2-core CPU is several times faster than the default asynchronous launch.
"""

import sys

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from repo_paths import FIXTURES
from tolerances import assert_close_to_scale

sys.path.insert(0, str(FIXTURES))
from load_reference import FIXTURES_DIR, VARIANTS, load_reference  # noqa: E402

from ms_deepseek import DeepseekV2ForCausalLM  # noqa: E402
from ms_deepseek.config.model import get_preset  # noqa: E402
from ms_deepseek.core.errors import UserError  # noqa: E402
from ms_deepseek.generate import generate, generate_batch, process_logits, sample  # noqa: E402
from ms_deepseek.model.decode import CachedDecoder, cache_figures  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _pynative_blocking():
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.runtime.launch_blocking()
    yield
    ms.set_context(mode=ms.PYNATIVE_MODE)


_MODELS = {}


def _load(variant):
    if variant not in _MODELS:
        folder = FIXTURES_DIR / variant
        _MODELS[variant] = (
            DeepseekV2ForCausalLM.from_pretrained(folder, show_progress=False),
            load_reference(folder)["generate"],
        )
    return _MODELS[variant]


@pytest.mark.parametrize("variant", VARIANTS)
def test_reference_generations_cached_and_uncached(variant):
    model, ref = _load(variant)
    penalty = ref["repetition_penalty"]
    n = ref["max_new_tokens"]
    greedy = generate(model, ref["prompt"], n, eos_ids=())  # the fixtures were made with EOS disabled
    assert greedy.ids == ref["greedy"], f"{variant}: cached greedy {greedy.ids} != {ref['greedy']}"
    assert greedy.new_ids == ref["greedy"][len(ref["prompt"]) :] and greedy.finish_reason == "length"
    t = greedy.timings
    assert t["new_tokens"] == n and t["prefill_s"] > 0 and t["decode_tokens_per_s"] > 0
    pen = generate(model, ref["prompt"], n, eos_ids=(), repetition_penalty=penalty)
    assert pen.ids == ref["penalty13"], f"{variant}: cached penalty {pen.ids} != {ref['penalty13']}"
    plain = generate(model, ref["prompt"], n, eos_ids=(), use_cache=False)
    assert plain.ids == greedy.ids and plain.cache is None
    if variant in ("v2", "lite_yarn"):  # the penalty path without the cache on one variant of each kind
        assert generate(model, ref["prompt"], n, eos_ids=(), repetition_penalty=penalty, use_cache=False).ids == pen.ids


@pytest.mark.parametrize("variant", ["v2", "lite_yarn"])
def test_decode_logits_and_cache_contents(variant):
    """Every decode step's logits equal the full forward's at that position; the cache rows are the latent."""
    model, ref = _load(variant)
    cfg = model.config
    ids = ref["greedy"]
    T0, total = len(ref["prompt"]), len(ids)
    full = model(Tensor([ids], ms.int32)).logits.asnumpy()[0]  # [total, V]
    dec = CachedDecoder(model, batch_size=1, max_len=total + 3)
    assert len(dec.caches) == cfg.num_hidden_layers
    assert tuple(dec.caches[0].shape) == (1, total + 3, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    assert [p.name for p in model.get_parameters()][0] == "model.embed_tokens.weight"  # names untouched
    tol = dict(ulps=2, terms=cfg.hidden_size)
    logits = dec(Tensor([ids[:T0]], ms.int32), Tensor(0, ms.int32), True).asnumpy()
    assert_close_to_scale(logits[0], full[T0 - 1], **tol, err_msg="prefill logits")
    for pos in range(T0, total):
        logits = dec(Tensor([[ids[pos]]], ms.int32), Tensor(pos, ms.int32)).asnumpy()
        assert_close_to_scale(logits[0], full[pos], **tol, err_msg=f"decode logits at position {pos}")
    # The absorbed path on several new tokens at once (causal among them) after a shorter prefill.
    dec(Tensor([ids[:2]], ms.int32), Tensor(0, ms.int32), True)
    logits = dec(Tensor([ids[2 : T0 + 1]], ms.int32), Tensor(2, ms.int32)).asnumpy()
    assert_close_to_scale(logits[0], full[T0], **tol, err_msg="absorbed chunk logits")
    dec(Tensor([ids[T0 + 1 :]], ms.int32), Tensor(T0 + 1, ms.int32))
    # Layer 0's cache rows: c_kv after kv_a_layernorm and the rotated k_pe, computed by the training path.
    m = model.model
    x = m.embed_tokens(Tensor([ids], ms.int32))
    cos, sin = m.rotary_emb(ms.ops.arange(0, total, dtype=ms.float32))
    c_kv, k_pe = m.layers[0].self_attn.latent(m.layers[0].input_layernorm(x), cos, sin)
    expected = np.concatenate([c_kv.asnumpy(), k_pe.asnumpy()], -1)[0]  # [total, kv_lora + rope]
    assert_close_to_scale(dec.caches[0].asnumpy()[0, :total], expected, ulps=2, terms=cfg.hidden_size, err_msg="cache")


def test_graph_mode_matches_reference():
    model, ref = _load("v2_yarn")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        greedy = generate(model, ref["prompt"], ref["max_new_tokens"], eos_ids=())
        pen = generate(
            model, ref["prompt"], ref["max_new_tokens"], eos_ids=(), repetition_penalty=ref["repetition_penalty"]
        )
        plain = generate(model, ref["prompt"], ref["max_new_tokens"], eos_ids=(), use_cache=False)  # padded
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert greedy.mode == "graph"
    assert greedy.ids == ref["greedy"] and pen.ids == ref["penalty13"] and plain.ids == ref["greedy"]


def test_batch_equals_single_rows():
    model, ref = _load("lite")
    prompts = [ref["prompt"], [5, 9, 200, 17, 3]]
    batch = generate_batch(model, prompts, 6, eos_ids=())
    for prompt, res in zip(prompts, batch):
        assert res.ids == generate(model, prompt, 6, eos_ids=()).ids


def test_eos_stops_generation():
    model, ref = _load("lite")
    T0 = len(ref["prompt"])
    new = ref["greedy"][T0:]
    stop = next(i for i, tok in enumerate(new) if new.index(tok) == i and i >= 1)  # first occurrence, not step 0
    res = generate(model, ref["prompt"], 8, eos_ids=[new[stop]])
    assert res.finish_reason == "eos" and res.ids == ref["greedy"][: T0 + stop + 1]
    # Default: the config's eos_token_id (1 for the fixtures).
    assert model.config.eos_ids == [1]


def test_sampling_seeded_and_filters():
    model, ref = _load("lite")
    a = generate(model, ref["prompt"], 6, temperature=1.5, top_p=0.95, seed=7, eos_ids=())
    b = generate(model, ref["prompt"], 6, temperature=1.5, top_p=0.95, seed=7, eos_ids=())
    assert a.ids == b.ids
    assert (
        generate(model, ref["prompt"], 4, temperature=0.8, top_k=1, seed=3, eos_ids=()).ids
        == ref["greedy"][: len(ref["prompt"]) + 4]
    )
    # numpy logits processing: top-k keeps k, top-p keeps the smallest set reaching p (at least one).
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    assert np.isfinite(process_logits(logits, 1.0, 2, 1.0)).tolist() == [[True, True, False, False]]
    assert np.isfinite(process_logits(logits, 1.0, 0, 0.8)).tolist() == [[True, True, False, False]]
    assert np.isfinite(process_logits(logits, 1.0, 0, 0.81)).tolist() == [[True, True, True, False]]
    assert np.isfinite(process_logits(logits, 1.0, 0, 0.1)).tolist() == [[True, False, False, False]]
    rng = np.random.default_rng(0)
    draws = [int(sample(logits, rng, 1.0, 0, 1.0)[0]) for _ in range(2000)]
    assert abs(draws.count(0) / 2000 - 0.5) < 0.05 and abs(draws.count(3) / 2000 - 0.05) < 0.02


def test_cache_figures():
    v2 = cache_figures(get_preset("deepseek-v2"), "bfloat16")
    assert v2.latent_elements_per_layer == 512 + 64
    assert v2.latent_bytes_per_token == 60 * 576 * 2 == 69120
    assert v2.full_elements_per_layer == 128 * (192 + 128)
    assert v2.full_bytes_per_token == 60 * 128 * 320 * 2
    assert round(v2.ratio, 2) == 71.11
    model, ref = _load("lite")
    res = generate(model, ref["prompt"], 2, eos_ids=())
    cfg = model.config
    assert res.cache["latent_bytes_per_token"] == cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    assert res.cache["full_kv_bytes_per_token"] == cfg.num_hidden_layers * 4 * (24 + 16) * 4
    assert res.cache["buffer_rows"] == 16  # 5 + 2 tokens, rounded up to a power of two >= 16
    assert res.cache["buffer_bytes"] == res.cache["latent_bytes_per_token"] * 16


def test_decoders_are_reused_between_calls(monkeypatch):
    """Generations whose cache fits the same buffer rows reuse one latent cache (one graph compile)."""
    from ms_deepseek.generate import cache_length
    from ms_deepseek.model import decode

    built = []

    class Counting(decode.CachedDecoder):
        def __init__(self, *args):
            super().__init__(*args)
            built.append(args[1:])

    monkeypatch.setattr(decode, "CachedDecoder", Counting)
    ref = _load("lite")[1]
    model = DeepseekV2ForCausalLM.from_pretrained(FIXTURES_DIR / "lite", show_progress=False)  # no decoders yet
    generate(model, ref["prompt"], 3, eos_ids=())
    generate(model, ref["prompt"][:3], 6, eos_ids=(), repetition_penalty=1.2)  # 9 tokens: 16 rows again
    assert built == [(1, 16)]
    generate(model, ref["prompt"], 20, eos_ids=())  # 25 tokens: a 32-row buffer
    assert built == [(1, 16), (1, 32)]
    assert [cache_length(n, 4096) for n in (1, 16, 17, 100, 4000)] == [16, 16, 32, 128, 4096]
    assert cache_length(300, 260) == 260


@pytest.mark.parametrize(
    "call, message",
    [
        (dict(prompt_ids=[1, 2, 256]), "token id 256 at position 2 is outside the model's vocabulary [0, 256)"),
        (dict(prompt_ids=[1, -3]), "token id -3 at position 1 is outside"),
        (dict(prompt_ids=[]), "prompt is empty"),
        (dict(repetition_penalty=0.0), "repetition penalty must be > 0"),
        (dict(repetition_penalty=-1.3), "repetition penalty must be > 0"),
        (
            dict(max_new_tokens=4092),
            "prompt length 5 + max_new_tokens 4092 = 4097 exceeds the model's max_position_embeddings 4096",
        ),
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
        (dict(temperature=-1.0), "temperature must be"),
        (dict(top_p=0.0), "top_p must be in (0, 1]"),
        (dict(top_k=-2), "top_k must be an integer >= 0"),
    ],
)
def test_bad_calls_raise_user_error(call, message):
    model, ref = _load("lite")
    kwargs = dict(prompt_ids=ref["prompt"], max_new_tokens=3)
    kwargs.update(call)
    with pytest.raises(UserError) as err:
        generate(model, kwargs.pop("prompt_ids"), kwargs.pop("max_new_tokens"), **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("variant", ["v2", "lite", "lite int8"])
def test_one_token_moe_path_equals_the_dispatch_path(variant):
    """A decode step's MoE (the chosen experts' weights gathered) computes what the capacity dispatch does,
    on stacked float weights and on a quantised stack (its rows dequantised)."""
    if variant.endswith("int8"):
        from ms_deepseek.config.quant import QuantSpec
        from ms_deepseek.model.quant import quantize_model

        model = DeepseekV2ForCausalLM.from_pretrained(FIXTURES_DIR / "lite", show_progress=False)
        assert quantize_model(model, QuantSpec(bits=8)) > 0
    else:
        model, _ = _load(variant)
    moe = next(layer.mlp for layer in model.model.layers if layer.is_moe)
    assert type(moe.experts.gate_proj).__name__ == ("QuantStackedWeight" if "int8" in variant else "StackedWeight")
    model.set_train(False)
    x = Tensor(np.random.default_rng(0).normal(size=(2, 1, model.config.hidden_size)).astype(np.float32))
    assert moe.one_token_fits(x) and not moe.one_token_fits(ms.ops.concat((x, x), 1))  # one token per row
    assert_close_to_scale(
        moe.one_token(x).asnumpy(), moe(x)[0].asnumpy(), ulps=2, terms=model.config.hidden_size, err_msg="moe"
    )
    model.set_train(True)
    try:
        assert not moe.one_token_fits(x)  # training keeps the capacity dispatch and its balance losses
    finally:
        model.set_train(False)


def test_long_prompt_bucketed_prefill_in_graph_mode():
    """A prompt past STEPWISE_PROMPT goes through a prefill padded to its bucket; the ids equal PyNative's."""
    from ms_deepseek.generate import STEPWISE_PROMPT, graph_shapes

    model, _ = _load("lite")
    cfg = model.config
    assert graph_shapes(cfg, 1, 5, 6) == {"batch": 1, "prompt_rows": 0, "rows": 16}
    assert graph_shapes(cfg, 1, STEPWISE_PROMPT + 1, 4)["prompt_rows"] == 128
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, STEPWISE_PROMPT + 6).tolist()
    eager = generate(model, prompt, 4, eos_ids=(), use_cache=False)
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        graph = generate(model, prompt, 4, eos_ids=())
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert graph.mode == "graph" and graph.cache["buffer_rows"] == 128
    assert graph.ids == eager.ids


@pytest.mark.parametrize("kind", ["lora", "int8"])
def test_decode_steps_use_kv_b_proj_as_the_layer_applies_it(kind):
    """The absorbed decode step reads kv_b_proj's matrix itself: with a LoRA adapter on it (B A added) and with
    a quantised base (dequantised) its logits still equal the full forward's."""
    model = DeepseekV2ForCausalLM.from_pretrained(FIXTURES_DIR / "v2", show_progress=False)
    if kind == "lora":
        from ms_deepseek.config.lora import LoraSpec
        from ms_deepseek.model.lora import add_adapters

        add_adapters(model, LoraSpec(r=4, alpha=8, target_modules=["kv_b_proj"]))
        rng = np.random.default_rng(0)
        for name, p in model.parameters_and_names():
            if "lora_B" in name:  # PEFT starts B at zero: a trained adapter is not
                p.set_data(Tensor(rng.normal(0, 0.5, p.shape).astype(np.float32)))
    else:
        from ms_deepseek.config.quant import QuantSpec
        from ms_deepseek.model.quant import quantize_model

        quantize_model(model, QuantSpec(bits=8))
    model.set_train(False)
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, 9).tolist()
    full = model(Tensor([ids], ms.int32)).logits.asnumpy()[0]  # [9, V]
    dec = CachedDecoder(model, batch_size=1, max_len=16)
    tol = dict(ulps=2, terms=model.config.hidden_size)
    dec(Tensor([ids[:3]], ms.int32), Tensor(0, ms.int32), True)
    for pos in range(3, len(ids)):
        logits = dec(Tensor([[ids[pos]]], ms.int32), Tensor(pos, ms.int32)).asnumpy()
        assert_close_to_scale(logits[0], full[pos], **tol, err_msg=f"{kind}: decode logits at {pos}")
