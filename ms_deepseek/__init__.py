"""ms-deepseek: train DeepSeek-V2 models with MindSpore on Ascend (and on CPU).

``import ms_deepseek`` is cheap: the model classes (which import MindSpore) load
on first attribute access, e.g. ``from ms_deepseek import DeepseekV2ForCausalLM``.
"""

__version__ = "0.1.0"

_LAZY = {
    "DeepseekV2ForCausalLM": "ms_deepseek.model.causal_lm",
    "DeepseekV2Config": "ms_deepseek.config.model",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ms_deepseek' has no attribute {name!r}")
