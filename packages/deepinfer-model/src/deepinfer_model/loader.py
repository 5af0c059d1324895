"""Checkpoint loading: `model.safetensors.index.json` + safetensors shards -> a built model.

How a load goes, and why:

1. `resolve_checkpoint` turns the source into a local directory (a hub repo id goes through
   `huggingface_hub.snapshot_download(allow_patterns=...)`).
2. `CheckpointReader` reads the index and only the *headers* of the shards (the safetensors
   format: a u64 little-endian header length, a JSON header, then the raw bytes). Every
   consistency problem is found here, before a byte of weight data is read, and reported
   naming the tensor and the file: a missing shard, a tensor the index lists but its shard
   lacks, a truncated file, a header whose byte range disagrees with dtype x shape.
3. `load_checkpoint_into(model, reader)` compares the checkpoint with `model.state_dict()`:
   missing / unexpected tensors, wrong shapes or dtypes are errors. Vision tensors (`vision.*`,
   `aligner.*`, `image_*`) are recognised and skipped with one log line (the engine is text
   only). Then each shard is memory-mapped and each tensor is copied exactly once, from the
   mapped file pages into the parameter that already lives on its device. The copy goes in
   chunks of 8 MiB whose file pages are released (`madvise(MADV_DONTNEED)`) right after, so
   resident memory while loading stays near the model's own size (peak RSS <= 1.2x the
   checkpoint), not model + shard (a V4.1 shard or its 94 GiB Engram table).
   Nothing is unpickled: safetensors is plain bytes.
   A model sharded over ranks (`Model(shard=...)`) loads only its own part (`ShardSources`):
   its expert slots from the checkpoint's experts they hold, its Engram rows as a row range
   of the full table (only those bytes are mapped and copied); the experts other ranks hold
   are never read.
4. `load_model` builds the model from `config.json` (`ModelConfig.from_hf`) on the target
   device, fills it this way, and returns it with its tokenizer.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from deepinfer_model.hub import resolve_checkpoint
from deepinfer_model.shard_sources import ShardSources, TensorSource
from deepinfer_model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from deepinfer_model.config import ModelConfig
    from deepinfer_model.rank_shard import RankShard

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

VISION_PREFIXES: tuple[str, ...] = ("vision.", "aligner.", "image_")
"""Checkpoint names of the V4.1 vision tower, aligner and image marker embeddings."""

# safetensors dtype names -> torch dtypes (the format's spec; F8_E8M0 holds UE8M0 scales).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_PLAIN_FLOATS = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors spec's own limit on header size


class CheckpointError(ValueError):
    """A checkpoint does not match its index, its own headers, or the model; names tensor + file."""


def is_vision_tensor(name: str) -> bool:
    """True for the vision tower / aligner / image-marker tensors that a text load skips."""
    return name.startswith(VISION_PREFIXES)


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes live: `file`, absolute byte `offset`, `nbytes`, dtype, shape."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """Parse a safetensors file's header (no tensor data is read); validate it against the file.

    Raises CheckpointError naming the file (and tensor) for a truncated file, a malformed
    header, an unknown dtype, or a byte range that disagrees with dtype x shape.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated file ({size} bytes, no safetensors header)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > _MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: header length {header_len} is not plausible")
        if 8 + header_len > size:
            raise CheckpointError(
                f"{path}: truncated file: header needs {8 + header_len} bytes, file has {size}"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: malformed safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: malformed safetensors header (not a JSON object)")
    data_start = 8 + header_len
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"tensor {name!r} in {path}: malformed header entry {info!r}"
            ) from None
        if dtype_name not in SAFETENSORS_DTYPES:
            raise CheckpointError(
                f"tensor {name!r} in {path}: dtype {dtype_name!r} is not supported "
                f"(supported: {sorted(SAFETENSORS_DTYPES)})"
            )
        dtype = SAFETENSORS_DTYPES[dtype_name]
        shape = tuple(int(s) for s in shape)
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * dtype.itemsize
        if end - begin != nbytes or begin < 0:
            raise CheckpointError(
                f"tensor {name!r} in {path}: byte range [{begin}, {end}) does not hold "
                f"{dtype_name} {list(shape)} ({nbytes} bytes)"
            )
        if data_start + end > size:
            raise CheckpointError(
                f"tensor {name!r} in {path}: truncated file: its data ends at byte "
                f"{data_start + end} but the file has only {size} bytes"
            )
        entries[name] = TensorEntry(name, path, dtype, shape, data_start + begin, nbytes)
    return entries


