"""Sampled-verify equals plain seeded sampling token for token, for any drafts and any K."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from _oracle import chi2_quantile, chi_square
from deepinfer_sampling import Sampler, SamplingBatch, SamplingParams, SamplingRow
from deepinfer_spec import accept_while_equal, greedy_verify, sampled_verify, verify_sampling_rows
from hypothesis import given, settings
from hypothesis import strategies as st

VOCAB = 24
EOS = 0
SAMPLER = Sampler()


@functools.cache
def toy_logits(context: tuple[int, ...]) -> torch.Tensor:
    """A fixed 'target model': logits [V] of the next token after ``context``."""
    g = torch.Generator().manual_seed(hash(context) % (2**61))
    return torch.randn(VOCAB, generator=g, dtype=torch.float64).to(torch.float32) * 2.0


def plain_generate(params: SamplingParams, prompt: list[int], n: int) -> list[int]:
    """Non-speculative decoding: one Sampler call per token."""
    out: list[int] = []
    for _ in range(n):
        row = SamplingRow(params=params, position=len(prompt) + len(out), output_token_ids=out)
        batch = SamplingBatch.build([row], vocab_size=VOCAB, eos_token_ids=[EOS])
        out.append(int(SAMPLER(toy_logits(tuple(prompt + out))[None], batch).token_ids[0]))
    return out


def speculative_generate(requests, n: int, rng: random.Random, oracle: list[list[int]]):
    """All requests in one varlen batch per step; drafts are the true continuation corrupted at
    random (so some are accepted), with a random K per sequence per step."""
    outs: list[list[int]] = [[] for _ in requests]
    while any(len(o) < n for o in outs):
        active = [b for b, o in enumerate(outs) if len(o) < n]
        rows, drafts, logits, counts = [], [], [], []
        for b in active:
            params, prompt = requests[b]
            out = outs[b]
            k = rng.randint(0, 4)
            truth = oracle[b][len(out) : len(out) + k]
            draft = [t if rng.random() < 0.7 else rng.randrange(VOCAB) for t in truth]
            draft += [rng.randrange(VOCAB) for _ in range(k - len(draft))]
            rows += verify_sampling_rows(params, len(prompt) + len(out), out, draft)
            logits += [toy_logits(tuple(prompt + out + draft[:j])) for j in range(k + 1)]
            drafts += draft
            counts.append(k)
        cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int64)
        batch = SamplingBatch.build(rows, vocab_size=VOCAB, eos_token_ids=[EOS])
        result = sampled_verify(
            cu, torch.tensor(drafts, dtype=torch.int64), torch.stack(logits), batch
        )
        for i, b in enumerate(active):
            assert 0 <= int(result.num_accepted[i]) <= counts[i]
            outs[b] += result.tokens(i)
    return [o[:n] for o in outs]


params_st = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.4]),
    top_k=st.sampled_from([0, 3, 8]),
    top_p=st.sampled_from([1.0, 0.8]),
    min_p=st.sampled_from([0.0, 0.05]),
    presence_penalty=st.sampled_from([0.0, 0.7]),
    frequency_penalty=st.sampled_from([0.0, 0.4]),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    min_tokens=st.sampled_from([0, 4]),
    seq_seed=st.integers(0, 2**63 - 1),
)


@settings(max_examples=12, deadline=None)
@given(
    st.lists(
        st.tuples(params_st, st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=4)),
        min_size=1,
        max_size=4,
    ),
    st.integers(0, 2**32),
)
def test_sampled_verify_equals_plain_seeded_sampling(requests, seed):
    n = 10
    plain = [plain_generate(p, list(prompt), n) for p, prompt in requests]
    spec = speculative_generate(
        [(p, list(prompt)) for p, prompt in requests], n, random.Random(seed), plain
    )
    assert spec == plain


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=5), st.integers(0, 2**32))
def test_varlen_batch_equals_per_sequence_calls(num_drafts, seed):
    rng = random.Random(seed)
    seqs = []
    for k in num_drafts:
        params = SamplingParams(
            temperature=rng.choice([0.0, 1.0]),
            top_k=rng.choice([0, 4]),
            seq_seed=rng.randrange(2**40),
        )
        prompt = [rng.randrange(1, VOCAB) for _ in range(3)]
        seqs.append((params, prompt, [rng.randrange(VOCAB) for _ in range(k)]))

    def run(group):
        rows, logits, drafts = [], [], []
        for params, prompt, draft in group:
            rows += verify_sampling_rows(params, len(prompt), [], draft)
            logits += [toy_logits(tuple(prompt + draft[:j])) for j in range(len(draft) + 1)]
            drafts += draft
        cu = torch.tensor([0, *torch.tensor([len(d) for *_, d in group]).cumsum(0).tolist()])
        batch = SamplingBatch.build(rows, vocab_size=VOCAB)
        return sampled_verify(
            cu, torch.tensor(drafts, dtype=torch.int64), torch.stack(logits), batch
        )

    whole = run(seqs)
    for b, seq in enumerate(seqs):
        assert whole.tokens(b) == run([seq]).tokens(0)


def test_k_zero_is_one_plain_sampling_step():
    params = SamplingParams(temperature=0.9, seq_seed=1234)
    prompt = [5, 6, 7]
    rows = verify_sampling_rows(params, len(prompt), [], [])
    assert len(rows) == 1
    batch = SamplingBatch.build(rows, vocab_size=VOCAB)
    out = sampled_verify(
        torch.tensor([0, 0]),
        torch.zeros(0, dtype=torch.int64),
        toy_logits(tuple(prompt))[None],
        batch,
    )
    assert out.num_accepted.tolist() == [0]
    assert out.tokens(0) == plain_generate(params, prompt, 1)


def test_first_emitted_token_is_distributed_as_the_sampler_distribution():
    """Losslessness of sampled-verify over seeds (fixed seeds, so not flaky)."""
    trials, k = 6000, 2
    params = [SamplingParams(temperature=1.0, top_k=6, seq_seed=s * 7 + 1) for s in range(trials)]
    prompt = [3, 4]
    g = torch.Generator().manual_seed(0)
    rows, drafts, logits = [], [], []
    for p in params:
        d = torch.randint(0, VOCAB, (k,), generator=g).tolist()
        rows += verify_sampling_rows(p, len(prompt), [], d)
        logits += [toy_logits(tuple(prompt + d[:j])) for j in range(k + 1)]
        drafts += d
    cu = torch.arange(trials + 1, dtype=torch.int64) * k
    batch = SamplingBatch.build(rows, vocab_size=VOCAB)
    out = sampled_verify(cu, torch.tensor(drafts), torch.stack(logits), batch)
    # Expected: softmax over the 6 largest logits of the first row (float64, by hand).
    x = toy_logits(tuple(prompt)).double().tolist()
    top = sorted(range(VOCAB), key=lambda i: -x[i])[:6]
    z = sum(pow(2.718281828459045, x[i] - x[top[0]]) for i in top)
    p0 = [pow(2.718281828459045, x[i] - x[top[0]]) / z if i in top else 0.0 for i in range(VOCAB)]
    counts = torch.bincount(out.output_token_ids[:, 0], minlength=VOCAB).tolist()
    stat, df = chi_square(counts, p0)
    assert stat < chi2_quantile(0.9999, df)


def test_accept_while_equal_and_greedy_by_hand():
    cu = torch.tensor([0, 2, 2, 5])
    drafts = torch.tensor([4, 1, 7, 7, 2])
    target = torch.tensor([4, 1, 9, 3, 7, 8, 2, 5])
    out = accept_while_equal(cu, drafts, target)
    assert [out.tokens(b) for b in range(3)] == [[4, 1, 9], [3], [7, 8]]
    scores = torch.nn.functional.one_hot(target, 10).float()
    assert torch.equal(greedy_verify(cu, drafts, scores).output_token_ids, out.output_token_ids)
    with pytest.raises(ValueError, match="target_token_ids must be"):
        accept_while_equal(cu, drafts, target[:-1])


def test_sampled_verify_rejects_a_batch_of_the_wrong_size():
    params = SamplingParams(seq_seed=1)
    batch = SamplingBatch.build(verify_sampling_rows(params, 0, [], [1]), vocab_size=VOCAB)
    with pytest.raises(ValueError, match="sampling_batch must describe"):
        sampled_verify(torch.tensor([0, 2]), torch.tensor([1, 2]), torch.zeros(3, VOCAB), batch)


GRAMMAR_VOCAB = [
    "<eos>",
    "a",
    "b",
    "c",
    "ab",
    "ba",
    "bc",
    "aa",
    "bb",
    "x",
    "y",
    "z",
    "q",
    "r",
    "s",
    "t",
    "u",
    "v",
    "w",
    "abc",
    "cab",
    "d",
    "e",
    "f",
]


@functools.cache
def _grammar_cache():
    from deepinfer_sampling import GrammarCache, tokenizer_info_from_vocab

    info = tokenizer_info_from_vocab(GRAMMAR_VOCAB, stop_token_ids=[EOS], vocab_size=VOCAB)
    return GrammarCache(info, max_threads=1)


def _generate_with_grammar(params, prompt, n, speculative, rng=None, oracle=None):
    so = {"schema_type": "regex", "schema": "[ab]{1,6}c"}
    matcher = _grammar_cache().matcher(so)
    out: list[int] = []
    while len(out) < n and not matcher.is_terminated():
        if not speculative:
            row = SamplingRow(params, len(prompt) + len(out), out, matcher)
            batch = SamplingBatch.build([row], vocab_size=VOCAB, eos_token_ids=[EOS])
            emitted = [int(SAMPLER(toy_logits(tuple(prompt + out))[None], batch).token_ids[0])]
        else:
            k = rng.randint(0, 4)
            truth = oracle[len(out) : len(out) + k]
            draft = [t if rng.random() < 0.6 else rng.randrange(VOCAB) for t in truth]
            draft += [rng.randrange(VOCAB) for _ in range(k - len(draft))]
            rows = verify_sampling_rows(params, len(prompt) + len(out), out, draft, matcher)
            logits = torch.stack(
                [toy_logits(tuple(prompt + out + draft[:j])) for j in range(k + 1)]
            )
            batch = SamplingBatch.build(rows, vocab_size=VOCAB, eos_token_ids=[EOS])
            emitted = sampled_verify(
                torch.tensor([0, k]), torch.tensor(draft, dtype=torch.int64), logits, batch
            ).tokens(0)
        for t in emitted:
            assert matcher.accept_token(t), (t, out)
            out.append(t)
            if matcher.is_terminated():
                break
    return out


@settings(max_examples=6, deadline=None)
@given(st.integers(0, 2**40), st.sampled_from([0.0, 0.8, 1.5]), st.integers(0, 2**32))
def test_sampled_verify_with_a_grammar_equals_plain_seeded_sampling(seq_seed, temperature, seed):
    params = SamplingParams(temperature=temperature, seq_seed=seq_seed)
    prompt = [1, 2]
    plain = _generate_with_grammar(params, prompt, 12, speculative=False)
    spec = _generate_with_grammar(
        params, prompt, 12, speculative=True, rng=random.Random(seed), oracle=plain
    )
    assert spec == plain
    assert plain[-1] == EOS  # the grammar finished: the test covered the whole match
