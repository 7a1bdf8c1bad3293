"""`xpar-zoo train`: exact resume (bit-identical losses on the same mesh; the same data order on ep2 -> ep4 and on
4 -> 2 ranks), gradient accumulation equal to a larger micro-batch, the loss falling on a learnable corpus, the
metrics (fields, real token counts, expert load), the router auxiliary loss over the global batch against
single-process transformers, the correction-bias update (identical on every rank, toward balance, in checkpoints),
packing with document-boundary attention, the configuration, and a two-"node" torchrun launch (c10d rendezvous).

One 4-rank job runs every in-process training (module fixture); the torchrun test resumes one of its checkpoints
on 2 ranks started by two torchrun agents."""

import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch

from xpar_zoo.commands import cli
from xpar_zoo.loss.global_batch import IGNORE_INDEX
from xpar_zoo.testing import launch, parity
from xpar_zoo.train import TrainConfig
from xpar_zoo.train.data import PackedCorpus, read_documents, tokenize
from xpar_zoo.train.metrics import read_metrics

WORLD = 4
SEQ = 32
CHARS = "abcdefghijklmnopqrstuvwxyz .,"
SENTENCES = ["the cat sat on the mat", "a dog ran to the park", "birds sing in the tree", "we eat bread and jam"]
FIELDS = {"step", "loss", "grad_norm", "lr", "tokens", "target_tokens", "tokens_per_s", "step_time_s", "peak_mem_bytes",
          "data_position", "epoch", "expert_load"}
AUX_COEF = 0.5
# planned units reduce-scattering with forced sums (ep_fsdp 2), planned units of one FSDP rank, HSDP
ACCUMULATION_MESHES = {"ep2_emb2_head2": {"ep": 2, "emb": 2, "head": 2}, "ep4": {"ep": 4},
                       "ep2_replicate2": {"ep": 2, "replicate": 2}}
BIAS_RATE, BIAS_START = 0.01, 0.1


