"""Rejection sampling: losslessness (chi-square), varlen == per-sequence, K = 0, greedy, errors."""

from __future__ import annotations

import pytest
import torch
from _oracle import chi2_quantile, chi_square, random_batch, random_probs
from deepinfer_spec import greedy_verify, rejection_sample
from hypothesis import given, settings
from hypothesis import strategies as st

VOCAB = 6


def _first_token_counts(draft_kind: str, seeded: bool, trials: int = 20000):
    """Verify ``trials`` copies of one situation (same p rows, same q rows, fresh draws)."""
    g = torch.Generator().manual_seed(7)
    k = 3
    p = random_probs(k + 1, VOCAB, g)
    q = random_probs(k, VOCAB, g)
    if draft_kind == "one_hot":
        # A poor drafter: always proposes the token the target likes least among those it allows.
        x1 = torch.where(p[:k] > 0, p[:k], torch.full_like(p[:k], 2.0)).argmin(-1)
        x = x1.repeat(trials)
        draft_probs = None
    else:
        x = torch.multinomial(q.double(), trials, replacement=True, generator=g).T.reshape(-1)
        draft_probs = q.repeat(trials, 1)
    cu = torch.arange(trials + 1, dtype=torch.int64) * k
    target = p.repeat(trials, 1)
    kwargs = {}
    if seeded:
        kwargs = dict(
            seeds=torch.arange(trials, dtype=torch.int64) * 7919 + 11,
            positions=torch.arange(k + 1, dtype=torch.int64).repeat(trials) + 100,
        )
    else:
        kwargs = dict(generator=torch.Generator().manual_seed(3))
    out = rejection_sample(cu, x, draft_probs, target, **kwargs)
    first = out.output_token_ids[:, 0]
    return torch.bincount(first, minlength=VOCAB).tolist(), p[0].double().tolist(), out


@pytest.mark.parametrize("draft_kind", ["sampled", "one_hot"])
@pytest.mark.parametrize("seeded", [True, False])
def test_first_emitted_token_is_distributed_as_p(draft_kind, seeded):
    counts, p0, out = _first_token_counts(draft_kind, seeded)
    stat, df = chi_square(counts, p0)
    assert stat < chi2_quantile(0.9999, df), (counts, p0)
    # The test has teeth: rejections and acceptances both happened.
    assert 0 < int((out.num_accepted == 0).sum()) < out.num_accepted.shape[0]


def test_first_two_emitted_tokens_follow_the_target_chain():
    """Joint of (y0, y1) equals p(y0) p(y1 | y0) with target rows conditioned on the drafts."""
    vocab, trials, k = 4, 20000, 2
    g = torch.Generator().manual_seed(11)
    # A fixed target "model" p(. | prefix) and drafter q(. | prefix) as lookup tables.
    p0 = random_probs(1, vocab, g)[0]
    p1 = random_probs(vocab, vocab, g)  # p1[a] = p(. | a)
    p2 = random_probs(vocab * vocab, vocab, g).reshape(vocab, vocab, vocab)
    q0 = random_probs(1, vocab, g, zero_frac=0.0)[0]
    q1 = random_probs(vocab, vocab, g, zero_frac=0.0)
    x0 = torch.multinomial(q0.double(), trials, replacement=True, generator=g)
    x1 = torch.multinomial(q1[x0].double(), 1, generator=g)[:, 0]
    drafts = torch.stack([x0, x1], dim=1).reshape(-1)
    draft_probs = torch.stack([q0.expand(trials, vocab), q1[x0]], dim=1).reshape(-1, vocab)
    target = torch.stack([p0.expand(trials, vocab), p1[x0], p2[x0, x1]], dim=1).reshape(-1, vocab)
    out = rejection_sample(
        torch.arange(trials + 1, dtype=torch.int64) * k,
        drafts,
        draft_probs,
        target,
        seeds=torch.arange(trials, dtype=torch.int64),
        positions=torch.arange(k + 1, dtype=torch.int64).repeat(trials),
    )
    y0 = out.output_token_ids[:, 0]
    # Where only one token was emitted, the second comes from the next step: sample it here.
    y1_next_step = torch.multinomial(p1[y0].double(), 1, generator=g)[:, 0]
    y1 = torch.where(out.num_accepted >= 1, out.output_token_ids[:, 1], y1_next_step)
    counts = torch.bincount(y0 * vocab + y1, minlength=vocab * vocab).tolist()
    expected = [float(p0[a]) * float(p1[a, b]) for a in range(vocab) for b in range(vocab)]
    total = sum(expected)
    stat, df = chi_square(counts, [e / total for e in expected])
    assert stat < chi2_quantile(0.9999, df)
    assert 0 < int((out.num_accepted == 1).sum()) < trials  # both branches were exercised


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=6),
    st.booleans(),
    st.integers(0, 2**31),
)
def test_varlen_batch_equals_per_sequence_calls(num_drafts, with_q, seed):
    cu, x, q, p, seeds, pos = random_batch(num_drafts, VOCAB, seed, with_draft_probs=with_q)
    whole = rejection_sample(cu, x, q, p, seeds=seeds, positions=pos)
    for b, k in enumerate(num_drafts):
        d0, d1 = int(cu[b]), int(cu[b + 1])
        alone = rejection_sample(
            torch.tensor([0, k]),
            x[d0:d1],
            None if q is None else q[d0:d1],
            p[d0 + b : d1 + b + 1],
            seeds=seeds[b : b + 1],
            positions=pos[d0 + b : d1 + b + 1],
        )
        assert whole.tokens(b) == alone.tokens(0)
        assert int(whole.num_accepted[b]) <= k


