"""Tiny random configurations of the transformers families kernmap kernelizes (no downloads): 2 layers,
hidden 32, 4 heads (2 KV heads), vocabulary 64; MoE families with 4 experts, top-2."""

import torch
from transformers import (
    LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM,
    Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM,
    Qwen3MoeConfig, Qwen3MoeForCausalLM,
)

VOCAB = 64
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64)
_MOE = dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)

FAMILIES = {
    "qwen2": lambda: (Qwen2ForCausalLM, Qwen2Config(intermediate_size=48, **_COMMON)),
    "qwen3": lambda: (Qwen3ForCausalLM, Qwen3Config(intermediate_size=48, head_dim=8, **_COMMON)),
    "llama": lambda: (LlamaForCausalLM, LlamaConfig(intermediate_size=48, **_COMMON)),
    "mistral": lambda: (MistralForCausalLM, MistralConfig(intermediate_size=48, **_COMMON)),
    "qwen2_moe": lambda: (Qwen2MoeForCausalLM, Qwen2MoeConfig(intermediate_size=48, shared_expert_intermediate_size=24,
                                                              **_MOE, **_COMMON)),
    "qwen3_moe": lambda: (Qwen3MoeForCausalLM, Qwen3MoeConfig(intermediate_size=48, head_dim=8, **_MOE, **_COMMON)),
    "mixtral": lambda: (MixtralForCausalLM, MixtralConfig(intermediate_size=16, num_local_experts=4,
                                                          num_experts_per_tok=2, **_COMMON)),
}
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral")


def make_model(family: str, dtype=torch.float32, seed: int = 0):
    cls, config = FAMILIES[family]()
    torch.manual_seed(seed)
    return cls(config).to(dtype)


def batch(seed: int = 1, shape=(2, 9)):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def expected_layers(family: str) -> dict[str, int]:
    """How many modules of each layer the tiny model has (2 decoder layers)."""
    # rotary_pos_emb: one per attention; ForCausalLMLoss: the *ForCausalLM model itself
    layers = {"RMSNorm": 2 * 2 + 1, "rotary_pos_emb": 2, "ForCausalLMLoss": 1}
    if family in ("qwen3", "qwen3_moe"):
        layers["RMSNorm"] += 2 * 2  # q_norm and k_norm per attention
    if family in MOE_FAMILIES:
        layers["Experts"] = 2
        layers["SiLU"] = 2 * (2 if family == "qwen2_moe" else 1)  # the experts' act_fn (+ the shared expert's)
        if family == "qwen2_moe":
            layers["SiluAndMul"] = 2  # the shared expert
    else:
        layers["SiluAndMul"] = 2
        layers["SiLU"] = 2  # the MLP's act_fn (used only if the MLP falls back)
    return layers


def save_checkpoint(family: str, path, seed: int = 0):
    """A tiny checkpoint folder as from_pretrained reads it: config.json, model.safetensors and a Qwen2 tokenizer
    of single letters ("<pad>" 0, "<eos>" 1, "<unk>" 2, the space 3, "a".."z" 4..29, no merges), so that TRL's
    SFTTrainer finds a processing class. Qwen families only: AutoTokenizer picks the tokenizer class by model
    type."""
    import string

    from transformers import Qwen2Tokenizer

    model = make_model(family, seed=seed)
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    model.save_pretrained(path)
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for ch in "\u0120" + string.ascii_lowercase:  # \u0120: byte-level BPE's space
        vocab[ch] = len(vocab)
    Qwen2Tokenizer(vocab=vocab, merges=[], unk_token="<unk>", pad_token="<pad>",
                   eos_token="<eos>").save_pretrained(path)
    return model
