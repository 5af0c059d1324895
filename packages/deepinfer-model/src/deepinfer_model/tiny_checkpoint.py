"""The built-in tiny V4.1 checkpoint: written once by package code, loaded like the real one.

`ensure_tiny_checkpoint()` returns a directory in the Hugging Face layout:

    config.json                    text_config (ModelConfig.tiny()) + a small vision_config
    tokenizer.json                 byte level: BOS/EOS/PAD, V4.1 special tokens, 256 bytes
    tokenizer_config.json          names BOS / EOS / PAD
    model.safetensors.index.json   metadata.total_size + weight_map
    model-0000{1,2}-of-00002.safetensors

under ``$XDG_CACHE_HOME/deepinfer/tiny-v41-<version>`` (``~/.cache`` when unset). `<version>`
is the format version plus a fingerprint of the config and of the model's parameter names,
shapes and dtypes, so a changed model never loads a stale checkpoint.

Weights are in the real formats: dense projections FP8 e4m3 with 32x32 UE8M0 block scales,
experts FP4 e2m1 (two per byte) with UE8M0 scales per 32 along K, embeddings/head/norms and
the compressor/DSpark-head weights BF16, mHC parameters, sinks and router biases FP32. Values
come from a CPU `torch.Generator` seeded per tensor from (seed, name), so each tensor is
independent of the others and of their order, and the files are byte-identical on every
machine and every run (a checksum test holds this).

A few small `vision.*` / `aligner.*` / `image_*` tensors are included, as in the released
checkpoint, so the loader's "skip vision weights" path runs on every tiny load.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer_model.tokenizer import BOS_TOKEN, EOS_TOKEN, IMAGE_TOKEN, V41_SPECIAL_TOKENS

TINY_FORMAT_VERSION = 1
"""Bump when the generation rules change; part of the cache directory name."""
TINY_SEED = 20260917
NUM_SHARDS = 2
PAD_TOKEN = "<｜▁pad▁｜>"

# Id order of the tiny vocabulary: BOS=0, EOS=1, PAD=2 as in DeepSeek's vocabulary (the Engram
# pad id is 2), then the other special tokens, then the 256 byte tokens.
TINY_SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    *V41_SPECIAL_TOKENS[2:],
)
# Dropped by decode(skip_special_tokens=True); the role, think, DSML, task and image markers
# stay visible in decoded text, as in DeepSeek's tokenizer.json, which marks them non-special.
_SKIPPED_ON_DECODE = {BOS_TOKEN, EOS_TOKEN, PAD_TOKEN}


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def byte_level_alphabet() -> dict[int, str]:
    """The byte-level BPE alphabet: byte -> printable char (printable Latin-1 bytes map to
    themselves, the other 68 bytes to U+0100.. in byte order), as GPT-2-style tokenizers use."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(0x100 + extra)
            extra += 1
    return out


