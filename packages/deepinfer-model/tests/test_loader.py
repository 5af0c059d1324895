"""The safetensors loader: round trips, every error case, vision skipping, the hub path, RSS."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from deepinfer_model.hub import resolve_checkpoint
from deepinfer_model.loader import (
    CheckpointError,
    CheckpointReader,
    is_vision_tensor,
    load_checkpoint_into,
    read_safetensors_header,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file


class Small(torch.nn.Module):
    """Every dtype a V4.1 checkpoint holds: bf16, fp32, fp8 e4m3, e8m0 scales, int8 (FP4)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.zeros(10, 8, dtype=torch.bfloat16))
        self.norm = torch.nn.Parameter(torch.zeros(8, dtype=torch.float32))
        self.w = torch.nn.Parameter(
            torch.zeros(64, 32, dtype=torch.float8_e4m3fn), requires_grad=False
        )
        self.w_scale = torch.nn.Parameter(
            torch.zeros(2, 1, dtype=torch.float8_e8m0fnu), requires_grad=False
        )
        self.packed = torch.nn.Parameter(torch.zeros(4, 16, dtype=torch.int8), requires_grad=False)
        self.register_buffer("bias", torch.zeros(3, dtype=torch.float32))
        # Derived state: not part of the checkpoint.
        self.register_buffer("cache", torch.ones(5), persistent=False)


def _random_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(10, 8, generator=g).to(torch.bfloat16),
        "norm": torch.randn(8, generator=g),
        "w": torch.randn(64, 32, generator=g).to(torch.float8_e4m3fn),
        "w_scale": torch.tensor([[0.5], [4.0]]).to(torch.float8_e8m0fnu),
        "packed": torch.randint(-128, 128, (4, 16), generator=g, dtype=torch.int8),
        "bias": torch.randn(3, generator=g),
    }


def _write_sharded(
    directory: Path, state: dict[str, torch.Tensor], shards: list[list[str]]
) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: state[n] for n in names}, str(directory / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, fname))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


SHARDS = [["embed", "norm", "bias"], ["w", "w_scale", "packed"]]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def test_sharded_round_trip_is_bitwise(tmp_path: Path) -> None:
    state = _random_state()
    _write_sharded(tmp_path, state, SHARDS)
    model = Small()
    report = load_checkpoint_into(model, CheckpointReader(tmp_path), progress=False)
    assert report.num_tensors == 6
    assert report.num_bytes == sum(t.numel() * t.element_size() for t in state.values())
    for name, t in model.state_dict().items():
        assert t.dtype == state[name].dtype
        assert torch.equal(_bits(t), _bits(state[name])), name
    assert torch.equal(model.cache, torch.ones(5))


def test_single_file_without_index(tmp_path: Path) -> None:
    state = _random_state(1)
    save_file(state, str(tmp_path / "model.safetensors"))
    model = Small()
    load_checkpoint_into(model, CheckpointReader(tmp_path), progress=False)
    assert torch.equal(_bits(model.w), _bits(state["w"]))


def test_plain_floats_are_cast_to_the_model_dtype(tmp_path: Path) -> None:
    state = _random_state(2)
    _write_sharded(tmp_path, state, SHARDS)
    model = Small()
    model.embed.data = torch.zeros(10, 8, dtype=torch.float32)
    load_checkpoint_into(model, CheckpointReader(tmp_path), progress=False)
    assert model.embed.dtype == torch.float32
    assert torch.equal(model.embed, state["embed"].float())


def test_missing_shard_names_shard_and_tensor(tmp_path: Path) -> None:
    _write_sharded(tmp_path, _random_state(), SHARDS)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match=r"missing shard 'model-00002-of-00002.safetensors'.*'w'"
    ):
        CheckpointReader(tmp_path)


def test_missing_tensor_names_tensor_and_index(tmp_path: Path) -> None:
    state = _random_state()
    _write_sharded(tmp_path, state, SHARDS)
    model = Small()
    model.extra = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(
        CheckpointError, match=r"missing tensor.*'extra'.*model.safetensors.index.json"
    ):
        load_checkpoint_into(model, CheckpointReader(tmp_path), progress=False)


def test_unexpected_tensor_names_tensor_and_file(tmp_path: Path) -> None:
    state = _random_state() | {"layers.9.stray": torch.zeros(3)}
    _write_sharded(tmp_path, state, [[*SHARDS[0], "layers.9.stray"], SHARDS[1]])
    with pytest.raises(
        CheckpointError, match=r"unexpected tensor.*'layers.9.stray'.*model-00001-of-00002"
    ):
        load_checkpoint_into(Small(), CheckpointReader(tmp_path), progress=False)


