"""``python -m adaptive_amp bench multi-gpu`` end to end on the CPU: two gloo processes under torch.distributed.run.

The suite is meant for two GPUs with NCCL; here it runs its CPU path (gloo,
a few steps, tiny overhead sizes) so that it is known to work before it meets
the GPUs, and its CPU checks must pass: ranks skip together, scales agree on
all ranks, ours == torch bitwise under DDP, and the FSDP2 checks where FSDP2
runs on gloo/CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import adaptive_amp

SUITE = ["-m", "adaptive_amp", "bench", "multi-gpu"]
PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(adaptive_amp.__file__)))

_dist_ok = torch.distributed.is_available() and torch.distributed.is_gloo_available()


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    if not _dist_ok:
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path_factory.mktemp("multi_gpu")
    env = dict(os.environ, PYTHONPATH=PKG_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *SUITE,
           "--backend", "gloo", "--device", "cpu", "--steps", "6", "--out", str(out), "--timeout", "120"]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the multi-gpu suite timed out after 180 s:\n{(exc.stdout or '')[-3000:]}\n{(exc.stderr or '')[-3000:]}")
    log = f"rc {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    path = out / "multi_gpu.json"
    assert path.exists(), log
    return {"rc": proc.returncode, "log": log, "json": json.loads(path.read_text()), "out": out}


def _checks(rep, section):
    return [c for c in rep["json"]["checks"] if c["section"] == section]


def _find(rep, section, name):
    found = [c for c in _checks(rep, section) if c["name"] == name]
    assert found, f"no check {section}: {name!r}\n{rep['log']}"
    return found[0]


def test_script_runs_and_writes_reports(report):
    assert report["rc"] == 0, report["log"]
    assert not report["json"]["errors"], report["json"]["errors"]
    assert (report["out"] / "multi_gpu.txt").exists()
    assert {"ddp", "single_vs_ddp", "fsdp2", "overhead"} <= set(report["json"]["sections"])
    text = (report["out"] / "multi_gpu.txt").read_text()
    assert "[checks]" in text and "PASS" in text


def test_ddp_checks_pass(report):
    for run in ("ours", "torch_ar", "ours_clip_torch", "torch_ar_clip_torch", "ours_clip_ours",
                "loss_inject_torch", "loss_inject_ours"):
        for name in ("ranks agree on every skip", "scales identical on all ranks",
                     "every injected step skipped on every rank"):
            c = _find(report, "ddp", f"{run}: {name}")
            assert c["passed"], c
    for label in ("ours vs torch+allreduce", "clip (unscale_ + clip_grad_norm_) ours vs torch+allreduce",
                  "loss inf: ours vs plain torch.amp.GradScaler"):
        for name in ("scale history identical", "same skipped steps", "parameters bitwise identical"):
            c = _find(report, "ddp", f"{label}: {name}")
            assert c["passed"], c
    failed = [c for c in _checks(report, "ddp") if not c["passed"] and not c["info"]]
    assert not failed, failed
    runs = report["json"]["sections"]["ddp"]["runs"]
    inject = report["json"]["meta"]["inject_steps"]
    assert inject and all(s in runs["ours"]["skips"][0] for s in inject)
    # The control shows the inf is rank-local: without a process group the ranks part ways.
    assert runs["control_ours_nopg"]["skips"][0] != runs["control_ours_nopg"]["skips"][1]


def test_fsdp2_checks_pass(report):
    sec = report["json"]["sections"]["fsdp2"]
    if sec.get("skipped"):
        pytest.skip(sec["skipped"])
    for run in ("ours", "sharded", "ours_clip_ours", "sharded_clip_torch"):
        for name in ("ranks agree on every skip", "scales identical on all ranks",
                     "every injected step skipped on every rank"):
            c = _find(report, "fsdp2", f"{run}: {name}")
            assert c["passed"], c
    c = _find(report, "fsdp2", "ours vs ShardedGradScaler: scale history identical")
    assert c["passed"], c
    failed = [c for c in _checks(report, "fsdp2") if not c["passed"] and not c["info"]]
    assert not failed, failed


def test_single_process_and_overhead_recorded(report):
    sv = report["json"]["sections"]["single_vs_ddp"]
    assert "single_final_loss" in sv and "ddp_final_loss_seed1" in sv
    rows = report["json"]["sections"]["overhead"]["rows"]
    assert len(rows) == 4
    assert all(set(r["ms"]) == {"plain", "torch", "torch+AR", "ours", "ours+AR"} for r in rows)


@pytest.mark.parametrize("suite", ["multi-gpu", "multi-gpu-integrations"])
def test_without_torchrun_it_says_how_to_launch(suite, capsys, monkeypatch, tmp_path):
    from adaptive_amp.bench import main

    monkeypatch.delenv("RANK", raising=False)
    assert main([suite, "--out", str(tmp_path)]) == 2
    assert "torchrun --standalone --nproc_per_node=2 -m adaptive_amp bench " + suite in capsys.readouterr().err