class CheckpointReader:
    """The tensors of one checkpoint directory, validated from the index and shard headers.

    `entries`: every tensor name -> TensorEntry; `shards`: shard files in index order.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        index_file = self.path / INDEX_FILE
        if index_file.is_file():
            weight_map = self._read_index(index_file)
        elif (self.path / SINGLE_FILE).is_file():
            index_file = self.path / SINGLE_FILE
            weight_map = None
        else:
            raise CheckpointError(f"{self.path}: neither {INDEX_FILE} nor {SINGLE_FILE} is present")
        self.index_file = index_file

        if weight_map is None:
            self.shards = [self.path / SINGLE_FILE]
            self.entries = read_safetensors_header(self.shards[0])
            return

        by_shard: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            by_shard.setdefault(shard, []).append(name)
        for shard, names in by_shard.items():
            if not (self.path / shard).is_file():
                more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
                raise CheckpointError(
                    f"missing shard {shard!r} in {self.path}: {INDEX_FILE} places tensor "
                    f"{names[0]!r}{more} there"
                )
        self.shards = [self.path / shard for shard in by_shard]
        self.entries = {}
        for shard, names in by_shard.items():
            header = read_safetensors_header(self.path / shard)
            for name in names:
                if name not in header:
                    raise CheckpointError(
                        f"missing tensor {name!r}: {INDEX_FILE} places it in {shard!r}, "
                        "which does not contain it"
                    )
            listed = set(names)
            for name in header:
                if name not in listed:
                    raise CheckpointError(
                        f"unexpected tensor {name!r} in {shard!r}: it is not listed in "
                        f"{INDEX_FILE} for that shard"
                    )
            self.entries.update(header)

    @staticmethod
    def _read_index(index_file: Path) -> dict[str, str]:
        try:
            index = json.loads(index_file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{index_file}: not valid JSON ({e})") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(f"{index_file}: 'weight_map' must map tensor names to files")
        for name, shard in weight_map.items():
            if Path(shard).name != shard:
                raise CheckpointError(
                    f"{index_file}: tensor {name!r} maps to {shard!r}, which is not a plain "
                    "file name in the checkpoint directory"
                )
        return weight_map

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data in the checkpoint (what the loaded weights occupy)."""
        return sum(e.nbytes for e in self.entries.values())

    def copy_shard(
        self, shard: Path, jobs: dict[str, tuple[TensorEntry, torch.Tensor]]
    ) -> tuple[int, int]:
        """Copy the `jobs` (target name -> (source bytes, target tensor)) whose bytes are in
        `shard`; return (tensors, bytes).

        The shard is memory-mapped; tensors are visited in file order and copied in chunks of
        at most `COPY_CHUNK_BYTES`, each chunk's pages dropped (MADV_DONTNEED) right after its
        copy, so at most one chunk of the file is resident besides the destination tensors.
        """
        work = sorted((j for j in jobs.values() if j[0].file == shard), key=lambda j: j[0].offset)
        if not work:
            return 0, 0
        with open(shard, "rb") as f:
            # ACCESS_COPY: a private mapping that torch can wrap without a read-only warning;
            # nothing writes to it, so no page is ever copied.
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        try:
            for entry, target in work:
                _copy_entry(mm, entry, target)
        finally:
            mm.close()
        return len(work), sum(e.nbytes for e, _ in work)


COPY_CHUNK_BYTES = 8 * 1024 * 1024


