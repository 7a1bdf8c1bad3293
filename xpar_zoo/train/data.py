"""Training data: documents read from a file, tokenized, packed into ``seq_len`` rows, and dealt to the ranks.

- :func:`read_documents`: JSONL (``text``, or token ids in ``input_ids``), plain ``.txt`` (one document per
  non-empty line), and what ``datasets.load_dataset`` reads locally (parquet, arrow, csv, ``save_to_disk``
  directories) with the ``data`` extra.
- :func:`tokenize`: the model's tokenizer with its special tokens, EOS appended.
- :class:`PackedCorpus`: documents shuffled per epoch from ``(seed, epoch)``, concatenated and cut into rows;
  ``position_ids`` restart at every document and row start, whose first label is ``-100``.
- Dealing: micro-batch ``m`` of rank ``r`` in the step starting at row ``P`` holds rows
  ``P + (m·world + r)·micro_batch + [0, micro_batch)``; ``P`` means the same on any mesh and world size.

Design: ``docs/design.md``, "Training".
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import DataError
from ..loss.global_batch import IGNORE_INDEX

NATIVE_SUFFIXES = (".jsonl", ".json", ".txt")
DATASETS_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}


@dataclass(frozen=True)
class Documents:
    """What :func:`read_documents` found: texts, or token ids when the data is pre-tokenized."""

    texts: list[str] | None
    token_ids: list[list[int]] | None
    source: str

    def __len__(self) -> int:
        return len(self.texts if self.texts is not None else self.token_ids)


def _from_records(records: Iterator[tuple[str, dict]], field: str, source: str) -> Documents:
    texts: list[str] = []
    ids: list[list[int]] = []
    for where, record in records:
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected an object with a {field!r} (or 'input_ids') field, got "
                            f"{type(record).__name__}")
        if field in record:
            value = record[field]
            if not isinstance(value, str):
                raise DataError(f"{where}: field {field!r} is {type(value).__name__}, not text")
            if ids:
                raise DataError(f"{where}: mixes text and 'input_ids' records")
            if value:
                texts.append(value)
        elif "input_ids" in record:
            value = record["input_ids"]
            if not (isinstance(value, Sequence) and all(isinstance(t, int) and t >= 0 for t in value)):
                raise DataError(f"{where}: 'input_ids' must be a list of non-negative integers")
            if texts:
                raise DataError(f"{where}: mixes text and 'input_ids' records")
            if value:
                ids.append([int(t) for t in value])
        else:
            raise DataError(f"{where}: no {field!r} field (fields: {', '.join(map(str, record)) or 'none'}); "
                            f"set text_field / --text-field, or give token ids as 'input_ids'")
    if ids:
        return Documents(None, ids, source)
    return Documents(texts, None, source)


def _jsonl_records(path: Path) -> Iterator[tuple[str, dict]]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield f"{path}:{n}", json.loads(line)
                except ValueError as e:
                    raise DataError(f"{path}:{n}: not a JSON object ({e})") from None


def _datasets_records(path: Path) -> Iterator[tuple[str, dict]]:
    try:
        import datasets
    except ModuleNotFoundError:
        raise DataError(f"{path}: reading {path.suffix or 'a directory'} needs the `datasets` package: "
                        "pip install 'xpar_zoo[data]' (or use JSONL / .txt)") from None
    try:
        if path.is_dir() and (path / "state.json").is_file():
            ds = datasets.load_from_disk(str(path))
        elif path.is_dir():
            ds = datasets.load_dataset(str(path), split="train")
        else:
            ds = datasets.load_dataset(DATASETS_BUILDERS[path.suffix], data_files=str(path), split="train")
    except (OSError, ValueError, KeyError) as e:
        raise DataError(f"{path}: datasets cannot read it ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{path}: a dataset without a 'train' split (splits: {', '.join(ds)})")
        ds = ds["train"]
    for n, record in enumerate(ds):
        yield f"{path}[{n}]", record


def iter_records(path: str | os.PathLike) -> Iterator[tuple[str, dict]]:
    """``(where, record)`` of every record of a JSONL file or of what ``datasets`` reads locally (``where`` names the
    file and line or record); ``.txt`` files hold documents, not records."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    if path.is_file() and path.suffix.lower() in (".jsonl", ".json"):
        return _jsonl_records(path)
    if path.is_dir() or path.suffix.lower() in DATASETS_BUILDERS:
        return _datasets_records(path)
    raise DataError(f"{path}: records come from .jsonl, .parquet, .arrow, .csv or a datasets directory")


