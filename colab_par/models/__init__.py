"""Reference models and adapters for third-party ones."""
from colab_par.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
