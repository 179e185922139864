"""Model loading (transformers does configs, tokenizers and weights) and our compact Llama forward pass."""
from .llama import CompactLlama, AttentionMetadata
from .loader import LoadedModel, ModelNotAvailableError, UnsupportedModelError, load_model

__all__ = ["CompactLlama", "AttentionMetadata", "LoadedModel", "ModelNotAvailableError",
           "UnsupportedModelError", "load_model"]
