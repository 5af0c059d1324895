"""The random-weight tiny checkpoint: HF layout, real formats, same bytes every time, loads and
runs (the built-in trained one is tested in test_builtin.py)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from deepinfer_kernels import quant
from deepinfer_model.batch import ForwardBatch
from deepinfer_model.cache import CacheSpec, KVCache
from deepinfer_model.chat import encode_messages
from deepinfer_model.config import ModelConfig
from deepinfer_model.loader import CheckpointReader, load_model, read_safetensors_header
from deepinfer_model.tiny_checkpoint import (
    TINY_SEED,
    ensure_tiny_checkpoint,
    model_tensor_specs,
    tiny_config,
    tiny_weights,
    write_tiny_checkpoint,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny matmuls gain nothing from threads, and on a loaded CI machine OpenMP spin-waits
    # make them 10-50x slower; restore the setting for the other test modules.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def test_hf_layout(tiny_dir: Path) -> None:
    names = sorted(p.name for p in tiny_dir.iterdir())
    assert names == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    }
    reader = CheckpointReader(tiny_dir)
    assert index["metadata"]["total_size"] == reader.total_bytes
    hf = json.loads((tiny_dir / "config.json").read_text())
    assert "text_config" in hf and "vision_config" in hf
    assert ModelConfig.from_hf(hf) == tiny_config()


def test_weights_are_in_the_real_formats(tiny_dir: Path) -> None:
    entries = CheckpointReader(tiny_dir).entries
    e = entries["layers.0.attn.wq_a.weight"]
    assert e.dtype == torch.float8_e4m3fn
    assert entries["layers.0.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    w1 = entries["layers.0.ffn.experts.0.w1.weight"]
    assert w1.dtype == torch.int8
    assert entries["layers.0.ffn.experts.0.w1.scale"].shape == (w1.shape[0], 2 * w1.shape[1] // 32)
    assert entries["embed.weight"].dtype == torch.bfloat16
    assert entries["layers.0.hc_attn_fn"].dtype == torch.float32
    # reference §4: head, compressor wkv/wgate and the DSpark heads are BF16 on disk (the model
    # computes with them in fp32; the loader widens them); sinks and router biases stay F32
    last = tiny_config().num_nextn_predict_layers - 1
    for name in (
        "head.weight",
        "layers.2.attn.compressor.wkv.weight",
        "layers.2.attn.compressor.wgate.weight",
        "layers.4.attn.compressor.wkv.weight",
        f"mtp.{last}.markov_head.head.weight",
        f"mtp.{last}.confidence_head.proj.weight",
    ):
        assert entries[name].dtype == torch.bfloat16, name
    assert entries["layers.2.attn.attn_sink"].dtype == torch.float32
    assert entries["layers.2.ffn.gate.bias"].dtype == torch.float32
    assert entries["layers.1.engram.embed.weight"].dtype == torch.float8_e4m3fn
    assert any(n.startswith("vision.") for n in entries)
    assert {e.dtype for e in entries.values()} == {
        torch.bfloat16,
        torch.float32,
        torch.float8_e4m3fn,
        torch.float8_e8m0fnu,
        torch.int8,
    }
    for shard in sorted(tiny_dir.glob("*.safetensors")):
        assert read_safetensors_header(shard)  # every header parses and fits its file


def test_quantised_weights_dequantise_to_sane_scales() -> None:
    config = tiny_config()
    specs = model_tensor_specs(config)
    w = tiny_weights(specs, config.hc_mult, TINY_SEED)
    dense = quant.dequantize_fp8_blocks(
        w["layers.3.attn.wq_b.weight"], w["layers.3.attn.wq_b.scale"], torch.float64
    )
    assert abs(dense.std().item() * dense.shape[1] ** 0.5 - 1.0) < 0.2  # N(0, 1/K)
    expert = quant.dequantize_fp4(
        w["layers.3.ffn.experts.1.w2.weight"], w["layers.3.ffn.experts.1.w2.scale"], torch.float64
    )
    assert abs(expert.std().item() * expert.shape[1] ** 0.5 - 1.0) < 0.3
    # Scales are powers of two by construction of the e8m0 format; all finite and nonzero.
    s = w["layers.3.attn.wq_b.scale"].float()
    assert torch.isfinite(s).all() and (s > 0).all()
    # Each tensor depends only on (seed, name): a different seed changes it, order does not.
    w_other = tiny_weights(list(reversed(specs)), config.hc_mult, TINY_SEED)
    assert all(torch.equal(w[n].view(torch.uint8), w_other[n].view(torch.uint8)) for n in w)
    assert not torch.equal(
        w["embed.weight"], tiny_weights(specs[:1], config.hc_mult, 7)["embed.weight"]
    )


def test_ensure_writes_once_into_the_xdg_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = ensure_tiny_checkpoint()
    assert path.parent == tmp_path / "deepinfer" and path.name.startswith("tiny-v41-")
    stamp = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    assert ensure_tiny_checkpoint() == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == stamp
    assert [p.name for p in (tmp_path / "deepinfer").iterdir()] == [path.name]  # no temp left


def _greedy(loaded, prompt_ids: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    cfg = loaded.config
    cache = KVCache(cfg, CacheSpec.from_config(cfg, block_size=64), num_blocks=4, num_slots=1)
    out, logits, ctx, toks = [], [], 0, prompt_ids
    for _ in range(steps):
        batch = ForwardBatch.build([toks], [ctx], [0], [list(range(4))])
        row = loaded.model(batch, cache).logits[-1]
        logits.append(row)
        ctx += len(toks)
        toks = [int(row.argmax())]
        out.append(toks[0])
    return out, logits


def test_the_cached_tiny_checkpoint_loads_and_generates(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="deepinfer_model.loader"):
        loaded = load_model(ensure_tiny_checkpoint(), "cpu", torch.float32, progress=False)
    assert loaded.path.parent == tmp_path / "deepinfer"
    assert sum("skipping 7 vision tensors" in r.getMessage() for r in caplog.records) == 1
    assert loaded.config == tiny_config()
    assert loaded.tokenizer.vocab_size == loaded.config.vocab_size

    # The loaded parameters are the generated tensors, bit for bit (plain floats cast bf16->fp32).
    config = loaded.config
    generated = tiny_weights(model_tensor_specs(config), config.hc_mult, TINY_SEED)
    for name, t in loaded.model.state_dict().items():
        g = generated[name]
        if g.dtype == torch.bfloat16:
            assert torch.equal(t, g.float()), name
        else:
            assert torch.equal(t.view(torch.uint8), g.view(torch.uint8)), name

    prompt = loaded.tokenizer.encode(encode_messages([{"role": "user", "content": "Hi!"}]))
    out, logits = _greedy(loaded, prompt, 32)
    assert len(out) == 32 and all(0 <= i < config.vocab_size for i in out)
    for row in logits:  # activations stay sane through every layer: finite, O(1) logits
        assert torch.isfinite(row).all()
        assert 0.1 < row.std().item() < 10.0


def test_the_cached_and_a_written_tiny_checkpoint_are_the_same_model(
    tiny_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    a = load_model(ensure_tiny_checkpoint(), "cpu", torch.float32, progress=False)
    b = load_model(tiny_dir, "cpu", torch.float32, progress=False)
    assert a.path.parent == tmp_path / "deepinfer" and b.path == tiny_dir
    prompt = a.tokenizer.encode("abc")
    assert _greedy(a, prompt, 3)[0] == _greedy(b, prompt, 3)[0]


def test_fresh_process_writes_the_same_bytes_and_loads(tiny_dir: Path, tmp_path: Path) -> None:
    """A fresh interpreter (another hash seed, an empty XDG cache) writes byte-identical files
    and loads them from the cache: same bytes every time, and the real first-run path."""
    script = textwrap.dedent(
        f"""
        import torch
        from deepinfer_model.loader import load_model
        from deepinfer_model.tiny_checkpoint import ensure_tiny_checkpoint, write_tiny_checkpoint
        write_tiny_checkpoint({str(tmp_path / "b")!r})
        m = load_model(ensure_tiny_checkpoint(), "cpu", torch.float32, progress=False)
        print(m.path)
        """
    )
    env = os.environ | {
        "XDG_CACHE_HOME": str(tmp_path / "xdg"),
        "PYTHONHASHSEED": "12345",
        "OMP_NUM_THREADS": "1",
    }
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    written = Path(out.stdout.strip())
    assert written.parent == tmp_path / "xdg" / "deepinfer"
    assert _digests(tiny_dir) == _digests(tmp_path / "b") == _digests(written)
