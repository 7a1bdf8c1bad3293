"""Vocab parallelism (emb, head) beyond mesh parity (tests/distributed/test_parity.py): the head never builds full-vocab
logits, the loss honours ignore_index / num_items_in_batch / padding_idx and gives full logits on request, tied
embeddings are refused under vocab plans, models that change their logits keep transformers' loss, and activation
checkpointing trains exactly (4 gloo ranks, fp32)."""

import functools

import pytest
import torch

from xpar_zoo.testing import parity

WORLD = 4
EMB, HEAD = "model.embed_tokens.weight", "lm_head.weight"
TRACE_VOCAB = 200
PAD_ID = 70  # owned by the second rank of a size-2 vocab group (V = 128)


def _loss_backward(model, ids) -> None:
    model(input_ids=ids, labels=ids).loss.backward()


def _shapes_during(fn) -> list[tuple[int, ...]]:
    """Shapes of every plain tensor an op creates while ``fn`` runs (forward and backward)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.shapes += [tuple(t.shape) for t in tree_leaves(out)
                            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor)]
            return out

    with Record() as rec:
        fn()
    return rec.shapes


def _semantics(cfg) -> dict:
    """Labels with ignore_index, num_items_in_batch, padding_idx and full logits on Mesh(emb=2, head=2), per rank
    against single-process transformers on the same rank's data; one SGD step on the per-rank losses, each scaled
    by its rank + 1."""
    import torch.distributed as dist

    import xpar_zoo
    from xpar_zoo.styles.vocab import full_logits

    rank = dist.get_rank()
    ids = parity.make_batches(cfg.vocab_size, 1, WORLD, seed=3)[0]  # [world, batch, seq]
    ids[:, 0, -3:] = PAD_ID
    labels = ids.clone()
    labels[ids == PAD_ID] = -100
    labels[1, :, :5] = -100
    n_items = int((labels[..., 1:] != -100).sum())
    ref = parity.build_model(cfg, experts_implementation="eager")
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    model = xpar_zoo.parallelize(parity.build_model(cfg), xpar_zoo.Mesh(emb=2, head=2))
    row = {}
    # Evaluation first: in torch 2.13 a no_grad forward of the FSDP root drops the root group's pending grads.
    with torch.no_grad():
        summed = model(input_ids=ids[rank], labels=labels[rank], num_items_in_batch=n_items).loss.clone()
        dist.all_reduce(summed)
        with full_logits(model):
            logits = model(input_ids=ids[rank]).logits
    gathered = [torch.empty_like(logits) for _ in range(WORLD)]
    dist.all_gather(gathered, logits.contiguous())
    out = model(input_ids=ids[rank], labels=labels[rank])
    row["logits_none"] = out.logits is None
    # Each rank scales its loss differently (the head's exact recompute path); FSDP averages over the world,
    # scaled back below to the sum of the scaled per-rank losses.
    (out.loss * (rank + 1)).backward()
    mean = out.loss.detach().clone()
    dist.all_reduce(mean)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(WORLD)
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    params = xpar_zoo.full_state_dict(model)
    if rank == 0:
        with torch.no_grad():
            ref_sum = ref(input_ids=ids.flatten(0, 1), labels=labels.flatten(0, 1), num_items_in_batch=n_items).loss
            ref_logits = ref(input_ids=ids.flatten(0, 1)).logits
        # each rank's loss is its share of the global-batch mean: its targets' sum over N / world
        ref_losses = [ref(input_ids=ids[r], labels=labels[r], num_items_in_batch=n_items / WORLD).loss
                      for r in range(WORLD)]
        sum((r + 1) * loss for r, loss in enumerate(ref_losses)).backward()
        torch.optim.SGD(ref.parameters(), lr=1.0).step()
        row.update(mean=(mean.item(), sum(x.item() for x in ref_losses)), summed=(summed.item(), ref_sum.item()),
                   logits=(torch.cat(gathered) - ref_logits).abs().max().item(), logits_shape=tuple(logits.shape),
                   errors=parity.param_errors(params, {k: v.detach() for k, v in ref.state_dict().items()}, before),
                   pad_row_unchanged=bool(torch.equal(params[EMB][PAD_ID], before[EMB][PAD_ID])))
    return row


def _job() -> dict:
    import torch.distributed as dist

    import xpar_zoo
    from xpar_zoo.errors import PlanError

    rank = dist.get_rank()
    cfg = parity.tiny_config("qwen3_moe")
    results = {}
    # Allocation trace: every plain tensor created in forward + backward, with and without the head plan.
    # A vocabulary size (200) that no other dimension of the tiny model can produce by accident.
    ids = parity.make_batches(cfg.vocab_size, 1, WORLD, batch=3, seq=7, seed=4)[0, rank]  # 21 tokens per rank
    traced = parity.tiny_config("qwen3_moe", vocab_size=TRACE_VOCAB)
    from xpar_zoo.styles.vocab import install_fused_loss

    for name, mesh_kwargs, fused in [("traced_head", {"emb": 2, "head": 2}, True),
                                     ("traced_fused", {"emb": 2}, True), ("traced_plain", {"emb": 2}, False)]:
        model = parity.build_model(traced)
        if name == "traced_fused":  # the whole-vocab fused head, chosen before parallelize: 8 tokens' logits a chunk
            install_fused_loss(model, chunk_elements=8 * TRACE_VOCAB)
        model = xpar_zoo.parallelize(model, xpar_zoo.Mesh(**mesh_kwargs), fused_loss=fused)
        results[name] = _shapes_during(functools.partial(_loss_backward, model, ids))

    results["semantics"] = _semantics(parity.tiny_config("qwen3_moe", pad_token_id=PAD_ID))

    # Tied embeddings: refused with a clear error under a vocab plan; plain EP still trains them exactly.
    tied = parity.tiny_config("qwen3_moe", tie_word_embeddings=True)
    errors = {}
    for mesh_kwargs in ({"emb": 2}, {"head": 2}):
        try:
            xpar_zoo.parallelize(parity.build_model(tied), xpar_zoo.Mesh(**mesh_kwargs))
            errors[str(mesh_kwargs)] = None
        except PlanError as e:
            errors[str(mesh_kwargs)] = str(e)
    results["tied_errors"] = errors
    tied_before = parity.build_model(tied).state_dict()
    sgd_data = parity.make_batches(cfg.vocab_size, 1, WORLD, seed=1)
    ref_tied = parity.train_reference(tied, sgd_data, "sgd", None) if rank == 0 else None
    rec = parity.train_parallel(tied, sgd_data, {"ep": 2}, "sgd", None)
    if rank == 0:
        results["tied_ep2"] = {"loss": (rec.losses, ref_tied.losses),
                               "errors": parity.param_errors(rec.params, ref_tied.params, tied_before)}

    # A model that changes its logits before the loss (granitemoe divides them by logits_scaling): the head plan is
    # refused naming the line, and parallelize's default keeps transformers' loss for it, exactly.
    granite = parity.tiny_config("granitemoe", logits_scaling=2.0)
    try:
        xpar_zoo.parallelize(parity.build_model(granite), xpar_zoo.Mesh(head=2))
        results["granite_head_error"] = None
    except PlanError as e:
        results["granite_head_error"] = str(e)
    ref_granite = parity.train_reference(granite, sgd_data, "sgd", None) if rank == 0 else None
    rec = parity.train_parallel(granite, sgd_data, {"ep": 2}, "sgd", None)
    if rank == 0:
        results["granite_ep2"] = {"loss": (rec.losses, ref_granite.losses), "errors": parity.param_errors(
            rec.params, ref_granite.params, parity.build_model(granite).state_dict())}

    # transformers' activation checkpointing (every decoder layer recomputed in backward) on every plan at once (all
    # three vocab-side modules planned), and on ep2 alone (embedding and fused head as FSDP units of their own)
    ref_plain = parity.train_reference(cfg, sgd_data, "sgd", None) if rank == 0 else None
    plain_before = parity.build_model(cfg).state_dict()
    for name, mesh_kwargs in (("checkpointing", {"ep": 2, "emb": 2, "head": 2}), ("checkpointing_ep2", {"ep": 2})):
        rec = parity.train_parallel(cfg, sgd_data, mesh_kwargs, "sgd", None, checkpointing=True)
        if rank == 0:
            results[name] = {"loss": (rec.losses, ref_plain.losses),
                             "errors": parity.param_errors(rec.params, ref_plain.params, plain_before)}
    return results


def zoo_job(tmp_path_factory) -> tuple:
    """This module's job in the zoo's one 4-rank run (``zoo_proofs`` in tests/conftest.py), which runs beside the
    other tests."""
    return _job, ()


@pytest.fixture(scope="module")
def results(zoo_proofs):
    return zoo_proofs[__name__]


def test_head_plan_never_allocates_full_vocab_logits(results):
    vocab, tokens = TRACE_VOCAB, 21

    def logits_like(shape):  # [..., V] or a V dimension beside the rank's or the group's token count
        return bool(shape) and (shape[-1] == vocab or (vocab in shape and {tokens, 2 * tokens} & set(shape)))

    seen = [s for s in results["traced_head"] if logits_like(s)]
    assert not seen, f"full-vocab logits-like tensors under the head plan: {seen[:5]}"
    # The whole-vocab fused head holds at most a chunk's (8 tokens') logits.
    hidden = parity.tiny_config("qwen3_moe").hidden_size
    chunks = [s for s in results["traced_fused"] if s and s[-1] == vocab and s != (hidden, vocab)]  # not weight.t()
    assert chunks and all(len(s) == 2 and s[0] <= 8 for s in chunks), chunks[:5]
    # The tracer does see them with transformers' loss (fused_loss=False): [3, 7, V] logits.
    assert (3, 7, vocab) in results["traced_plain"]


def test_a_model_that_changes_its_logits_keeps_transformers_loss_and_refuses_the_head_plan(results):
    message = results["granite_head_error"]
    assert message and "logits = logits / self.config.logits_scaling" in message, message
    row = results["granite_ep2"]
    parity.assert_losses_match(*row["loss"], what="granitemoe (logits_scaling=2) on ep2")
    parity.assert_params_match(row["errors"], what="granitemoe (logits_scaling=2) on ep2, one SGD step:")


@pytest.mark.parametrize("key,mesh", [("checkpointing", "ep2+emb2+head2"), ("checkpointing_ep2", "ep2")])
def test_activation_checkpointing_trains_exactly_on_every_plan(results, key, mesh):
    row = results[key]
    parity.assert_losses_match(*row["loss"], what=f"activation checkpointing on {mesh}")
    parity.assert_params_match(row["errors"], what=f"activation checkpointing on {mesh}, one SGD step:")


def test_loss_semantics_ignore_index_num_items_padding_and_full_logits(results):
    row = results["semantics"]
    assert row["logits_none"], "out.logits must be None unless full_logits() is asked for"
    assert abs(row["mean"][0] - row["mean"][1]) < parity.LOSS_TOL * 4
    assert abs(row["summed"][0] / WORLD - row["summed"][1]) < parity.LOSS_TOL  # the mean over ranks: global
    assert row["logits_shape"] == (2, 8, 128)
    assert row["logits"] < 1e-5
    worst = max(row["errors"].items(), key=lambda kv: kv[1])
    assert worst[1] < parity.PARAM_REL_TOL, f"{worst[0]}: relative error {worst[1]:.2e}"
    assert row["pad_row_unchanged"], "padding_idx row must get no gradient"


def test_tied_embeddings_refused_under_vocab_plans_with_a_clear_error(results):
    for mesh, message in results["tied_errors"].items():
        assert message is not None, f"{mesh}: tied embeddings were silently split"
        assert "tied" in message and "lm_head.weight" in message and "model.embed_tokens.weight" in message


def test_tied_embeddings_train_exactly_without_vocab_plans(results):
    row = results["tied_ep2"]
    (par,), (ref,) = row["loss"]
    assert abs(par - ref) < parity.LOSS_TOL
    worst = max(row["errors"].items(), key=lambda kv: kv[1])
    assert worst[1] < parity.PARAM_REL_TOL, f"{worst[0]}: relative error {worst[1]:.2e}"
