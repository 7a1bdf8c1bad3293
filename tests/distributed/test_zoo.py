"""The zoo: every curated architecture, and every transformers MoE type proved through the automatic plan, trains
under its plans + FSDP2 exactly like single-process transformers (4 gloo ranks, fp32, one SGD step); every plan
``parallelize`` refuses for a type, and every refused type, is refused with its reason.

One 4-rank run holds every architecture on every mesh (processes and imports are shared), together with
tests/distributed/test_zoo_placement.py's dim-1 proof (``zoo_proofs`` in tests/conftest.py): a job per architecture, so
that one failing fails only its own tests."""

import pytest
import torch
from safetensors.torch import save_file

import xpar_zoo
from xpar_zoo.testing import modality, parity
from xpar_zoo.testing.proofs import AUTO_PROVED, proof_meshes, proved_architectures
from xpar_zoo.testing.proofs import PROOF_WORLD as WORLD
from xpar_zoo.zoo.registry import refused_architectures

PROVED = proved_architectures()
REFUSED = refused_architectures()

CASES = [(a, m) for a in PROVED for m in proof_meshes(a)]
IMAGES = sorted(a for a, p in AUTO_PROVED.items() if p.inputs != "text")
VISION = ("visual", "vision_tower", "vision_model", "vision_encoder", "multi_modal_projector")  # of `model`: vision
PLAN_REFUSALS = [(a, p) for a in sorted(AUTO_PROVED) for p in AUTO_PROVED[a].without]


def _refusal(fn) -> str:
    try:
        fn()
    except xpar_zoo.XparError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


# A refused type's transformers class and the config overrides it builds with (their defaults do not build).
REFUSED_MODELS = {
    "diffusion_gemma": ("DiffusionGemmaForBlockDiffusion",
                        dict(text_config=dict(num_experts=8, top_k_experts=2, moe_intermediate_size=16))),
    "openai_privacy_filter": ("OpenAIPrivacyFilterForTokenClassification", {}),
    "qwen3_omni_moe": ("Qwen3OmniMoeForConditionalGeneration", dict(enable_audio_output=False)),
}
# Loaded by from_pretrained on ep=2 from a saved tiny model and saved back with save_pretrained: rules transformers
# converts whole (transposed experts of a multimodal class; one hub tensor split into four, which reverts only as a
# group), next to the slice-wise read of per-expert keys.
LOADED = ("qwen3_vl_moe", "lara_mini", "qwen3_moe")


def _refused_model(model_type: str):
    """A model of a refused type on the meta device (its transformers class, whatever task it has)."""
    import transformers
    from transformers import AutoConfig

    class_name, overrides = REFUSED_MODELS[model_type]
    with torch.device("meta"):
        return getattr(transformers, class_name)._from_config(AutoConfig.for_model(model_type, **overrides))


def _hub_tensors(directory: str) -> dict:
    from pathlib import Path

    from safetensors.torch import load_file

    return {k: v for f in sorted(Path(directory).glob("*.safetensors")) for k, v in load_file(f).items()}


