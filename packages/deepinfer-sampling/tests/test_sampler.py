"""Sampler properties, checked against float64 references written here with plain loops."""

import math

import pytest
import torch
from deepinfer_sampling import Sampler, SamplingBatch, SamplingParams, SamplingRow
from hypothesis import given, settings
from hypothesis import strategies as st

SAMPLER = Sampler()


def reference_distribution(logits, params, output_ids=(), eos_ids=(), vocab=None):
    """{token: probability} a row must sample from, in float64 with Python loops."""
    x = [float(v) for v in logits]
    counts = {}
    for t in output_ids:
        counts[t] = counts.get(t, 0) + 1
    for t, c in counts.items():
        if math.isinf(x[t]):
            continue
        r = params.repetition_penalty
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
        x[t] -= params.frequency_penalty * c + params.presence_penalty
    for t, b in (params.logit_bias or {}).items():
        x[t] += b
    if len(output_ids) < params.min_tokens:
        for t in (*eos_ids, *params.stop_token_ids):
            x[t] = -math.inf
    if params.temperature == 0:
        best = max(range(len(x)), key=lambda i: (x[i], -i))
        return {best: 1.0}
    v = [xi / params.temperature for xi in x]
    m = max(v)
    p = [math.exp(vi - m) for vi in v]
    z = sum(p)
    p = [pi / z for pi in p]
    order = sorted((i for i in range(len(p)) if p[i] > 0), key=lambda i: -p[i])
    kept = [i for i in order if p[i] >= params.min_p * p[order[0]]]
    if params.top_k > 0:
        kept = kept[: params.top_k]
    mass = sum(p[i] for i in kept)
    final, before = [], 0.0
    for i in kept:
        if before < params.top_p:
            final.append(i)
        before += p[i] / mass
    z = sum(p[i] for i in final)
    return {i: p[i] / z for i in final}


params_st = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.5]),
    top_k=st.sampled_from([0, -1, 1, 2, 5, 20, 2000]),
    top_p=st.sampled_from([1.0, 0.95, 0.6, 0.2]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
    presence_penalty=st.sampled_from([0.0, 0.5, -1.0]),
    frequency_penalty=st.sampled_from([0.0, 0.3]),
    repetition_penalty=st.sampled_from([1.0, 1.3, 0.8]),
    min_tokens=st.sampled_from([0, 3]),
    seed=st.none() | st.integers(0, 2**63 - 1),
)


def make_rows(draw_params, vocab, gen):
    rows = []
    for p in draw_params:
        n_out = int(torch.randint(0, 6, (), generator=gen))
        out = torch.randint(0, vocab, (n_out,), generator=gen).tolist()
        rows.append(
            SamplingRow(
                p, position=int(torch.randint(0, 1000, (), generator=gen)), output_token_ids=out
            )
        )
    return rows


@settings(max_examples=40, deadline=None)
@given(
    plist=st.lists(params_st, min_size=1, max_size=6),
    vocab=st.integers(2, 50),
    data_seed=st.integers(0, 2**20),
)
def test_tokens_stay_in_kept_set(plist, vocab, data_seed):
    gen = torch.Generator().manual_seed(data_seed)
    rows = make_rows(plist, vocab, gen)
    logits = torch.randn(len(rows), vocab, generator=gen) * 3
    eos = [vocab - 1]
    # Many draws of every row: repeat each row with 40 seeds (and 40 unseeded copies).
    rep_rows, rep_logits = [], []
    for i, r in enumerate(rows):
        for s in range(40):
            seed = None if (r.params.seed is None and s % 2) else s * 7919 + i
            rep_rows.append(
                SamplingRow(
                    r.params.replace(seed=None, seq_seed=seed), r.position, r.output_token_ids
                )
            )
            rep_logits.append(logits[i])
    batch = SamplingBatch.build(rep_rows, vocab_size=vocab, eos_token_ids=eos)
    tokens = SAMPLER(torch.stack(rep_logits), batch, torch.Generator().manual_seed(1)).token_ids
    probs = SAMPLER.probs(torch.stack(rep_logits), batch)
    # A tiny candidate cap sends rows through the fallback paths (top-k above the cap, top-p
    # reaching past the candidates); seeded tokens must not change.
    small = SamplingBatch.build(rep_rows, vocab_size=vocab, eos_token_ids=eos, candidate_cap=3)
    tokens_small = SAMPLER(torch.stack(rep_logits), small, torch.Generator().manual_seed(1))
    for j, r in enumerate(rep_rows):
        ref = reference_distribution(rep_logits[j].tolist(), r.params, r.output_token_ids, eos)
        assert tokens[j].item() in ref
        assert tokens_small.token_ids[j].item() in ref
        if r.params.seq_seed is not None:
            assert tokens_small.token_ids[j].item() == tokens[j].item()
        for t in range(vocab):
            # float32 penalties vs the float64 reference: agree to float32 precision.
            assert probs[j, t].item() == pytest.approx(ref.get(t, 0.0), rel=2e-5, abs=1e-7)


