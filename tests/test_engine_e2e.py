"""End to end over the built-in trained tiny V4.1 checkpoint (the random-weight tiny checkpoint
where a test needs its window of 8): LLM -> engine -> deepinfer_model -> sampler.

Kept small (a few tokens, fp32 on CPU): the reference path of the model is slow on CPU.
"""

from __future__ import annotations

import gc
import re

import pytest
import torch
from _tiny_llm import tiny_llm
from deepinfer import LLM, SamplingParams
from deepinfer_model.batch import ForwardBatch
from deepinfer_model.cache import CacheSpec, KVCache
from deepinfer_model.tiny_checkpoint import ensure_tiny_checkpoint

PROMPTS = ["Hello, my name is", "The capital of France is a city that", "1 2 3"]


@pytest.fixture(scope="module")
def llm():
    return tiny_llm(kv_cache_bytes=64 << 20, max_num_seqs=8, max_model_len=256)


def plain_greedy(
    model, config, prompt_ids: list[int], n: int, floor: int = 0, mode: str = "compact"
) -> list[int]:
    """Greedy decoding that recomputes the whole sequence from an empty cache at every step.

    floor > 0: the model's own YOCO truncation (`ForwardBatch.yoco_floor`, truncating as `mode`
    says), one shot.
    """
    toks, out = list(prompt_ids), []
    spec = CacheSpec.from_config(config, block_size=8, dtype=torch.float32)
    for _ in range(n):
        blocks = (len(toks) + 7) // 8
        cache = KVCache(config, spec, blocks, 1, device="cpu", dtype=torch.float32)
        batch = ForwardBatch.build([toks], [0], [0], [list(range(blocks))])
        if floor:
            batch.yoco_floor = torch.tensor([floor])
            batch.yoco_truncation = mode
        with torch.inference_mode():
            t = int(model.forward(batch, cache).logits[0].argmax())
        toks.append(t)
        out.append(t)
        if t == config.eos_token_id:
            break
    return out


