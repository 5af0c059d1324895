"""Run by test_ranks.py under torchrun: every process is one rank of an LLM(data=2, expert=2)
and writes the tokens it returns to <out dir>/rank<RANK>.json."""

import json
import os
import sys

import torch
from deepinfer_engine.llm import LLM
from deepinfer_sampling.params import SamplingParams

torch.set_num_threads(1)
prompts, max_tokens = json.loads(sys.argv[2])
llm = LLM(
    kv_cache_bytes=8 << 20,
    max_num_seqs=8,
    data_parallel_size=2,
    expert_parallel_size=2,
    collective_timeout_s=60,
)
outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump([[c.token_ids for c in o.outputs] for o in outs], f)
llm.shutdown()
