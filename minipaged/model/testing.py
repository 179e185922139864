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
                     tokenizer=None, **family_fields) -> Path:
    """Write a random model of ``family`` (a model_type of families.py) + byte tokenizer into ``folder``.

    ``tokenizer``: another (fast) tokenizer to ship instead of the byte one; the vocabulary and the special
    ids follow it. A real tokenizer makes detokenisation cost what it costs with a real model (benchmarks).

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
    tokenizer = tokenizer or build_byte_tokenizer()
    vocab_size = len(tokenizer)
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id}
    rope = family_fields.pop("rope_parameters", None) or {"rope_type": "default"}
    config = getattr(transformers, CONFIG_CLASSES[family])(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, rope_parameters={**rope, "rope_theta": rope_theta},
        tie_word_embeddings=tie_word_embeddings, initializer_range=0.2, torch_dtype="float32", **special,
        **family_fields)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters() if random_norms_and_biases else ():
            if name.endswith("bias"):
                param.copy_(torch.randn_like(param) * 0.5)
            elif "norm" in name:
                param.copy_(1.0 + torch.randn_like(param) * 0.3)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# TinyLlama/TinyLlama-1.1B-Chat-v1.0's config.json, the sizes that matter (its weights cannot be downloaded here).
TINYLLAMA_SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                       num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, rope_theta=10000.0,
                       tie_word_embeddings=False)


def build_tinyllama_shaped(folder: str | os.PathLike, *, device: str = "cpu",
                           dtype: torch.dtype = torch.float32) -> Path:
    """A TinyLlama-1.1B-shaped LlamaForCausalLM with random weights (normal, std 0.02) and the byte tokenizer,
    saved once in ``dtype``: for measuring speed and memory, which depend on the shapes, not on the values.
    ``device="cuda"`` draws the 1.1B random numbers on the GPU (seconds there, against minutes on a CPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**TINYLLAMA_SHAPE, torch_dtype=str(dtype).removeprefix("torch.")))
    model = model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)
    return folder


# transformers' module names -> llama.cpp's tensor names (what a GGUF file calls each weight of a layer).
GGUF_LAYER_TENSORS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_tiny_gguf(folder: str | os.PathLike, out_file: str | os.PathLike) -> Path:
    """Write the tiny model in ``folder`` (from ``build_tiny_model``) as a float32 GGUF file, the way llama.cpp
    lays one out, so that tests can load GGUF files of every family without a download.

    llama.cpp writes Mistral under the ``llama`` architecture and stores Llama's q and k rows permuted
    (transformers undoes both on load); the byte tokenizer goes in as a ``gpt2`` BPE vocabulary with no merges.
    """
    import numpy as np
    from gguf import GGUFWriter
    from transformers import AutoModelForCausalLM
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    config, out_file = model.config, Path(out_file)
    arch = "llama" if config.model_type == "mistral" else config.model_type
    writer = GGUFWriter(str(out_file), arch)
    writer.add_name(f"tiny-{config.model_type}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    byte_chars = bytes_to_unicode()
    tokens = [byte_chars[b] for b in range(BYTE_VOCAB)] + SPECIAL_TOKENS
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * BYTE_VOCAB + [3] * len(SPECIAL_TOKENS))   # normal, then control tokens
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(BYTE_VOCAB)
    writer.add_eos_token_id(BYTE_VOCAB + 1)
    writer.add_pad_token_id(BYTE_VOCAB + 2)
    for name, tensor in model.state_dict().items():
        array = tensor.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            if config.tie_word_embeddings:
                continue
            gguf_name = "output.weight"
        else:                                                 # model.layers.{i}.{module}.{weight|bias}
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{GGUF_LAYER_TENSORS[module]}.{kind}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj") and kind == "weight":
                heads = config.num_attention_heads if module == "self_attn.q_proj" else config.num_key_value_heads
                array = (array.reshape(heads, 2, array.shape[0] // heads // 2, *array.shape[1:])
                         .swapaxes(1, 2).reshape(array.shape))
        writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_file
