"""k3jax: a JAX serving stack for Kimi-K3-class hybrid models (KDA + MLA + latent MoE)."""

from k3jax.config import ModelConfig, PRESETS, get_preset, from_hf_config, load_hf_config
from k3jax.runtime import Model, load_model

__all__ = ["Model", "ModelConfig", "PRESETS", "get_preset", "from_hf_config", "load_hf_config", "load_model"]
__version__ = "0.1.0"
