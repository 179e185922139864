"""minipaged: a compact, readable LLM inference engine that shows how vLLM-class serving works.

    from minipaged import Engine, SamplingParams
    engine = Engine(model="smollm2")
    print(engine.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))[0].text)
"""
from .config import ConfigError, EngineConfig
from .events import EngineInfo, StepEvent
from .outputs import CompletionOutput, RequestOutput
from .request import InvalidRequestError, SamplingParams, StructuredOutputsParams

__all__ = ["Engine", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "StepEvent", "EngineInfo",
           "EngineConfig", "ConfigError", "InvalidRequestError"]


def __getattr__(name: str):
    # Importing the engine pulls in torch and transformers; do it only when someone asks for it.
    if name == "Engine":
        from .engine import Engine
        return Engine
    raise AttributeError(name)