def _copy_entry(mm: mmap.mmap, entry: TensorEntry, target: torch.Tensor) -> None:
    """target <- the bytes of `entry` in mapping `mm`, chunk by chunk (see copy_shard)."""
    if entry.nbytes == 0:
        return
    itemsize = entry.dtype.itemsize
    numel = entry.nbytes // itemsize
    # A contiguous target can be filled in flat chunks; otherwise copy the tensor whole.
    chunk = max(1, COPY_CHUNK_BYTES // itemsize) if target.is_contiguous() else numel
    flat_target = target.view(-1) if target.is_contiguous() else None
    page = mmap.PAGESIZE
    for lo in range(0, numel, chunk):
        hi = min(numel, lo + chunk)
        start = entry.offset + lo * itemsize
        raw = torch.frombuffer(mm, dtype=torch.uint8, count=(hi - lo) * itemsize, offset=start)
        src = raw.view(entry.dtype)
        if flat_target is not None:
            flat_target[lo:hi].copy_(src)
        else:
            target.copy_(src.view(entry.shape))
        del raw, src
        page_lo = start // page * page
        page_hi = min(len(mm), -(-(start + (hi - lo) * itemsize) // page) * page)
        mm.madvise(mmap.MADV_DONTNEED, page_lo, page_hi - page_lo)


def _compatible(stored: torch.dtype, wanted: torch.dtype) -> bool:
    """Quantised/integer tensors must match exactly; plain floats may be cast (bf16 -> fp32)."""
    return stored == wanted or (stored in _PLAIN_FLOATS and wanted in _PLAIN_FLOATS)


def _listing(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


@dataclass
class LoadReport:
    """What a load did: tensors and bytes copied, vision tensors skipped, tensors left to other
    ranks, and the process's peak resident memory after it (bytes, from getrusage)."""

    num_tensors: int = 0
    num_bytes: int = 0
    skipped_vision: list[str] = field(default_factory=list)
    held_elsewhere: int = 0
    peak_rss_bytes: int = 0


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far, in bytes."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _rows_entry(entry: TensorEntry, rows: tuple[int, int]) -> TensorEntry:
    """The entry of rows [lo, hi) of `entry` (contiguous bytes in a row-major tensor)."""
    lo, hi = rows
    if not entry.shape or not 0 <= lo <= hi <= entry.shape[0]:
        raise CheckpointError(
            f"tensor {entry.name!r} in {entry.file.name!r}: rows [{lo}, {hi}) are not within "
            f"its shape {list(entry.shape)}"
        )
    row_bytes = entry.nbytes // entry.shape[0] if entry.shape[0] else 0
    return TensorEntry(
        entry.name,
        entry.file,
        entry.dtype,
        (hi - lo, *entry.shape[1:]),
        entry.offset + lo * row_bytes,
        (hi - lo) * row_bytes,
    )


def load_checkpoint_into(
    model: torch.nn.Module,
    reader: CheckpointReader,
    *,
    progress: bool = True,
    shard: ShardSources | None = None,
) -> LoadReport:
    """Fill every tensor of `model.state_dict()` from `reader`, in place, on its current device.

    Each checkpoint tensor is copied once, from the mapped file into the existing parameter or
    persistent buffer (plain float tensors are cast to the model's dtype; quantised and integer
    tensors must match exactly). Raises CheckpointError naming tensor and file for a missing or
    unexpected tensor, a wrong shape or a wrong dtype. `shard`: a sharded model's sources
    (`Model.shard_sources()`); only those bytes are read.
    """
    targets: dict[str, torch.Tensor] = model.state_dict(keep_vars=True)
    shard = shard or ShardSources()
    entries = reader.entries
    source = {n: shard.sources.get(n, TensorSource(n)) for n in targets}
    used = {src.name for src in source.values()}
    vision = sorted(n for n in entries if is_vision_tensor(n) and n not in used)
    if vision:
        logger.info(
            "skipping %d vision tensors (vision.*, aligner.*, image_*): text-only model",
            len(vision),
        )
    missing = sorted(n for n, src in source.items() if src.name not in entries)
    if missing:
        raise CheckpointError(
            f"missing tensor(s) {_listing([source[n].name for n in missing])} in "
            f"{reader.index_file}: the model needs them and the checkpoint does not have them"
        )
    unexpected = sorted(
        n for n in entries if n not in used and not is_vision_tensor(n) and n not in shard.elsewhere
    )
    if unexpected:
        first = entries[unexpected[0]]
        raise CheckpointError(
            f"unexpected tensor(s) {_listing(unexpected)} (first in {first.file.name!r}): "
            "the model has no such parameter"
        )
    jobs: dict[str, tuple[TensorEntry, torch.Tensor]] = {}
    for name, target in targets.items():
        src = source[name]
        entry = entries[src.name]
        if src.rows is not None:
            entry = _rows_entry(entry, src.rows)
        jobs[name] = (entry, target)
        if tuple(target.shape) != entry.shape:
            raise CheckpointError(
                f"tensor {entry.name!r} in {entry.file.name!r}: shape {list(entry.shape)}, "
                f"the model expects {list(target.shape)}"
            )
        if not _compatible(entry.dtype, target.dtype):
            raise CheckpointError(
                f"tensor {entry.name!r} in {entry.file.name!r}: dtype {entry.dtype}, "
                f"the model expects {target.dtype}"
            )

    from deepinfer_model.layers.linear import use_checkpoint_order_

    use_checkpoint_order_(model)  # the copies below write the checkpoint's bytes in place
    report = LoadReport(
        skipped_vision=vision, held_elsewhere=sum(1 for n in entries if n in shard.elsewhere)
    )
    bar = tqdm(reader.shards, desc="loading shards", unit="shard", disable=not progress)
    with torch.no_grad():
        for file in bar:
            n, nbytes = reader.copy_shard(file, jobs)
            report.num_tensors += n
            report.num_bytes += nbytes
    check_expert_scales(model, reader, source)
    report.peak_rss_bytes = peak_rss_bytes()
    return report


def check_expert_scales(
    model: torch.nn.Module,
    reader: CheckpointReader,
    source: dict[str, TensorSource] | None = None,
) -> None:
    """Raise CheckpointError naming the first FP4 expert scale tensor with a UE8M0 byte above
    `quant.FP4_MAX_SCALE_BYTE` (a scale above 2, which the GPU kernels would expand to infinity).
    One device-to-host copy for the whole model."""
    from deepinfer_kernels.quant import FP4_MAX_SCALE_BYTE

    from deepinfer_model.layers.linear import FP4Weight

    named = [(f"{n}.scale", m.scale) for n, m in model.named_modules() if isinstance(m, FP4Weight)]
    if not named:
        return
    with torch.no_grad():
        largest = torch.stack([s.view(torch.uint8).amax() for _, s in named]).cpu()
    bad = (largest > FP4_MAX_SCALE_BYTE).nonzero()
    if bad.numel():
        name = named[int(bad[0])][0]
        if source is not None and name in source:
            name = source[name].name
        byte = int(largest[int(bad[0])])
        file = reader.entries[name].file.name if name in reader.entries else "?"
        raise CheckpointError(
            f"tensor {name!r} in {file!r}: FP4 scale byte {byte} (2**{byte - 127}); FP4 expert "
            f"scales must be at most {FP4_MAX_SCALE_BYTE} (2**{FP4_MAX_SCALE_BYTE - 127}), the "
            "largest the GPU kernels expand exactly"
        )


@dataclass
class LoadedModel:
    """A model ready to run: the module, its config, its tokenizer, the checkpoint dir, and what
    the load did."""

    model: torch.nn.Module
    config: ModelConfig
    tokenizer: Tokenizer
    path: Path
    report: LoadReport | None = None


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed `config.json` of a checkpoint directory."""
    config_file = Path(path) / CONFIG_FILE
    if not config_file.is_file():
        raise CheckpointError(f"{Path(path)}: no {CONFIG_FILE}")
    try:
        return json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file}: not valid JSON ({e})") from None


def build_model(
    config: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    shard: RankShard | None = None,
) -> torch.nn.Module:
    """An un-loaded model for `config` (this rank's part of it with `shard`), its parameters
    allocated once, directly on `device`."""
    from deepinfer_model.model import Model

    return Model(config, dtype=dtype, device=device, shard=shard)


def install_engram_token_map(model: torch.nn.Module, tokenizer: Tokenizer) -> None:
    """Give the model's Engram hasher the tokenizer's compressed token map (not a checkpoint
    tensor: it is derived from the vocabulary). Ids the model has beyond the tokenizer's
    vocabulary (padding rows) never occur in input; they map to the pad token's class."""
    hasher = getattr(model, "engram_hasher", None)
    if hasher is None:
        return
    from deepinfer_model.layers.engram import build_compressed_token_map

    token_map, num_classes = build_compressed_token_map(tokenizer.backend)
    vocab = model.config.vocab_size
    if len(token_map) > vocab:
        raise CheckpointError(
            f"tokenizer has {len(token_map)} tokens but the config's vocab_size is {vocab}"
        )
    pad_class = token_map[model.config.engram_pad_token_id]
    token_map = token_map + [pad_class] * (vocab - len(token_map))
    hasher.set_token_map(token_map, num_classes)


def checkpoint_config(source: str | os.PathLike | None) -> tuple[Path, ModelConfig]:
    """The local directory of `source` (as `load_model` takes it) and its model config, without
    reading any weights (e.g. to plan a sharded load first)."""
    from deepinfer_model.config import ModelConfig

    if source is None:
        from deepinfer_model.builtin import builtin_checkpoint

        path = builtin_checkpoint()
    else:
        path = resolve_checkpoint(source)
    return path, ModelConfig.from_hf(read_hf_config(path))


def load_model(
    source: str | os.PathLike | None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    *,
    progress: bool = True,
    shard: RankShard | None = None,
) -> LoadedModel:
    """Load a V4.1 checkpoint into a model on `device` with compute dtype `dtype`.

    `source`: a checkpoint directory, a hub repo id (`owner/name`), or None: the built-in
    trained tiny checkpoint (package data, `builtin.builtin_checkpoint()`), loaded through this
    same path. The random-weight tiny checkpoint is
    `load_model(tiny_checkpoint.ensure_tiny_checkpoint())`. `shard`: load only this rank's
    part (`rank_shard.RankShard`, built for the checkpoint's config).
    """
    path, config = checkpoint_config(source)
    tokenizer = Tokenizer.from_dir(path)
    reader = CheckpointReader(path)
    model = build_model(config, device, dtype, shard)
    sources = model.shard_sources() if shard is not None else None
    report = load_checkpoint_into(model, reader, progress=progress, shard=sources)
    install_engram_token_map(model, tokenizer)
    model.eval()
    return LoadedModel(model=model, config=config, tokenizer=tokenizer, path=path, report=report)
