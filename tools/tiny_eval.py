"""Measuring a V4.1 checkpoint on held-out text: bits per byte, and DSpark drafting.

Used by `tools/train_tiny.py` during training and runnable on its own over a checkpoint and a
corpus built by `tools/build_tiny_corpus.py`:

    uv run python tools/tiny_eval.py --corpus /tmp/tiny-corpus            # the built-in model
    uv run python tools/tiny_eval.py --corpus /tmp/tiny-corpus --model DIR --json out.json

Bits per byte: held-out tokens in windows of `--window` tokens, each window predicting its
tokens 1.. from its own prefix; bits over the UTF-8 bytes those tokens stand for (EOS
separators count bits, no bytes). The unigram baseline (training-split token frequencies,
add-1/2 smoothing) is scored on the same tokens.

Drafting (`speculative_run`): held-out prompts are decoded by the target through the model's
own inference path (prefill, then verify steps of the anchor plus `dspark_block_size` drafts,
rolled back by position), drafts from `dspark.dspark_step`, verified by
`deepinfer_spec.rejection_sample` (greedy: accept while a draft equals the target's argmax;
sampled: accept with min(1, p/q) against the Markov-corrected draft distribution at the same
temperature). Acceptance length counts the emitted tokens of a step (accepted drafts + 1).
Calibration: per draft position k, the predicted probability that the first k drafts are all
accepted is the cumulative product of the confidence head's probabilities; the expected
calibration error (10 equal-width bins) compares it with what verification accepted.
Sequential temperature scaling fits one temperature per position, left to right, each
minimising that position's error with the earlier ones fixed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from deepinfer_model.batch import ForwardBatch
from deepinfer_model.cache import CacheSpec, KVCache
from deepinfer_model.dspark import confidence_probabilities, dspark_step

ECE_BINS = 10
TEMPERATURE_GRID = tuple(float(t) for t in np.exp(np.linspace(math.log(0.05), math.log(20), 241)))


@dataclass
class Corpus:
    """A corpus directory of `tools/build_tiny_corpus.py`."""

    path: Path
    train: np.ndarray
    heldout: np.ndarray
    manifest: dict

    @classmethod
    def load(cls, path: str | Path) -> Corpus:
        path = Path(path)
        train = np.fromfile(path / "train.bin", dtype=np.uint16)
        heldout = np.fromfile(path / "heldout.bin", dtype=np.uint16)
        return cls(path, train, heldout, json.loads((path / "manifest.json").read_text()))

    def backend(self):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.path / "tokenizer.json"))


def token_byte_lengths(backend) -> np.ndarray:
    """[vocab] UTF-8 bytes each token id stands for (0 for special and added tokens)."""
    from deepinfer_model.tiny_checkpoint import byte_level_alphabet

    inverse = {ch: b for b, ch in byte_level_alphabet().items()}
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    n = backend.get_vocab_size(with_added_tokens=True)
    out = np.zeros(n, dtype=np.int64)
    for tok, i in backend.get_vocab(with_added_tokens=True).items():
        if tok not in added:
            out[i] = len(tok) if all(c in inverse for c in tok) else len(tok.encode())
    return out


def windows(tokens: np.ndarray, length: int, limit: int | None = None) -> np.ndarray:
    """Non-overlapping windows [n, length] of a token stream (the tail shorter than a window is
    dropped), at most `limit` of them, evenly spread when limited."""
    n = len(tokens) // length
    w = tokens[: n * length].reshape(n, length).astype(np.int64)
    if limit is not None and n > limit:
        w = w[np.linspace(0, n - 1, limit).round().astype(np.int64)]
    return w


def cache_for(config, num_seqs: int, max_len: int, device, dtype, block_size: int = 64):
    """A KV cache of `num_seqs` slots with room for `max_len` positions each, and the block
    tables that give sequence b its own pages."""
    spec = CacheSpec.from_config(config, block_size=block_size, dtype=dtype)
    per = -(-max_len // block_size)
    cache = KVCache(config, spec, per * num_seqs, num_seqs, device=device, dtype=dtype)
    return cache, [list(range(b * per, (b + 1) * per)) for b in range(num_seqs)]


def window_logits(model, ids: torch.Tensor, *, return_hidden: bool = False, dtype=torch.float32):
    """One prefill of each row of ids [B, L] from an empty cache: (logits [B, L, vocab] fp32,
    hidden [B*L, D*n_targets] or None)."""
    b, length = ids.shape
    cache, tables = cache_for(model.config, b, length, ids.device, dtype)
    batch = ForwardBatch.build(
        ids.tolist(),
        [0] * b,
        list(range(b)),
        tables,
        logits_rows="all",
        return_hidden=return_hidden,
        device=ids.device,
    )
    out = model(batch, cache)
    return out.logits.view(b, length, -1), out.hidden


@torch.no_grad()
def heldout_bits(model, wins: np.ndarray, byte_len: np.ndarray, device, batch: int = 8, **kw):
    """(bits, bytes, tokens) of the model over held-out windows [n, L]: each window's tokens
    1..L-1 predicted from their prefix."""
    bits = nbytes = ntok = 0.0
    for s in range(0, len(wins), batch):
        ids = torch.from_numpy(wins[s : s + batch]).to(device)
        logits, _ = window_logits(model, ids, **kw)
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        bits += float(nll.sum()) / math.log(2)
        nbytes += float(byte_len[wins[s : s + batch, 1:]].sum())
        ntok += nll.numel()
    return bits, nbytes, ntok


def unigram_bits(train: np.ndarray, wins: np.ndarray, byte_len: np.ndarray, vocab: int):
    """(bits, bytes, tokens) of the add-1/2 unigram of `train` on the same predicted tokens."""
    counts = np.bincount(train.astype(np.int64), minlength=vocab).astype(np.float64) + 0.5
    logp = np.log2(counts / counts.sum())
    toks = wins[:, 1:]
    return float(-logp[toks].sum()), float(byte_len[toks].sum()), int(toks.size)


@dataclass
class SpecStats:
    """Per verify step of each sequence: accepted drafts [N], the draft block's raw confidence
    logits [N, block], and which prompt it decoded [N]."""

    accepted: np.ndarray
    confidence: np.ndarray
    prompt: np.ndarray

    def subset(self, keep: np.ndarray) -> SpecStats:
        return SpecStats(self.accepted[keep], self.confidence[keep], self.prompt[keep])

    @property
    def block(self) -> int:
        return self.confidence.shape[1]

    def mean_acceptance_length(self) -> float:
        return float((self.accepted + 1).mean())

    def position_rates(self) -> list[float]:
        """P(draft k accepted | drafts 1..k-1 accepted), k = 1..block."""
        out = []
        for k in range(1, self.block + 1):
            reached = (self.accepted >= k - 1).sum()
            out.append(float((self.accepted >= k).sum() / reached) if reached else float("nan"))
        return out

    def prefix_probs(self, temperatures) -> np.ndarray:
        """[N, block] predicted probability that drafts 1..k are all accepted."""
        logits = torch.from_numpy(self.confidence)
        cfg = _Temps(tuple(temperatures))
        return confidence_probabilities(cfg, logits).cumprod(-1).numpy()

    def labels(self) -> np.ndarray:
        """[N, block] 1 where drafts 1..k were all accepted."""
        return (self.accepted[:, None] >= np.arange(1, self.block + 1)[None]).astype(np.float64)

    def ece(self, temperatures) -> list[float]:
        """Expected calibration error of each position's prefix prediction."""
        p, y = self.prefix_probs(temperatures), self.labels()
        return [expected_calibration_error(p[:, k], y[:, k]) for k in range(self.block)]