def read_documents(path: str | os.PathLike, text_field: str = "text") -> Documents:
    """The documents in ``path`` (see the module docstring for the formats); empty documents are skipped. Raises
    :class:`DataError` naming the file (and line or record) on anything unreadable."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    suffix = path.suffix.lower()
    if path.is_file() and suffix in (".jsonl", ".json"):
        docs = _from_records(_jsonl_records(path), text_field, str(path))
    elif path.is_file() and suffix == ".txt":
        with open(path, encoding="utf-8") as f:
            docs = Documents([line.rstrip("\n") for line in f if line.strip()], None, str(path))
    elif path.is_dir() or suffix in DATASETS_BUILDERS:
        docs = _from_records(_datasets_records(path), text_field, str(path))
    else:
        raise DataError(f"{path}: unknown data format {suffix!r}; use .jsonl (a {text_field!r} field), .txt, "
                        f".parquet, .arrow, .csv or a datasets directory")
    if not len(docs):
        raise DataError(f"{path}: no documents (no non-empty {text_field!r} field)")
    return docs


def load_tokenizer(name_or_dir: str):
    """The transformers tokenizer of ``name_or_dir`` (a local directory or a hub id); :class:`DataError` when there
    is none."""
    from transformers import AutoTokenizer

    hint = "pass --tokenizer NAME_OR_DIR, or give pre-tokenized data ('input_ids' records)"
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_dir)
    except (OSError, ValueError, KeyError, TypeError) as e:
        first = (str(e).splitlines() or [""])[0]
        raise DataError(f"no tokenizer in {name_or_dir} ({type(e).__name__}: {first}); {hint}") from None
    # transformers builds an empty tokenizer of the config's class from a directory without tokenizer files
    if not tokenizer("The tokenizer works.", add_special_tokens=False)["input_ids"]:
        raise DataError(f"no tokenizer in {name_or_dir} (no tokenizer files: it encodes text as nothing); {hint}")
    return tokenizer


def tokenize(docs: Documents, tokenizer, batch: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """All documents as one flat int64 token array and the length of each document. Text is encoded with the
    tokenizer's special tokens and EOS appended where the tokenizer has one and the document does not end with it;
    pre-tokenized documents are taken as they are."""
    if docs.token_ids is not None:
        pieces = docs.token_ids
    else:
        if tokenizer is None:
            raise DataError(f"{docs.source}: text documents need a tokenizer")
        eos = tokenizer.eos_token_id
        pieces = []
        for start in range(0, len(docs.texts), batch):
            for ids in tokenizer(docs.texts[start:start + batch], add_special_tokens=True)["input_ids"]:
                if eos is not None and (not ids or ids[-1] != eos):
                    ids = [*ids, eos]
                pieces.append(ids)
    lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
    tokens = np.fromiter((t for p in pieces for t in p), dtype=np.int64, count=int(lengths.sum()))
    return tokens, lengths


class PackedCorpus:
    """Documents packed into rows of ``seq_len`` tokens, reshuffled every epoch (see the module docstring).
    ``rows(first, count)`` returns ``input_ids``, ``position_ids`` and ``labels`` ``[count, seq_len]`` of the global
    rows ``first … first + count − 1``."""

    def __init__(self, tokens: np.ndarray, lengths: np.ndarray, seq_len: int, seed: int, source: str = "data"):
        if seq_len < 2:
            raise DataError(f"seq_len must be at least 2, got {seq_len}")
        if int(lengths.sum()) < seq_len:
            raise DataError(f"{source} holds {int(lengths.sum())} tokens, fewer than one row of seq_len {seq_len}")
        self.tokens, self.lengths = tokens, lengths
        self.seq_len, self.seed, self.source = seq_len, seed, source
        self.rows_per_epoch = int(lengths.sum()) // seq_len
        self._epoch: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._doc_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def fingerprint(self) -> str:
        """A digest of the token stream, the row length and the seed: a resumed run must see the same."""
        h = hashlib.sha1()
        h.update(np.asarray([self.seq_len, self.seed, len(self.lengths)], dtype=np.int64).tobytes())
        h.update(self.lengths.tobytes())
        h.update(self.tokens.tobytes())
        return h.hexdigest()[:16]

    def _layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The epoch's document order, and each ordered document's start and end in that epoch's stream."""
        if self._epoch is None or self._epoch[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.lengths))
            ends = np.cumsum(self.lengths[order])
            self._epoch = (epoch, order, ends - self.lengths[order], ends)
        return self._epoch[1:]

    def _row(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        epoch, i = divmod(g, self.rows_per_epoch)
        order, starts, ends = self._layout(epoch)
        a, b = i * self.seq_len, (i + 1) * self.seq_len
        ids = np.empty(self.seq_len, dtype=np.int64)
        pos = np.empty(self.seq_len, dtype=np.int64)
        j = int(np.searchsorted(ends, a, side="right"))
        while a < b:
            doc, lo, hi = order[j], int(starts[j]), int(ends[j])
            take = min(hi, b) - a
            src = int(self._doc_starts[doc]) + (a - lo)
            out = a - i * self.seq_len
            ids[out:out + take] = self.tokens[src:src + take]
            pos[out:out + take] = np.arange(take)
            a += take
            j += 1
        return ids, pos

    def rows(self, first: int, count: int) -> dict[str, torch.Tensor]:
        """``input_ids``, ``position_ids`` and ``labels`` of global rows ``first … first + count − 1``."""
        pairs = [self._row(g) for g in range(first, first + count)]
        ids = torch.from_numpy(np.stack([p[0] for p in pairs]))
        pos = torch.from_numpy(np.stack([p[1] for p in pairs]))
        labels = ids.masked_fill(pos == 0, IGNORE_INDEX)
        return {"input_ids": ids, "position_ids": pos, "labels": labels}


def rows_per_step(world: int, micro_batch: int, grad_accum: int) -> int:
    """Global rows one optimizer step consumes."""
    return world * micro_batch * grad_accum


def micro_batches(corpus: PackedCorpus, position: int, rank: int, world: int, micro_batch: int,
                  grad_accum: int) -> list[dict[str, torch.Tensor]]:
    """This rank's ``grad_accum`` micro-batches of the optimizer step that starts at global row ``position``."""
    return [corpus.rows(position + (m * world + rank) * micro_batch, micro_batch) for m in range(grad_accum)]


def flatten_rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A micro-batch ``[B, S]`` as one row ``[1, B·S]``: transformers' flash-attention kernels separate packed
    documents (varlen, from ``position_ids``) only in a batch of one row; row starts are document starts (position
    0, label ``-100``), so the loss and every gradient are those of the ``[B, S]`` batch."""
    return {k: v.reshape(1, -1) for k, v in batch.items()}
