"""torch's own HF storage against xpar_zoo's hand-written paths (issue 29, not a test), on bench/export.py's ≈ 1 GB
qwen3_moe checkpoint. Each variant runs in a fresh interpreter (page cache warm), the sides interleaved, ``--rounds``
times; time of the call and peak RSS growth over the imports. The figures go to bench/RESULTS.md and docs/design.md
by hand ("torch's HF storage").

- export (DCP → hub files): ``ours`` = ``xpar-zoo convert to-hf`` (:class:`xpar_zoo.hub.writer.HubWriter`: a shard
  planned on meta tensors, tensors streamed into place); ``torch`` = the full model state read from the DCP
  checkpoint, reverted to the hub keys by transformers, and written by ``dcp.save`` through
  ``torch.distributed.checkpoint.HuggingFaceStorageWriter`` with our shard assignment (``fqn_to_index_mapping``).
  Compared: every output file byte for byte, and every tensor.
- to-dcp (hub files → DCP): ``ours`` = ``convert_to_dcp`` (batches written by several ``dcp.save`` calls, their
  pickled ``Metadata`` merged by hand); ``lazy`` = one ``dcp.save`` whose planner assembles each batch when the writer
  first asks for one of its tensors (:func:`lazy_to_dcp`, here only). Compared: every tensor read back.

    python bench/hf_storage.py [--rounds 2] [--shard 200MB] [--keep DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

_RUN = """
import json, resource, sys, time
sys.path.insert(0, {here!r})
import hf_storage
hf_storage.imports()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t0 = time.perf_counter()
hf_storage.{fn}(*{args!r})
T = time.perf_counter() - t0
print("RESULT", json.dumps({{"s": T, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base}}))
"""


def imports() -> None:
    """What every variant imports before it is measured."""
    import torch.distributed.checkpoint  # noqa: F401
    import transformers.core_model_loading  # noqa: F401
    from xpar_zoo.converters import export, to_dcp  # noqa: F401

    import xpar_zoo.checkpoint  # noqa: F401
    from xpar_zoo import loader  # noqa: F401
    from xpar_zoo.hub import writer  # noqa: F401


def ours_export(ckpt: str, out: str, shard: str) -> None:
    from xpar_zoo.converters.export import export_to_hf

    export_to_hf(ckpt, out, max_shard_size=shard, progress=False)


def torch_export(ckpt: str, out: str, shard: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from xpar_zoo.converters.export import _config_from

    from xpar_zoo.checkpoint import (
        iter_model_tensors,
        model_tensor_specs,
        read_checkpoint_metadata,
        resolve_checkpoint,
    )
    from xpar_zoo.checkpoint.dcp_io import quiet_single_process
    from xpar_zoo.hub.writer import HubWriter, parse_size, revert_to_hub
    from xpar_zoo.loader import build_meta

    step = resolve_checkpoint(ckpt)
    config = _config_from(read_checkpoint_metadata(step), None)
    meta_model = build_meta(config, torch.float32)
    plan = HubWriter(meta_model, config, model_tensor_specs(step), max_shard_bytes=parse_size(shard))
    state = dict(iter_model_tensors(step, plan.names))  # the writer takes a whole state dict
    hub = revert_to_hub(meta_model, state)
    del state
    mapping = {key: i for i, entries in enumerate(plan.files.values(), 1) for key, _, _ in entries}
    Path(out).mkdir(parents=True)
    with quiet_single_process():
        dcp.save(hub, storage_writer=HuggingFaceStorageWriter(out, fqn_to_index_mapping=mapping), no_dist=True)
    config.save_pretrained(out)


def ours_to_dcp(hub: str, out: str) -> None:
    from xpar_zoo.converters.to_dcp import convert_to_dcp

    convert_to_dcp(hub, out, progress=False)


def lazy_to_dcp(hub: str, out: str, max_bytes: int = 1 << 30) -> None:
    """``convert_to_dcp`` with one ``dcp.save`` and a lazy planner instead of several saves whose metadata are merged:
    the same steps (hub layout, staging directory, metadata, COMPLETE marker) around a different write."""
    import json

    import torch
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.planner import WriteItemType
    from xpar_zoo.converters import to_dcp

    from xpar_zoo.checkpoint import (
        EXTRA_FILE,
        META_FILE,
        MODEL_KEY,
        checkpoint_name,
        write_complete_marker,
    )
    from xpar_zoo.checkpoint.dcp_io import quiet_single_process
    from xpar_zoo.checkpoint.state import metadata_record
    from xpar_zoo.errors import ConvertError
    from xpar_zoo.hub.safetensors_files import SAFETENSORS_DTYPES
    from xpar_zoo.io.atomic_dir import StagingDir, durable_write
    from xpar_zoo.io.batching import byte_batches
    from xpar_zoo.loader import open_hub_checkpoint

    class LazyPlanner(DefaultSavePlanner):
        """Planned on meta tensors; each tensor's data assembled when the writer asks for it, a batch at a time."""

        def __init__(self, produce) -> None:
            super().__init__()
            self.produce = produce

        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            return self.produce(write_item.index.fqn.removeprefix(f"{MODEL_KEY}."))

    hub_ckpt = open_hub_checkpoint(hub, None)
    directory, model, layout = hub_ckpt.directory, hub_ckpt.model, hub_ckpt.layout
    state_names = list(model.state_dict(keep_vars=True))
    buffers = to_dcp._init_buffers(model, layout.init_buffers) if layout.init_buffers else {}
    sizes = {n: sum(p.source.nbytes for p in layout.targets[n].pieces) for n in state_names if n in layout.targets}
    canonical = {a: c for a, c in layout.aliases.items() if a in state_names}
    specs = {n: (tuple(layout.targets[n].shape), SAFETENSORS_DTYPES[layout.targets[n].pieces[0].source.dtype])
             for n in sizes}
    specs.update({n: (tuple(t.shape), t.dtype) for n, t in buffers.items()})
    specs.update({a: specs[c] for a, c in canonical.items()})
    batches = byte_batches(sizes.items(), max_bytes)
    batch_of = {n: k for k, batch in enumerate(batches) for n in batch}
    held: dict = {"k": None, "tensors": {}}

    def produce(name: str) -> torch.Tensor:
        if name in buffers:
            return buffers[name]
        name = canonical.get(name, name)
        k = batch_of[name]
        if held["k"] != k:
            held["tensors"], files = {}, to_dcp._Files(directory)
            try:
                held["tensors"] = {n: to_dcp.assemble(layout, n, files) for n in batches[k]}
            finally:
                files.close()
            held["k"] = k
        return held["tensors"][name]

    placeholders = {n: torch.empty(specs[n][0], dtype=specs[n][1], device="meta") for n in state_names}
    with StagingDir(Path(out), ConvertError) as tmp:
        ckpt = tmp / checkpoint_name(0)
        ckpt.mkdir(parents=True)
        with quiet_single_process():
            dcp_save({MODEL_KEY: placeholders}, storage_writer=FileSystemWriter(str(ckpt), sync_files=True),
                     planner=LazyPlanner(produce), no_dist=True)
        meta = metadata_record(model, 0, None, {}, None)
        meta.update(world_size=None)
        durable_write(ckpt / META_FILE, json.dumps(meta, indent=1).encode())
        durable_write(ckpt / EXTRA_FILE, json.dumps({}).encode())
        write_complete_marker(ckpt, 0)


