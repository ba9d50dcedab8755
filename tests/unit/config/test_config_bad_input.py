"""Model config: an optional rope_scaling key set to null means its default."""


def test_rope_scaling_optional_key_null_means_its_default():
    from ms_deepseek.config.model import DeepseekV2Config

    base = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096}
    with_null = DeepseekV2Config(rope_scaling={**base, "mscale": None, "beta_fast": None})
    assert with_null.rope_scaling == DeepseekV2Config(rope_scaling=base).rope_scaling
