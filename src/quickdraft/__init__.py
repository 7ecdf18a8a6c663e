"""quickdraft: speculative decoding for Hugging Face causal language models."""

from quickdraft.errors import QuickdraftError
from quickdraft.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = ["QuickdraftError", "SamplingParams", "__version__"]