def test_k_zero_everywhere_emits_one_sample_per_sequence():
    cu, x, q, p, seeds, pos = random_batch([0, 0, 0, 0], VOCAB, 3)
    out = rejection_sample(cu, x, q, p, seeds=seeds, positions=pos)
    assert out.num_accepted.tolist() == [0, 0, 0, 0]
    assert out.output_token_ids.shape == (4, 1)
    assert bool((p[torch.arange(4), out.next_token_ids] > 0).all())
    empty = rejection_sample(torch.zeros(1, dtype=torch.int64), x, None, p[:0])
    assert empty.num_accepted.shape == (0,)


def test_identical_draft_and_target_accepts_everything():
    cu, x, q, p, seeds, pos = random_batch([3, 1, 4], VOCAB, 5)
    # Target rows for drafts equal the draft distributions; bonus rows stay as they are.
    layout_rows = [
        r for b, k in enumerate([3, 1, 4]) for r in range(int(cu[b]) + b, int(cu[b]) + b + k)
    ]
    p[layout_rows] = q
    out = rejection_sample(cu, x, q, p, seeds=seeds, positions=pos)
    assert out.num_accepted.tolist() == [3, 1, 4]


def test_one_hot_target_is_greedy():
    num_drafts = [2, 0, 3, 1]
    cu, x, q, p, seeds, pos = random_batch(num_drafts, VOCAB, 9)
    # Make some drafts equal to the argmax so that acceptance happens.
    layout_rows = [
        r for b, k in enumerate(num_drafts) for r in range(int(cu[b]) + b, int(cu[b]) + b + k)
    ]
    x[::2] = p[layout_rows].argmax(-1)[::2]
    one_hot = torch.nn.functional.one_hot(p.argmax(-1), VOCAB).float()
    q = q + torch.nn.functional.one_hot(x, VOCAB)  # keep each draft in its draft's support
    q = q / q.sum(-1, keepdim=True)
    want = greedy_verify(cu, x, p)
    for draft_probs in (q, None):
        got = rejection_sample(cu, x, draft_probs, one_hot, seeds=seeds, positions=pos)
        assert torch.equal(got.output_token_ids, want.output_token_ids)
    flagged = rejection_sample(
        cu, x, q, p, seeds=seeds, positions=pos, greedy=torch.ones(4, dtype=torch.bool)
    )
    assert torch.equal(flagged.output_token_ids, want.output_token_ids)


def test_greedy_verify_by_hand():
    cu = torch.tensor([0, 3, 3, 5])
    scores = torch.full((8, 5), -1.0)
    argmax = [1, 2, 3, 4, 0, 2, 2, 1]
    scores[torch.arange(8), torch.tensor(argmax)] = 1.0
    x = torch.tensor([1, 2, 0, 2, 2])
    out = greedy_verify(cu, x, scores)
    assert out.tokens(0) == [1, 2, 3]  # rows 0, 1 accept; row 2 (argmax 3) rejects 0
    assert out.tokens(1) == [0]  # K = 0: just the argmax of row 3... of its only row (4)
    assert out.tokens(2) == [2, 2, 1]  # both accepted, bonus from row 7
    assert out.num_accepted.tolist() == [2, 0, 2]
    assert out.next_token_ids.tolist() == [3, 0, 1]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda a: a.update(cu=torch.tensor([0, 2, 1])), "non-decreasing"),
        (
            lambda a: a.update(cu=torch.tensor([0.0, 2.0])),
            "cu_num_draft_tokens must be a 1-D int64",
        ),
        (lambda a: a.update(x=torch.tensor([1])), "draft_token_ids must be \\[sum K\\]"),
        (lambda a: a.update(x=torch.tensor([1, 9])), "draft_token_ids must lie in"),
        (lambda a: a.update(p=torch.rand(2, VOCAB)), "target_probs must be \\[sum K \\+ B, V\\]"),
        (lambda a: a.update(q=torch.rand(2, VOCAB + 1)), "draft_probs must be None or"),
        (lambda a: a.update(seeds=torch.tensor([1, 2])), "seeds must be int64 \\[B\\]"),
        (lambda a: a.update(pos=None), "positions \\[sum K \\+ B\\] is required"),
        (lambda a: a.update(pos=torch.arange(2)), "positions must be int64"),
        (lambda a: a.update(greedy=torch.tensor([1])), "greedy must be a bool tensor"),
    ],
)
def test_bad_inputs_raise_value_errors(mutate, message):
    args = dict(
        cu=torch.tensor([0, 2]),
        x=torch.tensor([1, 2]),
        q=random_probs(2, VOCAB, torch.Generator().manual_seed(0)),
        p=random_probs(3, VOCAB, torch.Generator().manual_seed(1)),
        seeds=torch.tensor([5]),
        pos=torch.arange(3),
        greedy=None,
    )
    mutate(args)
    with pytest.raises(ValueError, match=message):
        rejection_sample(
            args["cu"],
            args["x"],
            args["q"],
            args["p"],
            seeds=args["seeds"],
            positions=args["pos"],
            greedy=args["greedy"],
        )