@dataclass(frozen=True)
class _Temps:
    dspark_confidence_temperatures: tuple[float, ...]


def expected_calibration_error(p: np.ndarray, y: np.ndarray, bins: int = ECE_BINS) -> float:
    """Sum over equal-width bins of (share of samples) * |mean prediction - mean label|."""
    idx = np.clip((p * bins).astype(np.int64), 0, bins - 1)
    err = 0.0
    for b in range(bins):
        m = idx == b
        if m.any():
            err += m.mean() * abs(p[m].mean() - y[m].mean())
    return float(err)


def sequential_temperatures(stats: SpecStats) -> tuple[float, ...]:
    """Sequential temperature scaling: T_1, then T_2 given T_1, ..., each from
    `TEMPERATURE_GRID` minimising that position's prefix calibration error."""
    temps: list[float] = []
    for k in range(stats.block):
        # ties (flat stretches of the binned error) go to the temperature nearest 1
        best = min(
            TEMPERATURE_GRID,
            key=lambda t: (
                stats.ece([*temps, t] + [1.0] * (stats.block - k - 1))[k],
                abs(math.log(t)),
            ),
        )
        temps.append(best)
    return tuple(temps)


@torch.no_grad()
def speculative_run(
    model,
    prompts: np.ndarray,
    steps: int,
    temperature: float,
    seed: int = 0,
    dtype=torch.float32,
) -> SpecStats:
    """Decode each prompt (rows of [B, P]) for `steps` verify steps with DSpark drafts.

    temperature 0: greedy drafts and greedy verification; else drafts sampled from the
    Markov-corrected draft distribution at `temperature` and lossless rejection sampling
    against the target at the same temperature (torch generators seeded by `seed`)."""
    from deepinfer_spec import rejection_sample

    cfg = model.config
    dev = next(model.parameters()).device
    blk = cfg.dspark_block_size
    b, plen = prompts.shape
    cache, tables = cache_for(cfg, b, plen + (steps + 1) * (blk + 1) + 1, dev, dtype)
    slots = list(range(b))
    gen = torch.Generator(device=dev).manual_seed(seed)

    def pick(logits: torch.Tensor) -> torch.Tensor:
        if temperature == 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=gen).squeeze(-1)

    batch = ForwardBatch.build(
        prompts.tolist(), [0] * b, slots, tables, return_hidden=True, device=dev
    )
    out = model(batch, cache)
    anchor = pick(out.logits)
    draft = dspark_step(model, batch, out.hidden, cache, draft_ids=anchor, sample=pick)
    ctx = torch.full((b,), plen, dtype=torch.int64)
    cu = torch.arange(0, b * blk + 1, blk, dtype=torch.int64, device=dev)
    accepted, conf = [], []
    for _ in range(steps):
        seqs = torch.cat([anchor[:, None], draft.tokens], dim=1).tolist()
        batch = ForwardBatch.build(
            seqs, ctx.tolist(), slots, tables, logits_rows="all", return_hidden=True, device=dev
        )
        out = model(batch, cache)
        if temperature == 0:
            target = torch.softmax(out.logits.float(), dim=-1)
            res = rejection_sample(
                cu,
                draft.tokens.flatten(),
                None,
                target,
                greedy=torch.ones(b, dtype=torch.bool, device=dev),
            )
        else:
            target = torch.softmax(out.logits.float() / temperature, dim=-1)
            q = torch.softmax(draft.logits.float() / temperature, dim=-1).flatten(0, 1)
            res = rejection_sample(cu, draft.tokens.flatten(), q, target, generator=gen)
        n_acc = res.num_accepted.cpu()
        accepted.append(n_acc.numpy())
        conf.append(draft.confidence.float().cpu().numpy())
        anchor = res.next_token_ids.to(dev)
        draft = dspark_step(
            model,
            batch,
            out.hidden,
            cache,
            draft_ids=anchor,
            sample=pick,
            last_positions=(ctx + n_acc).to(dev),
        )
        ctx = ctx + n_acc + 1
    prompt = np.tile(np.arange(b), steps)
    return SpecStats(np.concatenate(accepted), np.concatenate(conf), prompt)


