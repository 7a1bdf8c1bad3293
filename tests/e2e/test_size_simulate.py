"""``xpar-zoo size --simulate``: the real code on one rank of a fake world (torch's fake process group, fake tensors,
torch's FSDP memory tracker) beside the analytic estimate, which agrees within 10 % on a tiny model on ep 8, a
mid-size one on 64 ranks (ep 16, planned slices sharded on dim 1) and a tiny DeepSeek-V3 (MLA: the simulation
runs a GPU's memory-efficient sdpa kernel, where the CPU's would keep the scores; a dense layer beside an MoE
one), a tiny gpt-oss (flex attention by its kernel's footprint, a gate autograd keeps), the emb and head plans
(their row counts fixed) and sp + cp (plain rows, a GPU's lower-right kernels); ``--route-imbalance`` makes the busiest rank's experts hold more. All simulations run in one process of their own (it owns the fake process group)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xpar_zoo.testing import parity

TINY_MOE = {"hidden_size": 256, "moe_intermediate_size": 128, "vocab_size": 2048, "num_experts": 8, "num_hidden_layers": 2}
MID_MOE = {"hidden_size": 1024, "moe_intermediate_size": 512, "vocab_size": 32000, "num_experts": 32, "num_hidden_layers": 4,
               "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64}
# DeepSeek's latent attention (query/key heads wider than the value heads), one dense layer then one MoE layer
TINY_MLA = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 64,
            "kv_lora_rank": 32, "qk_rope_head_dim": 16, "head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
            "n_routed_experts": 8, "moe_intermediate_size": 128, "intermediate_size": 512, "vocab_size": 2048,
            "first_k_dense_replace": 1, "max_position_embeddings": 2048}
# gpt-oss: flex attention with sinks (simulated by its kernel's footprint), a clamped GLU gate kept by autograd
TINY_OSS = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
            "num_local_experts": 8, "intermediate_size": 256, "vocab_size": 2048, "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 2048}
GLOO = ("tiny MoE, ep2 on 4", {"ep": 2}, 512)  # also run on 4 gloo ranks
CASES = {"mid MoE, ep16 on 64": ["qwen3_moe", MID_MOE, {"world": 64, "sizes": {"ep": 16}, "seq": 2048}],
         GLOO[0]: ["qwen3_moe", TINY_MOE, {"world": 4, "sizes": GLOO[1], "seq": GLOO[2]}],
         "tiny MoE, ep2 emb2 head2 on 4": ["qwen3_moe", TINY_MOE, {"world": 4, "sizes": {"ep": 2, "emb": 2, "head": 2},
                                                                    "seq": 256}],
         "tiny MoE, sp2 cp2 on 4": ["qwen3_moe", TINY_MOE, {"world": 4, "sizes": {"ep": 2}, "seq": 1024, "sp": 2,
                                                           "cp": 2}],
         "tiny MLA MoE, ep4 on 8": ["deepseek_v3", TINY_MLA, {"world": 8, "sizes": {"ep": 4}, "seq": 512}],
         "tiny gpt-oss, flex, ep4 on 8": ["gpt_oss", TINY_OSS, {"world": 8, "sizes": {"ep": 4}, "seq": 512,
                                                                 "attention": "flex_attention"}]}
SUPPORT = Path(__file__).resolve().parents[1] / "support" / "simulated_sizes.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model = tmp_path_factory.mktemp("tiny_moe")
    parity.tiny_config("qwen3_moe", **TINY_MOE).save_pretrained(model)
    common = ["size", str(model), "--world", "8", "--ep", "8", "--seq", "512", "--simulate"]
    request = {"cli": [common, [*common, "--json", "--route-imbalance", "2"]], "cases": list(CASES.values())}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SUPPORT.parents[1])}
    done = subprocess.run([sys.executable, str(SUPPORT), json.dumps(request)], check=False, capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_simulate_prints_the_simulated_peak_by_kind_beside_the_estimate(runs):
    text = runs["cli"][0]
    assert "memory per rank:" in text and "simulated on rank 0 of a fake 8-rank world" in text
    assert "routing simulated as balanced" in text
    for kind in ("parameters", "gradients", "optimizer states", "activations", "temporaries", "peak"):
        assert f"    {kind} " in text
    ratio = float(text.rsplit("estimated / simulated peak:", 1)[1].split()[0])
    assert 0.9 <= ratio <= 1.1, text


def test_simulate_json_has_both_peaks_and_says_how_routing_was_simulated(runs):
    out = json.loads(runs["cli"][1])
    est, sim = out["estimate"], out["simulated"]
    assert est["peak_bytes"] > 0 and set(sim["by_kind"]) == {"parameters", "gradients", "optimizer states",
                                                              "activations", "temporaries"}
    assert sim["peak_bytes"] >= sum(sim["by_kind"].values()) * 0.99
    assert "busiest, receiving 2x the mean tokens" in sim["routing"]
    assert sim["by_kind"]["optimizer states"] == pytest.approx(est["memory"]["optimizer states (adamw)"], rel=0.01)
    # the busiest rank holds twice the routed rows: more than the balanced run
    line = next(t for t in runs["cli"][0].splitlines() if t.startswith("    peak "))
    value, unit = line.split()[-2:]
    assert sim["peak_bytes"] > 1.05 * float(value) * {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


@pytest.mark.parametrize("case", list(CASES))
def test_estimate_is_within_10_percent_of_the_simulated_peak(runs, case):
    result = runs["cases"][list(CASES).index(case)]
    ratio = result["estimate"] / result["simulated"]["peak_bytes"]
    assert 0.9 <= ratio <= 1.1, (f"estimate {result['estimate'] / 2**20:.1f} MiB, simulated "
                                 f"{result['simulated']['peak_bytes'] / 2**20:.1f} MiB: {result['simulated']['by_kind']}")


def test_simulate_refuses_what_it_cannot_run_in_one_line(tmp_path, capsys):
    from xpar_zoo.commands import cli

    parity.tiny_config("qwen3_moe", **TINY_MOE).save_pretrained(tmp_path)
    common = ["size", str(tmp_path), "--world", "8", "--simulate"]
    for extra, said in ((["--suggest"], "--simulate runs one mesh"),
                        (["--ep", "8", "--dtype", "fp32"], "takes bf16 only"),
                        (["--ep", "8", "--route-imbalance", "0.5"], "at least the mean")):
        assert cli.main([*common, *extra]) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, err


def test_simulated_step_is_within_15_percent_of_what_4_gloo_ranks_hold(runs):
    """What a step adds to the sharded parameters and optimizer states (its peak above them), simulated and measured
    by the torch profiler on 4 gloo ranks (the busiest rank: real routing is not perfectly balanced)."""
    from support.simulated_sizes import measured_peak
    from xpar_zoo.testing import launch

    measured = max(launch.run(measured_peak, 4, TINY_MOE, GLOO[1], GLOO[2]))
    tracker = runs["cases"][list(CASES).index(GLOO[0])]["simulated"]["tracker"]
    simulated = tracker["Total"] - tracker["Sharded Param"] - tracker["OptState"]
    assert 0.85 * measured <= simulated <= 1.15 * measured, (
        f"simulated {simulated / 2**20:.2f} MiB, measured {measured / 2**20:.2f} MiB: {tracker}")
