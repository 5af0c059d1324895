"""The built-in model's tools: the corpus builder and the training script's CPU toy run.

The toy run (`train_tiny.py --toy`: the random tiny checkpoint's sizes, a few steps on a small
corpus) goes through every phase: target training in training mode, export through the
checkpoint writer, drafter training, calibration, the final checkpoint loaded by the loader.
"""

from __future__ import annotations

import hashlib
import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import build_tiny_corpus
import train_tiny
from deepinfer_model.loader import load_model

PROSE = """Now is the winter of our discontent made glorious summer by this sun of York; and all
the clouds that lour'd upon our house in the deep bosom of the ocean buried. Now are our brows
bound with victorious wreaths, our bruised arms hung up for monuments, our stern alarums changed
to merry meetings, our dreadful marches to delightful measures."""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    import difflib
    import shlex

    docs = [build_tiny_corpus.Document(f"prose{i}", PROSE * 8, heldout=i == 0) for i in range(4)]
    for mod, held in ((textwrap, False), (shlex, False), (difflib, True)):
        docs.append(build_tiny_corpus.Document(mod.__name__, Path(mod.__file__).read_text(), held))
    out = tmp_path_factory.mktemp("corpus")
    build_tiny_corpus.write_corpus(docs, out, vocab_size=400)
    return out


def test_corpus_files(corpus: Path) -> None:
    from tokenizers import Tokenizer

    manifest = json.loads((corpus / "manifest.json").read_text())
    assert manifest["heldout"]["documents"] == ["prose0", "difflib"]
    tok = Tokenizer.from_file(str(corpus / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == 400
    assert tok.id_to_token(0) == "<｜begin▁of▁sentence｜>" and tok.id_to_token(2) == "<｜▁pad▁｜>"
    ids = np.fromfile(corpus / "heldout.bin", dtype=np.uint16)
    assert len(ids) == manifest["heldout"]["tokens"] and (ids == 1).sum() == 2  # EOS each
    first = ids[: list(ids).index(1)].tolist()
    assert tok.decode(first) == PROSE * 8


def _run(corpus: Path, out: Path) -> dict:
    return train_tiny.main(
        [
            "--corpus", str(corpus), "--out", str(out), "--toy", "--seed", "3",
            "--target-steps", "8", "--target-seconds", "1e9", "--lr", "1e-2",
            "--draft-steps", "3", "--draft-seconds", "1e9", "--log-every", "100",
        ]
    )  # fmt: skip


def _digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_toy_run_trains_exports_and_is_seeded(corpus: Path, tmp_path: Path) -> None:
    report = _run(corpus, tmp_path / "a")
    t = report["target"]
    bpb = {k: t[k]["bits_per_byte"] for k in ("heldout_initial", "heldout_qat")}
    bpb |= {k: t[k]["bits_per_byte"] for k in ("heldout_unquantized", "heldout_exported")}
    assert bpb["heldout_qat"] < 0.93 * bpb["heldout_initial"], bpb  # the loss went down
    # the exported checkpoint (FP8 / FP4, bf16 plain weights) against the training weights
    assert abs(bpb["heldout_exported"] / bpb["heldout_unquantized"] - 1) < 0.03, bpb
    assert abs(bpb["heldout_exported"] / bpb["heldout_qat"] - 1) < 0.01, bpb
    loaded = load_model(tmp_path / "a", "cpu", torch.float32, progress=False)
    temps = loaded.config.dspark_confidence_temperatures
    assert temps == tuple(report["drafter"]["heldout"]["calibration"]["temperatures"])
    assert len(temps) == loaded.config.dspark_block_size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # stages cleaned up
    # same seed, step-bounded schedule, CPU: the same bytes
    _run(corpus, tmp_path / "b")
    assert _digests(tmp_path / "a") == _digests(tmp_path / "b")
