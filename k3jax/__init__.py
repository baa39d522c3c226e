"""k3jax: a JAX serving stack for Kimi-K3-class hybrid models (KDA + MLA + latent MoE)."""

from k3jax.config import ModelConfig, PRESETS, get_preset, from_hf_config, load_hf_config
from k3jax.runtime import Model, load_model



def __getattr__(name):
    """The serving API lives in the `serve` package; import it lazily."""
    if name == "LLM":
        from serve.llm import LLM
        return LLM
    if name == "initialize_distributed":
        from serve.multihost import initialize
        return initialize
    if name == "LoRARequest":
        from serve.lora import LoRARequest
        return LoRARequest
    if name in ("BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence"):
        import serve.beam_search
        return getattr(serve.beam_search, name)
    if name in ("LogitsProcessor", "ProcessorContext"):
        import serve.logits_processors
        return getattr(serve.logits_processors, name)
    if name in ("SamplingParams", "RequestOutput", "RequestOutputKind", "StructuredOutputsParams"):
        import serve.types
        return getattr(serve.types, name)
    raise AttributeError(f"module 'k3jax' has no attribute {name!r}")


__all__ = ["LLM", "LoRARequest", "initialize_distributed", "SamplingParams", "RequestOutput", "RequestOutputKind",
           "StructuredOutputsParams", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "LogitsProcessor",
           "ProcessorContext", "Model", "ModelConfig", "PRESETS", "get_preset", "from_hf_config", "load_hf_config",
           "load_model"]
__version__ = "0.1.0"
