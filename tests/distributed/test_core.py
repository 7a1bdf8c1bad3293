"""Core: mixed precision under EP, and the embedding and the head as FSDP units of their own (4 gloo ranks). The
parity of every mesh with single-process transformers is tests/distributed/test_parity.py."""

from xpar_zoo.testing import launch, parity

WORLD = 4


def _mixed_precision_job() -> dict:
    """Mesh(ep=2) with bf16 parameters and fp32 reduction: one step's loss against the fp32 reference."""
    import torch.distributed as dist

    import xpar_zoo

    cfg = parity.tiny_config("qwen3_moe")
    data = parity.make_batches(cfg.vocab_size, 1, WORLD, seed=1)
    model = xpar_zoo.parallelize(parity.build_model(cfg), xpar_zoo.Mesh(ep=2), mixed_precision=True)
    ids = data[0, dist.get_rank()]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grad = model.model.layers[0].mlp.experts.gate_up_proj.grad
    dist.all_reduce(loss := loss.detach().float())
    ref = parity.train_reference(cfg, data, "sgd", None).losses[0] if dist.get_rank() == 0 else None
    return {"loss": loss.item() / WORLD, "ref": ref, "grad_dtype": str(grad.dtype),
            "param_dtype": str(model.model.layers[0].mlp.experts.gate_up_proj.dtype)}


def test_mixed_precision_bf16_params_fp32_reduce_trains_close_to_fp32():
    row = launch.run(_mixed_precision_job, WORLD)
    assert row["param_dtype"] == "torch.float32" and row["grad_dtype"] == "torch.float32"  # sharded fp32 masters
    assert abs(row["loss"] - row["ref"]) < 2e-2, row


def _edge_units_job() -> dict:
    """Mesh(ep=2): whether the embedding and head weights are sharded while layer 0 runs forward and when layer 1's
    backward starts; and which modules are FSDP units, untied and tied."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    import xpar_zoo

    cfg = parity.tiny_config("qwen3_moe")
    model = xpar_zoo.parallelize(parity.build_model(cfg), xpar_zoo.Mesh(ep=2))
    embed, head = model.model.embed_tokens, model.lm_head
    seen = {}

    def record(when):
        seen[when] = {"embed sharded": isinstance(embed.weight, DTensor), "head sharded": isinstance(head.weight, DTensor)}

    def at_backward(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden.register_hook(lambda grad: record("layer 1 backward"))

    model.model.layers[0].register_forward_pre_hook(lambda module, args: record("layer 0 forward"))
    model.model.layers[1].register_forward_hook(at_backward)
    ids = parity.make_batches(cfg.vocab_size, 1, WORLD, seed=1)[0, 0]
    model(input_ids=ids, labels=ids).loss.backward()
    tied = xpar_zoo.parallelize(parity.build_model(parity.tiny_config("qwen3_moe", tie_word_embeddings=True)),
                                xpar_zoo.Mesh(ep=2))
    seen["units"] = [isinstance(m, FSDPModule) for m in (embed, head)]
    seen["tied units"] = [isinstance(m, FSDPModule) for m in (tied.model.embed_tokens, tied.lm_head)]
    return seen


def test_embedding_and_head_are_gathered_only_around_their_own_use():
    """The embedding and the head are FSDP units of their own (untied): the embedding is resharded after its forward
    and the head is not gathered until the last layer runs, and is resharded after its backward — neither is held
    unsharded through the step as a root parameter. Tied, they stay the root's (one weight, one unit)."""
    seen = launch.run(_edge_units_job, WORLD)
    assert seen["units"] == [True, True] and seen["tied units"] == [False, False]
    assert seen["layer 0 forward"] == {"embed sharded": True, "head sharded": True}
    assert seen["layer 1 backward"] == {"embed sharded": True, "head sharded": True}
