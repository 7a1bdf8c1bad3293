"""Multimodal MoE models train exactly like single-process transformers on a global batch that mixes text-only and
image rows (4 gloo ranks, fp32, one SGD step): two ranks hold no image at all, one row holds two images
(:data:`xpar_zoo.testing.modality.MIXED_ROWS`). Ranks without images run the vision tower on a dummy image
(:mod:`xpar_zoo.styles.encoders`), so its FSDP collectives match; without that the ranks' collectives mismatch.
Under long context (``sp=2, ep=2`` and ``cp=2``) each sequence group encodes its whole rows' images, computes their
multimodal RoPE positions on the whole rows and keeps each rank's features (:mod:`xpar_zoo.styles.sequence_media`):
qwen3_5_moe's gated delta nets run on the whole rows, gemma4's images are seen both ways on its sliding layers (as
its published configs set); the families sp/cp cannot split are refused with the reason. Packed rows with images
(:data:`xpar_zoo.testing.modality.PACKED_ROWS`, positions per document) train on every mesh of the mixed rows too,
as a second step of the same run where the config allows. qwen3_vl_moe's mixed rows hold a two-frame video too, on
a rank without images (:data:`xpar_zoo.testing.modality.VIDEO_ROWS`): the ranks without it encode a dummy video, and
a sequence group deals it as it deals images; its packed rows hold that video in a document of its own beside a
document with an image (positions per document, each video frame a run of its own). The jobs run in the zoo's one
4-rank run (``zoo_proofs`` in tests/conftest.py)"""

import contextlib

import pytest

from xpar_zoo.testing import modality, parity
from xpar_zoo.testing.proofs import (
    AUTO_PROVED,
    PROOF_WORLD,
    long_context_meshes,
    proof_meshes,
)

ARCHS = ("qwen3_vl_moe", "qwen3_5_moe", "gemma4")
BIDIRECTIONAL_IMAGES = ("gemma4",)
VL = "qwen3_vl_moe"
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # LoRA's target_parameters: the fused experts
LORA_JOB = f"{VL} lora on the vision tower"
REFUSED = {"aria": "without multimodal RoPE"}  # a family not proved with images


def _meshes(arch: str) -> dict[str, dict]:
    meshes = {name: m for name, m in proof_meshes(arch).items() if name != "fsdp"}
    return {**meshes, **long_context_meshes(arch)}


CASES = [(a, m) for a in ARCHS for m in _meshes(a)]
# The job whose results hold an architecture's packed rows, on every mesh of its mixed rows: the mixed rows' job
# trains them as its second step; gemma4's run in a job of their own, without its image overlay (:func:`_packed_job`).
PACKED_JOB = {arch: f"{arch} packed" if arch in BIDIRECTIONAL_IMAGES else arch for arch in ARCHS}


def _packed_rows(arch: str, cfg, host, **video) -> tuple:
    """Token ids and each rank's inputs of :data:`~xpar_zoo.testing.modality.PACKED_ROWS` (``video``: the videos
    and row length of :func:`~xpar_zoo.testing.modality.mixed_batches`), their positions computed per document as
    the training data makes them (multimodal RoPE's 3-D ones where the model uses them, else 1-D) by ``host`` (a
    model of ``cfg``)."""
    from xpar_zoo.styles.encoders import document_positions

    ids, images = modality.mixed_batches(AUTO_PROVED[arch].inputs, cfg, PROOF_WORLD, rows=modality.PACKED_ROWS,
                                         **video)
    return ids, [{**images[r], "position_ids": document_positions(host, {"input_ids": ids[r], **images[r]})[
        "position_ids"]} for r in range(PROOF_WORLD)]