def v41_tokenizer(tokens: list[str], merges: list[tuple[str, str]]):
    """A byte-level BPE `tokenizers.Tokenizer` with the V4.1 special tokens at ids 0.. (in
    `TINY_SPECIAL_TOKENS` order) followed by `tokens` (byte-level strings, in id order) and the
    BPE `merges` among them. BOS/EOS/PAD are special (dropped on decode); the role, think,
    DSML, task and image markers are added tokens that stay visible in decoded text, as in
    DeepSeek's tokenizer.json."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    vocab = {tok: i for i, tok in enumerate(TINY_SPECIAL_TOKENS)}
    for tok in tokens:
        if tok in vocab:
            raise ValueError(f"v41_tokenizer: token {tok!r} is listed twice")
        vocab[tok] = len(vocab)
    backend = Backend(models.BPE(vocab=vocab, merges=list(merges)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    # Both kinds are matched whole in input text; only `special` ones are dropped on decode.
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t in TINY_SPECIAL_TOKENS
            if t in _SKIPPED_ON_DECODE
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t in TINY_SPECIAL_TOKENS
            if t not in _SKIPPED_ON_DECODE
        ]
    )
    return backend


def build_tiny_tokenizer():
    """A byte-level `tokenizers.Tokenizer`: the special tokens at ids 0.., then 256 bytes."""
    return v41_tokenizer([byte_level_alphabet()[b] for b in range(256)], [])


def tiny_tokenizer_config() -> dict:
    """`tokenizer_config.json` of the tiny checkpoint."""
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------

TINY_VISION_CONFIG = {
    "model_type": "deepseek_v41_vision",
    "num_hidden_layers": 1,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "intermediate_size": 88,
    "patch_size": 14,
    "downsample_ratio": 3,
    "max_image_tokens": 16,
}
"""A small vision config: the text-only engine recognises and skips it (and its weights)."""


def tiny_config(backend=None):
    """`ModelConfig.tiny()` fitted to the tiny tokenizer: vocab size, image token, and the
    Engram compressed vocabulary (the number of classes of the tokenizer's compressed map).

    The tiny vocabulary has no reserved ids, so the DSpark noise token is PAD (id 2).
    """
    from deepinfer_model.config import ModelConfig
    from deepinfer_model.layers.engram import build_compressed_token_map

    backend = backend if backend is not None else build_tiny_tokenizer()
    _, num_classes = build_compressed_token_map(backend)
    return ModelConfig.tiny(
        vocab_size=backend.get_vocab_size(with_added_tokens=True),
        image_token_id=backend.token_to_id(IMAGE_TOKEN),
        dspark_noise_token_id=backend.token_to_id(PAD_TOKEN),
        pad_token_id=backend.token_to_id(PAD_TOKEN),
        engram_pad_token_id=backend.token_to_id(PAD_TOKEN),
        engram_compressed_vocab_size=num_classes,
    )


def tiny_hf_config(config) -> dict:
    """The composite `config.json`: the text config plus a small `vision_config`."""
    hf = config.to_hf()
    hf["vision_config"] = dict(TINY_VISION_CONFIG)
    hf["torch_dtype"] = "bfloat16"
    return hf


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------

_PLAIN_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one checkpoint tensor (from the model's state_dict)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


# Plain weights the model holds in fp32 only because it computes with them in fp32 (as the
# reference promotes them), while the released checkpoint stores them BF16 (reference §4: head,
# compressor wkv/wgate, DSpark markov head; the reference notes confidence_head.proj is bf16).
_BF16_ON_DISK = (
    "head.weight",
    "compressor.wkv.weight",
    "compressor.wgate.weight",
    "confidence_head.proj.weight",
)


def model_tensor_specs(config) -> list[TensorSpec]:
    """The checkpoint tensors of `config`'s model, in `state_dict` order, in their stored dtypes.

    The model is built with bf16 as its plain dtype, so a tensor the model keeps in fp32
    whatever the compute dtype (mHC parameters, sinks, router biases) is stored as F32 and the
    rest as BF16, as in the released checkpoint; the fp32-computed plain weights of
    `_BF16_ON_DISK` are stored BF16 as there too (the loader widens them).
    """
    from deepinfer_model.model import Model

    with torch.device("cpu"):
        model = Model(config, dtype=torch.bfloat16)
    return [
        TensorSpec(
            n,
            tuple(t.shape),
            torch.bfloat16 if t.dtype == torch.float32 and n.endswith(_BF16_ON_DISK) else t.dtype,
        )
        for n, t in model.state_dict().items()
    ]


def _generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator for one tensor: depends only on (seed, name), never on order."""
    return torch.Generator(device="cpu").manual_seed(
        seed * 4_294_967_311 + zlib.crc32(name.encode())
    )


def _normal(shape: tuple[int, ...], std: float, g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float32) * std


def _hc_base(numel: int, hc: int) -> torch.Tensor:
    """mHC base [(2+hc)*hc]: pre = 1/hc per stream (mean of the streams), post = 1, and a
    comb logit of 2 on the diagonal so each stream mostly keeps itself (Sinkhorn makes the
    mix doubly stochastic)."""
    if numel != (2 + hc) * hc:
        raise ValueError(f"hc base: expected {(2 + hc) * hc} entries for hc_mult {hc}, got {numel}")
    base = torch.zeros(numel)
    base[:hc] = torch.log(torch.tensor(1.0 / (hc - 1)))  # sigmoid(b) = 1/hc
    base[2 * hc :] = (2.0 * torch.eye(hc)).flatten()
    return base


def init_float_tensor(spec: TensorSpec, hc: int, g: torch.Generator) -> torch.Tensor:
    """Initial values of a plain-float tensor, chosen so activations stay O(1) through the
    layers: norms and Engram stream weights 1, sinks and router biases 0, embeddings N(0, 1),
    projections N(0, 1/fan_in), mHC mixing small around a sane base."""
    name, shape = spec.name, spec.shape
    last = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight") or last in ("q_weight", "k_weight"):
        return torch.ones(shape)
    if last in ("attn_sink", "bias", "bias_vl"):
        return torch.zeros(shape)
    if last.startswith("hc_") and last.endswith("_scale"):
        return torch.ones(shape)
    if last.startswith("hc_") and last.endswith("_base"):
        return _hc_base(shape[0], hc)
    if last.startswith("hc_") and last.endswith("_fn"):
        return _normal(shape, 0.5 / shape[-1] ** 0.5, g)
    if name.endswith("embed.weight"):
        return _normal(shape, 1.0, g)
    if len(shape) == 2:
        return _normal(shape, 1.0 / shape[-1] ** 0.5, g)
    raise NotImplementedError(
        f"tiny checkpoint: no initialisation rule for {name} {list(shape)} {spec.dtype}; "
        "add one to deepinfer_model.tiny_checkpoint.init_float_tensor"
    )


def quantized_format(spec: TensorSpec, scale: TensorSpec | None) -> str:
    """How a quantised checkpoint weight is stored, from its dtype and its scale's shape:
    "fp8_blocks" (e4m3 [N, K] + e8m0 [N/32, K/32]), "fp8_rows" (e4m3 [N, K] + e8m0 [N, K/32],
    the Engram table) or "fp4" (int8 [N, K/2] e2m1 pairs + e8m0 [N, K/32], the experts).
    Raises NotImplementedError naming the tensor for anything else."""
    name = spec.name
    if not name.endswith(".weight") or scale is None or scale.dtype != torch.float8_e8m0fnu:
        raise NotImplementedError(
            f"checkpoint: no rule for {name} {list(spec.shape)} {spec.dtype} "
            "(quantised weights need a sibling '.scale' of dtype float8_e8m0fnu)"
        )
    n, k = spec.shape
    if spec.dtype == torch.float8_e4m3fn and scale.shape == (-(-n // 32), -(-k // 32)):
        return "fp8_blocks"
    if spec.dtype == torch.float8_e4m3fn and scale.shape == (n, k // 32):
        return "fp8_rows"
    if spec.dtype == torch.int8 and scale.shape == (n, 2 * k // 32):
        return "fp4"
    raise NotImplementedError(
        f"checkpoint: no rule for {name} {list(spec.shape)} {spec.dtype} with "
        f"scale {list(scale.shape)}"
    )


def _scale_of(spec: TensorSpec, by_name: dict[str, TensorSpec]) -> TensorSpec | None:
    return by_name.get(spec.name.removesuffix(".weight") + ".scale")


def _is_scale(spec: TensorSpec, by_name: dict[str, TensorSpec]) -> bool:
    """A `.scale` that belongs to a quantised `.weight` (it comes out of that weight's
    quantisation)."""
    name = spec.name
    return name.endswith(".scale") and name.removesuffix(".scale") + ".weight" in by_name


def initial_values(
    specs: list[TensorSpec], hc: int, seed: int = TINY_SEED
) -> dict[str, torch.Tensor]:
    """fp32 starting values of every checkpoint tensor of `specs` except the quantisation
    scales: plain floats by `init_float_tensor`; a quantised weight as its unquantised [N, K]
    matrix (K unpacked for FP4), N(0, 1/K) (N(0, 1) for the FP8-row Engram tables). Each tensor
    from its own generator seeded by (seed, name)."""
    by_name = {s.name: s for s in specs}
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        if _is_scale(spec, by_name):
            continue
        g = _generator(seed, spec.name)
        if spec.dtype in _PLAIN_FLOATS:
            out[spec.name] = init_float_tensor(spec, hc, g)
            continue
        n, k = spec.shape
        fmt = quantized_format(spec, _scale_of(spec, by_name))
        if fmt == "fp8_blocks":
            out[spec.name] = _normal((n, k), 1.0 / k**0.5, g)
        elif fmt == "fp8_rows":
            out[spec.name] = _normal((n, k), 1.0, g)
        else:
            out[spec.name] = _normal((n, 2 * k), 1.0 / (2 * k) ** 0.5, g)
    return out


def checkpoint_tensors(
    specs: list[TensorSpec], values: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Every tensor of `specs` in its checkpoint format, from float `values` (keyed like
    `initial_values`: plain tensors, and quantised weights as unquantised [N, K] matrices).

    Plain floats are cast to their stored dtype; `X.weight` FP8 with 32x32 block scales goes
    through `quant.quantize_fp8_blocks`, FP8 rows with a scale per 32 (the Engram table)
    through `quant.act_quant_fp8`, FP4 e2m1 experts through `quant.quantize_fp4_experts`; the
    sibling `X.scale` comes out of the same call. Checks every shape and dtype.
    """
    from deepinfer_kernels import quant

    by_name = {s.name: s for s in specs}
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        if _is_scale(spec, by_name):
            continue
        name = spec.name
        if name not in values:
            raise KeyError(f"checkpoint: no value for {name}")
        w = values[name].detach().to("cpu", torch.float32)
        if spec.dtype in _PLAIN_FLOATS:
            out[name] = w.to(spec.dtype).contiguous()
            continue
        scale = _scale_of(spec, by_name)
        fmt = quantized_format(spec, scale)
        if fmt == "fp8_blocks":
            q, s = quant.quantize_fp8_blocks(w)
        elif fmt == "fp8_rows":
            q, s32 = quant.act_quant_fp8(w)
            s = s32.to(torch.float8_e8m0fnu)  # powers of two: exact
        else:
            q, s = quant.quantize_fp4_experts(w)
        out[name], out[scale.name] = q.contiguous(), s.contiguous()
    for spec in specs:
        t = out[spec.name]
        if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
            raise AssertionError(
                f"checkpoint: {spec.name} came out {t.dtype} {list(t.shape)}, "
                f"wants {spec.dtype} {list(spec.shape)}"
            )
    return out


def tiny_weights(
    specs: list[TensorSpec], hc: int, seed: int = TINY_SEED
) -> dict[str, torch.Tensor]:
    """Every tensor of `specs`, generated deterministically in its checkpoint format:
    `checkpoint_tensors` of `initial_values`."""
    return checkpoint_tensors(specs, initial_values(specs, hc, seed))


def tiny_vision_weights(text_hidden: int, seed: int = TINY_SEED) -> dict[str, torch.Tensor]:
    """A handful of small vision / aligner / image-marker tensors (skipped by the loader)."""
    v = TINY_VISION_CONFIG["hidden_size"]
    shapes = {
        "vision.patch_embed.weight": (v, 3 * 14 * 14),
        "vision.blocks.0.attn.qkv.weight": (3 * v, v),
        "vision.norm.weight": (v,),
        "aligner.w1.weight": (text_hidden, 9 * v),
        "image_start": (text_hidden,),
        "image_end": (text_hidden,),
        "image_newline": (text_hidden,),
    }
    return {
        name: _normal(shape, 0.02, _generator(seed, name)).to(torch.bfloat16)
        for name, shape in shapes.items()
    }


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def _fingerprint(hf_config: dict, specs: list[TensorSpec], tokenizer_json: str, seed: int) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(hf_config, sort_keys=True).encode())
    for s in specs:
        h.update(f"{s.name}|{list(s.shape)}|{s.dtype}\n".encode())
    h.update(tokenizer_json.encode())
    h.update(f"seed={seed};format={TINY_FORMAT_VERSION}".encode())
    return h.hexdigest()[:12]


def write_checkpoint(
    directory: str | os.PathLike,
    hf_config: dict,
    tensors: dict[str, torch.Tensor],
    tokenizer_backend,
    tokenizer_config: dict,
    *,
    extra_tensors: dict[str, torch.Tensor] | None = None,
    generation_config: dict | None = None,
    num_shards: int = NUM_SHARDS,
) -> Path:
    """Write a checkpoint in the Hugging Face layout into `directory` (created; must be empty or
    absent): `config.json`, `model.safetensors.index.json` + `num_shards` shards,
    `tokenizer.json`, `tokenizer_config.json` and, if given, `generation_config.json`.

    `tensors` (checkpoint formats, e.g. `checkpoint_tensors`) go in their order, cut into
    shards of about equal bytes; `extra_tensors` (the vision tensors) go last, as in the
    released checkpoint. The same inputs give the same bytes."""
    from safetensors.torch import save

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if any(directory.iterdir()):
        raise ValueError(f"directory {directory} is not empty")
    extra = dict(extra_tensors or {})
    names = list(tensors)
    total_text = sum(t.numel() * t.element_size() for t in tensors.values())
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    shard, acc = 0, 0
    for name in names:
        if shard < num_shards - 1 and acc >= total_text * (shard + 1) / num_shards:
            shard += 1
        shards[shard].append(name)
        acc += tensors[name].numel() * tensors[name].element_size()
    shards[-1] += list(extra)
    if not all(shards):
        raise ValueError(f"write_checkpoint: too few tensors for {num_shards} shards")
    everything = tensors | extra
    weight_map: dict[str, str] = {}
    for i, shard_names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        data = save({n: everything[n] for n in shard_names}, metadata={"format": "pt"})
        (directory / fname).write_bytes(data)
        weight_map.update(dict.fromkeys(shard_names, fname))
    total = sum(t.numel() * t.element_size() for t in everything.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_json(directory / "model.safetensors.index.json", index)
    _write_json(directory / "config.json", hf_config)
    _write_json(directory / "tokenizer_config.json", tokenizer_config)
    if generation_config is not None:
        _write_json(directory / "generation_config.json", generation_config)
    (directory / "tokenizer.json").write_text(tokenizer_backend.to_str(), encoding="utf-8")
    return directory


def write_tiny_checkpoint(directory: str | os.PathLike, seed: int = TINY_SEED) -> Path:
    """Write the tiny checkpoint files into `directory` (created; must be empty or absent)."""
    backend = build_tiny_tokenizer()
    config = tiny_config(backend)
    specs = model_tensor_specs(config)
    tensors = tiny_weights(specs, config.hc_mult, seed)
    return write_checkpoint(
        directory,
        tiny_hf_config(config),
        {s.name: tensors[s.name] for s in specs},  # state_dict order
        backend,
        tiny_tokenizer_config(),
        extra_tensors=tiny_vision_weights(config.hidden_size, seed),
    )


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", "utf-8")


def tiny_checkpoint_name(seed: int = TINY_SEED) -> str:
    """`tiny-v41-<format version>-<fingerprint of config, parameter specs, tokenizer, seed>`."""
    backend = build_tiny_tokenizer()
    config = tiny_config(backend)
    fp = _fingerprint(tiny_hf_config(config), model_tensor_specs(config), backend.to_str(), seed)
    return f"tiny-v41-{TINY_FORMAT_VERSION}-{fp}"


def ensure_tiny_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """The tiny checkpoint's directory, writing it first if absent.

    `cache_dir` defaults to `$XDG_CACHE_HOME/deepinfer` (`~/.cache/deepinfer` when unset).
    The files are written into a temporary sibling and renamed into place, so a concurrent or
    interrupted writer never leaves a half-written checkpoint under the final name.
    """
    from deepinfer_model.hub import user_cache_dir

    root = Path(cache_dir) if cache_dir is not None else user_cache_dir()
    final = root / tiny_checkpoint_name()
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        write_tiny_checkpoint(tmp)
        try:
            os.replace(tmp, final)
        except OSError:
            if not final.is_dir():  # not a lost race with another writer: a real error
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> None:
    """`python -m deepinfer_model.tiny_checkpoint [DIR]`: write the tiny checkpoint into DIR
    (which must be empty or absent), or ensure it in the user cache; print its path."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("directory", nargs="?", help="target directory (default: the user cache)")
    args = ap.parse_args(argv)
    path = write_tiny_checkpoint(args.directory) if args.directory else ensure_tiny_checkpoint()
    print(path)


if __name__ == "__main__":
    main()
