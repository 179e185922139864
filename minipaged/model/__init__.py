"""Model loading (transformers does configs, tokenizers and weights), the model families as data, and our
compact Llama-architecture forward pass."""
from .families import FAMILIES, ModelFamily
from .llama import CompactLlama, CompactModel, AttentionMetadata
from .loader import LoadedModel, ModelNotAvailableError, UnsupportedModelError, load_model

__all__ = ["CompactLlama", "CompactModel", "FAMILIES", "ModelFamily", "AttentionMetadata", "LoadedModel",
           "ModelNotAvailableError", "UnsupportedModelError", "load_model"]