def _job(arch: str) -> dict:
    """One SGD step on the mixed rows on every mesh of :func:`_meshes`, and where the same config serves them a
    second on packed rows (:func:`_packed_rows`; transformers masks packed documents only without a cache, which
    changes nothing on the mixed rows), against single-process transformers' same steps. qwen3_vl_moe's rows of
    both steps hold a video (in a packed row, a document of its own beside one with an image)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    cfg = parity.tiny_config(arch)
    if arch in BIDIRECTIONAL_IMAGES:  # its published configs' image blocks, seen both ways on sliding layers
        cfg.get_text_config().use_bidirectional_attention = "vision"
    else:
        for config in (cfg, cfg.get_text_config()):
            config.use_cache = False
    video = {"videos": modality.VIDEO_ROWS, "seq": modality.VIDEO_SEQ} if arch == VL else {}
    ids, images = modality.mixed_batches(AUTO_PROVED[arch].inputs, cfg, PROOF_WORLD, **video)
    videos = video.get("videos", ())
    steps = [(ids, images)]
    host = parity.build_model(cfg)
    if PACKED_JOB[arch] == arch:
        steps.append(_packed_rows(arch, cfg, host, **video))
    data, extra = torch.stack([s[0] for s in steps]), [s[1] for s in steps]
    before = host.state_dict() if rank == 0 else None
    ref = parity.train_reference(cfg, data, "sgd", None, extra=extra) if rank == 0 else None
    out = {}
    for name, mesh in _meshes(arch).items():
        with _encoded_rows() as encoded:
            rec = parity.train_parallel(cfg, data, mesh, "sgd", None, extra=extra)
        rows = [None] * PROOF_WORLD
        dist.all_gather_object(rows, encoded[:1 + bool(videos)])  # the first step's embeds: images, videos
        if rank == 0:
            out[arch, name] = {"losses": dict(zip(("mixed", "packed"), zip(rec.losses, ref.losses))),
                               "errors": parity.param_errors(rec.params, ref.params, before), "encoded": rows,
                               "one image": images[0]["pixel_values"].shape[0] // 2,  # rank 0's row 0: two images
                               "one video": sum(len(e.get("pixel_values_videos", ())) for e in images)}
    return out


@contextlib.contextmanager
def _encoded_rows():
    """The pixel rows (patches, or whole images) that each call of this rank's vision tower embeds while inside, in
    order (per step: images, then videos; :mod:`xpar_zoo.styles.encoders`)."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    rows: list[int] = []

    def hook(module, args):
        if "PatchEmbed" in type(module).__name__ and args:
            rows.append(args[0].shape[0])

    handle = register_module_forward_pre_hook(hook)
    try:
        yield rows
    finally:
        handle.remove()


