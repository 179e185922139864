"""Tiny random checkpoints (Llama, and the other families of families.py) for tests, demos without the real model, and fast TUI runs.

They are saved with transformers' own ``save_pretrained`` so they go through the same loading code as a
real model. The tokenizer is byte-level (every byte is a token) so any text round-trips.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

BYTE_VOCAB = 256
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]


def build_byte_tokenizer():
    """A byte-level tokenizer: ids 0..255 are bytes, then <s>, </s>, <pad>. Offline and deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(BYTE_VOCAB)}
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = BYTE_VOCAB + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return fast


# transformers' config class of each family (families.py), by model_type.
CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def build_tiny_llama(folder: str | os.PathLike, *, hidden_size: int = 64, num_layers: int = 2,
                     num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                     tie_word_embeddings: bool = True, max_position_embeddings: int = 2048,
                     rope_theta: float = 10000.0, seed: int = 0) -> Path:
    """Write a random LlamaForCausalLM + byte tokenizer into ``folder`` and return its path."""
    return build_tiny_model(folder, "llama", hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                            num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                            tie_word_embeddings=tie_word_embeddings, max_position_embeddings=max_position_embeddings,
                            rope_theta=rope_theta, seed=seed, random_norms_and_biases=False)


def build_tiny_model(folder: str | os.PathLike, family: str = "llama", *, hidden_size: int = 64,
                     num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                     tie_word_embeddings: bool = True, max_position_embeddings: int = 2048,
                     rope_theta: float = 10000.0, seed: int = 0, random_norms_and_biases: bool = True,
                     **family_fields) -> Path:
    """Write a random model of ``family`` (a model_type of families.py) + byte tokenizer into ``folder``.

    ``family_fields`` go to the family's config class as they are (``head_dim``, ``sliding_window``,
    ``rope_parameters`` ...). The weights are scaled up from transformers' default init so that the logits are
    spread out: greedy argmax then has clear winners, and tiny numerical differences cannot flip a token. Norm
    weights and biases, which transformers initialises to ones and zeros, are drawn at random too: a forward
    pass that forgot the q/k norm or a bias would then give other logits, not the same ones by luck
    (``build_tiny_llama`` keeps transformers' ones and zeros: other tests' recorded outputs rely on its weights).
    """
    import transformers
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(seed)
    vocab_size = BYTE_VOCAB + len(SPECIAL_TOKENS)
    rope = family_fields.pop("rope_parameters", None) or {"rope_type": "default"}
    config = getattr(transformers, CONFIG_CLASSES[family])(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, rope_parameters={**rope, "rope_theta": rope_theta},
        tie_word_embeddings=tie_word_embeddings, bos_token_id=BYTE_VOCAB, eos_token_id=BYTE_VOCAB + 1,
        pad_token_id=BYTE_VOCAB + 2, initializer_range=0.2, torch_dtype="float32", **family_fields)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters() if random_norms_and_biases else ():
            if name.endswith("bias"):
                param.copy_(torch.randn_like(param) * 0.5)
            elif "norm" in name:
                param.copy_(1.0 + torch.randn_like(param) * 0.3)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)
    return folder
