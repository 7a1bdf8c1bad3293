"""What a checkpoint directory is, from its headers and metadata only (no tensor data): the format (hub per-expert,
hub fused, xpar_zoo DCP checkpoint or root of checkpoints, plain DCP), the architecture, the parameter count, the
dtypes, the shards, and for an xpar_zoo checkpoint its step, the mesh and plans it was saved with and whether it
is complete."""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

from xpar_zoo.checkpoint import (
    DCP_METADATA,
    META_FILE,
    MODEL_KEY,
    STEP_PREFIX,
    TMP_PREFIX,
    SafeReader,
    incomplete_reason,
    read_dcp_metadata,
    scan_root,
    step_of,
    verify_checkpoint,
)
from xpar_zoo.checkpoint.layout import run_checkpoint_root
from xpar_zoo.errors import ConvertError, XparError

HUB_PER_EXPERT = "hub per-expert"
HUB_FUSED = "hub fused"
XPAR_CHECKPOINT = "xpar_zoo DCP checkpoint"
XPAR_ROOT = "xpar_zoo DCP checkpoint root"
PLAIN_DCP = "plain DCP"
_EXPERT_KEY = re.compile(r"\.experts\.\d+\.")


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _hub_format(directory: Path, config, tensors) -> tuple[str, str | None]:
    """``(format, note)``: per-expert when transformers' conversion rules fuse any key, from a meta-device model."""
    try:
        import torch

        from xpar_zoo.hub.layout import map_hub_layout
        from xpar_zoo.zoo.registry import build_meta

        layout = map_hub_layout(build_meta(config, torch.float32), tensors)
        fused = any(t.rule != "key" for t in layout.targets.values())
        return (HUB_PER_EXPERT if fused else HUB_FUSED), None
    except Exception as e:  # an architecture transformers lacks, or a checkpoint that does not fit: say so
        per_expert = any(_EXPERT_KEY.search(k) for k in tensors)
        return (HUB_PER_EXPERT if per_expert else HUB_FUSED), f"does not load as is: {str(e).splitlines()[0]}"


def _inspect_hub(directory: Path) -> dict[str, Any]:
    from xpar_zoo.hub.safetensors_files import (
        DTYPE_SIZES,
        SAFETENSORS_DTYPES,
        read_checkpoint_headers,
    )

    def _dtype_name(code: str) -> str:  # torch's names, so that hub and DCP reports read alike
        return str(SAFETENSORS_DTYPES[code]).removeprefix("torch.") if code in SAFETENSORS_DTYPES else code

    from xpar_zoo.zoo.configs import load_config

    config = load_config(directory, ConvertError)
    tensors = read_checkpoint_headers(directory)
    fmt, note = _hub_format(directory, config, tensors)
    files: dict[str, dict[str, int]] = {}
    for info in tensors.values():
        entry = files.setdefault(info.file, {"tensors": 0, "bytes": (directory / info.file).stat().st_size})
        entry["tensors"] += 1
    out = {
        "format": fmt,
        "path": str(directory),
        "model_type": config.model_type,
        "architectures": getattr(config, "architectures", None),
        "parameters": sum(math.prod(t.shape) for t in tensors.values()),
        "tensors": len(tensors),
        "dtypes": dict(Counter(_dtype_name(t.dtype) for t in tensors.values()).most_common()),
        "tensor_bytes": sum(math.prod(t.shape) * DTYPE_SIZES.get(t.dtype, 1) for t in tensors.values()),
        "shards": [{"file": f, **files[f]} for f in sorted(files)],
    }
    if note:
        out["note"] = note
    export_info = directory / "xpar_export.json"
    if export_info.is_file():
        out["xpar_export"] = json.loads(export_info.read_text())
    return out