def _packed_job(arch: str) -> dict:
    """One SGD step on packed rows (:func:`_packed_rows`) on every mesh of :func:`_meshes`, for a family whose mixed
    rows' config cannot serve them: gemma4 without its images seen both ways, since single-process transformers reads
    that overlay at positions within each document on packed rows
    (:func:`test_transformers_gemma4_reads_its_image_overlay_at_document_positions`)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    cfg = parity.tiny_config(arch)
    for config in (cfg, cfg.get_text_config()):  # transformers masks packed documents only without a cache
        config.use_cache = False
    host = parity.build_model(cfg)
    ids, images = _packed_rows(arch, cfg, host)
    data, extra = ids[None], [images]
    before = host.state_dict() if rank == 0 else None
    ref = parity.train_reference(cfg, data, "sgd", None, extra=extra) if rank == 0 else None
    out = {}
    for name, mesh in _meshes(arch).items():
        rec = parity.train_parallel(cfg, data, mesh, "sgd", None, extra=extra)
        if rank == 0:
            out[PACKED_JOB[arch], name] = {"losses": {"packed": (rec.losses[0], ref.losses[0])},
                                           "errors": parity.param_errors(rec.params, ref.params, before)}
    return out


def _lora_vision_job(base: str) -> dict:
    """LoRA on attention, on the fused experts (whose checkpoint tensors transformers converts with a shape check
    through the wrapped model) and on every linear of the vision tower and projector (``--lora-vision``'s targets) of
    a saved tiny qwen3_vl_moe, loaded by ``from_pretrained`` on ``ep=2``, one SGD step on the mixed rows, against
    single-process PEFT from the same initial adapter."""
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoModelForImageTextToText

    import xpar_zoo
    from xpar_zoo.hub.adapter_files import adapter_state
    from xpar_zoo.train.multimodal import vision_linears

    rank = dist.get_rank()
    cfg = parity.tiny_config(VL)
    ids, images = modality.mixed_batches("image", cfg, PROOF_WORLD)
    labels = parity.make_labels(ids[None])[0]
    lora = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_parameters=EXPERTS,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", *vision_linears(parity.build_model(cfg))])
    model = xpar_zoo.from_pretrained(base, xpar_zoo.Mesh(ep=2), peft_config=lora, progress=False).train()
    init = adapter_state(model)
    opt = parity.sgd([p for p in model.parameters() if p.requires_grad])
    loss = model(input_ids=ids[rank], labels=labels[rank], **images[rank]).loss
    loss.backward()
    opt.step()
    losses = [None] * PROOF_WORLD
    dist.all_gather_object(losses, loss.item())
    after = adapter_state(model)
    if rank != 0:
        return {}
    ref = get_peft_model(AutoModelForImageTextToText.from_pretrained(base, experts_implementation="eager"), lora)
    set_peft_model_state_dict(ref, init)
    ref.train()
    ref_opt = parity.sgd([p for p in ref.parameters() if p.requires_grad])
    ref_loss = ref(input_ids=ids.flatten(0, 1), labels=labels.flatten(0, 1),
                   **parity.step_inputs([images], 0)).loss
    ref_loss.backward()
    ref_opt.step()
    expected = {k: v.detach().clone() for k, v in get_peft_model_state_dict(ref).items()}
    return {(LORA_JOB, "ep2"): {"loss": (sum(losses) / len(losses), ref_loss.item()),
                                "errors": parity.param_errors(after, expected, init),
                                "vision adapters": sorted({k.split(".lora_")[0] for k in init if ".visual." in k}),
                                "expert adapters": sorted({k.split(".lora_")[0] for k in init if "experts" in k})}}


def zoo_jobs(tmp_path_factory) -> dict:
    """This module's part of the zoo's 4-rank run: a job per architecture, one of packed rows, one of LoRA on the
    vision tower (on a saved base)."""
    base = tmp_path_factory.mktemp("vl_lora") / "base"
    parity.build_model(parity.tiny_config(VL)).save_pretrained(base)
    return {**{arch: (_job, (arch,)) for arch in ARCHS},
            **{job: (_packed_job, (arch,)) for arch, job in PACKED_JOB.items() if job != arch},
            LORA_JOB: (_lora_vision_job, (str(base),))}


@pytest.fixture(scope="module")
def results(zoo_proofs):
    return zoo_proofs[__name__]


@pytest.mark.parametrize("arch,mesh", CASES)
def test_images_in_some_rows_only_match_single_process(results, arch, mesh):
    row = results[arch, mesh]
    par, ref = row["losses"]["mixed"]
    parity.assert_losses_match([par], [ref], what=f"{arch} on {mesh}, mixed rows")
    parity.assert_params_match(row["errors"], what=f"{arch} on {mesh}, mixed rows (and packed rows after them):")


@pytest.mark.parametrize("arch,mesh", [(a, m) for a in ARCHS for m in long_context_meshes(a)])
def test_each_sequence_group_encodes_each_image_once(results, arch, mesh):
    row = results[arch, mesh]  # a group's two images: one on each of its ranks, not both on both
    assert max(rows[0] for rows in row["encoded"]) <= row["one image"], row["encoded"]


@pytest.mark.parametrize("arch,mesh", [(VL, m) for m in long_context_meshes(VL)])
def test_each_sequence_group_encodes_each_video_once(results, arch, mesh):
    row = results[arch, mesh]  # one rank of the video's group encodes it, the others a dummy
    assert row["one video"] and [rows[1] >= row["one video"] for rows in row["encoded"]].count(True) == 1, row

@pytest.mark.parametrize("job,mesh", [(PACKED_JOB[a], m) for a, m in CASES])
def test_packed_rows_with_images_match_single_process(results, job, mesh):
    row = results[job, mesh]
    par, ref = row["losses"]["packed"]
    parity.assert_losses_match([par], [ref], what=f"{job}: packed rows on {mesh}")
    parity.assert_params_match(row["errors"], what=f"{job}: packed rows on {mesh}:")


@pytest.mark.parametrize("job", [LORA_JOB])
def test_lora_on_the_vision_tower_matches_single_process_peft(results, job):
    pytest.importorskip("peft")
    row = results[job, "ep2"]
    assert any("blocks.0.attn.qkv" in m for m in row["vision adapters"]) and any(
        "merger" in m for m in row["vision adapters"]), row["vision adapters"]
    assert row["expert adapters"], "no adapter on the fused experts"
    parity.assert_losses_match([row["loss"][0]], [row["loss"][1]], what=f"{job} on ep2")
    parity.assert_params_match(row["errors"], what=f"{job} on ep2:")


def test_the_mixed_rows_leave_ranks_without_images():
    cfg = parity.tiny_config("qwen3_vl_moe")
    _, images = modality.mixed_batches("image", cfg, PROOF_WORLD)
    assert [("pixel_values" in e) for e in images] == [True, False, True, False]
    assert len(images[0]["image_grid_thw"]) == 2  # two images in one row


def test_the_packed_rows_hold_a_video_beside_a_document_with_an_image():
    cfg = parity.tiny_config(VL)
    _, inputs = modality.mixed_batches("image", cfg, PROOF_WORLD, rows=modality.PACKED_ROWS,
                                       videos=modality.VIDEO_ROWS, seq=modality.VIDEO_SEQ)
    [(r, b)] = modality.VIDEO_ROWS
    half = modality.VIDEO_SEQ // 2
    types, positions = inputs[r]["mm_token_type_ids"][b], inputs[r]["position_ids"][b]
    assert positions[half] == 0 and (types[:half] == 2).any() and (types[half:] == 1).any() and not types[half:].eq(
        2).any() and not types[:half].eq(1).any(), types


@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_families_not_proved_with_images_are_refused_under_long_context_with_the_reason(arch):
    from xpar_zoo.commands.model_cards import long_context_refusal

    message = long_context_refusal(parity.build_model(parity.tiny_config(arch)))
    assert message is not None and REFUSED[arch] in message and "\n" not in message, message


def test_transformers_gemma4_reads_its_image_overlay_at_document_positions():
    """Why gemma4's packed proof leaves ``use_bidirectional_attention`` unset: on packed rows single-process
    transformers looks the image blocks up at each token's position within its document, so in a row whose first
    document holds an image at positions 1-4, the second document's text at those document positions sees its own
    future. xpar_zoo's sp/cp mask reads them on the row. When this fails, transformers has changed: prove the packed
    rows with the overlay."""
    import torch
    from transformers.models.gemma4 import modeling_gemma4

    cfg = parity.tiny_config("gemma4").get_text_config()
    cfg.use_bidirectional_attention, cfg._attn_implementation = "vision", "eager"
    _, images = modality.mixed_batches("patches", parity.tiny_config("gemma4"), PROOF_WORLD, rows=modality.PACKED_ROWS)
    types, positions = images[2]["mm_token_type_ids"], images[2]["position_ids"]  # rank 2: ((1, 0), (0, 0))
    assert types[0, 1:5].tolist() == [1] * 4 and positions[0, 10] == 0 and not types[0, 10:].any()
    masks = modeling_gemma4.create_masks_for_vision_model(
        config=cfg, inputs_embeds=torch.zeros(*types.shape, 1), attention_mask=None, cache=None,
        position_ids=positions, block_sequence_ids=modeling_gemma4.get_block_sequence_ids_for_mask(types, "cpu"))
    sees = masks["sliding_attention"][0, 0] == 0  # eager: 0 where attended
    assert sees[1, 4] and sees[11, 12], sees  # the image both ways; the second document's text too