def drafting_report(model, prompts: np.ndarray, steps: int, seed: int, dtype) -> dict:
    """Acceptance (greedy and T = 0.8) and calibration on held-out prompts: at T = 0.8 the
    steps of the first half of the prompts fit the temperatures, the second half's measure."""
    out: dict = {"prompts": len(prompts), "prompt_tokens": int(prompts.shape[1])}
    out["steps_per_prompt"] = steps
    for name, temp in (("greedy", 0.0), ("t0.8", 0.8)):
        st = speculative_run(model, prompts, steps, temp, seed, dtype)
        out[name] = {
            "mean_acceptance_length": st.mean_acceptance_length(),
            "position_acceptance": st.position_rates(),
            "verify_steps": len(st.accepted),
        }
        if temp == 0.8:
            first = st.prompt < len(prompts) // 2
            fit, test = st.subset(first), st.subset(~first)
            temps = sequential_temperatures(fit)
            ones = [1.0] * st.block
            out["calibration"] = {
                "temperatures": list(temps),
                "ece_before": test.ece(ones),
                "ece_after": test.ece(temps),
                "ece_before_mean": float(np.mean(test.ece(ones))),
                "ece_after_mean": float(np.mean(test.ece(temps))),
                "ece_with_config_temperatures": test.ece(
                    model.config.dspark_confidence_temperatures or ones
                ),
                "fit_steps": len(fit.accepted),
                "test_steps": len(test.accepted),
            }
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the built-in model)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--windows", type=int, default=64, help="held-out windows scored")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from deepinfer_model.loader import load_model

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # small ops: on a small shared CPU the thread pool costs more
    corpus = Corpus.load(args.corpus)
    loaded = load_model(args.model, "cpu", torch.float32, progress=False)
    model, cfg = loaded.model, loaded.config
    byte_len = token_byte_lengths(loaded.tokenizer.backend)
    wins = windows(corpus.heldout, args.window, args.windows)
    bits, nbytes, _ = heldout_bits(model, wins, byte_len, "cpu")
    ubits, ubytes, _ = unigram_bits(corpus.train, wins, byte_len, cfg.vocab_size)
    prompts = windows(corpus.heldout[len(corpus.heldout) // 2 :], args.prompt_tokens, args.prompts)
    report = {
        "bits_per_byte": bits / nbytes,
        "unigram_bits_per_byte": ubits / ubytes,
        "drafting": drafting_report(model, prompts, args.steps, args.seed, torch.float32),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
