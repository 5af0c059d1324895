"""Engram: n-gram hash memory added to the residual streams before layers `engram_layer_ids`.

Hashing (`EngramHasher`, once per forward for all Engram layers): token ids go through the
compressed token map; the window is the current token plus the `max_ngram - 1` previous ones
(missing positions use ``map[engram_pad_token_id]``); ``p_i = t_i * mult[layer][i]`` (int64), a
rolling XOR gives the n-gram hash for n = 2..max_ngram, each taken ``mod prime[layer][n][head]``
plus the bucket's offset in the layer's table: `(max_ngram - 1) * n_heads` row ids per token.
Multipliers come from ``numpy.random.default_rng(10007 * layer)`` (odd, bounded so products fit in
int64); the released config's are frozen below since numpy does not promise stable streams.

Gating (`Engram`): rows (FP8 + per-32 scale) -> ``wkv`` -> key [hc, D] and value [D];
``g = sigmoid(signed_sqrt(<h_k, q_w k_w key_k> * rsqrt(ms h_k) * rsqrt(ms key_k) / sqrt(D)))``;
``h_k += g_k * value`` (`ops.engram_gate`). Parameters (HF names): `embed.weight [rows, hd] e4m3`,
`embed.scale [rows, hd/32] e8m0`, `wkv` (FP8 [D*(hc+1), cols*hd]), `q_weight`, `k_weight` [hc, D].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from deepinfer_kernels import ops
from torch import nn

from ..cache import KVCache
from ..config import ModelConfig
from ..step_context import StepContext
from . import rounding
from .linear import SCALE_DTYPE, FP8Linear

if TYPE_CHECKING:
    from ..rank_shard import RankShard

FROZEN_MULTIPLIERS: dict[tuple[int, int, int], tuple[int, ...]] = {
    # (layer, max_ngram_size, compressed vocab) -> multipliers (released V4.1-Flash)
    (1, 4, 99092): (76632096046245, 4839876093313, 35959672319349, 73987337458391),
    (14, 4, 99092): (67716810739261, 51510806800915, 30921347202721, 82619226485591),
}


def hash_multipliers(layer_id: int, max_ngram_size: int, compressed_vocab: int) -> tuple[int, ...]:
    """Odd multipliers of one layer (frozen values for the released config, else numpy's)."""
    key = (layer_id, max_ngram_size, compressed_vocab)
    if key in FROZEN_MULTIPLIERS:
        return FROZEN_MULTIPLIERS[key]
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    vals = np.random.default_rng(10007 * layer_id).integers(
        0, bound, size=(max_ngram_size,), dtype=np.int64
    )
    return tuple(int(v) * 2 + 1 for v in vals)


def build_compressed_token_map(backend) -> tuple[list[int], int]:
    """Map each token id of a `tokenizers.Tokenizer` to a class of tokens that normalise alike
    (NFKC, NFD, strip accents, lowercase, collapse whitespace; a token that is exactly one space
    survives). Returns (map [vocab], number of classes). Partial UTF-8 tokens key by raw form."""
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"
    norm = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )
    classes: dict[str, int] = {}
    n = backend.get_vocab_size(with_added_tokens=True)
    out = [0] * n
    for i in range(n):
        text = backend.decode([i], skip_special_tokens=False)
        if "\ufffd" in text:
            key = backend.id_to_token(i)
        else:
            normed = norm.normalize_str(text)
            key = normed if normed else text
        out[i] = classes.setdefault(key, len(classes))
    return out, len(classes)


