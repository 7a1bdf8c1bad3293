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
import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import DataError, HubResolutionError
from ..loss.global_batch import IGNORE_INDEX
from .config import DEFAULT_MAX_LINE_BYTES, INT64_MAX

NATIVE_SUFFIXES = (".jsonl", ".json", ".txt")
DATASETS_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
DATASETS_METADATA = ("dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json")


@dataclass(frozen=True)
class Documents:
    """What :func:`read_documents` found: texts, or token ids when the data is pre-tokenized."""

    texts: list[str] | None
    token_ids: list[list[int]] | None
    source: str

    def __len__(self) -> int:
        return len(self.texts if self.texts is not None else self.token_ids)


def _token_ids(value, where: str) -> list[int]:
    """``input_ids`` of a record: a list of non-negative integers that fit int64 (JSON ``true`` is not 1)."""
    if not isinstance(value, list):
        raise DataError(f"{where}: 'input_ids' must be a list of non-negative integers, got {type(value).__name__}")
    for i, t in enumerate(value):
        if type(t) is not int or not 0 <= t <= INT64_MAX:  # bool is an int subclass: JSON true/false are refused
            shown = json.dumps(t) if isinstance(t, (bool, int, float)) or t is None else type(t).__name__
            shown = shown if len(shown) <= 40 else shown[:40] + "…"
            raise DataError(f"{where}: input_ids[{i}] is {shown}: token ids are non-negative integers below 2**63")
    return value


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
            value = _token_ids(record["input_ids"], where)
            if texts:
                raise DataError(f"{where}: mixes text and 'input_ids' records")
            if value:
                ids.append(value)
        else:
            raise DataError(f"{where}: no {field!r} field (fields: {', '.join(map(str, record)) or 'none'}); "
                            f"set text_field / --text-field, or give token ids as 'input_ids'")
    if ids:
        return Documents(None, ids, source)
    return Documents(texts, None, source)


def text_lines(path: Path, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of each line of a UTF-8 text file, read as bytes a line at a time (memory stays
    bounded by ``max_line_bytes``). :class:`DataError` naming the file, the line and the byte offset on a line
    longer than the cap, a NUL byte (binary data) or invalid UTF-8."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror or e})") from None
    with f:
        offset = 0
        for n in itertools.count(1):
            try:
                raw = f.readline(max_line_bytes + 1)
            except OSError as e:
                raise DataError(f"{path}:{n}: cannot read it ({e.strerror or e})") from None
            if not raw:
                return
            if len(raw) > max_line_bytes and not (len(raw) == max_line_bytes + 1 and raw.endswith(b"\n")):
                raise DataError(f"{path}:{n}: line longer than {max_line_bytes} bytes (--max-line-bytes): split the "
                                "document, or raise the cap")
            nul = raw.find(b"\0")
            if nul >= 0:
                raise DataError(f"{path}:{n}: binary data (a NUL byte at byte offset {offset + nul}); the data must "
                                "be UTF-8 text: JSONL or .txt")
            if n == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark
                raw, offset = raw[3:], 3
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{n}: invalid UTF-8 at byte offset {offset + e.start} (byte "
                                f"0x{raw[e.start]:02x}); the data must be UTF-8 text") from None
            offset += len(raw)
            yield n, text