def test_greedy_equals_plain_loop_and_mixed_batch_equals_alone(llm):
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=3)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    for o in outs:
        ref = plain_greedy(eng.model.model, eng.model.config, o.prompt_token_ids, 3)
        assert o.outputs[0].token_ids == ref
        assert o.outputs[0].text == llm.get_tokenizer().decode(ref)
    alone = llm.generate([PROMPTS[1]], sp, use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_async_on_equals_off_and_seeded_is_reproducible(llm):
    sp = SamplingParams(temperature=0.8, top_k=50, seed=7, max_tokens=4, n=2)
    llm.engine.config.async_scheduling = True
    on = llm.generate(PROMPTS[:2], sp, use_tqdm=False)
    llm.engine.config.async_scheduling = False
    off = llm.generate(PROMPTS[1::-1], sp, use_tqdm=False)[::-1]
    llm.engine.config.async_scheduling = True
    toks = [[c.token_ids for c in o.outputs] for o in on]
    assert toks == [[c.token_ids for c in o.outputs] for o in off]


def test_structured_output_parses(llm):
    sp = SamplingParams(
        temperature=1.0,
        seed=1,
        max_tokens=12,
        so_args={"schema_type": "regex", "schema": "[0-9]{2}-[a-c]"},
    )
    out = llm.generate([PROMPTS[2]], sp, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch("[0-9]{2}-[a-c]", out.text)


def test_chat_and_bad_input(llm):
    out = llm.chat(
        [{"role": "user", "content": "hi"}],
        SamplingParams(temperature=0, max_tokens=2),
        use_tqdm=False,
    )[0]
    assert len(out.outputs[0].token_ids) >= 1 and out.prompt.startswith("<｜begin▁of▁sentence｜>")
    with pytest.raises(ValueError, match=r"prompt 1: .*role"):
        llm.chat(
            [[{"role": "user", "content": "a"}], [{"role": "wizard", "content": "b"}]],
            use_tqdm=False,
        )
    with pytest.raises(ValueError, match="prompt 0: token id"):
        llm.generate([[1, 10**6]], use_tqdm=False)


@pytest.mark.parametrize("mode", ["compact", "mask"])
def test_yoco_truncation_matches_the_models_truncated_prefill_under_chunking(mode):
    k = 10  # tiny window 8 + (use_nextn_decode 1 + 1)
    llm = LLM(
        str(ensure_tiny_checkpoint()),
        accelerator="cpu",
        kv_cache_bytes=64 << 20,
        max_num_seqs=4,
        block_size=8,
        max_model_len=256,
        max_num_batched_tokens=7,
        yoco_prefill_truncation_mode=mode,
        yoco_prefill_keep_tokens=k,
        use_nextn_decode=1,
    )
    prompt = "The quick brown fox jumps over the lazy dog"
    out = llm.generate(
        [prompt, "1 2 3"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False
    )
    model, cfg = llm.engine.model.model, llm.engine.model.config
    for o in out:
        ids = o.prompt_token_ids
        ref = plain_greedy(model, cfg, ids, 3, floor=max(0, len(ids) - k), mode=mode)
        assert o.outputs[0].token_ids == ref


def test_one_token_prompt_admitted_next_to_a_decode_row():
    # max_num_seqs=2: the third prompt (1 token) is admitted when the first finishes, and runs
    # in the same step as the second prompt's decode row (both 1 new token: one select group).
    llm = tiny_llm(kv_cache_bytes=64 << 20, max_num_seqs=2, max_model_len=64)
    prompts = [list(range(5, 15)), list(range(20, 32)), [40]]
    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (2, 8, 3)]
    outs = llm.generate(prompts, sps, use_tqdm=False)
    model, cfg = llm.engine.model.model, llm.engine.model.config
    for o, m in zip(outs, (2, 8, 3), strict=True):
        ref = plain_greedy(model, cfg, o.prompt_token_ids, m)
        assert o.outputs[0].token_ids == ref


def _gpu_greedy_tokens(prompts, sp, **kw) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of a fresh CUDA engine (freed afterwards) and its captured graph buckets."""
    llm = LLM(accelerator="nvidia", dtype="float32", max_num_seqs=8, max_model_len=256, **kw)
    try:
        outs = llm.generate(prompts, sp, use_tqdm=False)
        graphs = llm.engine.runner.graphs
        return [o.outputs[0].token_ids for o in outs], sorted(graphs.buckets) if graphs else []
    finally:
        del llm  # give the KV cache back before the next engine sizes its own
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_give_the_eager_tokens():
    """Decode steps through piecewise CUDA graphs == enforce_eager, token for token, with async
    scheduling on and off (4 prompts: the graphs run exactly the eager shapes, bucket 4)."""
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [*PROMPTS, "one more prompt"]
    want, none = _gpu_greedy_tokens(prompts, sp, enforce_eager=True, gpu_memory_utilization=0.2)
    assert none == []
    for async_on in (True, False):
        got, buckets = _gpu_greedy_tokens(
            prompts, sp, async_scheduling=async_on, gpu_memory_utilization=0.2
        )
        assert buckets == [4]
        assert got == want, f"async_scheduling={async_on}"


TINY_CPU = {
    "accelerator": "cpu",
    "dtype": "float32",
    "kv_cache_bytes": 64 << 20,
    "max_num_seqs": 4,
    "block_size": 8,
    "max_model_len": 128,
}


def test_model_dir_env_is_resolved_by_the_engine_config(tmp_path, monkeypatch):
    """DEEPINFER_HF_MODEL_DIR reaches the loader through EngineConfig: the same model as the
    explicit path (the model package itself reads no environment)."""
    from deepinfer_model.tiny_checkpoint import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(ckpt))
    from_env = LLM(**TINY_CPU)
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR")
    explicit = LLM(str(ckpt), **TINY_CPU)
    assert from_env.engine.config.model == str(ckpt)
    assert from_env.engine.model.name == explicit.engine.model.name == str(ckpt)
    sp = SamplingParams(temperature=0, max_tokens=3)
    a, b = (llm.generate([PROMPTS[0]], sp, use_tqdm=False)[0] for llm in (from_env, explicit))
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_batch_invariant_argument_and_env_give_the_same_bits(monkeypatch):
    """LLM(batch_invariant=True) and DEEPINFER_BATCH_INVARIANT=1 are one setting: the same
    tokens and logprobs, bit for bit, with an engine of the other mode built and run in between;
    every forward of each engine runs in its own engine's mode."""
    from deepinfer_kernels import REGISTRY

    def recording(llm: LLM) -> tuple[LLM, list[bool]]:
        modes: list[bool] = []
        runtime = llm.engine.model
        forward = runtime.forward

        def spy(batch, cache):
            modes.append(REGISTRY.batch_invariant)
            return forward(batch, cache)

        runtime.forward = spy
        return llm, modes

    by_arg, arg_modes = recording(LLM(batch_invariant=True, **TINY_CPU))
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    by_env, env_modes = recording(LLM(**TINY_CPU))
    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT")
    default, default_modes = recording(LLM(**TINY_CPU))
    sp = SamplingParams(temperature=0, max_tokens=2, logprobs=2)

    def run(llm: LLM):  # short prompts: batch-invariant mode runs every token alone
        outs = llm.generate(["ab", "1 2"], sp, use_tqdm=False)
        return [(c.token_ids, c.cumulative_logprob, c.logprobs) for o in outs for c in o.outputs]

    want = run(by_arg)
    run(default)
    assert run(by_env) == want
    assert set(arg_modes) == set(env_modes) == {True} and set(default_modes) == {False}
