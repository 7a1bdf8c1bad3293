"""Post-training (issue 40) on 4 gloo ranks, one launch for every case:

- ``xpar_zoo.iter_hub_weights`` on ``Mesh(ep=2, emb=2, head=2)`` yields exactly the names and bytes ``xpar-zoo
  convert to-hf`` writes (plain, bf16, LoRA merged, the adapter alone in PEFT's files; an HSDP model as
  transformers saves it) on every rank, with a per-rank peak of one bucket plus one hub tensor, never a whole fused
  experts tensor;
- ``XparDPOTrainer``: loss, grad_norm and the reward metrics of 3 steps equal single-process TRL's on ``{ep:2}`` and
  ``{ep:2, emb:2, head:2}``, with a second xpar_zoo model as the reference, with precomputed reference
  log-probabilities, and with a LoRA policy whose disabled adapter is the reference;
- ``XparGRPOTrainer`` on ``{ep:2}`` (a prompt's 4 completions on two ranks): with the completions recorded from the
  sharded run and replayed in one process, loss and grad_norm of 2 steps equal single-process TRL's; greedy
  generation gives one process's completions; TRL's vLLM weight sync (a fake colocated engine) loads the hub tensors
  ``iter_hub_weights`` streams; options that cannot hold are refused in one line."""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import xpar_zoo
from xpar_zoo.testing import launch, parity

peft = pytest.importorskip("peft")  # an optional extra: requirements-test.txt installs it
from support import preference  # noqa: E402

WORLD = 4
FULL_MESH = {"ep": 2, "emb": 2, "head": 2}
SMALL_BUCKET = 4096  # bytes: smaller than a fused experts tensor, larger than one expert's slice of it


def _config(**overrides):
    return parity.tiny_config("qwen3_moe", vocab_size=64, **overrides)