def _tokenizer():
    """A character-level fast tokenizer with an EOS (built here: nothing is downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def _save_model(path, model_type, **overrides):
    model = parity.build_model(parity.tiny_config(model_type, **overrides))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # routers start imbalanced: experts 0 and 1 take (nearly) all
                buf.zero_()[:2] = BIAS_START
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    base = tmp_path_factory.mktemp("train")
    rng = random.Random(0)
    with open(base / "corpus.jsonl", "w") as f:  # a learnable corpus: four sentences, recombined
        for _ in range(300):
            text = " ".join(rng.choice(SENTENCES) for _ in range(rng.randint(1, 3))) + "."
            f.write(json.dumps({"text": text}) + "\n")
    return {"base": base, "data": base / "corpus.jsonl",
            "qwen": _save_model(base / "qwen3_moe", "qwen3_moe"),
            "aux": _save_model(base / "qwen3_moe_aux", "qwen3_moe", output_router_logits=True,
                               router_aux_loss_coef=AUX_COEF),
            "glm": _save_model(base / "glm4_moe", "glm4_moe")}


def _corpus(data, model_dir, seed=0) -> PackedCorpus:
    from transformers import AutoTokenizer

    tokens, lengths = tokenize(read_documents(data), AutoTokenizer.from_pretrained(model_dir))
    return PackedCorpus(tokens, lengths, SEQ, seed)


def _reference_aux(model_dir, rows, world) -> dict:
    """Single-process transformers on the step's rows at once: the CE loss, the auxiliary loss and the gradient
    norm of CE + coef * aux (the global batch); and the gradient norm with the auxiliary loss taken per rank (what
    each rank alone would compute), to show the test can tell them apart."""
    from transformers import AutoModelForCausalLM

    out = {}
    for mode in ("global", "per_rank"):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, experts_implementation="eager")
        model.train()
        res = model(**rows, use_cache=False)
        loss = res.loss
        if mode == "per_rank":
            loss = loss - AUX_COEF * res.aux_loss
            per = rows["input_ids"].shape[0] // world
            for r in range(world):
                part = {k: v[r * per:(r + 1) * per] for k, v in rows.items()}
                loss = loss + AUX_COEF * model(**part, use_cache=False).aux_loss / world
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
        out[mode] = {"ce": (res.loss - AUX_COEF * res.aux_loss).item(), "aux": res.aux_loss.item(), "norm": norm}
    return out


def _jobs(files, out) -> dict:
    """Every rank: the in-process runs of this file, in order; rank 0 returns what the tests check."""
    import torch.distributed as dist

    from xpar_zoo.train import train
    from xpar_zoo.train.config import validate

    rank = dist.get_rank()

    def run(name, model="qwen", **kw):
        settings = dict(model=str(files[model]), data=str(files["data"]), output=str(out / name), seq_len=SEQ,
                        lr=3e-3, steps=4, mesh={"ep": 2}, progress=False, tensorboard=False)
        settings.update(kw)
        cfg = TrainConfig(**settings)
        validate(cfg)
        return train(cfg)

    def copy(src, dst):
        if rank == 0:
            shutil.copytree(out / src, out / dst)
        dist.barrier()

    run("straight")
    run("resumed", stop_after=2)
    copy("resumed", "remeshed")
    copy("resumed", "torchrun")
    run("resumed", resume=True)
    run("remeshed", resume=True, mesh={"ep": 4})
    run("recompute", steps=2, recompute=True)
    for name, mesh in ACCUMULATION_MESHES.items():
        run(f"accum_micro_{name}", steps=3, micro_batch=1, grad_accum=2, mesh=mesh)
        run(f"accum_batch_{name}", steps=3, micro_batch=2, grad_accum=1, mesh=mesh)
    run("learn", steps=30, micro_batch=2, lr=1e-2, warmup=3, save_every=10, keep_last=2, export_hf=str(out / "hf"),
        tensorboard=True)
    aux = run("aux", model="aux", steps=1, micro_batch=2)
    bias = run("bias", model="glm", steps=8, lr=0.0, expert_bias_update_rate=BIAS_RATE)
    biases = {n: b.detach().clone() for n, b in bias.model.named_buffers() if n.endswith("e_score_correction_bias")}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, biases)
    result = None
    if rank == 0:
        rows = _corpus(files["data"], files["aux"]).rows(0, WORLD * 2)
        result = {"biases": gathered, "aux_ref": _reference_aux(files["aux"], rows, WORLD),
                  "aux_local": aux.last}
    return result


@pytest.fixture(scope="module")
def jobs(files):
    out = files["base"] / "runs"
    out.mkdir()
    result = launch.run(_jobs, WORLD, files, out, timeout_s=600)
    metrics = {p.name: read_metrics(p) for p in out.iterdir() if (p / "metrics.jsonl").is_file()}
    return {**result, "out": out, "metrics": metrics}


# ---- resume, accumulation, learning, metrics --------------------------------------------------------------------
def test_resume_on_the_same_mesh_gives_bit_identical_losses(jobs):
    straight, resumed = jobs["metrics"]["straight"], jobs["metrics"]["resumed"]
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]  # the stopped run's lines, then the resumed run's
    for key in ("loss", "grad_norm", "lr", "data_position"):
        assert [m[key] for m in resumed] == [m[key] for m in straight], key
    assert [m["expert_load"] for m in resumed] == [m["expert_load"] for m in straight]
    assert sorted(p.name for p in (jobs["out"] / "resumed" / "checkpoints").iterdir()) == ["step-00000002",
                                                                                          "step-00000004"]


def test_resume_on_ep4_continues_the_same_data_order(jobs):
    straight, remeshed = jobs["metrics"]["straight"], jobs["metrics"]["remeshed"]
    assert [m["data_position"] for m in remeshed] == [m["data_position"] for m in straight] == [4, 8, 12, 16]
    for a, b in zip(remeshed[2:], straight[2:]):  # steps 3-4 on ep=4: the same rows and weights, other reductions
        assert abs(a["loss"] - b["loss"]) < parity.LOSS_TOL and a["target_tokens"] == b["target_tokens"]
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-5 * b["grad_norm"]


@pytest.mark.parametrize("mesh", ACCUMULATION_MESHES)
def test_accumulation_equals_the_larger_micro_batch(jobs, mesh):
    micro, batch = jobs["metrics"][f"accum_micro_{mesh}"], jobs["metrics"][f"accum_batch_{mesh}"]
    assert len(micro) == len(batch) == 3
    for a, b in zip(micro, batch):
        assert a["target_tokens"] == b["target_tokens"] and a["tokens"] == b["tokens"]
        assert abs(a["loss"] - b["loss"]) < 1e-6 * b["loss"], (a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-6 * b["grad_norm"], (a["grad_norm"], b["grad_norm"])


def test_recompute_trains_the_same_and_counts_each_token_once(jobs):
    """Activation checkpointing runs each layer's forward again in backward: the expert-load hook must not count
    those tokens twice."""
    for a, b in zip(jobs["metrics"]["recompute"], jobs["metrics"]["straight"][:2]):
        assert abs(a["loss"] - b["loss"]) < 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-6 * b["grad_norm"]
        assert a["expert_load"] == b["expert_load"]
        assert all(sum(layer["tokens"]) == 2 * a["tokens"] for layer in a["expert_load"])


def test_loss_falls_on_a_learnable_corpus(jobs):
    losses = [m["loss"] for m in jobs["metrics"]["learn"]]
    assert len(losses) == 30
    assert sum(losses[-3:]) / 3 < 0.6 * losses[0], losses


def test_metrics_fields_and_real_token_counts(jobs, files):
    learn = jobs["metrics"]["learn"]
    corpus = _corpus(files["data"], files["qwen"])
    per_step = WORLD * 2  # ranks x micro-batch rows
    for m in learn:
        assert FIELDS <= set(m), FIELDS - set(m)
        assert m["tokens"] == per_step * SEQ
        rows = corpus.rows(m["data_position"] - per_step, per_step)
        assert m["target_tokens"] == int((rows["labels"][:, 1:] != IGNORE_INDEX).sum())
        assert m["tokens_per_s"] == pytest.approx(m["tokens"] / m["step_time_s"])
        assert m["peak_mem_bytes"] > 0 and m["grad_norm"] > 0
        assert [layer["layer"] for layer in m["expert_load"]] == [0, 1]
        for layer in m["expert_load"]:  # every token goes to top-2 of 8 experts, in every MoE layer
            assert sum(layer["tokens"]) == 2 * m["tokens"] and len(layer["tokens"]) == 8
            assert layer["max_over_mean"] == pytest.approx(max(layer["tokens"]) / (sum(layer["tokens"]) / 8))
    lrs = [m["lr"] for m in learn]
    # warmup 3 (step k at lr·k/3: step 1 trains at lr/3, not 0), then cosine
    assert lrs[:4] == [pytest.approx(1e-2 / 3), pytest.approx(2e-2 / 3), pytest.approx(1e-2), pytest.approx(1e-2)]
    assert lrs[-1] < lrs[10]
    assert list((jobs["out"] / "learn" / "tensorboard").glob("events.out.tfevents.*"))  # tensorboard is installed
    kept = sorted(p.name for p in (jobs["out"] / "learn" / "checkpoints").iterdir())
    assert kept == ["step-00000020", "step-00000030"]  # save_every 10, keep_last 2


def test_export_hf_loads_in_transformers(jobs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = jobs["out"] / "hf"
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(hf)("ab")["input_ids"] == [2, 3]
    assert model.config.model_type == "qwen3_moe"


# ---- load balancing -----------------------------------------------------------------------------------------------
def test_router_aux_loss_is_the_global_batch_one(jobs):
    ours, ref = jobs["aux_local"], jobs["aux_ref"]
    assert abs(ours["loss"] - ref["global"]["ce"]) < parity.LOSS_TOL
    assert abs(ours["aux_loss"] - ref["global"]["aux"]) < parity.LOSS_TOL
    assert abs(ours["grad_norm"] - ref["global"]["norm"]) < 1e-5 * ref["global"]["norm"]
    # taken per rank, the auxiliary loss's gradient differs measurably: the check above can tell
    assert abs(ref["per_rank"]["norm"] - ref["global"]["norm"]) > 1e-3 * ref["global"]["norm"]


def test_correction_bias_update_is_identical_on_every_rank_and_balances_the_load(jobs):
    from xpar_zoo.checkpoint import iter_model_tensors

    biases, metrics = jobs["biases"], jobs["metrics"]["bias"]
    assert sorted(biases[0]) == ["model.layers.1.mlp.gate.e_score_correction_bias",
                                 "model.layers.2.mlp.gate.e_score_correction_bias"]
    for other in biases[1:]:
        for name, value in biases[0].items():
            assert torch.equal(other[name], value), name
    balance = [[layer["max_over_mean"] for layer in m["expert_load"]] for m in metrics]
    assert all(x > 3.5 for x in balance[0]), balance  # at first experts 0 and 1 take (nearly) every token
    assert all(sum(b[i] for b in balance[-3:]) / 3 < 2.8 for i in range(2)), balance
    for i, name in enumerate(sorted(biases[0])):  # bias = start + rate * sum of sign(mean - load) over the steps
        expect = torch.zeros(8)
        expect[:2] = BIAS_START
        for m in metrics:
            load = torch.tensor(m["expert_load"][i]["tokens"], dtype=torch.float32)
            expect.add_(torch.sign(load.mean() - load) * BIAS_RATE)
        assert torch.equal(biases[0][name], expect), (biases[0][name], expect)
    saved = dict(iter_model_tensors(jobs["out"] / "bias" / "checkpoints", sorted(biases[0])))
    for name, value in biases[0].items():
        assert torch.equal(saved[name], value)


# ---- two "nodes" ------------------------------------------------------------------------------------------------
def test_two_torchrun_nodes_resume_a_four_rank_run_in_the_same_data_order(jobs, files):
    """Two torchrun agents on localhost (one rank each, c10d rendezvous) resume the 4-rank ep=2 run stopped after
    step 2 with twice the micro-batch: the same rows per step, the same losses as the straight 4-rank run."""
    out = jobs["out"] / "torchrun"
    port = launch.free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    rdzv = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", "xpar-train-test", "--max-restarts", "0"]
    args = ["--model", str(files["qwen"]), "--data", str(files["data"]), "--output", str(out), "--seq-len", str(SEQ),
            "--micro-batch", "2", "--steps", "4", "--lr", "3e-3", "--mesh", "ep=2", "--resume", "--no-progress"]
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    console_script = os.path.join(os.path.dirname(sys.executable), "xpar-zoo")  # the venv's, as pip installed it
    nodes = [subprocess.Popen(torchrun + rdzv + ["-m", "xpar_zoo.train", *args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True),
             subprocess.Popen(torchrun + rdzv + ["--no-python", console_script, "train",
                                                 *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)]
    logs = [p.communicate(timeout=300)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(logs)
    got, straight = read_metrics(out), jobs["metrics"]["straight"]
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    for a, b in zip(got[2:], straight[2:]):
        assert a["data_position"] == b["data_position"] and a["target_tokens"] == b["target_tokens"]
        assert abs(a["loss"] - b["loss"]) < parity.LOSS_TOL
    meta = json.loads((out / "checkpoints" / "step-00000004" / "extra_state.json").read_text())
    assert meta["world_size"] == 2 and meta["data"]["position"] == 16



def test_refuses_to_overwrite_a_run_and_a_missing_tokenizer(jobs, files, tmp_path, capsys):
    common = ["--data", str(files["data"]), "--steps", "2", "--seq-len", str(SEQ), "--no-progress"]
    out = jobs["out"] / "straight"
    assert cli.main(["train", "--model", str(files["qwen"]), "--output", str(out), *common]) == 2
    assert ("holds a finished run (step-00000004, the last of its 4 steps): rerun with --force to replace it"
            in capsys.readouterr().err)
    other = tmp_path / "other"
    shutil.copytree(out, other)
    assert cli.main(["train", "--model", str(files["qwen"]), "--output", str(other), "--resume", "--seed", "1",
                     *common]) == 2
    assert "--resume: seed was 0 at step 4, now 1: cannot change on resume" in capsys.readouterr().err
    bare = tmp_path / "bare"
    shutil.copytree(files["qwen"], bare, ignore=shutil.ignore_patterns("tokenizer*"))
    assert cli.main(["train", "--model", str(bare), "--output", str(tmp_path / "o"), *common]) == 2
    assert f"no tokenizer in {bare}" in capsys.readouterr().err
