"""Self-checks of the committed transformers reference fixtures (numpy only).

An independent float64 forward written from the original DeepSeek-V2 code
(tests/fixtures/numpy_reference.py) must reproduce what transformers recorded: logits,
loss, routing, balance losses, greedy generations, and (by finite differences) the
gradients. This also pins down the checkpoint layout the converters must read.
"""

import json
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from repo_paths import FIXTURES
from tolerances import assert_close_to_scale

sys.path.insert(0, str(FIXTURES))
from load_reference import FIXTURES_DIR, VARIANTS, grads, load_hf_weights, load_reference  # noqa: E402
from numpy_reference import forward, rope_settings  # noqa: E402


@pytest.fixture(scope="module", params=VARIANTS)
def case(request):
    folder = FIXTURES_DIR / request.param
    cfg = json.loads((folder / "config.json").read_text())
    ref = load_reference(folder)
    weights = load_hf_weights(folder)
    out = forward(cfg, weights, ref["input_ids"], ref["labels"])
    return request.param, folder, cfg, ref, weights, out


def expected_names(cfg):
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        attn = ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
        attn += ["q_proj"] if cfg["q_lora_rank"] is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"]
        names |= {f"{p}self_attn.{a}.weight" for a in attn}
        if i < cfg["first_k_dense_replace"]:
            names |= {f"{p}mlp.{m}_proj.weight" for m in ("gate", "up", "down")}
            continue
        names.add(p + "mlp.gate.weight")
        names |= {f"{p}mlp.shared_experts.{m}_proj.weight" for m in ("gate", "up", "down")}
        names |= {
            f"{p}mlp.experts.{e}.{m}_proj.weight"
            for e in range(cfg["n_routed_experts"])
            for m in ("gate", "up", "down")
        }
    return names


def test_config_format(case):
    name, _, cfg, _, _, _ = case
    assert cfg["model_type"] == "deepseek_v2"
    if name == "v2_yarn":  # transformers-5 format, as save_pretrained writes it
        assert "rope_scaling" not in cfg and cfg["rope_parameters"]["rope_type"] == "yarn"
    else:  # release format
        assert "rope_parameters" not in cfg and "rope_theta" in cfg
        for key in ("moe_layer_freq", "aux_loss_alpha", "seq_aux", "scoring_func", "ep_size", "torch_dtype"):
            assert key in cfg, key
        assert (cfg["rope_scaling"] or {}).get("type") in (None, "yarn")
    assert cfg["num_hidden_layers"] == 3 and cfg["first_k_dense_replace"] == 1
    rope = rope_settings(cfg)
    if "yarn" in name:
        assert rope["type"] == "yarn"
        if name == "yarn_mscale":
            assert rope["mscale"] != rope["mscale_all_dim"]
        else:
            assert cfg["max_position_embeddings"] == rope["factor"] * rope["original_max_position_embeddings"]
    else:
        assert rope is None


def test_weight_layout(case):
    name, folder, cfg, _, weights, _ = case
    assert set(weights) == expected_names(cfg)
    assert all(v.dtype == np.float32 for v in weights.values())
    h, i_moe = cfg["hidden_size"], cfg["moe_intermediate_size"]
    assert weights["model.layers.1.mlp.experts.0.gate_proj.weight"].shape == (i_moe, h)
    assert weights["model.layers.1.mlp.experts.0.down_proj.weight"].shape == (h, i_moe)
    assert weights["model.layers.1.mlp.gate.weight"].shape == (cfg["n_routed_experts"], h)
    index = folder / "model.safetensors.index.json"
    if name != "v2":
        assert not index.exists() and (folder / "model.safetensors").exists()
        return
    meta = json.loads(index.read_text())
    files = sorted(set(meta["weight_map"].values()))
    assert len(files) >= 3 and not (folder / "model.safetensors").exists()
    assert files == [f"model-{k:05d}-of-{len(files):05d}.safetensors" for k in range(1, len(files) + 1)]
    for f in files:  # every shard holds exactly the tensors the index maps to it
        assert set(load_file(str(folder / f))) == {n for n, g in meta["weight_map"].items() if g == f}
    assert meta["metadata"]["total_size"] == sum(v.nbytes for v in weights.values())


def test_logits_loss_routing_match_independent_forward(case):
    _, _, cfg, ref, _, out = case
    assert ref["logits"].shape == (2, 13, cfg["vocab_size"]) and ref["logits"].dtype == np.float32
    # torch's float32 forward against this float64 one: 2 ulps per term of the longest reduction (hidden size)
    tol = dict(ulps=2, terms=cfg["hidden_size"], dtype=np.float32)
    assert_close_to_scale(ref["logits"], out["logits"], **tol, err_msg="logits")
    assert_close_to_scale(float(ref["loss"]), out["loss"], **tol, err_msg="loss")
    assert ref["moe_layers"] == sorted(out["routing"]) == [1, 2]
    for i, (scores, idx, weight) in out["routing"].items():
        assert_close_to_scale(ref[f"routing.{i}.scores"], scores, **tol, err_msg=f"layer {i} scores")
        np.testing.assert_array_equal(ref[f"routing.{i}.topk_idx"], idx)
        assert_close_to_scale(ref[f"routing.{i}.topk_weight"], weight, **tol, err_msg=f"layer {i} weights")


