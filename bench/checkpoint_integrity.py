"""Checksum cost (issue 18, not a test): save and load time of an xpar_zoo checkpoint with and without its
per-file CRC-32s, side by side in one run (the two variants alternate, medians reported), plus the raw hashing
speed of the candidates. Prints a Markdown section for bench/RESULTS.md.

    python bench/checkpoint_integrity.py [--world 2] [--rounds 5] [--hidden 1024]

"Without" patches the checksums out of the save (the running CRC-32 of the written streams and the reading back of
the side files; the COMPLETE marker then records none) and loads with ``verify=False``; "with" is the default save
and ``load_checkpoint(..., verify=True)``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import os
import platform
import statistics
import tempfile
import time
import zlib

WORLD_DEFAULT = 2


def cpu_model() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def hash_speeds(mib: int = 256) -> dict[str, float]:
    """MiB/s of each candidate over one in-memory buffer."""
    data = os.urandom(mib << 20)
    speeds = {}
    for name, fn in (("zlib.crc32", lambda: zlib.crc32(data)), ("sha256", lambda: hashlib.sha256(data).digest()),
                     ("blake2b", lambda: hashlib.blake2b(data).digest()), ("md5", lambda: hashlib.md5(data).digest())):
        start = time.perf_counter()
        fn()
        speeds[name] = mib / (time.perf_counter() - start)
    return speeds


def _config(hidden: int):
    from xpar_zoo.testing import parity

    return parity.tiny_config("qwen3_moe", hidden_size=hidden, moe_intermediate_size=hidden, num_experts=16,
                              num_hidden_layers=4, vocab_size=32000, num_attention_heads=8, num_key_value_heads=4,
                              head_dim=128, intermediate_size=2 * hidden)


def _job(root: str, rounds: int, hidden: int) -> dict:
    import shutil
    from pathlib import Path

    import torch.distributed as dist

    import xpar_zoo
    from xpar_zoo import checkpoint
    from xpar_zoo.checkpoint import dcp_io, layout, save
    from xpar_zoo.testing import parity

    distributed = dist.is_initialized()
    model = parity.build_model(_config(hidden))
    if distributed:
        model = xpar_zoo.parallelize(model, xpar_zoo.Mesh(ep=dist.get_world_size()))
    real = (save.checksum_files, layout.file_checksum, dcp_io.RecordingStream)

    class Unhashed(dcp_io.RecordingStream):  # the stream without its running CRC-32
        def write(self, data):
            self._crc = None
            return self._recorded("write", data)

    def sync() -> None:
        if distributed:
            dist.barrier()

    def timed(fn) -> tuple[float, float]:
        """(wall seconds, CPU seconds of all ranks together: contention from other processes barely moves it)."""
        sync()
        start, cpu = time.perf_counter(), time.process_time()
        fn()
        cpu = time.process_time() - cpu
        sync()
        wall = time.perf_counter() - start
        if distributed:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, cpu)
            cpu = sum(every)
        return wall, cpu

    times: dict[str, list[tuple[float, float]]] = {k: [] for k in ("save_with", "save_without", "load_with",
                                                                   "load_without")}
    step, kept = 0, None
    for r in range(rounds + 1):  # round 0 warms up (imports, first allocations) and is not counted
        for with_sums in ((True, False) if r % 2 else (False, True)):
            step += 1
            if not with_sums:
                save.checksum_files, layout.file_checksum, dcp_io.RecordingStream = (
                    lambda d, names: {}), (lambda p: "-"), Unhashed
            seconds = timed(functools.partial(xpar_zoo.save_checkpoint, root, model, step=step, keep_last=2))
            save.checksum_files, layout.file_checksum, dcp_io.RecordingStream = real
            if r:
                times[f"save_{'with' if with_sums else 'without'}"].append(seconds)
            if with_sums:
                kept = Path(root) / checkpoint.checkpoint_name(step)
        for verify in ((True, False) if r % 2 else (False, True)):
            seconds = timed(functools.partial(xpar_zoo.load_checkpoint, kept, model, verify=verify))
            if r:
                times[f"load_{'with' if verify else 'without'}"].append(seconds)
    size = sum(f.stat().st_size for f in kept.rglob("*") if f.is_file())
    sync()
    verify = []  # the checksums alone: one process reading and hashing every file (inspect --verify)
    if not distributed or dist.get_rank() == 0:
        for _ in range(rounds):
            start = time.perf_counter()
            assert not checkpoint.verify_checkpoint(kept)["problems"]
            verify.append(time.perf_counter() - start)
        shutil.rmtree(root, ignore_errors=True)
    sync()
    def summary(rows: list[tuple[float, float]]) -> tuple[float, float, float]:  # median wall, best wall, CPU
        return (statistics.median(w for w, _ in rows), min(w for w, _ in rows), statistics.median(c for _, c in rows))

    return {"bytes": size, "verify": statistics.median(verify) if verify else None,
            **{k: summary(v) for k, v in times.items()}}


def _row(what: str, without: tuple[float, float, float], with_: tuple[float, float, float]) -> str:
    wall = f"{with_[0] / without[0]:.2f}× ({with_[0] - without[0]:+.2f} s)"
    cpu = f"{with_[2] - without[2]:+.2f} s"
    return (f"| {what} | {without[0]:.2f} s ({without[1]:.2f}), CPU {without[2]:.2f} s | {with_[0]:.2f} s "
            f"({with_[1]:.2f}), CPU {with_[2]:.2f} s | {wall}; CPU {cpu} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=WORLD_DEFAULT, help="gloo ranks (1: one process, no group)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=1024)
    args = ap.parse_args()
    import torch
    import transformers

    from xpar_zoo.testing import launch

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        root = os.path.join(tmp, "ckpt")
        if args.world == 1:
            result = _job(root, args.rounds, args.hidden)
        else:
            result = launch.run(_job, args.world, root, args.rounds, args.hidden, timeout_s=1800)
    speeds = hash_speeds()
    mib = result["bytes"] / 2**20
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"""
## Checkpoint checksums (issue 18)

- date: {when}; host: {platform.node()}, {cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__},
  transformers {transformers.__version__}, Python {platform.python_version()}
- checkpoint: qwen3_moe fp32, hidden {args.hidden}, 16 experts, 4 layers, vocab 32000: {mib:.0f} MiB of DCP
  (model only); {'one process' if args.world == 1 else f'{args.world} gloo ranks, Mesh(ep={args.world})'};
  page cache warm (a save checksums each data file as it writes it, the small side files by reading them
  back; a load verifies a share of the files on each rank); {args.rounds} alternating rounds after one warm-up

| | without checksums | with CRC-32 | cost (medians) |
|---|---|---|---|
{_row("`save_checkpoint`", result["save_without"], result["save_with"])}
{_row("`load_checkpoint` (`verify=False` / `True`)", result["load_without"], result["load_with"])}

- times: wall median (best) of the rounds, and the median CPU time of all ranks together; load average
  {os.getloadavg()[0]:.1f} at the end (other sessions share this host); `xpar-zoo convert inspect --verify` of the
  same checkpoint in one process
  (every file read and hashed): {result['verify']:.2f} s, {mib / result['verify']:,.0f} MiB/s
- hashing one 256 MiB buffer in memory: {', '.join(f'{k} {v:,.0f} MiB/s' for k, v in speeds.items())}
""")


if __name__ == "__main__":
    main()