def _jsonl_records(path: Path, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Iterator[tuple[str, dict]]:
    for n, line in text_lines(path, max_line_bytes):
        if line.strip():
            try:
                record = json.loads(line)
            except RecursionError:
                raise DataError(f"{path}:{n}: JSON nested too deeply to be a record") from None
            except ValueError as e:
                raise DataError(f"{path}:{n}: not a JSON object ({str(e)[:200]})") from None
            yield f"{path}:{n}", record


def _text_documents(path: Path, max_line_bytes: int) -> list[str]:
    return [line.rstrip("\r\n") for _, line in text_lines(path, max_line_bytes) if line.strip()]


def _datasets_records(path: Path, files: list[Path] | None = None) -> Iterator[tuple[str, dict]]:
    try:
        import datasets
    except ModuleNotFoundError:
        raise DataError(f"{path}: reading {path.suffix or 'a directory'} needs the `datasets` package: "
                        "pip install 'xpar_zoo[data]' (or use JSONL / .txt)") from None
    try:
        if path.is_dir() and (path / "state.json").is_file():
            ds = datasets.load_from_disk(str(path))
        else:
            files = files or [path]
            ds = datasets.load_dataset(DATASETS_BUILDERS[files[0].suffix.lower()],
                                       data_files=[str(p) for p in files], split="train")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: datasets cannot read it ({type(e).__name__}: "
                        f"{(str(e).splitlines() or [''])[0][:200]})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{path}: a dataset without a 'train' split (splits: {', '.join(ds)})")
        ds = ds["train"]
    for n, record in enumerate(ds):
        yield f"{path}[{n}]", record


def data_files(directory: Path) -> list[Path]:
    """The data files of a directory (every file below it of a data format, hidden folders and the ``datasets``
    metadata files aside), all of ONE format. :class:`DataError` on a loading script (xpar_zoo never runs code from
    data), on several formats (naming them), or on none."""
    scripts = sorted(p for p in directory.rglob("*.py") if not _hidden(p, directory))
    if scripts:
        raise DataError(f"{directory}: holds a dataset loading script ({scripts[0].relative_to(directory)}); "
                        "xpar_zoo never runs code from data: convert the dataset to JSONL or parquet files")
    found: dict[str, list[Path]] = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and not _hidden(p, directory) and p.name not in DATASETS_METADATA:
            suffix = p.suffix.lower()
            if suffix in NATIVE_SUFFIXES or suffix in DATASETS_BUILDERS:
                found.setdefault(".jsonl" if suffix == ".json" else suffix, []).append(p)
    if len(found) > 1:
        kinds = ", ".join(f"{len(v)} {k}" for k, v in sorted(found.items()))
        raise DataError(f"{directory}: a directory of mixed formats ({kinds}); xpar_zoo reads every file of one "
                        "format: keep one format per directory, or pass a file")
    if not found:
        raise DataError(f"{directory}: no data files (.jsonl, .json, .txt, .parquet, .arrow, .csv) in it")
    return next(iter(found.values()))


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _source(path: str | os.PathLike, max_line_bytes: int, jsonl_hint: str = "") -> tuple[str, Path, Iterator]:
    """What ``path`` holds, read lazily: ``("text", path, documents)`` for ``.txt`` (one document per non-empty
    line), ``("jsonl", path, records)`` or ``("datasets", path, records)`` (``(where, record)`` pairs). A directory is
    read whole: every data file of its one format, in sorted order (:func:`data_files`)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    suffix = path.suffix.lower()
    if path.is_dir() and not (path / "state.json").is_file():
        files = data_files(path)
        kind = files[0].suffix.lower()
        if kind in (".jsonl", ".json"):
            return "jsonl", path, itertools.chain.from_iterable(_jsonl_records(p, max_line_bytes) for p in files)
        if kind == ".txt":
            return "text", path, (t for p in files for t in _text_documents(p, max_line_bytes))
        return "datasets", path, _datasets_records(path, files)
    if path.is_file() and suffix in (".jsonl", ".json"):
        return "jsonl", path, _jsonl_records(path, max_line_bytes)
    if path.is_file() and suffix == ".txt":
        return "text", path, iter(_text_documents(path, max_line_bytes))
    if path.is_dir() or suffix in DATASETS_BUILDERS:
        return "datasets", path, _datasets_records(path)
    raise DataError(f"{path}: unknown data format {suffix!r}; use .jsonl{jsonl_hint}, .txt, .parquet, .arrow, .csv "
                    "or a datasets directory")


def iter_records(path: str | os.PathLike, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
                 ) -> Iterator[tuple[str, dict]]:
    """``(where, record)`` of every record of a JSONL file, of what ``datasets`` reads locally, or of a directory of
    such files (``where`` names the file and line or record); nothing for ``.txt`` (documents, not records)."""
    kind, _, items = _source(path, max_line_bytes)
    return iter(()) if kind == "text" else items


def read_documents(path: str | os.PathLike, text_field: str = "text",
                   max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Documents:
    """The documents in ``path`` (see the module docstring for the formats); empty documents are skipped. A
    directory is read whole: every data file of its one format, in sorted order (:func:`data_files`). Raises
    :class:`DataError` naming the file (and line, byte offset or record) on anything unreadable."""
    kind, path, items = _source(path, max_line_bytes, f" (a {text_field!r} field)")
    if kind == "text":
        docs = Documents(list(items), None, str(path))
    else:
        records = _capped(items, text_field, max_line_bytes) if kind == "datasets" else items
        docs = _from_records(records, text_field, str(path))
    if not len(docs):
        raise DataError(f"{path}: no documents (no non-empty {text_field!r} field)")
    return docs


def _capped(records: Iterator[tuple[str, dict]], field: str, max_bytes: int) -> Iterator[tuple[str, dict]]:
    """Records of a ``datasets`` file whose text is at most ``max_bytes`` (UTF-8), as lines of JSONL are."""
    for where, record in records:
        text = record.get(field) if isinstance(record, dict) else None
        if isinstance(text, str) and len(text) * 4 > max_bytes and len(text.encode("utf-8")) > max_bytes:
            raise DataError(f"{where}: {field!r} is longer than {max_bytes} bytes (--max-line-bytes): split the "
                            "document, or raise the cap")
        yield where, record


def load_tokenizer(name_or_dir: str):
    """The transformers tokenizer of ``name_or_dir`` (a local directory or a hub id); :class:`DataError` when there
    is none."""
    from transformers import AutoTokenizer

    from ..hub.resolve import refuse_missing_local

    hint = "pass --tokenizer NAME_OR_DIR, or give pre-tokenized data ('input_ids' records)"
    try:
        refuse_missing_local(name_or_dir)
    except HubResolutionError as e:
        raise DataError(f"no tokenizer: {e}; {hint}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_dir, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as e:
        first = (str(e).splitlines() or [""])[0]
        raise DataError(f"no tokenizer in {name_or_dir} ({type(e).__name__}: {first}); {hint}") from None
    # transformers builds an empty tokenizer of the config's class from a directory without tokenizer files
    if not tokenizer("The tokenizer works.", add_special_tokens=False)["input_ids"]:
        raise DataError(f"no tokenizer in {name_or_dir} (no tokenizer files: it encodes text as nothing); {hint}")
    return tokenizer


def _text_batches(texts: list[str], max_docs: int, max_chars: int) -> Iterator[list[str]]:
    """``texts`` in consecutive batches of at most ``max_docs`` documents and about ``max_chars`` characters."""
    batch: list[str] = []
    chars = 0
    for text in texts:
        if batch and (len(batch) >= max_docs or chars + len(text) > max_chars):
            yield batch
            batch, chars = [], 0
        batch.append(text)
        chars += len(text)
    if batch:
        yield batch


def tokenize(docs: Documents, tokenizer, batch: int = 1024, batch_chars: int = 1 << 20
             ) -> tuple[np.ndarray, np.ndarray]:
    """All documents as one flat int64 token array and the length of each document. Text is encoded with the
    tokenizer's special tokens and EOS appended where the tokenizer has one and the document does not end with it;
    pre-tokenized documents are taken as they are. The tokenizer sees at most ``batch`` documents and about
    ``batch_chars`` characters at a time, and each batch's ids become an int64 array at once, so memory beyond the
    texts stays bounded."""
    if docs.token_ids is not None:
        arrays = [np.asarray(p, dtype=np.int64) for p in docs.token_ids]
    else:
        if tokenizer is None:
            raise DataError(f"{docs.source}: text documents need a tokenizer")
        eos = tokenizer.eos_token_id
        arrays = []
        for texts in _text_batches(docs.texts, batch, batch_chars):
            for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]:
                if eos is not None and (not ids or ids[-1] != eos):
                    ids = [*ids, eos]
                arrays.append(np.asarray(ids, dtype=np.int64))
    lengths = np.fromiter((len(p) for p in arrays), dtype=np.int64, count=len(arrays))
    tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
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
    0, label ``-100``), so the loss and every gradient are those of the ``[B, S]`` batch. Per-token inputs are
    flattened alike; per-image inputs (pixels) stay as they are."""
    rows = batch["input_ids"].shape
    out = dict(batch)
    for k, v in batch.items():
        if v.shape == rows:
            out[k] = v.reshape(1, -1)
        elif v.dim() == 3 and v.shape[1:] == rows:  # multimodal RoPE positions [k, B, S]
            out[k] = v.reshape(v.shape[0], 1, -1)
    return out