def chi2_quantile(dof, z=3.29):
    # Wilson-Hilferty approximation of the upper quantile (z=3.29: p ~ 0.0005).
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.1, top_k=6, top_p=0.9),
        SamplingParams(temperature=0.5, presence_penalty=0.5, repetition_penalty=1.2),
    ],
)
@pytest.mark.parametrize("cap", [2, 1024])
def test_seeded_samples_match_exact_distribution(params, cap):
    vocab, n = 8, 20000
    logits = torch.tensor([2.0, 1.5, 1.2, 0.7, 0.1, -0.4, -1.0, 0.9])
    out_ids = [0, 3, 3]
    ref = reference_distribution(logits.tolist(), params, out_ids)
    rows = [
        SamplingRow(params.replace(seed=s), position=5, output_token_ids=out_ids) for s in range(n)
    ]
    batch = SamplingBatch.build(rows, vocab_size=vocab, candidate_cap=cap)
    tokens = SAMPLER(logits.expand(n, vocab), batch).token_ids
    counts = torch.bincount(tokens, minlength=vocab).tolist()
    assert all(counts[t] == 0 for t in range(vocab) if t not in ref)
    chi2 = sum((counts[t] - n * p) ** 2 / (n * p) for t, p in ref.items())
    assert chi2 < chi2_quantile(max(len(ref) - 1, 1))
    # Same with one seed and many positions (the other axis of the counter).
    rows = [
        SamplingRow(params.replace(seed=12345), position=s, output_token_ids=out_ids)
        for s in range(n)
    ]
    batch = SamplingBatch.build(rows, vocab_size=vocab, candidate_cap=cap)
    tokens = SAMPLER(logits.expand(n, vocab), batch).token_ids
    counts = torch.bincount(tokens, minlength=vocab).tolist()
    chi2 = sum((counts[t] - n * p) ** 2 / (n * p) for t, p in ref.items())
    assert chi2 < chi2_quantile(max(len(ref) - 1, 1))


def test_unseeded_rows_match_distribution_and_use_generator():
    vocab, n = 6, 20000
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 0.3])
    params = SamplingParams(temperature=0.9, top_p=0.9)
    ref = reference_distribution(logits.tolist(), params)
    batch = SamplingBatch.build([SamplingRow(params, 0)] * n, vocab_size=vocab)
    a = SAMPLER(logits.expand(n, vocab), batch, torch.Generator().manual_seed(3)).token_ids
    b = SAMPLER(logits.expand(n, vocab), batch, torch.Generator().manual_seed(3)).token_ids
    c = SAMPLER(logits.expand(n, vocab), batch, torch.Generator().manual_seed(4)).token_ids
    assert torch.equal(a, b) and not torch.equal(a, c)
    counts = torch.bincount(a, minlength=vocab).tolist()
    chi2 = sum((counts[t] - n * p) ** 2 / (n * p) for t, p in ref.items())
    assert chi2 < chi2_quantile(len(ref) - 1)
    assert sum(counts[t] for t in range(vocab) if t not in ref) == 0


@settings(max_examples=30, deadline=None)
@given(
    plist=st.lists(params_st, min_size=1, max_size=8),
    extra=st.lists(params_st, min_size=0, max_size=5),
    data_seed=st.integers(0, 2**20),
)
def test_seeded_rows_invariant_to_batch(plist, extra, data_seed):
    vocab = 300
    gen = torch.Generator().manual_seed(data_seed)
    rows = make_rows(plist, vocab, gen)
    logits = torch.randn(len(rows), vocab, generator=gen) * 2
    batch = SamplingBatch.build(rows, vocab_size=vocab, eos_token_ids=[0])
    first = SAMPLER(logits, batch).token_ids
    again = SAMPLER(logits, batch).token_ids
    seeded = [i for i, r in enumerate(rows) if r.params.seq_seed is not None]
    assert torch.equal(first[seeded], again[seeded])
    # Shuffle and interleave other rows: seeded rows keep their tokens.
    more = make_rows(extra, vocab, gen)
    all_rows = rows + more
    all_logits = torch.cat([logits, torch.randn(len(more), vocab, generator=gen)])
    perm = torch.randperm(len(all_rows), generator=gen)
    batch2 = SamplingBatch.build([all_rows[i] for i in perm], vocab_size=vocab, eos_token_ids=[0])
    shuffled = SAMPLER(all_logits[perm], batch2).token_ids
    where = {int(p): k for k, p in enumerate(perm)}
    for i in seeded:
        assert shuffled[where[i]].item() == first[i].item()
    greedy = [i for i, r in enumerate(rows) if r.params.temperature == 0]
    for i in greedy:
        assert shuffled[where[i]].item() == first[i].item()


