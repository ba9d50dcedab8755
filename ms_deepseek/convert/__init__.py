"""HuggingFace <-> ms_deepseek checkpoint conversion (streaming, byte-level, dtype-preserving)."""

from ms_deepseek.convert.api import ConvertResult, hf_to_ms, ms_to_hf, parse_size

__all__ = ["ConvertResult", "hf_to_ms", "ms_to_hf", "parse_size"]
