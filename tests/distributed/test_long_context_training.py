"""Long context where users meet it (issue 30, item 5): ``xpar-zoo train`` (``xpar_zoo.train.loop.train``) and
``XparTrainer`` on an sp/cp mesh train exactly as on a mesh without sp/cp on the same global batch.

4 gloo ranks, tiny qwen3_moe, fp32, eager attention. The training command reads packed rows (``position_ids``
restart per document): with ``--mesh sp=2,ep=2`` (or ``cp=2``) there are 2 data parts (``xpar_zoo.data_shard``)
of 2 rows each instead of 4 of 1 row (``--mesh ep=2``), so both runs read the same 4 global rows per step; the
per-step losses, gradient norms and ``metrics.jsonl``'s ``tokens`` / ``targets`` (each token counted once, not once
per rank of a sequence group) must match. The Trainer: ``Mesh(sp=2)`` with 4 rows per device against ``Mesh()``
with 2, gradient accumulation 2 (``num_items_in_batch`` counted once per sequence group): logged losses, gradient
norms and the evaluation loss match. Both take ``xpar_zoo.ParallelOptions``: ``--mesh cp=2`` runs with
``--attention-block-mib`` and the Trainer on ``Mesh(sp=2)`` with ``XparTrainer(options=...)`` tiny enough that the
masked attention runs blocked (the paths the wrapper took are recorded), exact all the same. One launched run for
all."""

import json
import random

import pytest

from xpar_zoo.testing import launch, parity

WORLD = 4
SEQ = 32
STEPS = 3
LOSS_RTOL, NORM_RTOL = 1e-5, 1e-4
TRAIN_MESHES = {"sp2_ep2": {"sp": 2, "ep": 2}, "cp2": {"cp": 2}}  # each against ep=2 on the same rows
TRAINER_ROWS, TRAINER_SEQ, ACCUM = 32, 16, 2
BLOCK_MIB = {"cp2": 0.0005}  # the runs given a block budget of 512 bytes (a few queries per block)


def _config():
    return parity.tiny_config("qwen3_moe", attn_implementation="eager", use_cache=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    base = tmp_path_factory.mktemp("long_context_train")
    config = _config()
    parity.build_model(config).save_pretrained(base / "model")
    rng = random.Random(0)
    with open(base / "tokens.jsonl", "w") as f:  # pre-tokenized documents of 3 to 40 tokens: rows pack several
        for _ in range(120):
            f.write(json.dumps({"input_ids": [rng.randrange(config.vocab_size)
                                              for _ in range(rng.randint(3, 40))]}) + "\n")
    return base


def _trainer_rows(vocab_size: int) -> list[dict]:
    ids = parity.make_batches(vocab_size, 1, TRAINER_ROWS, batch=1, seq=TRAINER_SEQ, seed=3)
    ids = ids.reshape(TRAINER_ROWS, TRAINER_SEQ)
    labels = parity.make_labels(ids.reshape(1, TRAINER_ROWS, 1, TRAINER_SEQ), seed=5).reshape(TRAINER_ROWS,
                                                                                              TRAINER_SEQ)
    return [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels)]


def _jobs(base) -> dict:
    """Every rank: the training command on each mesh, then the Trainer with and without sp."""
    import torch.distributed as dist
    from transformers import TrainingArguments

    import xpar_zoo
    from xpar_zoo.integrations.trainer import XparTrainer
    from xpar_zoo.styles.sequence import sequence_state
    from xpar_zoo.train import TrainConfig, train
    from xpar_zoo.train.config import validate

    result = {"shards": {}, "paths": {}}

    def paths(model):
        state = sequence_state(model)
        return sorted(state.paths) if state is not None else []

    def run(name, mesh, micro_batch):
        cfg = TrainConfig(model=str(base / "model"), data=str(base / "tokens.jsonl"), output=str(base / name),
                          seq_len=SEQ, steps=STEPS, lr=3e-3, micro_batch=micro_batch, mesh=mesh,
                          attn_implementation="eager", progress=False, tensorboard=False,
                          attention_block_mib=BLOCK_MIB.get(name))
        validate(cfg)
        done = train(cfg)
        result["shards"][name] = xpar_zoo.data_shard(done.model)
        result["paths"][name] = paths(done.model)

    run("ep2", {"ep": 2}, 1)
    for name, mesh in TRAIN_MESHES.items():
        run(name, mesh, 2)

    config = _config()
    rows = _trainer_rows(config.vocab_size)

    def trainer(name, mesh, per_device, options=None):
        args = TrainingArguments(output_dir=str(base / name), per_device_train_batch_size=per_device,
                                 per_device_eval_batch_size=per_device, gradient_accumulation_steps=ACCUM,
                                 max_steps=STEPS, learning_rate=1e-2, logging_steps=1, save_strategy="no",
                                 report_to="none", disable_tqdm=True, use_cpu=True, seed=0,
                                 include_num_input_tokens_seen="all")
        model = xpar_zoo.parallelize(parity.build_model(config), xpar_zoo.Mesh(**mesh))
        t = XparTrainer(model=model, args=args, train_dataset=rows, options=options)
        t.train()
        log = [{k: h[k] for k in ("step", "loss", "grad_norm")} for h in t.state.log_history if "loss" in h]
        seen = [None] * WORLD  # the first sample of each rank's first batch
        dist.all_gather_object(seen, next(iter(t.get_train_dataloader()))["input_ids"][:, :2].tolist())
        return {"log": log, "eval_loss": t.evaluate(eval_dataset=rows[:8])["eval_loss"], "seen": seen,
                "shard": xpar_zoo.data_shard(model), "tokens_seen": t.state.num_input_tokens_seen,
                "paths": paths(model)}

    result["trainer_ref"] = trainer("trainer_ref", {}, 2)
    tiny_blocks = xpar_zoo.ParallelOptions(attention_block_mib=0.0005)
    result["trainer_sp2"] = trainer("trainer_sp2", {"sp": 2}, 4, tiny_blocks)
    return result if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def jobs(files):
    from xpar_zoo.train.metrics import read_metrics

    result = launch.run(_jobs, WORLD, files, timeout_s=900)
    metrics = {name: read_metrics(files / name) for name in ("ep2", *TRAIN_MESHES)}
    return {**result, "metrics": metrics}


