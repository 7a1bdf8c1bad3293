"""`xpar-zoo publish` uploads the model and nothing else: only the files a hub model or adapter needs (the rest
listed as skipped, or refused with --strict), no symlink out of the folder, no local path or credential in any
uploaded file (named with its file and line), config strings escaped in the card, repo ids validated as the hub
does. The hub is faked: upload_folder records its arguments and the files it would send are computed with
huggingface_hub's own filter."""

import json
import os
import shutil

import pytest
import yaml

from xpar_zoo.commands import cli
from xpar_zoo.testing import parity

MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors"}


@pytest.fixture(scope="module")
def hub_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("publish") / "tiny"
    parity.build_model(parity.tiny_config("qwen3_moe")).save_pretrained(folder)
    assert {p.name for p in folder.iterdir()} == MODEL_FILES
    return folder


@pytest.fixture
def folder(hub_folder, tmp_path):
    out = tmp_path / "export"
    shutil.copytree(hub_folder, out)
    return out


@pytest.fixture
def hub(monkeypatch):
    """huggingface_hub's network calls, faked: ``sent`` is the set of files upload_folder would send."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import filter_repo_objects

    state = {"calls": [], "sent": None}

    def upload_folder(self, *, folder_path, allow_patterns=None, ignore_patterns=None, **kwargs):
        files = [os.path.relpath(os.path.join(d, f), folder_path)
                 for d, _, fs in os.walk(folder_path, followlinks=True) for f in fs]
        state["sent"] = set(filter_repo_objects(files, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))
        state["calls"].append("upload_folder")
        return "https://huggingface.co/me/x/commit/0"

    monkeypatch.setattr(HfApi, "create_repo", lambda self, *a, **k: state["calls"].append("create_repo"))
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    return state


def _publish(folder, *extra, repo="me/tiny"):
    return cli.main(["publish", str(folder), repo, *extra])


def test_publish_uploads_only_the_files_a_hub_model_needs_and_lists_the_rest(folder, hub, capsys):
    secrets = {".env": "HF_TOKEN=x\n", "credentials.json": "{}", ".git-credentials": "https://u:p@github.com\n",
               "training_args.bin": "pickle", "optimizer.pt": "pickle", "notes.txt": "mine\n"}
    for name, text in secrets.items():
        (folder / name).write_text(text)
    (folder / "checkpoint-5").mkdir()
    (folder / "checkpoint-5" / "model.safetensors").write_bytes(b"x")
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "model_max_length": 8}))
    assert _publish(folder) == 0
    assert hub["sent"] == MODEL_FILES | {"tokenizer_config.json", "README.md"}
    err = capsys.readouterr().err
    for name in [*secrets, "checkpoint-5/ (a training checkpoint)", "training_args.bin (the Trainer's pickled"]:
        assert name in err, err


def test_publish_strict_refuses_a_folder_with_anything_else(folder, hub, capsys):
    (folder / ".env").write_text("HF_TOKEN=x\n")
    assert _publish(folder, "--strict") == 2
    assert "not part of a hub model (--strict): .env (environment secrets)" in capsys.readouterr().err
    assert hub["calls"] == [] and not (folder / "README.md").exists()


def test_publish_dry_run_lists_the_skipped_files(folder, hub, capsys):
    (folder / "training_args.bin").write_bytes(b"\x80")
    assert _publish(folder, "--dry-run") == 0
    out = capsys.readouterr().out
    assert "skipped (not part of a hub model): training_args.bin" in out
    assert "  training_args.bin" not in out and hub["calls"] == []


@pytest.mark.parametrize("target", ["file", "dir"])
def test_publish_refuses_a_symlink_leaving_the_folder(folder, hub, tmp_path, capsys, target):
    outside = tmp_path / "private"
    outside.mkdir()
    (outside / "id_rsa").write_text("key")
    link = folder / ("tokenizer.json" if target == "file" else "extra")
    link.symlink_to(outside / "id_rsa" if target == "file" else outside)
    assert _publish(folder) == 2
    err = capsys.readouterr().err
    assert "symlinks leading out of the folder" in err and link.name in err
    assert hub["calls"] == []


def test_publish_takes_a_symlink_inside_the_folder(folder, hub):
    (folder / "generation_config.json").rename(folder / "gen.json")
    (folder / "generation_config.json").symlink_to("gen.json")
    assert _publish(folder) == 0
    assert "generation_config.json" in hub["sent"] and "gen.json" not in hub["sent"]


@pytest.mark.parametrize("name, text, what, line", [
    ("README.md", "# card\n\nuse it\ntoken hf_" + "a1B2" * 9 + "\n", "a Hugging Face token", 4),
    ("tokenizer_config.json", '{\n  "bos_token": "<s>",\n  "token": "s3cr3t-value"\n}', "a credential field", 3),
    ("generation_config.json", '{\n "aws": "AKIAABCDEFGHIJKLMNOP"\n}', "an AWS access key id", 2),
    ("chat_template.jinja", "{{ x }}\n-----BEGIN OPENSSH PRIVATE KEY-----\n", "a private key", 2),
])
def test_publish_refuses_a_credential_naming_the_file_and_line(folder, hub, capsys, name, text, what, line):
    (folder / name).write_text(text)  # an existing README.md is the card, uploaded as it is: scanned too
    assert _publish(folder) == 2
    err = capsys.readouterr().err
    assert f"looks like a credential, which publish would upload: {name} line {line}: {what}" in err, err
    assert hub["calls"] == []


@pytest.mark.parametrize("name, text, said", [
    ("chat_template.jinja", "{# from /home/alice/templates/chat.jinja #}\n{{ messages }}",
     "chat_template.jinja line 1: /home/alice/templates/chat.jinja"),
    ("tokenizer_config.json", '{\n  "bos_token": "<s>",\n  "name_or_path": "/scratch/alice/tok"\n}',
     "tokenizer_config.json name_or_path: /scratch/alice/tok (line 3)"),
    ("generation_config.json", '{\n "note": "trained from /home/alice/run on 4 GPUs"\n}',
     "generation_config.json note: trained from /home/alice/run on 4 GPUs (line 2)"),
    ("generation_config.json", '{\n "source": "file:///mnt/x/ckpt"\n}', "generation_config.json source: file:///mnt/x/ckpt"),
    ("chat_template.jinja", "{# see file:///srv/t.jinja #}\n", "chat_template.jinja line 1: file:///srv/t.jinja"),
])
def test_publish_refuses_a_local_path_naming_the_file_and_line(folder, hub, capsys, name, text, said):
    (folder / name).write_text(text)
    assert _publish(folder) == 2
    err = capsys.readouterr().err
    assert "records local paths, which publish would upload: " + said in err, err
    assert hub["calls"] == []


def test_publish_takes_a_tokenizer_whose_vocabulary_holds_slashes(folder, hub):
    vocab = {"/": 0, "//": 1, "/home": 2, "</s>": 3, "~": 4}
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": []},
                                                       "added_tokens": [{"content": "/"}]}, indent=1))
    (folder / "vocab.json").write_text(json.dumps(vocab))
    assert _publish(folder) == 0
    assert {"tokenizer.json", "vocab.json"} <= hub["sent"]


@pytest.mark.parametrize("architectures", [["<script>alert(1)</script>", "[click](https://evil.example)"],
                                           ["Qwen3MoeForCausalLM\n\n# Injected heading"]])
def test_publish_escapes_odd_architectures_in_the_card(folder, hub, architectures):
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = architectures
    (folder / "config.json").write_text(json.dumps(config))
    assert _publish(folder) == 0
    text = (folder / "README.md").read_text()
    body = text.split("---\n", 2)[2]
    assert "<script>" not in body and "](https://evil" not in body and "\n# Injected" not in body
    assert "&lt;script&gt;" in body or "Injected heading" in body
    card = yaml.safe_load(text.split("---\n")[1])
    assert card["xpar_zoo"]["architectures"] == architectures  # the YAML front matter keeps them, quoted


@pytest.mark.parametrize("architectures, said", [(["Ok", 1], "architectures must be a list of class names"),
                                                 ("Qwen3MoeForCausalLM", "architectures must be a list"),
                                                 ([{"a": 1}], "architectures must be a list")])
def test_publish_refuses_non_string_architectures_in_one_line(folder, hub, capsys, architectures, said):
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = architectures
    (folder / "config.json").write_text(json.dumps(config))
    assert _publish(folder) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1 and hub["calls"] == []


@pytest.mark.parametrize("repo", ["org/..", "org/na--me", "a/b/c", "org/.x", "org/x.git", "org-/x", "org/a b",
                                  "org/" + "a" * 97, "noslash"])
def test_publish_refuses_a_repo_id_the_hub_would_refuse(folder, hub, capsys, repo):
    assert _publish(folder, repo=repo) == 2
    assert "is not a hub repo id" in capsys.readouterr().err
    assert hub["calls"] == [] and not (folder / "README.md").exists()


def test_publish_refuses_a_config_with_custom_code(folder, hub, capsys):
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_x.XConfig"}
    (folder / "config.json").write_text(json.dumps(config))
    assert _publish(folder) == 2
    assert "names custom code (auto_map), which publish does not upload" in capsys.readouterr().err
    assert hub["calls"] == []


HOSTILE = ["<img src=x onerror=alert(1)>", "[log in](https://evil.example/login)", "www.evil.example", "me@evil.example",
           "![x](https://evil.example/t.png)", "<https://evil.example>", "**bold** `code` # head"]


def test_publish_card_shows_every_field_from_the_folder_as_inert_text(folder, hub):
    import re

    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = HOSTILE
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "xpar_export.json").write_text(json.dumps({"step": HOSTILE[1], "mesh": {"ep": HOSTILE[0]}}))
    assert _publish(folder) == 0
    body = (folder / "README.md").read_text().split("---\n", 2)[2]
    assert not re.search(r"<img|<https|\]\(|https?://evil|www\.evil|(?<!\\)@evil|\*\*bold|(^|\n)# head", body), body
    assert "&lt;img src\\=x onerror\\=alert\\(1\\)&gt;" in body  # still readable: the text, escaped


def test_refuse_local_paths_reads_every_text_file_subfolders_included(folder):
    from xpar_zoo.commands.publish import refuse_local_paths
    from xpar_zoo.errors import PublishError

    refuse_local_paths(folder)
    (folder / "sub").mkdir()
    (folder / "sub" / "config.json").write_text(json.dumps({"_name_or_path": "see /home/alice/base"}))
    with pytest.raises(PublishError, match=r"sub/config.json _name_or_path: see /home/alice/base \(line 1\)"):
        refuse_local_paths(folder)
