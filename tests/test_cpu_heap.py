"""Free heap handed back to the OS before each training forward on CPU (xpar_zoo.cpu_heap, issue 23)."""

import torch
from torch import nn

import xpar_zoo
from xpar_zoo.cpu_heap import malloc_trim, release_heap_before_training_forward
from xpar_zoo.testing import parity

MB = 1024 * 1024


def _rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _counting(model: nn.Module) -> list:
    calls = []
    release_heap_before_training_forward(model, trim=lambda pad: calls.append(pad) or 1)
    return calls


def test_trims_before_training_forwards_only():
    model = nn.Linear(4, 4)
    calls = _counting(model)
    x = torch.ones(2, 4)
    model(x)
    assert calls == [0]
    with torch.no_grad():  # evaluation and generation run without gradients: many small forwards, no trim
        model(x)
    model.eval()
    model(x)
    assert calls == [0]
    model.train()
    model(x)
    assert calls == [0, 0]


def test_not_for_parameters_off_the_cpu():
    model = nn.Linear(4, 4, device="meta")
    calls = _counting(model)
    model(torch.ones(2, 4, device="meta"))
    assert calls == []


def test_parallelize_installs_it_and_it_can_be_turned_off(monkeypatch):
    calls = []
    monkeypatch.setattr("xpar_zoo.cpu_heap.malloc_trim", lambda: lambda pad: calls.append(pad) or 1)
    cfg = parity.tiny_config("qwen3_moe")
    ids = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    for release, expected in ((True, [0]), (False, [])):
        calls.clear()
        model = xpar_zoo.parallelize(parity.build_model(cfg), xpar_zoo.Mesh(), release_cpu_heap=release).train()
        model(input_ids=ids, labels=ids).loss.backward()
        assert calls == expected, release


def test_the_free_heap_goes_back_to_the_os():
    """Real glibc: holes left in the heap by freed blocks stay resident until the next training forward trims them."""
    assert malloc_trim() is not None  # this suite runs on glibc
    model = nn.Linear(4, 4)
    release_heap_before_training_forward(model)
    blocks = [torch.ones(16 * 1024) for _ in range(2048)]  # 64 KiB each (below any mmap threshold): 128 MiB of heap
    del blocks[::2]  # 64 MiB of holes between live blocks: free() cannot return them
    before = _rss()
    model(torch.ones(2, 4))
    released = before - _rss()
    del blocks
    assert released > 32 * MB, f"{released / MB:.1f} MiB released"