def _close(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) <= rtol * max(abs(b), 1e-12)


@pytest.mark.parametrize("name", TRAIN_MESHES)
def test_train_command_on_a_sequence_mesh_matches_ep2_on_the_same_global_rows(jobs, name):
    ref, got = jobs["metrics"]["ep2"], jobs["metrics"][name]
    assert [m["step"] for m in got] == [m["step"] for m in ref] == list(range(1, STEPS + 1))
    for r, g in zip(ref, got):
        assert g["data_position"] == r["data_position"]  # the same global rows: 4 per step
        assert _close(g["loss"], r["loss"], LOSS_RTOL), (name, g["step"], g["loss"], r["loss"])
        assert _close(g["grad_norm"], r["grad_norm"], NORM_RTOL), (name, g["step"], g["grad_norm"], r["grad_norm"])
    assert len({round(m["loss"], 4) for m in ref}) == STEPS  # steps on other rows: not a comparison of constants


@pytest.mark.parametrize("name", TRAIN_MESHES)
def test_metrics_count_each_token_and_target_once(jobs, name):
    for r, g in zip(jobs["metrics"]["ep2"], jobs["metrics"][name]):
        assert g["tokens"] == r["tokens"] == WORLD * SEQ  # 4 rows of SEQ per step, not 4 rows x sp·cp ranks
        assert g["target_tokens"] == r["target_tokens"] > 0
        assert g["tokens_per_s"] == pytest.approx(g["tokens"] / g["step_time_s"])


def test_train_command_reads_by_data_shard(jobs):
    # rank 0's (index, count): world parts without sp/cp, world / (sp·cp) with them
    assert jobs["shards"] == {"ep2": (0, 4), "sp2_ep2": (0, 2), "cp2": (0, 2)}


def test_trainer_on_sp2_logs_the_losses_and_grad_norms_of_the_same_batch_without_sp(jobs):
    ref, got = jobs["trainer_ref"], jobs["trainer_sp2"]
    assert ref["shard"] == (0, 4) and got["shard"] == (0, 2)
    assert [h["step"] for h in got["log"]] == [h["step"] for h in ref["log"]] == list(range(1, STEPS + 1))
    for r, g in zip(ref["log"], got["log"]):
        assert _close(g["loss"], r["loss"], LOSS_RTOL), (g, r)
        assert _close(g["grad_norm"], r["grad_norm"], NORM_RTOL), (g, r)
    assert _close(got["eval_loss"], ref["eval_loss"], LOSS_RTOL), (got["eval_loss"], ref["eval_loss"])


def test_the_options_given_to_train_and_the_trainer_reach_the_attention(jobs):
    """``--attention-block-mib`` (``cp2``) and ``XparTrainer(options=...)`` (``trainer_sp2``) ran eager's masked
    attention a block at a time; without them (``sp2_ep2``: the default budget) the whole mask."""
    assert jobs["paths"] == {"ep2": [], "sp2_ep2": ["whole_mask"], "cp2": ["blocked"]}
    assert jobs["trainer_sp2"]["paths"] == ["blocked"] and jobs["trainer_ref"]["paths"] == []


def test_trainer_on_sp2_counts_each_input_token_once(jobs):
    # the two ranks of an sp group pass the same rows: num_input_tokens_seen counts them once, as without sp
    rows = WORLD * 2 * ACCUM * STEPS  # the reference's rows: 2 per device, every step
    assert jobs["trainer_sp2"]["tokens_seen"] == jobs["trainer_ref"]["tokens_seen"] > 0
    assert jobs["trainer_ref"]["tokens_seen"] == rows * TRAINER_SEQ


def test_trainer_gives_the_ranks_of_a_sequence_group_the_same_samples(jobs):
    seen = jobs["trainer_sp2"]["seen"]
    assert seen[0] == seen[1] and seen[2] == seen[3] and seen[0] != seen[2]  # sp groups: ranks {0, 1}, {2, 3}
    ref = jobs["trainer_ref"]["seen"]  # the same global rows: the sp run's 2 parts of 4 are the reference's 4 of 2
    assert [row for part in (seen[0], seen[2]) for row in part] == [row for part in ref for row in part]
