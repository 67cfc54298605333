"""roseray: a continuous-batching LLM engine with a paged KV cache, served on Ray Serve."""

from roseray.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig", "__version__"]


def __getattr__(name: str):
    # LLM and EngineConfig pull in torch and the models; load them on first use so that
    # `import roseray` stays cheap for the HTTP layer and the CLI's --help.
    if name == "LLM":
        from roseray.llm import LLM

        return LLM
    if name == "EngineConfig":
        from roseray.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'roseray' has no attribute {name!r}")
