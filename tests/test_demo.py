"""``python -m adaptive_amp demo`` end to end on the CPU, shortened (the full CPU demo takes minutes)."""

from __future__ import annotations

import json

from adaptive_amp.demo import main


def test_demo_runs_and_writes_its_table_reports_and_checks(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["--device", "cpu", "--steps", "12", "--timing-rounds", "1", "--out", str(out),
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "demo.json").read_text())
    runs = {(r["scenario"], r["recipe"]): r for r in result["results"]}
    assert set(runs) == {(s, r) for s in ("ordinary", "planted") for r in ("fp32", "torch_amp", "adaptive")}
    # The planted layer overflows in fp16 from the first step: torch AMP skips every step; adaptive_amp promotes
    # the layer at its first read (step 10 on the CPU configuration) and trains from there.
    assert runs["planted", "torch_amp"]["skipped_steps"] == 12
    planted = runs["planted", "adaptive"]
    assert planted["skipped_steps"] == 10 and "islands=inp" in planted["policy"]
    assert any(e["kind"] == "promote" and e["layer"] == "inp" for e in planted["events"])
    assert all(r["step_ms"] > 0 for r in runs.values())
    assert "planted: adaptive_amp final loss" in printed and "scenario" in printed
    assert (out / "demo.txt").read_text().startswith("scenario")
    for scenario in ("ordinary", "planted"):
        assert (out / f"report_{scenario}" / "report.txt").exists()
        assert (out / f"report_{scenario}" / "report.json").exists()