def _arch_job(arch: str, saved: str | None) -> dict:
    """``arch``'s proofs on each of its meshes, its refused plans, and (``saved``: a tiny model's hub folder) its
    from_pretrained on ep=2 and save_pretrained back."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    cfg = parity.tiny_config(arch)
    inputs = AUTO_PROVED[arch].inputs if arch in AUTO_PROVED else "text"
    if inputs != "text":
        ids, images = modality.batches(inputs, cfg, WORLD)
        data, extra = ids[None], [images]  # one step
    else:
        data, extra = parity.make_batches(cfg.get_text_config().vocab_size, 1, WORLD, seed=5), None
    before = parity.build_model(cfg).state_dict() if rank == 0 else None
    ref = parity.train_reference(cfg, data, "sgd", None, extra=extra) if rank == 0 else None
    if rank == 0:  # the proof trains the experts (and, with images, the vision tower) at all
        moved = {n for n, p in ref.params.items() if not torch.equal(p, before[n])}
        out[arch, "moved"] = {"experts": any(".experts." in n for n in moved),
                              "vision": sorted({n.split(".")[1] for n in moved if n.split(".")[1] in VISION})}
    for name, mesh_kwargs in proof_meshes(arch).items():
        rec = parity.train_parallel(cfg, data, mesh_kwargs, "sgd", None, extra=extra)
        if rank == 0:
            out[arch, name] = {"loss": (rec.losses[0], ref.losses[0]),
                               "errors": parity.param_errors(rec.params, ref.params, before)}
    for plan_name in AUTO_PROVED[arch].without if arch in AUTO_PROVED else ():
        mesh = xpar_zoo.Mesh(**{plan_name: 2})
        out[arch, f"without {plan_name}"] = _refusal(lambda mesh=mesh: xpar_zoo.parallelize(parity.build_model(cfg), mesh))
    if saved is not None:
        out.update(_loaded(arch, saved, rank))
    return out


def _loaded(arch: str, directory: str, rank: int) -> dict:
    model = xpar_zoo.from_pretrained(directory, mesh=xpar_zoo.Mesh(ep=2), progress=False)
    state = xpar_zoo.full_state_dict(model)
    model.save_pretrained(f"{directory}-saved", progress=False)  # and back to the hub's layout, every rank
    if rank != 0:
        return {}
    want = parity.build_model(parity.tiny_config(arch)).state_dict()
    hub, back = _hub_tensors(directory), _hub_tensors(f"{directory}-saved")
    return {(arch, "loaded"): sorted(n for n in want if n not in state or not torch.equal(state[n], want[n])),
            (arch, "saved"): sorted(k for k in hub.keys() | back.keys()
                                    if k not in hub or k not in back or not torch.equal(hub[k], back[k]))}


def _refused_job(model_type: str, directory: str) -> dict:
    return {(model_type, "parallelize"): _refusal(
                lambda: xpar_zoo.parallelize(_refused_model(model_type), xpar_zoo.Mesh())),
            (model_type, "from_pretrained"): _refusal(lambda: xpar_zoo.from_pretrained(directory, progress=False))}


def zoo_jobs(tmp_path_factory) -> dict:
    """This module's part of the zoo's 4-rank run (``zoo_proofs`` in tests/conftest.py): ``{name: (fn, args)}``, a
    job per architecture and per refused type (its results keyed ``(name, …)``), so that one failing fails only its
    own tests."""
    from transformers import AutoConfig

    jobs = {}
    for arch in PROVED:
        saved = None
        if arch in LOADED:
            saved = str(tmp_path_factory.mktemp(arch))
            parity.build_model(parity.tiny_config(arch)).save_pretrained(saved)
        jobs[arch] = (_arch_job, (arch, saved))
    for model_type in REFUSED:  # a config and a (meaningless) weights file: refused before any tensor is read
        directory = str(tmp_path_factory.mktemp(model_type))
        AutoConfig.for_model(model_type).save_pretrained(directory)
        save_file({"x": torch.zeros(1)}, f"{directory}/model.safetensors")
        jobs[model_type] = (_refused_job, (model_type, directory))
    return jobs


@pytest.fixture(scope="module")
def results(zoo_proofs):
    return zoo_proofs[__name__]



@pytest.mark.parametrize("arch,mesh", CASES)
def test_architecture_matches_single_process(results, arch, mesh):
    row = results[arch, mesh]
    parity.assert_losses_match([row["loss"][0]], [row["loss"][1]], what=f"{arch} on {mesh}")
    parity.assert_params_match(row["errors"], what=f"{arch} on {mesh}:")


@pytest.mark.parametrize("arch", [a for a in PROVED if any("ep" in m for m in proof_meshes(a).values())])
def test_the_proof_trains_the_experts(results, arch):
    assert results[arch, "moved"]["experts"], f"{arch}: no expert tensor changed in the reference step"


@pytest.mark.parametrize("arch", IMAGES)
def test_image_proof_trains_the_vision_tower(results, arch):
    assert results[arch, "moved"]["vision"], f"{arch}: no vision-tower parameter changed in the reference step"


@pytest.mark.parametrize("arch", LOADED)
def test_from_pretrained_on_ep2_loads_and_save_pretrained_writes_every_tensor_exactly(results, arch):
    assert results[arch, "loaded"] == []
    assert results[arch, "saved"] == []


@pytest.mark.parametrize("arch,plan", PLAN_REFUSALS)
def test_plan_is_refused_with_its_reason(results, arch, plan):
    message = results[arch, f"without {plan}"]
    assert message.startswith("PlanError: "), message
    assert AUTO_PROVED[arch].without[plan] in message, message


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_refused_architecture_raises_its_reason(results, model_type):
    reason = REFUSED[model_type]
    with pytest.raises(xpar_zoo.RefusedArchitectureError) as e:
        xpar_zoo.get_plan(model_type)
    assert reason in str(e.value) and repr(model_type) in str(e.value)
    for entry in ("parallelize", "from_pretrained"):
        message = results[model_type, entry]
        assert message.startswith("RefusedArchitectureError: ") and reason in message, f"{entry}: {message}"