def _files(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _differ(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose name, dtype, shape or bytes differ between the two."""
    def raw(t):
        return t.contiguous().view(-1).view(torch.uint8)

    return sorted(k for k in set(got) | set(want) if k not in got or k not in want or got[k].dtype != want[k].dtype
                  or got[k].shape != want[k].shape or not torch.equal(raw(got[k]), raw(want[k])))


def _streamed(model, **kwargs) -> dict[str, torch.Tensor]:
    return {k: v.clone() for bucket in xpar_zoo.iter_hub_weights(model, **kwargs) for k, v in bucket}


def _weights(root: Path) -> dict:
    """Every rank: the stream of a trained model, a LoRA model (merged) and its adapter against the files
    ``convert to-hf`` / ``save_adapter`` write, and of an HSDP model (replicas) against transformers' own save;
    rank 0's result holds every rank's."""
    from xpar_zoo.converters.export import export_to_hf

    from support.lora_setup import lora_config

    rank = dist.get_rank()
    cfg = _config()
    model = xpar_zoo.parallelize(parity.build_model(cfg), xpar_zoo.Mesh(**FULL_MESH))
    ids = parity.make_batches(cfg.vocab_size, 1, WORLD, seed=4)[0, rank]
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    torch.manual_seed(3)
    lora = xpar_zoo.from_pretrained(str(root / "base"), xpar_zoo.Mesh(**FULL_MESH), peft_config=lora_config(),
                                    progress=False)
    xpar_zoo.save_checkpoint(root / "ckpt", model)
    xpar_zoo.save_checkpoint(root / "lora_ckpt", lora)
    xpar_zoo.save_adapter(lora, root / "adapter")
    if rank == 0:
        export_to_hf(root / "ckpt", root / "hf", progress=False, max_shard_size="40KB")
        export_to_hf(root / "lora_ckpt", root / "lora_hf", progress=False, merge_adapter=True)
    dist.barrier()
    hub, merged, adapter = _files(root / "hf"), _files(root / "lora_hf"), _files(root / "adapter")
    row = {"small": _differ(_streamed(model, bucket_bytes=SMALL_BUCKET), hub),
           "one_bucket": _differ(_streamed(model, bucket_bytes="1MiB", dtype="bf16"),
                                 {k: v.to(torch.bfloat16) for k, v in hub.items()}),
           "merged": _differ(_streamed(lora, bucket_bytes=SMALL_BUCKET), merged),
           "adapter": _differ(_streamed(lora, adapter_only=True), adapter),
           "hsdp": _differ(_streamed(xpar_zoo.parallelize(parity.build_model(cfg), xpar_zoo.Mesh(ep=2, replicate=2)),
                                     bucket_bytes=SMALL_BUCKET), _files(root / "base")),
           "keys": len(hub),
           "peak": parity.live_peak_bytes(
               lambda: [None for _ in xpar_zoo.iter_hub_weights(model, bucket_bytes=SMALL_BUCKET)],
               str(root / f"trace{rank}.json")),
           "full_state_dict_peak": parity.live_peak_bytes(lambda: xpar_zoo.full_state_dict(model),
                                                          str(root / f"full{rank}.json")),
           "largest_hub_tensor": max(t.numel() * t.element_size() for t in hub.values()),
           "fused": model.model.layers[0].mlp.experts.gate_up_proj.numel() * 4}
    rows = [None] * WORLD
    dist.all_gather_object(rows, row)
    return rows


# ---- DPO ----------------------------------------------------------------------------------------------------------
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])  # B = 0: TRL's "ref" = disabled
LORA_LR = 5e-2
DPO_CASES = {"ref_ep2": ("reference", {"ep": 2}), "ref_full": ("reference", FULL_MESH),
             "precompute_full": ("precompute", FULL_MESH), "lora_ep2": ("lora", {"ep": 2}),
             "lora_full": ("lora", FULL_MESH)}


def _dpo_references(root: Path) -> dict:
    """Single-process TRL: a policy and a reference model, and a PEFT LoRA policy (TRL's "ref" adapter copy)."""
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl import DPOTrainer

    data, tok = Dataset.from_dict(preference.pairs()), preference.tokenizer()
    full = DPOTrainer(model=parity.build_model(_config(), experts_implementation="eager"),
                      ref_model=parity.build_model(_config(), experts_implementation="eager"),
                      args=preference.dpo_args(root / "ref", 1), train_dataset=data, processing_class=tok)
    full.train()
    torch.manual_seed(5)
    base = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32, experts_implementation="eager")
    lora = DPOTrainer(model=get_peft_model(base, LoraConfig(**LORA)), processing_class=tok, train_dataset=data,
                      args=preference.dpo_args(root / "ref_lora", 1, learning_rate=LORA_LR))
    lora.train()
    return {"reference": preference.log(full), "lora": preference.log(lora)}


def _dpo(root: Path) -> dict:
    """Every rank: XparDPOTrainer in each of :data:`DPO_CASES`; rank 0's logs."""
    import json

    from datasets import Dataset, load_dataset
    from peft import LoraConfig

    from xpar_zoo.integrations.dpo import XparDPOTrainer

    pairs = preference.pairs()
    if dist.get_rank() == 0:
        (root / "pairs.json").write_text("".join(json.dumps({k: pairs[k][i] for k in pairs}) + "\n"
                                                 for i in range(len(pairs["prompt"]))))
    dist.barrier()
    out = {}
    for name, (kind, mesh) in DPO_CASES.items():
        args = dict(learning_rate=LORA_LR) if kind == "lora" else {}
        data = Dataset.from_dict(pairs)
        if kind == "precompute":  # TRL caches the log-probabilities beside the dataset's files: one every rank sees
            data = load_dataset("json", data_files=str(root / "pairs.json"), split="train",
                                cache_dir=str(root / "datasets"))
            args["precompute_ref_log_probs"] = True
        if kind == "lora":
            torch.manual_seed(5)
            model = xpar_zoo.from_pretrained(str(root / "base"), xpar_zoo.Mesh(**mesh),
                                             peft_config=LoraConfig(**LORA), progress=False)
        else:
            model = xpar_zoo.parallelize(parity.build_model(_config()), xpar_zoo.Mesh(**mesh))
        reference = (xpar_zoo.parallelize(parity.build_model(_config()), xpar_zoo.Mesh(**mesh))
                     if kind == "reference" else None)
        trainer = XparDPOTrainer(model=model, ref_model=reference, train_dataset=data,
                                 processing_class=preference.tokenizer(),
                                 args=preference.dpo_args(root / name, WORLD, **args))
        trainer.train()
        out[name] = preference.log(trainer)
        if reference is not None:
            out[name + "_frozen"] = [n for n, p in reference.named_parameters() if p.requires_grad or p.grad is not None]
    return out


# ---- GRPO ---------------------------------------------------------------------------------------------------------
def _recording_trainer():
    from xpar_zoo.integrations.grpo import XparGRPOTrainer

    class Recording(XparGRPOTrainer):
        """Records every generation call's prompt and completion ids."""

        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            out = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            self.recorded.append(([list(p) for p in prompt_ids], [list(c) for c in out[0]]))
            return out

    return Recording


def _fake_vllm(trainer) -> dict[str, torch.Tensor]:
    """TRL's colocated vLLM weight sync run against a fake engine; what its ``load_weights`` received."""
    from types import SimpleNamespace

    from trl.generation.vllm_generation import VLLMGeneration

    loaded = {}

    class EngineModel:
        def load_weights(self, weights):
            loaded.update((name, tensor.clone()) for name, tensor in weights)

    runner = SimpleNamespace(model=EngineModel())
    generation = VLLMGeneration.__new__(VLLMGeneration)  # TRL's object, without starting vLLM
    generation.mode, generation.enable_sleep_mode, generation.accelerator = "colocate", False, trainer.accelerator
    generation.llm = SimpleNamespace(reset_prefix_cache=lambda: None, llm_engine=SimpleNamespace(
        model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner))))
    trainer.stream_weights_to(generation)
    generation.sync_weights()
    return loaded


