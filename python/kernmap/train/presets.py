"""Built-in tiny models for `python -m kernmap align | ablate --preset NAME`: the C++ command's three presets
(models/config.cpp, the same configurations: tests/python/test_train_python.py compares them) and the other
four families transformers runs, at the same sizes. Random weights from a fixed seed (transformers'
initialisation), so a run needs no checkpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import UsageError

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _config(cls: str, **fields) -> PretrainedConfig:
    """transformers' config class `cls`, imported when a preset is built: a command line that fails to parse
    never pays transformers' import."""
    import transformers

    return getattr(transformers, cls)(**fields)

# The C++ presets' shared sizes (models/config.cpp, preset_config).
_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               rms_norm_eps=1e-6, max_position_embeddings=32768, initializer_range=0.02,
               rope_parameters={"rope_type": "default", "rope_theta": 1e6})
# Many small experts, as in the MoE models whose expert loop the Experts kernel replaces.
_MOE = dict(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=32)

PRESETS = {
    "qwen2-tiny": lambda: _config("Qwen2Config", **_COMMON, num_hidden_layers=2, tie_word_embeddings=True),
    "qwen2-moe-tiny": lambda: _config("Qwen2MoeConfig", **_COMMON, **_MOE, num_hidden_layers=3, qkv_bias=True,
                                      shared_expert_intermediate_size=64, mlp_only_layers=[2],
                                      tie_word_embeddings=False),
    "qwen3-moe-tiny": lambda: _config("Qwen3MoeConfig", **_COMMON, **_MOE, num_hidden_layers=2, head_dim=16,
                                      norm_topk_prob=True, tie_word_embeddings=False),
    "qwen3-tiny": lambda: _config("Qwen3Config", **_COMMON, num_hidden_layers=2, head_dim=16,
                                  tie_word_embeddings=True),
    "llama-tiny": lambda: _config("LlamaConfig", **_COMMON, num_hidden_layers=2, head_dim=16),
    "mistral-tiny": lambda: _config("MistralConfig", **_COMMON, num_hidden_layers=2, head_dim=16,
                                    sliding_window=None),
    "mixtral-tiny": lambda: _config("MixtralConfig", **{**_COMMON, "intermediate_size": 32}, num_hidden_layers=2,
                                    head_dim=16, num_local_experts=32, num_experts_per_tok=4, sliding_window=None),
}


def preset_names() -> list[str]:
    return list(PRESETS)


def preset_config(name: str) -> PretrainedConfig:
    if name not in PRESETS:
        raise UsageError(f"--preset: unknown preset {name!r} (expected one of {', '.join(PRESETS)})")
    return PRESETS[name]()
