"""The DeepSeek-V4.1 text configuration (`ModelConfig`), parsed from a Hugging Face `config.json`.

Field names are the Hugging Face names of the V4.1 `text_config` (one exception, `HF_NAMES`:
`engram_pad_token_id`, which Hugging Face spells `engram_pad_id`); `ModelConfig.from_hf` also
accepts the names DeepSeek's reference `inference/config.json` uses (`dim`, `n_layers`,
`window_size`, `kv_source_layers`, ...) as aliases. Layer indices count the backbone layers
``0 .. num_hidden_layers-1``; the DSpark stages (`mtp.0..`) follow them in `compress_ratios`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# reference / inference-config name -> HF name
ALIASES: dict[str, str] = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "moe_inter_dim": "moe_intermediate_size",
    "route_scale": "routed_scaling_factor",
    "window_size": "sliding_window",
    "original_seq_len": "original_max_position_embeddings",
    "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids",
    "candidate_source_layer": "candidate_source_layer_id",
    "n_activated_experts": "num_experts_per_tok",
    "score_func": "scoring_func",
    "norm_eps": "rms_norm_eps",
    "rope_head_dim": "qk_rope_head_dim",
    "n_mtp_layers": "num_nextn_predict_layers",
    "engram_pad_id": "engram_pad_token_id",
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
    "max_seq_len": "max_position_embeddings",
}

# field -> Hugging Face's name where the field keeps another spelling: transformers'
# DeepseekV41TextConfig reads `engram_pad_id`, while released configs also write
# `engram_pad_token_id`. `from_hf` reads both; `to_hf` writes Hugging Face's.
HF_NAMES: dict[str, str] = {"engram_pad_token_id": "engram_pad_id"}

_TUPLE_FIELDS = (
    "compress_ratios",
    "kv_source_layer_ids",
    "index_source_layer_ids",
    "dspark_target_layer_ids",
    "engram_layer_ids",
    "engram_num_embeddings",
)


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (exact for every int64)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(
    layer_ids: tuple[int, ...], max_ngram_size: int, n_heads: int, engram_vocab_size: int
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Bucket moduli `[engram layer][n-gram size - 2][head]`.

    For every (layer, n-gram size, head) in that order, the smallest prime above the previous
    one of the same (layer, n-gram size) row (starting from `engram_vocab_size - 1`) that no
    earlier row used; primes are never reused across rows or layers (reference `EngramLayout`).
    """
    seen: set[int] = set()
    out = []
    for _ in layer_ids:
        per_n = []
        for _ in range(max_ngram_size - 1):
            cur, row = engram_vocab_size - 1, []
            for _ in range(n_heads):
                cur += 1
                while not _is_prime(cur) or cur in seen:
                    cur += 1
                seen.add(cur)
                row.append(cur)
            per_n.append(tuple(row))
        out.append(tuple(per_n))
    return tuple(out)


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V4.1 text model configuration (HF field names; see the module docstring).

    The defaults are the released V4.1-Flash values (reference §1).
    """

    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    # one entry per backbone layer, then one per DSpark stage (0 = sliding window only)
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0,) * 3
    kv_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    candidate_source_layer_id: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    # YaRN (rope_scaling in HF configs); applied only to layers with compress ratio > 0, no mscale
    rope_factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2304
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    norm_topk_prob: bool = True
    swiglu_limit: float = 10.0
    gate_temp: float = 1.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-20
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    # per draft position: the confidence head's probability is sigmoid(logit / T_i), fitted by
    # sequential temperature scaling; empty means 1.0 everywhere
    dspark_confidence_temperatures: tuple[float, ...] = ()
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_vocab_size: int = 16_000_000
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    max_position_embeddings: int = 1_048_576
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    image_token_id: int = 129264
    tie_word_embeddings: bool = False
    fp8_block_size: int = 32
    expert_dtype: str = "fp4"
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict (composite with `text_config`, or flat).

        Reference names (`dim`, `window_size`, ...) are accepted as aliases; `rope_scaling` and
        `quantization_config` are folded into the YaRN and FP8 block fields; a `vision_config`
        is recognised and skipped (text only). Unknown keys go to `extra`. Raises ValueError
        naming the field on an invalid value.

        Hugging Face semantics (`DeepseekV41TextConfig`): `compress_ratios` may list only the
        backbone layers (the DSpark stages' entries are 0); `candidate_source_layer_id` absent
        or null means the last kv source (a negative id disables the candidate level); null
        special token ids keep the defaults; `rope_parameters` ``{"main", "compress"}`` (a
        config saved by transformers) gives both thetas and the compressed layers' YaRN. As in
        the reference, a DSpark expert count of 0 means the backbone's.
        """
        if not isinstance(raw, Mapping):
            raise ValueError(f"config: expected a mapping, got {type(raw).__name__}")
        flat: dict[str, Any] = {}
        if "text_config" in raw:
            text = raw["text_config"]
            if not isinstance(text, Mapping):
                raise ValueError("text_config: expected a mapping")
            # top-level ids (bos/eos/pad/image) apply unless the text config overrides them
            for key, value in raw.items():
                if key not in ("text_config", "vision_config"):
                    flat[key] = value
            flat.update(text)
        else:
            flat.update(raw)
        if raw.get("vision_config") is not None:
            logger.info("config: vision_config present; the vision tower is skipped (text only)")
        flat.pop("vision_config", None)

        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        rope_scaling = flat.pop("rope_scaling", None)
        rope_parameters = flat.pop("rope_parameters", None)
        quant = flat.pop("quantization_config", None)
        for field_name, hf_name in HF_NAMES.items():
            if field_name in flat and hf_name in flat and flat[field_name] != flat[hf_name]:
                # both spellings occur in released configs: neither may silently win
                raise ValueError(
                    f"config: {hf_name}={flat[hf_name]!r} and {field_name}={flat[field_name]!r} "
                    "name the same field with different values; give one"
                )
        for key, value in flat.items():
            name = ALIASES.get(key, key)
            if name == "rope_factor" or key == "rope_factor":
                kwargs["rope_factor"] = value
            elif name in names:
                if name in kwargs and key != name:
                    continue  # the HF name wins over its alias
                kwargs[name] = value
            else:
                extra[key] = value
        if isinstance(rope_parameters, Mapping) and isinstance(
            rope_parameters.get("compress"), Mapping
        ):
            # transformers' saved form: {"main": plain rope, "compress": rope (+ YaRN)}; it wins
            # over the flat thetas, as in DeepseekV41TextConfig
            main, comp = rope_parameters.get("main") or {}, rope_parameters["compress"]
            if "rope_theta" in main:
                kwargs["rope_theta"] = main["rope_theta"]
            if "rope_theta" in comp:
                kwargs["compress_rope_theta"] = comp["rope_theta"]
            if comp.get("rope_type", comp.get("type", "default")) == "default":
                kwargs["original_max_position_embeddings"] = 0  # no YaRN
            elif rope_scaling is None:
                rope_scaling = comp
        elif rope_scaling is None:
            rope_scaling = rope_parameters
        if isinstance(rope_scaling, Mapping):
            rtype = rope_scaling.get("rope_type", rope_scaling.get("type", "yarn"))
            if rtype != "yarn":
                raise ValueError(f"rope_scaling.rope_type: {rtype!r} is not supported (yarn)")
            for src, dst in (
                ("factor", "rope_factor"),
                ("original_max_position_embeddings", "original_max_position_embeddings"),
                ("beta_fast", "beta_fast"),
                ("beta_slow", "beta_slow"),
            ):
                if src in rope_scaling:
                    kwargs[dst] = rope_scaling[src]
        if isinstance(quant, Mapping):
            block = quant.get("weight_block_size")
            if block is not None:
                if list(block)[:1] * 2 != list(block):
                    raise ValueError(
                        f"quantization_config.weight_block_size: {block!r} must be square"
                    )
                kwargs["fp8_block_size"] = int(block[0])
            if "expert_dtype" in quant and "expert_dtype" not in kwargs:
                kwargs["expert_dtype"] = quant["expert_dtype"]
        if isinstance(kwargs.get("eos_token_id"), list | tuple):
            kwargs["eos_token_id"] = int(kwargs["eos_token_id"][0])
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id"):
            if name in kwargs and kwargs[name] is None:
                del kwargs[name]  # HF writes null for "none given": keep the V4.1 default
        for name in _TUPLE_FIELDS:
            if name in kwargs:
                value = kwargs[name]
                if not isinstance(value, list | tuple):
                    raise ValueError(f"{name}: expected a list of ints, got {value!r}")
                kwargs[name] = tuple(int(v) for v in value)
        temps = kwargs.get("dspark_confidence_temperatures")
        if temps is not None:
            if not isinstance(temps, list | tuple) or not all(
                isinstance(v, int | float) and not isinstance(v, bool) for v in temps
            ):
                raise ValueError(
                    f"dspark_confidence_temperatures: expected a list of numbers, got {temps!r}"
                )
            kwargs["dspark_confidence_temperatures"] = tuple(float(v) for v in temps)

        def given(name: str) -> Any:
            return kwargs.get(name, cls.__dataclass_fields__[name].default)

        n, n_draft, ratios = (
            given("num_hidden_layers"),
            given("num_nextn_predict_layers"),
            given("compress_ratios"),
        )
        if isinstance(n, int) and isinstance(n_draft, int) and n <= len(ratios) < n + n_draft:
            # HF lists the backbone ratios, optionally followed by the DSpark stages' (always 0)
            kwargs["compress_ratios"] = tuple(ratios) + (0,) * (n + n_draft - len(ratios))
        for name, backbone in (
            ("dspark_n_routed_experts", "n_routed_experts"),
            ("dspark_num_experts_per_tok", "num_experts_per_tok"),
        ):
            if kwargs.get(name) == 0:
                # reference ModelArgs.get_moe_config: 0 means "as many as the backbone"
                kwargs[name] = given(backbone)
        if kwargs.get("candidate_source_layer_id") is None:
            # HF semantics: absent or null means the last kv source; a negative id disables it
            sources = given("kv_source_layer_ids")
            kwargs["candidate_source_layer_id"] = sources[-1] if sources else -1
        cfg = cls(**kwargs, extra=extra)
        cfg.validate()
        return cfg

    def to_hf(self) -> dict[str, Any]:
        """The composite Hugging Face `config.json` dict (text only) that `from_hf` reads back."""
        text: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in ("extra", "rope_factor", "original_max_position_embeddings"):
                continue
            if f.name in ("beta_fast", "beta_slow", "fp8_block_size", "expert_dtype"):
                continue
            value = getattr(self, f.name)
            text[HF_NAMES.get(f.name, f.name)] = list(value) if isinstance(value, tuple) else value
        text["model_type"] = "deepseek_v41_text"
        text["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": self.rope_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "beta_fast": self.beta_fast,
            "beta_slow": self.beta_slow,
        }
        return {
            "architectures": ["DeepseekV41ForCausalLM"],
            "model_type": "deepseek_v41",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "image_token_id": self.image_token_id,
            "quantization_config": {
                "quant_method": "fp8",
                "activation_scheme": "dynamic",
                "scale_fmt": "ue8m0",
                "weight_block_size": [self.fp8_block_size, self.fp8_block_size],
                "expert_dtype": self.expert_dtype,
            },
            "text_config": text,
        }

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """A small V4.1-architecture config with every layer type (reference doc, last section).

        Ratios [0,0,2,2,1,1,1,1] + two DSpark stages; kv sources [2,4]; index sources [2,4,6];
        candidate source 4 (2 blocks of 2 entries); Engram at [1,3]; window 8; dims multiples of
        32. `engram_num_embeddings` is derived from the primes. `vocab_size` 512 covers a
        byte-level tokenizer with the V4.1 special tokens; `engram_compressed_vocab_size` must
        equal the size of that tokenizer's compressed map (pass it as an override).
        """
        base: dict[str, Any] = dict(
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=8,
            num_attention_heads=4,
            head_dim=64,
            qk_rope_head_dim=16,
            q_lora_rank=64,
            o_groups=2,
            o_lora_rank=32,
            sliding_window=8,
            compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1, 0, 0),
            kv_source_layer_ids=(2, 4),
            index_source_layer_ids=(2, 4, 6),
            candidate_source_layer_id=4,
            candidate_topk_blocks=2,
            candidate_block_size=2,
            index_n_heads=2,
            index_head_dim=32,
            index_topk=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            num_nextn_predict_layers=2,
            dspark_block_size=4,
            dspark_noise_token_id=509,
            dspark_target_layer_ids=(5, 6, 7),
            dspark_markov_rank=32,
            dspark_n_routed_experts=4,
            dspark_num_experts_per_tok=2,
            engram_layer_ids=(1, 3),
            engram_max_ngram_size=4,
            engram_n_heads=2,
            engram_head_dim=32,
            engram_vocab_size=101,
            engram_compressed_vocab_size=300,
            max_position_embeddings=4096,
            image_token_id=510,
        )
        base.update(overrides)
        if "engram_num_embeddings" not in overrides:
            primes = engram_primes(
                tuple(base["engram_layer_ids"]),
                base["engram_max_ngram_size"],
                base["engram_n_heads"],
                base["engram_vocab_size"],
            )
            base["engram_num_embeddings"] = tuple(sum(sum(r) for r in layer) for layer in primes)
        cfg = cls(**base)
        cfg.validate()
        return cfg

    # -- derived facts -------------------------------------------------------------------------
    @property
    def num_layers_total(self) -> int:
        """Backbone layers plus DSpark stages."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def hc_mix_dim(self) -> int:
        """Width of one mHC mixing projection: pre (hc) + post (hc) + comb (hc*hc)."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def swa_ring_len(self) -> int:
        """Per-slot sliding-window ring length: window + 8, so a verify of up to 7 draft tokens
        (8 positions) can be rolled back without losing window entries."""
        return self.sliding_window + 8

    @property
    def engram_n_hash_cols(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def decoder_start_layer(self) -> int:
        """First layer of the CED "decoder" (the first ratio-1 layer), or num_hidden_layers."""
        for i, r in enumerate(self.compress_ratios[: self.num_hidden_layers]):
            if r == 1:
                return i
        return self.num_hidden_layers

    def compress_ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def kv_source_of(self, layer: int) -> int:
        """The kv-source layer whose compressed KV / index keys layer `layer` reads (-1: none)."""
        if layer >= self.num_hidden_layers or self.compress_ratios[layer] == 0:
            return -1
        srcs = [s for s in self.kv_source_layer_ids if s <= layer]
        return max(srcs) if srcs else -1

    def index_source_of(self, layer: int) -> int:
        """The index-source layer whose top-k selection layer `layer` uses (-1: none)."""
        if layer >= self.num_hidden_layers or self.compress_ratios[layer] == 0:
            return -1
        srcs = [s for s in self.index_source_layer_ids if s <= layer]
        return max(srcs) if srcs else -1

    def engram_layout_primes(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        return engram_primes(
            self.engram_layer_ids,
            self.engram_max_ngram_size,
            self.engram_n_heads,
            self.engram_vocab_size,
        )

    # -- validation ----------------------------------------------------------------------------
    def validate(self) -> None:
        """Check consistency; raises ValueError naming the offending field."""

        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"{name}: {msg} (got {getattr(self, name)!r})")

        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "head_dim",
            "q_lora_rank",
            "o_groups",
            "o_lora_rank",
            "sliding_window",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
            "n_routed_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "hc_mult",
            "hc_sinkhorn_iters",
            "max_position_embeddings",
        ):
            need(
                isinstance(getattr(self, name), int) and getattr(self, name) > 0,
                name,
                "must be a positive int",
            )
        blk = self.fp8_block_size
        need(
            blk == 32,
            "fp8_block_size",
            "must be 32 (V4.1's 32x32 weight blocks; the FP8 ops implement only that format)",
        )
        for name in (
            "hidden_size",
            "q_lora_rank",
            "head_dim",
            "moe_intermediate_size",
            "o_lora_rank",
        ):
            need(
                getattr(self, name) % blk == 0, name, f"must be a multiple of fp8_block_size {blk}"
            )
        need(
            self.index_head_dim % 32 == 0, "index_head_dim", "must be a multiple of 32 (FP4 blocks)"
        )
        need(self.head_dim % 16 == 0, "head_dim", "must be a multiple of 16 (FP4 KV blocks)")
        need(
            self.qk_rope_head_dim % 2 == 0
            and 0 < self.qk_rope_head_dim <= min(self.head_dim, self.index_head_dim),
            "qk_rope_head_dim",
            "must be even and at most head_dim and index_head_dim",
        )
        need(
            self.num_attention_heads % self.o_groups == 0,
            "o_groups",
            "must divide num_attention_heads",
        )
        need(
            (self.num_attention_heads * self.head_dim // self.o_groups) % blk == 0,
            "o_groups",
            "heads*head_dim/o_groups must be a multiple of fp8_block_size",
        )
        need(self.num_key_value_heads == 1, "num_key_value_heads", "must be 1 (shared K=V latent)")
        need(
            self.scoring_func == "sqrtsoftplus", "scoring_func", "only 'sqrtsoftplus' is supported"
        )
        need(self.n_shared_experts == 1, "n_shared_experts", "must be 1")
        need(
            self.num_experts_per_tok <= self.n_routed_experts,
            "num_experts_per_tok",
            "must be <= n_routed_experts",
        )
        need(self.expert_dtype == "fp4", "expert_dtype", "only 'fp4' is supported")

        def real(name: str) -> bool:
            v = getattr(self, name)
            return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

        for name in (
            "rope_theta",
            "compress_rope_theta",
            "rope_factor",
            "beta_fast",
            "beta_slow",
            "gate_temp",
            "routed_scaling_factor",
        ):
            need(real(name) and getattr(self, name) > 0, name, "must be a finite number > 0")
        for name in ("hc_eps", "rms_norm_eps"):
            need(real(name) and getattr(self, name) >= 0, name, "must be a finite number >= 0")
        need(real("swiglu_limit"), "swiglu_limit", "must be a finite number (<= 0: no clamp)")
        need(
            isinstance(self.original_max_position_embeddings, int)
            and self.original_max_position_embeddings >= 0,
            "original_max_position_embeddings",
            "must be an int >= 0 (0: no YaRN)",
        )
        need(self.sliding_window + 8 <= self.max_position_embeddings, "sliding_window", "too large")

        n, total = self.num_hidden_layers, self.num_layers_total
        need(self.num_nextn_predict_layers >= 0, "num_nextn_predict_layers", "must be >= 0")
        need(
            len(self.compress_ratios) == total,
            "compress_ratios",
            f"needs num_hidden_layers + num_nextn_predict_layers = {total} entries",
        )
        need(
            all(isinstance(r, int) and r >= 0 for r in self.compress_ratios),
            "compress_ratios",
            "entries must be ints >= 0",
        )
        need(
            all(r == 0 for r in self.compress_ratios[n:]),
            "compress_ratios",
            "DSpark stages (the entries after the backbone) must be 0 (window only)",
        )
        need(
            all(0 <= s < n for s in self.kv_source_layer_ids),
            "kv_source_layer_ids",
            f"must be in [0, {n})",
        )
        need(
            all(0 <= s < n for s in self.index_source_layer_ids),
            "index_source_layer_ids",
            f"must be in [0, {n})",
        )
        need(
            list(self.kv_source_layer_ids) == sorted(set(self.kv_source_layer_ids)),
            "kv_source_layer_ids",
            "must be sorted and unique",
        )
        need(
            list(self.index_source_layer_ids) == sorted(set(self.index_source_layer_ids)),
            "index_source_layer_ids",
            "must be sorted and unique",
        )
        need(
            all(self.compress_ratios[s] > 0 for s in self.kv_source_layer_ids),
            "kv_source_layer_ids",
            "every source must have compress ratio > 0",
        )
        need(
            all(self.compress_ratios[s] > 0 for s in self.index_source_layer_ids),
            "index_source_layer_ids",
            "every index source must have compress ratio > 0 (it selects compressed entries)",
        )
        need(
            set(self.kv_source_layer_ids) <= set(self.index_source_layer_ids),
            "kv_source_layer_ids",
            "every kv source must also be an index source (it owns the index keys)",
        )
        for layer in range(n):
            r = self.compress_ratios[layer]
            if r == 0:
                continue
            src = self.kv_source_of(layer)
            if src < 0 or self.compress_ratios[src] != r:
                raise ValueError(
                    f"compress_ratios: layer {layer} (ratio {r}) has no preceding kv source of the "
                    f"same ratio in kv_source_layer_ids {list(self.kv_source_layer_ids)}"
                )
            isrc = self.index_source_of(layer)
            if isrc < 0 or self.kv_source_of(isrc) != src:
                raise ValueError(
                    f"index_source_layer_ids: layer {layer} reads kv source {src} but its index "
                    f"source {isrc} selects over a different cache"
                )
        c = self.candidate_source_layer_id
        if c >= 0:
            need(
                c in self.index_source_layer_ids,
                "candidate_source_layer_id",
                "must be an index source",
            )
            need(
                self.candidate_topk_blocks > 0,
                "candidate_topk_blocks",
                "must be > 0 with a candidate source",
            )
            need(
                self.candidate_block_size > 0,
                "candidate_block_size",
                "must be > 0 with a candidate source",
            )
            need(
                self.index_topk <= self.candidate_topk_blocks * self.candidate_block_size,
                "index_topk",
                "must be <= candidate_topk_blocks * candidate_block_size",
            )
            for s in self.index_source_layer_ids:
                if s > c and self.kv_source_of(s) != self.kv_source_of(c):
                    raise ValueError(
                        f"candidate_source_layer_id: index source {s} uses candidates of layer {c} "
                        "but reads a different kv source"
                    )
        else:
            need(c == -1, "candidate_source_layer_id", "must be a layer id or -1")

        # Engram
        need(
            len(self.engram_num_embeddings) == len(self.engram_layer_ids),
            "engram_num_embeddings",
            "needs one entry per engram layer",
        )
        need(
            all(0 <= i < n for i in self.engram_layer_ids),
            "engram_layer_ids",
            f"must be in [0, {n})",
        )
        if self.engram_layer_ids:
            need(self.engram_max_ngram_size >= 2, "engram_max_ngram_size", "must be >= 2")
            need(self.engram_n_heads > 0, "engram_n_heads", "must be > 0")
            need(
                self.engram_head_dim > 0 and self.engram_head_dim % blk == 0,
                "engram_head_dim",
                f"must be a positive multiple of fp8_block_size {blk}",
            )
            need(
                self.engram_compressed_vocab_size > 0, "engram_compressed_vocab_size", "must be > 0"
            )
            need(
                0 <= self.engram_pad_token_id < self.vocab_size,
                "engram_pad_token_id",
                "must be a token id",
            )
            need(self.engram_vocab_size > 1, "engram_vocab_size", "must be > 1")
            primes = self.engram_layout_primes()
            for i, rows in enumerate(self.engram_num_embeddings):
                needed = sum(sum(r) for r in primes[i])
                if rows < needed:
                    raise ValueError(
                        f"engram_num_embeddings: layer {self.engram_layer_ids[i]} has {rows} rows "
                        f"but its hash buckets need {needed}"
                    )

        # DSpark
        if self.num_nextn_predict_layers:
            need(self.dspark_block_size > 0, "dspark_block_size", "must be > 0 with DSpark stages")
            need(
                len(self.dspark_target_layer_ids) > 0,
                "dspark_target_layer_ids",
                "must be non-empty",
            )
            need(
                all(0 <= i < n for i in self.dspark_target_layer_ids),
                "dspark_target_layer_ids",
                f"must be in [0, {n})",
            )
            need(
                0 <= self.dspark_noise_token_id < self.vocab_size,
                "dspark_noise_token_id",
                "must be a token id",
            )
            need(self.dspark_markov_rank > 0, "dspark_markov_rank", "must be > 0")
            temps = self.dspark_confidence_temperatures
            need(
                len(temps) in (0, self.dspark_block_size)
                and all(math.isfinite(t) and t > 0 for t in temps),
                "dspark_confidence_temperatures",
                "must be empty or one finite temperature > 0 per draft position "
                f"(dspark_block_size {self.dspark_block_size})",
            )
            need(
                0 < self.dspark_num_experts_per_tok <= self.dspark_n_routed_experts,
                "dspark_num_experts_per_tok",
                "must be in [1, dspark_n_routed_experts]",
            )
        need(0 <= self.bos_token_id < self.vocab_size, "bos_token_id", "must be a token id")
        need(0 <= self.eos_token_id < self.vocab_size, "eos_token_id", "must be a token id")