def _grpo(root: Path) -> dict:
    """Every rank: a sampled GRPO run and a greedy one on {ep:2}, recording their completions, and the weight sync;
    rank 0's result holds every rank's records."""
    from datasets import Dataset

    recording = _recording_trainer()
    out = {}
    for name, overrides in (("sampled", {}), ("greedy", {"max_steps": 1, "generation_kwargs": {"do_sample": False}})):
        model = xpar_zoo.parallelize(parity.build_model(_config()), xpar_zoo.Mesh(ep=2))
        trainer = recording(model=model, reward_funcs=[preference.vowels], processing_class=preference.tokenizer(),
                            train_dataset=Dataset.from_dict(preference.prompts()),
                            args=preference.grpo_args(root / f"grpo_{name}", WORLD, **overrides))
        trainer.recorded = []
        trainer.train()
        records = [None] * WORLD
        dist.all_gather_object(records, trainer.recorded)
        out[name] = {"log": preference.grpo_log(trainer), "records": records}
    loaded = _fake_vllm(trainer)
    out["vllm"] = {"differ": _differ(loaded, _streamed(trainer.model)), "keys": sorted(loaded)}
    return out


def _job(root: str) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/support on the ranks
    root = Path(root)
    return {"weights": _weights(root), "dpo": _dpo(root), "grpo": _grpo(root)}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("post_training")
    parity.build_model(_config()).save_pretrained(root / "base")
    return root


@pytest.fixture(scope="module")
def results(root):
    return launch.run(_job, WORLD, str(root))


@pytest.fixture(scope="module")
def dpo_references(root):
    return _dpo_references(root)


@pytest.mark.parametrize("case", ["small", "one_bucket", "merged", "adapter", "hsdp"])
def test_streamed_hub_weights_are_the_bytes_convert_to_hf_writes_on_every_rank(results, case):
    for rank, row in enumerate(results["weights"]):
        assert row["keys"] > 20
        assert row[case] == [], f"rank {rank}, {case}: differ {row[case][:6]}"


def test_streaming_peak_is_one_bucket_plus_one_hub_tensor_never_a_fused_tensor(results):
    for rank, row in enumerate(results["weights"]):
        assert 0 < row["peak"] <= SMALL_BUCKET + row["largest_hub_tensor"], (rank, row["peak"])
        assert row["peak"] < row["fused"], (rank, row["peak"], row["fused"])
    assert results["weights"][0]["full_state_dict_peak"] > 4 * results["weights"][0]["peak"]