def test_wrong_shape_names_tensor_and_file(tmp_path: Path) -> None:
    state = _random_state() | {"norm": torch.zeros(9)}
    _write_sharded(tmp_path, state, SHARDS)
    with pytest.raises(
        CheckpointError, match=r"'norm' in 'model-00001-of-00002.safetensors': shape \[9\].*\[8\]"
    ):
        load_checkpoint_into(Small(), CheckpointReader(tmp_path), progress=False)


def test_wrong_dtype_names_tensor_and_file(tmp_path: Path) -> None:
    # FP8 weights stored as int8 (a common conversion slip) must not be silently reinterpreted.
    state = _random_state() | {"w": torch.zeros(64, 32, dtype=torch.int8)}
    _write_sharded(tmp_path, state, SHARDS)
    with pytest.raises(
        CheckpointError, match=r"'w' in 'model-00002-of-00002.safetensors': dtype torch.int8"
    ):
        load_checkpoint_into(Small(), CheckpointReader(tmp_path), progress=False)


def test_truncated_file_names_tensor_and_file(tmp_path: Path) -> None:
    _write_sharded(tmp_path, _random_state(), SHARDS)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match=r"tensor '\w+' in .*model-00002-of-00002.*truncated"):
        CheckpointReader(tmp_path)
    shard.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002.*truncated"):
        CheckpointReader(tmp_path)


def test_index_listing_a_tensor_its_shard_lacks(tmp_path: Path) -> None:
    _write_sharded(tmp_path, _random_state(), SHARDS)
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["norm"] = "model-00002-of-00002.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"'norm'.*model-0000[12]-of-00002"):
        CheckpointReader(tmp_path)


