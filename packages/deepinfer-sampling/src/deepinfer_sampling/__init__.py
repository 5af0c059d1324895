"""deepinfer_sampling: deterministic, grammar-constrained sampling of next tokens from logits.

Stands alone (torch + xgrammar). xgrammar is imported only when a grammar is used.
"""

from .batch import CANDIDATE_CAP, NO_TOP_K, RowGroup, SamplingBatch, SamplingRow
from .grammar import (
    GrammarCache,
    GrammarMatcher,
    allocate_token_bitmask,
    apply_token_bitmask,
    bitmask_width,
    tokenizer_info_from_tokenizer,
    tokenizer_info_from_vocab,
)
from .json_schema import UnsupportedJsonSchema
from .logprobs import TokenLogprobs, token_logprobs
from .params import (
    SCHEMA_TYPES,
    SamplingParams,
    StructuredOutput,
    StructuredOutputsParams,
    parse_grammar,
)
from .rng import (
    STREAM_DRAFT,
    STREAM_SAMPLE,
    STREAM_SPEC_ACCEPT,
    STREAM_SPEC_RESIDUAL,
    counter_uniform,
    row_keys,
    uniform_from_keys,
)
from .sampler import Sampler, SamplerOutput

__version__ = "0.1.0"

__all__ = [
    "CANDIDATE_CAP",
    "NO_TOP_K",
    "SCHEMA_TYPES",
    "STREAM_DRAFT",
    "STREAM_SAMPLE",
    "STREAM_SPEC_ACCEPT",
    "STREAM_SPEC_RESIDUAL",
    "GrammarCache",
    "GrammarMatcher",
    "RowGroup",
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingParams",
    "SamplingRow",
    "StructuredOutput",
    "StructuredOutputsParams",
    "TokenLogprobs",
    "UnsupportedJsonSchema",
    "allocate_token_bitmask",
    "apply_token_bitmask",
    "bitmask_width",
    "counter_uniform",
    "parse_grammar",
    "row_keys",
    "token_logprobs",
    "tokenizer_info_from_tokenizer",
    "tokenizer_info_from_vocab",
    "uniform_from_keys",
]
