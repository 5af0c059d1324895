"""deepinfer_spec: speculative decoding for deepinfer (verification rules; DSpark drafting later).

Verification of a flat varlen batch of drafts (layout in :mod:`deepinfer_spec.verify_batch`):

* :func:`rejection_sample`: lossless rejection sampling (accept with min(1, p/q)).
* :func:`sampled_verify`: seeded; equals plain seeded sampling token for token.
* :func:`greedy_verify`: temperature 0.
"""

from .greedy_verify import greedy_verify
from .rejection_sampling import rejection_sample, sample_from_weights
from .sampled_verify import accept_while_equal, sampled_verify, verify_sampling_rows
from .verify_batch import DraftLayout, VerifyResult, check_draft_layout, check_verify_inputs

__all__ = [
    "DraftLayout",
    "VerifyResult",
    "accept_while_equal",
    "check_draft_layout",
    "check_verify_inputs",
    "greedy_verify",
    "rejection_sample",
    "sample_from_weights",
    "sampled_verify",
    "verify_sampling_rows",
]