@settings(max_examples=15, deadline=None)
@given(plist=st.lists(params_st, min_size=1, max_size=6), data_seed=st.integers(0, 2**20))
def test_dtype_determinism(plist, data_seed):
    vocab = 500
    gen = torch.Generator().manual_seed(data_seed)
    plist = [p if p.seq_seed is not None else p.replace(seed=data_seed) for p in plist]
    rows = make_rows(plist, vocab, gen)
    batch = SamplingBatch.build(rows, vocab_size=vocab)
    # bf16-representable logits: every float dtype holds the same values, so tokens agree.
    base = (torch.randn(len(rows), vocab, generator=gen) * 4).to(torch.bfloat16)
    tokens = [
        SAMPLER(base.to(dt), batch).token_ids
        for dt in (torch.bfloat16, torch.float16, torch.float32, torch.float64)
    ]
    for t in tokens[1:]:
        assert torch.equal(t, tokens[0])
    # Same-dtype determinism for arbitrary float64 logits.
    f64 = torch.randn(len(rows), vocab, generator=gen, dtype=torch.float64)
    assert torch.equal(SAMPLER(f64, batch).token_ids, SAMPLER(f64, batch).token_ids)


def test_min_tokens_bias_and_greedy():
    vocab = 10
    logits = torch.zeros(3, vocab)
    logits[:, 9] = 20.0  # EOS is overwhelmingly likely
    p = SamplingParams(
        temperature=1.0, min_tokens=2, stop_token_ids=[8], seed=1, logit_bias={8: 30.0}
    )
    rows = [
        SamplingRow(p, 3, [1]),
        SamplingRow(p, 3, [1, 2]),
        SamplingRow(SamplingParams(temperature=0, logit_bias={4: 25.0}), 0),
    ]
    out = SAMPLER(logits, SamplingBatch.build(rows, vocab_size=vocab, eos_token_ids=[9]))
    assert out.token_ids[0].item() not in (8, 9)  # below min_tokens: EOS and stop id banned
    assert out.token_ids[1].item() == 8  # reached: the biased stop id wins
    assert out.token_ids[2].item() == 4  # greedy follows the bias


def test_logprobs_are_raw_log_softmax():
    vocab = 40
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=gen)
    rows = [
        SamplingRow(SamplingParams(logprobs=3, seed=i, top_k=4, temperature=0.5), 1)
        for i in range(3)
    ]
    out = SAMPLER(logits, SamplingBatch.build(rows, vocab_size=vocab))
    for r in range(3):
        row = [float(v) for v in logits[r]]
        lse = math.log(sum(math.exp(v) for v in row))
        tok = out.token_ids[r].item()
        assert out.logprobs[r].item() == pytest.approx(row[tok] - lse, abs=1e-5)
        assert out.ranks[r].item() == 1 + sum(v > row[tok] for v in row)
        best = sorted(range(vocab), key=lambda i: -row[i])[:3]
        assert out.top_token_ids[r].tolist() == best
        for k, t in enumerate(best):
            assert out.top_logprobs[r, k].item() == pytest.approx(row[t] - lse, abs=1e-5)


def test_bad_logits_shape():
    batch = SamplingBatch.build([SamplingRow(SamplingParams(), 0)], vocab_size=5)
    with pytest.raises(ValueError, match="logits"):
        SAMPLER(torch.zeros(2, 5), batch)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingBatch.build([SamplingRow(SamplingParams(logit_bias={7: 1.0}), 0)], vocab_size=5)
    with pytest.raises(ValueError, match="position"):
        SamplingBatch.build([SamplingRow(SamplingParams(), -1)], vocab_size=5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_and_cuda_sample_same_tokens():
    vocab, n = 129280, 96
    gen = torch.Generator().manual_seed(0)
    configs = [
        dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02),
        dict(temperature=1.0, top_p=0.95),
        dict(temperature=1.0),
        dict(temperature=0.6, min_p=0.1, presence_penalty=0.5, repetition_penalty=1.1),
        dict(temperature=0.0),
    ]
    rows = [
        SamplingRow(
            SamplingParams(seed=i, **configs[i % len(configs)]),
            position=100 + i,
            output_token_ids=torch.randint(0, vocab, (20,), generator=gen).tolist(),
        )
        for i in range(n)
    ]
    # float32 logits: bf16 ones tie often, and top-k breaks ties in a device-dependent way.
    logits = torch.randn(n, vocab, generator=gen) * 3
    cpu = SAMPLER(logits, SamplingBatch.build(rows, vocab_size=vocab)).token_ids
    gpu = SAMPLER(logits.cuda(), SamplingBatch.build(rows, vocab_size=vocab, device="cuda"))
    assert torch.equal(cpu, gpu.token_ids.cpu())