def _close(got: float, want: float, scale: float, what: str) -> None:
    assert abs(got - want) <= 1e-5 * max(abs(want), scale), f"{what}: {got} against single-process TRL's {want}"


@pytest.mark.parametrize("case", list(DPO_CASES))
def test_dpo_losses_rewards_and_grad_norms_equal_single_process_trl(results, dpo_references, case):
    kind = DPO_CASES[case][0]
    want = dpo_references["lora" if kind == "lora" else "reference"]
    got = results["dpo"][case]
    assert len(got) == len(want) == 3
    for step, (g, w) in enumerate(zip(got, want), 1):
        # a reward is beta * (log p - log p_ref) of sums over a completion: its fp32 rounding is that of the sums
        logps = preference.BETA * max(abs(w["logps/chosen"]), abs(w["logps/rejected"]))
        for key in ("loss", "grad_norm"):
            _close(g[key], w[key], 0.0, f"{case} step {step} {key}")
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
            _close(g[key], w[key], logps, f"{case} step {step} {key}")


@pytest.mark.parametrize("case", ["ref_ep2", "ref_full"])
def test_dpo_reference_model_stays_frozen(results, case):
    assert results["dpo"][case + "_frozen"] == []


def _replayed(root: Path, records: list) -> list[dict]:
    """Single-process TRL's GRPO on the global batches, each generation call answered with the completions the
    ranks recorded (rank by rank: the global batch's order)."""
    from datasets import Dataset
    from trl import GRPOTrainer

    calls = [([p for rank in records for p in rank[i][0]], [c for rank in records for c in rank[i][1]])
             for i in range(len(records[0]))]

    class Replay(GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            prompts, completions = calls[self.replayed]
            assert [list(p) for p in prompt_ids] == prompts, "the global batch's prompts are not the ranks' in order"
            self.replayed += 1
            return completions, None

    trainer = Replay(model=parity.build_model(_config(), experts_implementation="eager"), train_dataset=Dataset.from_dict(
        preference.prompts()), reward_funcs=[preference.vowels], processing_class=preference.tokenizer(),
        args=preference.grpo_args(root / "grpo_replay", 1))
    trainer.replayed = 0
    trainer.train()
    assert trainer.replayed == len(calls)
    return preference.grpo_log(trainer)


def test_grpo_with_recorded_completions_equals_single_process_trl(results, root):
    got = results["grpo"]["sampled"]["log"]
    want = _replayed(root, results["grpo"]["sampled"]["records"])
    assert len(got) == len(want) == 2
    for step, (g, w) in enumerate(zip(got, want), 1):
        for key in ("loss", "grad_norm", "reward"):
            _close(g[key], w[key], 0.0, f"GRPO step {step} {key}")


def test_grpo_greedy_generation_on_ep2_equals_one_process(results):
    from trl.trainer.utils import pad

    model = parity.build_model(_config(), experts_implementation="eager").eval()
    tok = preference.tokenizer()
    for rank, calls in enumerate(results["grpo"]["greedy"]["records"]):
        for prompts, completions in calls:
            ids = pad([torch.tensor(p) for p in prompts], padding_value=tok.pad_token_id, padding_side="left")
            mask = pad([torch.ones(len(p), dtype=torch.long) for p in prompts], padding_value=0, padding_side="left")
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)[:, ids.shape[1]:]
            want = [row[:row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row for row in out.tolist()]
            assert completions == want, f"rank {rank}"


def test_grpo_vllm_weight_sync_loads_the_streamed_hub_tensors(results):
    row = results["grpo"]["vllm"]
    assert row["differ"] == []
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in row["keys"], row["keys"][:8]


@pytest.mark.parametrize("option", [{"beta": 0.1}, {"use_transformers_continuous_batching": True}])
def test_grpo_options_that_cannot_hold_are_refused_before_training(option, tmp_path):
    from xpar_zoo.integrations.grpo import check_grpo_args

    with pytest.raises(xpar_zoo.IntegrationError, match=next(iter(option))):
        check_grpo_args(parity.build_model(_config()), preference.grpo_args(tmp_path, 1, **option))