def _measure(fn: str, *args) -> dict:
    code = _RUN.format(here=str(HERE), fn=fn, args=args)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"OMP_NUM_THREADS": "1", **__import__("os").environ}).stdout
    return json.loads([x for x in out.splitlines() if x.startswith("RESULT")][-1].split(" ", 1)[1])


def _digests(directory: Path, pattern: str) -> dict:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(directory.glob(pattern))}


def _hub_tensors_equal(a: Path, b: Path) -> list[str]:
    import torch
    from safetensors.torch import load_file

    ta = {k: v for f in sorted(a.glob("*.safetensors")) for k, v in load_file(f).items()}
    tb = {k: v for f in sorted(b.glob("*.safetensors")) for k, v in load_file(f).items()}
    return sorted(k for k in ta.keys() | tb.keys() if k not in ta or k not in tb or not torch.equal(ta[k], tb[k]))


def _dcp_tensors_equal(a: Path, b: Path) -> list[str]:
    import torch

    from xpar_zoo.checkpoint import (
        iter_model_tensors,
        model_tensor_specs,
        resolve_checkpoint,
    )

    sa, sb = resolve_checkpoint(a), resolve_checkpoint(b)
    if set(model_tensor_specs(sa)) != set(model_tensor_specs(sb)):
        return ["(different keys)"]
    names = sorted(model_tensor_specs(sa))
    ta, tb = dict(iter_model_tensors(sa, names)), dict(iter_model_tensors(sb, names))
    return sorted(n for n in names if not torch.equal(ta[n], tb[n]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shard", default="200MB")
    ap.add_argument("--keep", help="work directory to keep (default: a temporary one)")
    ap.add_argument("--only", choices=("export", "to-dcp"))
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from export import _make_checkpoint

    from xpar_zoo.testing import launch

    work = Path(args.keep or tempfile.mkdtemp(prefix="xpar-hf-storage-bench-"))
    ckpt = work / "ckpt"
    if not ckpt.exists():
        launch.run(_make_checkpoint, 1, str(ckpt))
    results: dict = {"export": {"ours": [], "torch": []}, "to-dcp": {"ours": [], "lazy": []}}
    for r in range(args.rounds):
        for side in (("ours", "torch") if r % 2 == 0 else ("torch", "ours")):
            if args.only in (None, "export"):
                shutil.rmtree(work / f"hub-{side}", ignore_errors=True)
                results["export"][side].append(_measure(f"{side}_export", str(ckpt), str(work / f"hub-{side}"),
                                                        args.shard))
        for side in (("ours", "lazy") if r % 2 == 0 else ("lazy", "ours")):
            if args.only in (None, "to-dcp") and (work / "hub-ours").exists():
                shutil.rmtree(work / f"dcp-{side}", ignore_errors=True)
                results["to-dcp"][side].append(_measure(f"{side}_to_dcp", str(work / "hub-ours"),
                                                        str(work / f"dcp-{side}")))
    checks = {}
    if (work / "hub-torch").exists():
        ours, theirs = _digests(work / "hub-ours", "*.safetensors"), _digests(work / "hub-torch", "*.safetensors")
        checks["export files"] = sorted(ours) == sorted(theirs)
        checks["export files bit-identical"] = ours == theirs
        checks["export tensors differing"] = _hub_tensors_equal(work / "hub-ours", work / "hub-torch")
        checks["export index identical"] = ((work / "hub-ours" / "model.safetensors.index.json").read_text()
                                            == (work / "hub-torch" / "model.safetensors.index.json").read_text())
    if (work / "dcp-lazy").exists():
        checks["to-dcp tensors differing"] = _dcp_tensors_equal(work / "dcp-ours", work / "dcp-lazy")
    nbytes = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    print(json.dumps({"checkpoint_MiB": round(nbytes / 2**20), "results": results, "checks": checks}, indent=1))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