class EngramHasher(nn.Module):
    """Hash ids of every token for every Engram layer; keeps the per-slot token history.

    Buffers (not in the checkpoint): `token_map [vocab]` (set by `set_token_map`), `multipliers
    [L, max_ngram]`, `primes [L, max_ngram-1, heads]`, `offsets [L, (max_ngram-1)*heads]`.
    """

    def __init__(self, config: ModelConfig, device=None) -> None:
        super().__init__()
        self.config = config
        self.max_ngram = config.engram_max_ngram_size
        primes = config.engram_layout_primes()
        flat = [[p for row in layer for p in row] for layer in primes]
        offsets = [np.cumsum([0, *f[:-1]]).tolist() for f in flat]
        mults = [
            hash_multipliers(i, self.max_ngram, config.engram_compressed_vocab_size)
            for i in config.engram_layer_ids
        ]
        self.register_buffer(
            "primes", torch.tensor(primes, dtype=torch.int64, device=device), persistent=False
        )
        self.register_buffer(
            "offsets", torch.tensor(offsets, dtype=torch.int64, device=device), persistent=False
        )
        self.register_buffer(
            "multipliers", torch.tensor(mults, dtype=torch.int64, device=device), persistent=False
        )
        self.register_buffer(
            "token_map", torch.empty(0, dtype=torch.int64, device=device), persistent=False
        )

    def set_token_map(
        self, token_map: Sequence[int] | torch.Tensor, num_classes: int | None = None
    ) -> None:
        """Install the compressed token map ([vocab] ints, e.g. `build_compressed_token_map`)."""
        tm = torch.as_tensor(token_map, dtype=torch.int64).to(self.primes.device)
        if tm.dim() != 1 or tm.shape[0] < self.config.vocab_size:
            raise ValueError(
                f"token_map: needs one entry per token id ({self.config.vocab_size}), "
                f"got {list(tm.shape)}"
            )
        n = int(tm.max()) + 1 if num_classes is None else num_classes
        if n != self.config.engram_compressed_vocab_size:
            raise ValueError(
                "engram_compressed_vocab_size: the config says "
                f"{self.config.engram_compressed_vocab_size} but the token map has {n} classes"
            )
        self.token_map = tm

    def forward(self, input_ids: torch.Tensor, ctx: StepContext, cache: KVCache) -> torch.Tensor:
        """input_ids [T] -> hash row ids [T, n_engram_layers, (max_ngram-1)*heads] int64."""
        if self.token_map.numel() == 0:
            raise RuntimeError(
                "Engram token map not set: call model.engram_hasher.set_token_map(...) "
                "(deepinfer_model.layers.engram.build_compressed_token_map(tokenizer.backend))"
            )
        comp = self.token_map[input_ids]
        pad = self.token_map[self.config.engram_pad_token_id]
        hist = cache.engram_history
        s_len = hist.shape[1]
        ctx_t, start_t, slot_t = ctx.token["ctx"], ctx.token["start"], ctx.token["slot"]
        toks = []
        for shift in range(self.max_ngram):
            q = ctx.positions - shift
            from_step = comp[(start_t + q - ctx_t).clamp_min(0)]
            from_hist = hist[slot_t, q.remainder(s_len)]
            t = torch.where(q >= ctx_t, from_step, from_hist)
            toks.append(torch.where(q < 0, pad, t))
        toks = torch.stack(toks, dim=-1)  # [T, max_ngram]
        prods = toks.unsqueeze(1) * self.multipliers  # [T, L, max_ngram]
        rolling, hashes = prods[..., 0], []
        for i in range(1, self.max_ngram):
            rolling = torch.bitwise_xor(rolling, prods[..., i])
            hashes.append(rolling.unsqueeze(-1) % self.primes[:, i - 1])
        # history: newest positions of each sequence
        rows, slot, hist_row = ctx.ring_write(s_len)
        hist.index_put_((slot, hist_row), comp.index_select(0, rows))
        return torch.cat(hashes, dim=-1) + self.offsets


