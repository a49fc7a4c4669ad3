"""``python -m adaptive_amp bench multi-gpu-integrations`` on the CPU: two gloo processes under torch.distributed.run.

The suite is meant for GPUs with NCCL; its CPU path is the CI check that
the controller's decisions are collective under DDP and FSDP2 (torch's, Lightning's
and Accelerate's): a layer that overflows on one rank alone is promoted on
every rank at the same step, skips, scales and clip norms agree, nothing hangs,
and resumed runs (the controller's own state_dict, Accelerate's
save_state/load_state) end bitwise where the straight ones did. About 30 s:
two processes that each import transformers, Lightning and Accelerate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import adaptive_amp

pytest.importorskip("transformers")
pytest.importorskip("pytorch_lightning")
pytest.importorskip("accelerate")

SUITE = ["-m", "adaptive_amp", "bench", "multi-gpu-integrations"]
SECTIONS = ["controller", "resume", "fsdp2", "lightning", "lightning_fsdp2", "accelerate", "accelerate_fsdp2"]
PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(adaptive_amp.__file__)))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path_factory.mktemp("multi_gpu_integrations")
    env = dict(os.environ, PYTHONPATH=PKG_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *SUITE,
           "--backend", "gloo", "--device", "cpu", "--out", str(out), "--timeout", "120"]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the script hung (300 s):\n{(exc.stdout or '')[-3000:]}\n{(exc.stderr or '')[-3000:]}")
    log = f"rc {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"
    path = out / "multi_gpu_integrations.json"
    assert path.exists(), log
    return {"rc": proc.returncode, "log": log, "json": json.loads(path.read_text())}


def test_every_section_ran(report):
    assert not report["json"]["errors"], report["json"]["errors"]
    sections = {c["section"] for c in report["json"]["checks"]}
    assert sections == set(SECTIONS), report["log"]


@pytest.mark.parametrize("section", SECTIONS)
def test_section_checks_pass(report, section):
    checks = [c for c in report["json"]["checks"] if c["section"] == section]
    assert checks, report["log"]
    failed = [c for c in checks if not c["passed"]]
    assert not failed, failed


def test_accelerate_fsdp2_is_accelerates_fsdp_strategy(report):
    """On the CPU Accelerate never picks FSDP by itself (only on accelerators), so the script sets its
    distributed type and says so; the rest is Accelerate's FSDP2 code: sharded DTensor parameters, its
    prepare, save_state and load_state. (On GPUs the script checks that Accelerate picked FSDP itself.)"""
    facts = report["json"]["facts"]
    assert facts["accelerate_fsdp2_forced_fsdp"] is True
    assert all(r["distributed_type"] == "FSDP" for r in facts["accelerate_fsdp2"])
    names = {c["name"] for c in report["json"]["checks"] if c["section"] == "accelerate_fsdp2"}
    assert "Accelerate sharded the parameters (DTensors)" in names
    assert any(n.startswith("resumed through save_state/load_state") for n in names)


def test_decisions_really_were_collective(report):
    """The control run (each rank deciding alone) split, so the agreement above is the collective's doing;
    and the collective run promoted at the same step on both ranks."""
    facts = report["json"]["facts"]
    control = facts["control"]
    assert control[0]["policy_history"] != control[1]["policy_history"]
    ranks = facts["controller"]
    assert ranks[0]["policy_history"] == ranks[1]["policy_history"]
    assert len(ranks[0]["policy_history"]) >= 2 and "islands=lm_head" in ranks[0]["policy_history"][1][1]
    assert report["rc"] == 0, report["log"]
