"""deepinfer: the user facade of the deepinfer engine.

from deepinfer import LLM, SamplingParams
llm = LLM()  # the built-in tiny checkpoint; LLM("/path/to/DeepSeek-V4.1-Flash") for the real one
outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
"""

from deepinfer_engine.llm import LLM
from deepinfer_engine.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer_sampling.params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