def test_header_byte_range_must_match_dtype_and_shape(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    header = json.dumps({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(CheckpointError, match=r"tensor 'x' in .*bad.safetensors.*F32 \[3\]"):
        read_safetensors_header(path)


def test_vision_tensors_are_skipped_with_one_log_line(tmp_path: Path, caplog) -> None:
    vision = {
        "vision.blocks.0.attn.qkv.weight": torch.ones(4, 4),
        "aligner.w1": torch.ones(8, 4),
        "image_newline": torch.ones(8),
    }
    state = _random_state() | vision
    _write_sharded(tmp_path, state, [[*SHARDS[0], *vision], SHARDS[1]])
    with caplog.at_level(logging.INFO, logger="deepinfer_model.loader"):
        report = load_checkpoint_into(Small(), CheckpointReader(tmp_path), progress=False)
    assert sorted(report.skipped_vision) == sorted(vision)
    lines = [r.getMessage() for r in caplog.records if "vision" in r.getMessage()]
    assert lines == ["skipping 3 vision tensors (vision.*, aligner.*, image_*): text-only model"]
    assert all(is_vision_tensor(n) for n in vision)
    assert not is_vision_tensor("layers.0.attn.wq_a.weight")


def test_local_directory_resolves_to_itself(tmp_path: Path) -> None:
    assert resolve_checkpoint(tmp_path) == tmp_path
    with pytest.raises(FileNotFoundError, match="not an existing directory"):
        resolve_checkpoint(tmp_path / "nope" / "deeper")


def _fake_hub_cache(cache: Path, repo: str, files: dict[str, bytes]) -> Path:
    """The on-disk layout of the huggingface_hub cache: refs/main -> snapshots/<commit>/..."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, data in files.items():
        (snap / name).write_bytes(data)
    return snap


def test_hub_repo_id_resolves_through_snapshot_download_offline(tmp_path: Path) -> None:
    ckpt = tmp_path / "src"
    _write_sharded(ckpt, _random_state(3), SHARDS)
    files = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    snap = _fake_hub_cache(tmp_path / "hub", "acme/tiny-v41", files)
    # A fresh interpreter: huggingface_hub reads HF_HUB_OFFLINE / HF_HUB_CACHE at import time.
    script = textwrap.dedent(
        """
        import sys, torch
        from deepinfer_model.hub import resolve_checkpoint
        from deepinfer_model.loader import CheckpointReader
        path = resolve_checkpoint("acme/tiny-v41")
        print(path)
        reader = CheckpointReader(path)
        print(sorted(reader.entries))
        try:
            resolve_checkpoint("acme/absent")
        except FileNotFoundError as e:
            print("absent:", type(e.__cause__).__name__, "acme/absent" in str(e))
        """
    )
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert Path(out[0]) == snap
    assert out[1] == str(sorted(_random_state()))
    assert out[2] == "absent: LocalEntryNotFoundError True"


def test_hub_download_asks_only_for_text_model_files(tmp_path: Path, monkeypatch) -> None:
    import huggingface_hub

    seen = {}

    def fake_snapshot_download(**kwargs):
        seen.update(kwargs)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_checkpoint("deepseek-ai/DeepSeek-V4.1-Flash", revision="abc") == tmp_path
    assert seen["repo_id"] == "deepseek-ai/DeepSeek-V4.1-Flash" and seen["revision"] == "abc"
    assert "*.safetensors" in seen["allow_patterns"]
    assert not any(p.endswith((".bin", ".pt", ".pth", ".py")) for p in seen["allow_patterns"])


def test_peak_rss_while_loading_stays_under_1_2x_checkpoint(tmp_path: Path) -> None:
    # 4 shards x 2 tensors x 16 MiB; the loader must not hold a shard resident next to the model.
    n_shards, per_tensor = 4, 4 * 1024 * 1024
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    for i in range(n_shards):
        state = {f"p{i}_{j}": torch.randn(per_tensor, generator=g) for j in range(2)}
        save_file(state, str(tmp_path / f"s{i}.safetensors"))
        weight_map.update(dict.fromkeys(state, f"s{i}.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    n = 2 * n_shards
    script = textwrap.dedent(
        f"""
        import torch
        from deepinfer_model.loader import CheckpointReader, load_checkpoint_into

        def status(key):
            for line in open("/proc/self/status"):
                if line.startswith(key):
                    return int(line.split()[1]) * 1024

        reader = CheckpointReader({str(tmp_path)!r})
        before = status("VmRSS")
        model = torch.nn.Module()
        for name in {sorted(weight_map)!r}:
            model.register_parameter(name, torch.nn.Parameter(torch.empty({per_tensor})))
        load_checkpoint_into(model, reader, progress=False)
        print(status("VmHWM") - before, reader.total_bytes)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    peak, size = map(int, out.stdout.split())
    assert size == n * per_tensor * 4
    assert peak <= 1.2 * size, (peak / size, peak, size)


def test_load_model_needs_a_config(tmp_path: Path) -> None:
    from deepinfer_model.loader import load_model

    _write_sharded(tmp_path, _random_state(), SHARDS)
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_model(tmp_path, "cpu", torch.float32, progress=False)


_DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8]


@given(
    st.lists(
        st.tuples(
            st.sampled_from(_DTYPES),
            st.lists(st.integers(min_value=0, max_value=9), min_size=1, max_size=3),
        ),
        min_size=1,
        max_size=6,
    ),
    st.integers(min_value=1, max_value=3),
    st.sampled_from([1, 7, 64, 1 << 20]),
    st.integers(min_value=0, max_value=2**31),
)
@settings(max_examples=25, deadline=None)
def test_any_tensors_any_sharding_any_chunk_size_round_trip(specs, n_shards, chunk, seed) -> None:
    """Random dtypes/shapes (zero-size too), shard splits and copy chunk sizes: bitwise equal."""
    import tempfile

    import deepinfer_model.loader as loader_mod

    g = torch.Generator().manual_seed(seed)
    state = {}
    for i, (dtype, shape) in enumerate(specs):
        raw = torch.randint(
            0, 256, (int(torch.tensor(shape).prod()) * dtype.itemsize,), generator=g
        )
        t = raw.to(torch.uint8).view(dtype).view(shape)
        state[f"t{i}"] = t
    names = list(state)
    shards = [names[i::n_shards] for i in range(n_shards) if names[i::n_shards]]
    module = torch.nn.Module()
    for n, t in state.items():
        module.register_parameter(n, torch.nn.Parameter(torch.zeros_like(t), requires_grad=False))
    before = loader_mod.COPY_CHUNK_BYTES
    loader_mod.COPY_CHUNK_BYTES = chunk
    try:
        with tempfile.TemporaryDirectory() as d:
            _write_sharded(Path(d), state, shards)
            load_checkpoint_into(module, CheckpointReader(d), progress=False)
    finally:
        loader_mod.COPY_CHUNK_BYTES = before
    for n, t in state.items():
        assert torch.equal(_bits(getattr(module, n)), _bits(t)), n