class EngramTable(nn.Module):
    """The FP8 hash table: weight [rows, hd] e4m3 + scale [rows, hd/32] e8m0; rows dequantised
    on lookup.

    Row-sharded (`shard.engram[index]` given, Engram parallelism): the parameters hold only this
    rank's rows ``[lo, hi)`` (`sharded.shard`) and a lookup gathers the raw row bytes of any id
    from their owners over the Engram group, padded to the forward scope's rows."""

    def __init__(
        self,
        rows: int,
        dim: int,
        block: int,
        device=None,
        shard: RankShard | None = None,
        index: int = 0,
    ) -> None:
        super().__init__()
        self.block = block
        self.shard = shard if shard is not None and shard.engram is not None else None
        self.sharded = self.shard.engram[index] if self.shard is not None else None
        if self.sharded is not None and self.sharded.shard.num_rows != rows:
            raise ValueError(
                f"EngramTable: the row shard is of a {self.sharded.shard.num_rows}-row table, "
                f"this table has {rows} rows"
            )
        local = self.sharded.shard.num_local if self.sharded is not None else rows
        self.weight = nn.Parameter(
            torch.zeros(local, dim, dtype=torch.float8_e4m3fn, device=device), requires_grad=False
        )
        self.scale = nn.Parameter(
            torch.zeros(local, dim // block, dtype=SCALE_DTYPE, device=device), requires_grad=False
        )
        # training mode only (`deepinfer_model.training`): an fp32 [rows, dim] master table
        self.register_parameter("master", None)

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """ids [...] -> [..., dim] `dtype`."""
        if self.master is not None:
            if self.sharded is not None:
                raise NotImplementedError("training mode with row-sharded Engram tables")
            return rounding.engram_rows(self.master, ids, self.block).to(dtype)
        if self.sharded is not None:
            return self._gathered(ids, dtype)
        v = self.weight[ids].float().unflatten(-1, (-1, self.block)) * self.scale[
            ids
        ].float().unsqueeze(-1)
        return v.flatten(-2).to(dtype)

    def _row_bytes(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's rows `local` [M] as raw bytes [M, hd + hd/block]: values then scales."""
        return torch.cat(
            [self.weight[local].view(torch.uint8), self.scale[local].view(torch.uint8)], dim=1
        )

    def _gathered(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        dim = self.weight.shape[1]
        per_token = ids.shape[-1] if ids.dim() else 1
        flat = ids.reshape(-1)
        padded = self.shard.scope.rows * per_token
        raw = self.sharded.lookup(flat, self._row_bytes, dim + dim // self.block, padded)
        w = raw[:, :dim].contiguous().view(torch.float8_e4m3fn)
        sc = raw[:, dim:].contiguous().view(self.scale.dtype)
        v = w.float().unflatten(-1, (-1, self.block)) * sc.float().unsqueeze(-1)
        return v.flatten(-2).to(dtype).reshape(*ids.shape, dim)


class Engram(nn.Module):
    """h [T, hc, D], hash ids [T, cols] -> h [T, hc, D] with the gated value added."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        dtype: torch.dtype,
        device=None,
        shard: RankShard | None = None,
    ) -> None:
        super().__init__()
        self.layer_index = config.engram_layer_ids.index(layer_id)
        self.hc, self.dim, self.eps = config.hc_mult, config.hidden_size, config.rms_norm_eps
        cols, hd = config.engram_n_hash_cols, config.engram_head_dim
        self.embed = EngramTable(
            config.engram_num_embeddings[self.layer_index],
            hd,
            config.fp8_block_size,
            device,
            shard,
            self.layer_index,
        )
        self.wkv = FP8Linear(
            cols * hd, config.hidden_size * (config.hc_mult + 1), config.fp8_block_size, device
        )
        self.q_weight = nn.Parameter(
            torch.ones(self.hc, self.dim, dtype=dtype, device=device), requires_grad=False
        )
        self.k_weight = nn.Parameter(
            torch.ones(self.hc, self.dim, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, h: torch.Tensor, hash_ids: torch.Tensor) -> torch.Tensor:
        rows = self.embed(hash_ids, h.dtype).flatten(-2)  # [T, cols*hd]
        kv = self.wkv(rows)
        key = kv[:, : self.hc * self.dim].view(-1, self.hc, self.dim)
        value = kv[:, self.hc * self.dim :]
        weight = self.q_weight.float() * self.k_weight.float()
        return ops.engram_gate(h, key, value, weight, self.eps)

    def idle(self) -> None:
        """The sharded table lookup's collectives with no tokens (see `EngramTable`)."""
        if self.embed.sharded is not None:
            cols = self.wkv.in_features // self.embed.weight.shape[1]
            ids = torch.zeros(0, cols, dtype=torch.int64, device=self.embed.weight.device)
            self.embed(ids, self.q_weight.dtype)