def _dcp_summary(directory: Path, model_only: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = read_dcp_metadata(SafeReader(str(directory)), directory)
    except XparError:
        raise
    except Exception as e:
        raise ConvertError(f"{directory}: unreadable DCP metadata ({type(e).__name__}: {e})") from None
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    model = {k: v for k, v in tensors.items() if k.startswith(f"{MODEL_KEY}.")}
    counted = model if model_only else tensors
    files: Counter = Counter(info.relative_path for info in metadata.storage_data.values())
    shards = []
    for f in sorted(files):
        path = directory / f
        shards.append({"file": f, "items": files[f], "bytes": path.stat().st_size if path.is_file() else None})
    return {
        "parameters": sum(math.prod(v.size) for v in counted.values()),
        "tensors": len(counted),
        "dtypes": dict(Counter(_dtype_name(v.properties.dtype) for v in counted.values()).most_common()),
        "tensor_bytes": sum(math.prod(v.size) * v.properties.dtype.itemsize for v in counted.values()),
        "other_tensors": len(tensors) - len(model) if model_only else 0,
        "shards": shards,
    }


def _inspect_step(directory: Path, verify: bool = False) -> dict[str, Any]:
    try:
        meta = json.loads((directory / META_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ConvertError(f"{directory / META_FILE}: unreadable ({e})") from None
    why = incomplete_reason(directory, step_of(directory))
    out = {"format": XPAR_CHECKPOINT, "path": str(directory), "model_type": meta.get("model_type"),
           "model_class": meta.get("model_class"), "step": meta.get("step"), "complete": why is None}
    if why:
        out["incomplete_reason"] = why
    out.update(_dcp_summary(directory, model_only=True))
    out.update({"mesh": meta.get("mesh"), "plans": {k: len(v) for k, v in (meta.get("plans") or {}).items()},
                "world_size": meta.get("world_size"), "optimizer": (meta.get("optimizer") or {}).get("class"),
                "xpar_zoo_version": meta.get("xpar_zoo_version"), "torch_version": meta.get("torch_version")})
    if meta.get("converted_from"):
        out["converted_from"] = meta["converted_from"]
    if verify and why is None:
        out["verify"] = _verify(directory)
    return out


def _verify(directory: Path) -> dict[str, Any]:
    result = verify_checkpoint(directory)
    return {"checksum": result["checksum"], "files": result["files"], "problems": result["problems"]}


def _inspect_root(directory: Path, verify: bool) -> dict[str, Any]:
    complete, broken = scan_root(directory)
    out: dict[str, Any] = {
        "format": XPAR_ROOT, "path": str(directory),
        "checkpoints": [{"dir": p.name, "step": s, **({"verify": _verify(p)} if verify else {})}
                        for s, p in complete],
        "incomplete": [{"dir": p.name, "reason": why} for p, why in broken],
    }
    if complete:
        latest = _inspect_step(complete[-1][1], verify)
        out["latest"] = latest
        for key in ("model_type", "parameters", "dtypes", "step", "mesh", "plans"):
            out[key] = latest.get(key)
    return out


def inspect_checkpoint(path: str | os.PathLike, *, verify: bool = False) -> dict[str, Any]:
    """Describe the checkpoint at ``path`` from headers and metadata only: ``format`` (one of ``hub per-expert``,
    ``hub fused``, ``xpar_zoo DCP checkpoint``, ``xpar_zoo DCP checkpoint root``, ``plain DCP``), ``model_type``,
    ``parameters`` (elements of the model tensors), ``dtypes`` (tensor counts), ``shards`` (files, sizes), and for
    xpar_zoo checkpoints the step, mesh, plans and completeness (a root lists its incomplete checkpoints).
    ``verify=True`` also reads every file of an xpar_zoo checkpoint (of every complete one under a root) and checks
    it against the checksums recorded at save: ``verify`` ``{"checksum", "files", "problems"}`` (see
    :func:`damage`)."""

    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ConvertError(f"{directory}: not a directory")
    if (directory / META_FILE).is_file():
        return _inspect_step(directory, verify)
    if verify and ((directory / DCP_METADATA).is_file() or (directory / "config.json").is_file()):
        raise ConvertError(f"{directory}: --verify checks xpar_zoo checkpoints (their COMPLETE marker records a "
                           "checksum per file); this is not one")
    if (directory / DCP_METADATA).is_file():
        return {"format": PLAIN_DCP, "path": str(directory), "model_type": None,
                **_dcp_summary(directory, model_only=False)}
    if (directory / "config.json").is_file():
        return _inspect_hub(directory)
    if any(c.is_dir() and c.name.startswith((STEP_PREFIX, TMP_PREFIX)) for c in directory.iterdir()):
        return _inspect_root(directory, verify)
    if run_checkpoint_root(directory) != directory:  # a training run directory: its checkpoints/
        return inspect_checkpoint(run_checkpoint_root(directory), verify=verify)
    raise ConvertError(f"{directory}: neither a hub checkpoint (no config.json), nor a DCP checkpoint (no "
                       f"{DCP_METADATA}), nor a root of xpar_zoo checkpoints (no {STEP_PREFIX}* directory)")


def damage(info: dict[str, Any]) -> list[str]:
    """The damaged files that ``inspect_checkpoint(..., verify=True)`` found, as ``"<dir>/<file>: why"`` lines."""
    rows = [(info, "")] if "verify" in info else []
    rows += [(c, f"{c['dir']}/") for c in info.get("checkpoints", []) if "verify" in c]
    return [f"{prefix}{problem}" for row, prefix in rows for problem in row["verify"]["problems"]]


def _verify_line(result: dict[str, Any]) -> str:
    if result["checksum"] is None:
        return "checksums: none recorded (saved before xpar_zoo recorded them): not verified"
    if result["problems"]:
        return f"checksums: DAMAGED: {'; '.join(result['problems'])}"
    return f"checksums: {result['files']} files intact ({result['checksum']})"


def format_report(info: dict[str, Any]) -> str:
    """``inspect_checkpoint``'s result as readable lines."""
    lines = [f"{info['path']}: {info['format']}"]
    if info.get("note"):
        lines.append(f"  note: {info['note']}")
    if info["format"] == XPAR_ROOT:
        lines.append(f"  complete checkpoints: {', '.join(c['dir'] for c in info['checkpoints']) or 'none'}")
        lines += [f"  {c['dir']} {_verify_line(c['verify'])}" for c in info["checkpoints"] if "verify" in c]
        for c in info["incomplete"]:
            lines.append(f"  INCOMPLETE {c['dir']}: {c['reason']}")
        if "latest" in info:
            lines.append("  latest:")
            lines += ["  " + line for line in format_report(info["latest"]).splitlines()]
        return "\n".join(lines)
    if info.get("model_type") or info.get("model_class"):
        lines.append(f"  architecture: {info.get('model_type')}"
                     + (f" ({info['model_class']})" if info.get("model_class") else "")
                     + (f" {info['architectures']}" if info.get("architectures") else ""))
    if "step" in info:
        state = "complete" if info["complete"] else f"INCOMPLETE ({info['incomplete_reason']})"
        lines.append(f"  step: {info['step']}, {state}")
        lines.append(f"  mesh: {json.dumps(info.get('mesh'))}, world size {info.get('world_size')}")
        lines.append(f"  plans: {', '.join(f'{k} ({n} tensors)' for k, n in info['plans'].items()) or 'none'}")
        lines.append(f"  optimizer state: {info.get('optimizer') or 'none'}")
        if "verify" in info:
            lines.append(f"  {_verify_line(info['verify'])}")
        if info.get("converted_from"):
            src = info["converted_from"]
            lines.append(f"  converted from: {src.get('source')} ({src.get('layout')})")
    lines.append(f"  parameters: {info['parameters']:,} in {info['tensors']} tensors, "
                 f"{info['tensor_bytes'] / 2**20:.2f} MiB")
    lines.append(f"  dtypes: {', '.join(f'{d} x{n}' for d, n in info['dtypes'].items())}")
    lines.append(f"  shards ({len(info['shards'])}):")
    for s in info["shards"]:
        size = "missing" if s.get("bytes") is None else f"{s['bytes']:,} bytes"
        lines.append(f"    {s['file']}  {size}")
    return "\n".join(lines)
