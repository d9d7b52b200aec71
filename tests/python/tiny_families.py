"""Every causal-LM family of the installed transformers (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) as a tiny random model,
built from its config class's defaults with the sizes shrunk by attribute name (no downloads, no per-family
table). A family that cannot be built that way is skipped with the reason, never silently."""

from __future__ import annotations

import dataclasses
import inspect
import re

import torch
import transformers
from transformers import CONFIG_MAPPING
from transformers.models.auto import modeling_auto

VOCAB = 128
MAX_PARAMETERS = 2_000_000

# Size attributes by name, to their tiny value: as many of them as a config has are set. Widths keep the head
# arithmetic whole: 4 heads of 8 (2 KV heads) in a hidden size of 32.
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers",
                 "num_decoder_layers", "num_encoder_layers")
_TINY = {
    **dict.fromkeys(_LAYER_COUNTS, 2),
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "embedding_size", "emb_dim", "embedding_dim",
                     "word_embed_proj_dim", "input_embedding_size", "output_embedding_size", "lru_width",
                     "attention_hidden_size", "backbone_hidden_size", "hidden_size_global", "out_hidden_size"), 32),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "n_inner", "d_inner",
                     "dff", "dim_ff", "d_ff", "ffn_hidden_size", "feed_forward_size", "intermediate_size_mlp",
                     "dense_intermediate_size", "mlp_dim"), 48),
    **dict.fromkeys(("moe_intermediate_size", "expert_ffn_hidden_size", "shared_expert_intermediate_size",
                     "shared_experts_intermediate_size", "moe_shared_expert_intermediate_size",
                     "shared_intermediate_size", "router_hidden_size"), 16),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads",
                     "decoder_attention_heads", "encoder_attention_heads", "num_decoder_attention_heads",
                     "num_encoder_attention_heads", "swa_num_attention_heads", "linear_num_heads",
                     "linear_num_value_heads", "index_n_heads", "mamba_n_heads", "mamba_num_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "num_query_groups", "swa_num_key_value_heads",
                     "linear_num_key_heads"), 2),
    **dict.fromkeys(("head_dim", "attention_head_dim", "attention_head_size", "d_head", "dim_head", "kv_channels",
                     "swa_head_dim", "linear_head_dim", "linear_key_head_dim", "linear_value_head_dim",
                     "index_head_dim", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                     "rotary_dim"), 8),
    # State-space heads: 4 of 16 fill the usual expand = 2 of a hidden size of 32.
    **dict.fromkeys(("mamba_d_head", "mamba_head_dim", "mamba_headdim"), 16),
    **dict.fromkeys(("qk_head_dim",), 16),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank", "o_lora_rank", "laurel_rank", "adapter_rank",
                     "hidden_size_per_layer_input", "ple_embed_dim", "time_step_rank", "mamba_dt_rank"), 8),
    **dict.fromkeys(("state_size", "ssm_state_size", "mamba_d_state"), 8),
    **dict.fromkeys(("mamba_d_ssm",), 64),
    **dict.fromkeys(("vocab_size", "decoder_vocab_size", "vocab_size_per_layer_input", "unpadded_vocab_size"), VOCAB),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_target_positions",
                     "max_source_positions", "original_max_position_embeddings", "context_length"), 128),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k"), 2),
    **dict.fromkeys(("n_group", "topk_group", "n_shared_experts", "num_shared_experts", "first_k_dense_replace",
                     "n_groups", "mamba_n_groups", "mamba_ngroups"), 1),
}
# Token ids must lie in the tiny vocabulary.
# Sizes a config may leave None for its model to derive, which some models then do not.
_DERIVED = ("head_dim", "num_key_value_heads")
_TOKEN_ID = re.compile(r".*_token_id$|.*_token_index$")
_SUB_CONFIGS = ("text_config", "decoder_config", "language_config", "llm_config")
_LAYER_KINDS = ("layer_types", "layers_block_type", "block_types", "mlp_layer_types", "hybrid_override_pattern")


@dataclasses.dataclass
class Family:
    name: str  # the model type
    model_class: type
    config: object


def _kept_layers(defaults: dict) -> list[int]:
    """The layers a tiny model keeps: the first of each kind (attention, sliding, linear, state-space, dense or
    sparse MLP, ...) in every per-layer kind list of the config; at least two."""
    kinds = [defaults[k] for k in _LAYER_KINDS if isinstance(defaults.get(k), (list, str)) and defaults[k]]
    kept = {i for k in kinds for i in (list(map(str, k)).index(kind) for kind in dict.fromkeys(map(str, k)))}
    length = min((len(k) for k in kinds), default=2)
    return sorted(kept | set(range(min(2, length))))


def _shrunk(defaults: dict) -> dict:
    """The attributes of a config's defaults to change, and their tiny values."""
    kept = _kept_layers(defaults)
    layers = len(kept)
    out = {}
    for key in _LAYER_KINDS:
        value = defaults.get(key)
        if isinstance(value, (list, str)) and value:
            picked = [value[i] for i in kept if i < len(value)]
            out[key] = "".join(picked) if isinstance(value, str) else picked
    for key, value in defaults.items():
        if isinstance(value, bool) or key in out:
            continue
        if key in _LAYER_COUNTS and isinstance(value, int):
            out[key] = layers
        elif key in _TINY and (isinstance(value, int) or (value is None and key in _DERIVED)):
            out[key] = _TINY[key]
        elif key in _TINY and isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            out[key] = [_TINY[key]] * layers  # one per layer
        elif _TOKEN_ID.match(key) and isinstance(value, int):
            out[key] = min(value, VOCAB - 1)
        elif _TOKEN_ID.match(key) and isinstance(value, list):
            out[key] = [min(v, VOCAB - 1) for v in value if isinstance(v, int)]
        elif key == "per_layer_config" and isinstance(value, dict):
            out[key] = {kept.index(int(k)): v for k, v in value.items() if str(k).isdigit() and int(k) in kept}
        elif key in _SUB_CONFIGS and isinstance(value, dict):
            out[key] = {**value, **_shrunk(value)}
    return out


def model_classes() -> dict[str, str]:
    return dict(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def build(model_type: str, class_name: str) -> Family:
    """The family's tiny config and its model class; raises what transformers raises when it cannot be made."""
    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class().to_dict()
    accepted = set(inspect.signature(config_class.__init__).parameters) | set(defaults)
    config = config_class(**{k: v for k, v in _shrunk(defaults).items() if k in accepted})
    model_class = getattr(transformers, class_name)
    if not isinstance(config, model_class.config_class):  # a composite config: the model takes its text part
        config = config.get_text_config()
    with torch.device("meta"):
        parameters = sum(p.numel() for p in model_class(config).parameters())
    if parameters > MAX_PARAMETERS:
        raise ValueError(f"not tiny after shrinking by attribute name: {parameters} parameters (more than "
                         f"{MAX_PARAMETERS}: sizes this table does not know, such as a vision or audio tower)")
    return Family(model_type, model_class, config)


def make(family: Family, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return family.model_class(family.config).float().eval()
