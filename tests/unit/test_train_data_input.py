"""Bad training data is one line naming the file, the line and (for bytes) the offset, found while reading, before
any model loads (issue 31, item 6): invalid UTF-8, binary data, deeply nested JSON, integers past int64, JSON
booleans as token ids, a line past the cap (read in bounded memory), a dataset directory with a loading script, a
directory of mixed formats. A directory of one format is read whole."""

import json
import resource

import pytest

from xpar_zoo.errors import DataError
from xpar_zoo.train.data import read_documents, tokenize


def test_invalid_utf8_names_file_line_and_byte_offset(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=rf"{path}:2: invalid UTF-8 at byte offset 28 \(byte 0xe9\)"):
        read_documents(path)


def test_invalid_utf8_in_txt(tmp_path):
    path = tmp_path / "d.txt"
    path.write_bytes(b"fine\n\xc3\x28 broken\n")
    with pytest.raises(DataError, match=rf"{path}:2: invalid UTF-8 at byte offset 5"):
        read_documents(path)


def test_binary_data_is_named(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00" * 10)
    with pytest.raises(DataError, match=rf"{path}:1: binary data \(a NUL byte at byte offset 7\)"):
        read_documents(path)


def test_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "a"}\n')
    assert read_documents(path).texts == ["a"]


def test_deeply_nested_json_is_one_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n' + '{"x": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(DataError, match=rf"{path}:2: JSON nested too deeply"):
        read_documents(path)


def test_token_id_past_int64_is_refused(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 2**64]}) + "\n")
    with pytest.raises(DataError, match=rf"{path}:1: input_ids\[1\] is 18446744073709551616: token ids are"):
        read_documents(path)


def test_huge_integer_literal_is_one_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"input_ids": [' + "9" * 5000 + "]}\n")
    with pytest.raises(DataError, match=rf"{path}:1: not a JSON object"):
        read_documents(path)


@pytest.mark.parametrize("bad", [True, False, 1.0, -1, "3", None])
def test_json_booleans_and_non_integers_are_not_token_ids(tmp_path, bad):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"input_ids": [5, bad]}) + "\n")
    with pytest.raises(DataError, match=rf"{path}:1: input_ids\[1\] is "):
        read_documents(path)


def test_line_past_the_cap_is_refused_in_bounded_memory(tmp_path):
    """A 4.8 MB single line: refused at the cap (1 MiB by default) after reading 1 MiB of it."""
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "word " * 960_000}) + "\n")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(DataError, match=rf"{path}:1: line longer than 1048576 bytes \(--max-line-bytes\)"):
        read_documents(path)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50 * 1024  # KiB


def test_line_cap_is_a_setting(tmp_path):
    path = tmp_path / "d.txt"
    path.write_text("short\n" + "x" * 100 + "\n")
    with pytest.raises(DataError, match=rf"{path}:2: line longer than 50 bytes"):
        read_documents(path, max_line_bytes=50)
    assert read_documents(path, max_line_bytes=101).texts == ["short", "x" * 100]


def test_dataset_directory_with_a_loading_script_is_refused(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "ds.py").write_text("import os\nos.system('echo owned')\n")
    (tmp_path / "ds" / "train.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(DataError, match=r"holds a dataset loading script \(ds.py\); xpar_zoo never runs code"):
        read_documents(tmp_path / "ds")


def test_directory_of_mixed_formats_is_refused_naming_them(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "b.txt").write_text("b\n")
    (tmp_path / "c.txt").write_text("c\n")
    with pytest.raises(DataError, match=r"a directory of mixed formats \(1 \.jsonl, 2 \.txt\)"):
        read_documents(tmp_path)


def test_directory_of_one_format_is_read_whole(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "sub" / "b.jsonl").write_text('{"text": "b"}\n{"text": "c"}\n')
    (tmp_path / "README.md").write_text("# notes\n")
    (tmp_path / "dataset_info.json").write_text("{}\n")
    assert read_documents(tmp_path).texts == ["a", "b", "c"]


def test_empty_directory_is_one_line(tmp_path):
    with pytest.raises(DataError, match="no data files"):
        read_documents(tmp_path)


def test_tokenize_keeps_memory_bounded_on_a_long_document():
    """A document at the cap (1 MiB of text) tokenized in batches: the token arrays are int64, not Python lists."""
    from xpar_zoo.train.data import Documents

    class CharTokenizer:
        eos_token_id = 1

        def __call__(self, texts, add_special_tokens=True):
            return {"input_ids": [[2 + (ord(c) % 30) for c in t] for t in texts]}

    docs = Documents(["ab " * 300_000, "cd"], None, "mem")
    tokens, lengths = tokenize(docs, CharTokenizer(), batch_chars=1 << 16)
    assert lengths.tolist() == [900_001, 3] and tokens.dtype.name == "int64" and tokens[-1] == 1
