"""deepinfer_engine: the offline engine (LLM API, scheduler, output processor, KV cache manager,
model runner).

Users import the facade `deepinfer` (LLM, SamplingParams, RequestOutput); the modules here are for
tools and tests: `config.EngineConfig`, `engine.Engine`, `engine_model.EngineModel` (what the
engine needs from a model), `scheduler.Scheduler`, `output_processor.OutputProcessor`,
`kv_cache_manager.KVCacheManager`, `model_runner.ModelRunner`.
"""

from deepinfer_engine.config import EngineConfig
from deepinfer_engine.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = ["CompletionOutput", "EngineConfig", "Logprob", "RequestOutput"]