def test_labels_and_routing_nondegenerate(case):
    _, _, cfg, ref, _, _ = case
    ids, labels = ref["input_ids"], ref["labels"]
    assert ids.dtype == np.int64 and ids.shape == (2, 13) and (ids < cfg["vocab_size"]).all()
    masked = labels == -100
    assert 0 < masked.sum() < 5 and np.array_equal(labels[~masked], ids[~masked])
    for i in ref["moe_layers"]:
        load = np.bincount(ref[f"routing.{i}.topk_idx"].ravel(), minlength=cfg["n_routed_experts"])
        assert (load > 0).sum() >= cfg["n_routed_experts"] - 1  # routing spreads over the experts
    assert ref["margins"]["routing_topk_min_score_gap"] >= 1e-3
    assert ref["logits"].std() > 0.5


def test_balance_losses(case):
    _, _, cfg, ref, _, _ = case
    alpha, n_exp, k = cfg.get("aux_loss_alpha", 0.001), cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    for i in ref["moe_layers"]:
        scores = ref[f"routing.{i}.scores"].astype(np.float64).reshape(2, 13, n_exp)
        onehot = np.eye(n_exp)[ref[f"routing.{i}.topk_idx"].reshape(2, 13 * k)]  # [B, T*k, E]
        ce = onehot.sum(1) / (13 * k / n_exp)  # [B, E]
        seq = (ce * scores.mean(1)).sum(1).mean() * alpha
        token = (onehot.reshape(-1, n_exp).mean(0) * n_exp * scores.reshape(-1, n_exp).mean(0)).sum() * alpha
        assert abs(float(ref[f"aux.{i}.seq"]) - seq) < 1e-9
        assert abs(float(ref[f"aux.{i}.token"]) - token) < 1e-9
        assert seq != pytest.approx(token)  # the two definitions really differ here


def test_greedy_generations(case):
    _, _, cfg, ref, weights, _ = case
    gen = ref["generate"]
    assert gen["prompt"] == ref["input_ids"][0, :5].tolist()
    assert gen["greedy"] != gen["penalty13"]
    for key, penalty in (("greedy", None), ("penalty13", 1.3)):
        seq = list(gen["prompt"])
        for _ in range(8):  # full recompute each step: no KV cache involved
            logits = forward(cfg, weights, np.array([seq]))["logits"][0, -1]
            if penalty is not None:  # HF: every token already in the sequence, once
                seen = np.unique(seq)
                logits[seen] = np.where(logits[seen] < 0, logits[seen] * penalty, logits[seen] / penalty)
            seq.append(int(np.argmax(logits)))
        assert seq == gen[key], key


def _fd_names(cfg, ref):
    """Parameters of every kind (embedding, attention incl. the rope path, dense MLP, router,
    routed and shared experts, norms, head) whose gradients are checked."""
    chosen = int(ref["routing.1.topk_idx"][0, 0])
    last = cfg["num_hidden_layers"] - 1
    q = "q_proj" if cfg["q_lora_rank"] is None else "q_b_proj"
    return [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.0.mlp.down_proj.weight",
        f"model.layers.0.self_attn.{q}.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.0.self_attn.kv_b_proj.weight",
        "model.layers.1.mlp.gate.weight",
        f"model.layers.1.mlp.experts.{chosen}.gate_proj.weight",
        f"model.layers.1.mlp.experts.{chosen}.down_proj.weight",
        f"model.layers.{last}.mlp.shared_experts.up_proj.weight",
        f"model.layers.{last}.post_attention_layernorm.weight",
    ]


def test_gradients_by_finite_differences(case):
    _, _, cfg, ref, weights, _ = case
    g = grads(ref)
    assert set(g) == set(weights)
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    eps = 1e-6
    rope_rows = slice(cfg["kv_lora_rank"], None)  # the k_pe outputs of kv_a_proj_with_mqa
    for name in _fd_names(cfg, ref):
        grad = g[name]
        if name.endswith("kv_a_proj_with_mqa.weight"):
            sub = np.abs(grad[rope_rows])
            r, c = np.unravel_index(np.argmax(sub), sub.shape)
            entries = [(cfg["kv_lora_rank"] + int(r), int(c))]
        else:
            entries = [np.unravel_index(np.argmax(np.abs(grad)), grad.shape)]
        entries.append(tuple(d // 2 for d in grad.shape))  # a second, arbitrary entry
        for idx in entries:
            orig = w[name][idx]
            w[name][idx] = orig + eps
            up = forward(cfg, w, ref["input_ids"], ref["labels"])["loss"]
            w[name][idx] = orig - eps
            down = forward(cfg, w, ref["input_ids"], ref["labels"])["loss"]
            w[name][idx] = orig
            fd = (up - down) / (2 * eps)
            tol = 1e-3 * np.abs(grad).max() + 1e-7
            assert abs(fd - grad[idx]) <= tol, (name, idx, fd, grad[idx])
        assert abs(grad[entries[0]]) > 100 * tol, name  # the largest entry is far from zero
