"""The bench's wording: one direction for ratios, noise stated as such, ceilings above 100% flagged."""

from __future__ import annotations

from adaptive_amp.bench.kernels import Row, format_table, speedups, sround_summary, time_ratio

TORCH = "torch _amp_foreach_non_finite_check_and_unscale_"


def test_ratios_read_one_way():
    slower = time_ratio(Row("many", "ours", "graph", 1.03, 0, 0.0, None), Row("many", "t", "graph", 1.0, 0, 0.0, None),
                        "torch")
    assert slower == "1.03x torch's time" and "faster" not in slower
    lines = speedups([Row("gpt2", TORCH, "graph", 1.0, 1, 1.0, 0.5), Row("gpt2", "adaptive_amp unscale", "graph", 0.8,
                                                                        1, 1.0, 0.6)])
    assert lines == ["gpt2 graph: adaptive_amp unscale: 0.80x torch's time"]


def test_a_gap_inside_the_spread_is_no_measurable_difference():
    ours = Row("many", "adaptive_amp unscale", "cpu", 10.29, 1, 1.0, 0.2, spread_ms=0.3)
    base = Row("many", TORCH, "cpu", 10.11, 1, 1.0, 0.2, spread_ms=0.2)
    assert time_ratio(ours, base, "torch").startswith("no measurable difference from torch (10.290 +- 0.300 ms")
    far = Row("many", "adaptive_amp unscale", "cpu", 20.0, 1, 1.0, 0.2, spread_ms=0.3)
    assert time_ratio(far, base, "torch") == "1.98x torch's time"


def test_ceiling_above_100_percent_is_flagged_and_cpu_ceiling_explained():
    table = format_table([Row("ceiling", "host copy (read+write)", "cpu", 16.0, 1, 33.5, 1.0),
                          Row("many", TORCH, "cpu", 1.3, 1, 50.3, 1.499)])
    assert "149.9%*" in table and "* above the ceiling measured in the same run" in table
    assert "on the CPU 'of ceiling' is a reference, not a bound" in table
    gpu = format_table([Row("ceiling", "device copy", "graph", 1.0, 1, 4000.0, 1.0)])
    assert "*" not in gpu and "cpu rows" not in gpu


def test_gpu_targets_only_on_gpu_rows():
    def rows(mode):
        return [Row("sround", "adaptive_amp stochastic_round -> bf16", mode, 0.4, 1, 1.0, 0.95),
                Row("sround", "torch .to(dtype) (round to nearest) -> bf16", mode, 0.38, 1, 1.0, 0.99)]

    assert "target" not in " ".join(sround_summary(rows("cpu")))
    assert "(target <= 1.25x)" in " ".join(sround_summary(rows("graph")))


def test_optim_rows_keep_their_kind_and_memory():
    # The optim suite built its rows positionally; when Row gained spread_ms, every field from kind on landed one
    # off and the suite failed on the GPU ('int' object has no attribute 'split').
    from adaptive_amp.bench.optim import OptimRow, format_optim, optim_row

    row = optim_row("adaptive_amp.optim.AdamW bf16, fp32 moments, SR", "adamw_bf16_m32", (0.5, 0.6, 0.4), 20,
                    numel=1000, copy_gbps=1.0)
    assert row.kind == "adamw_bf16_m32" and row.spread_ms is None
    assert (row.bytes_per_param, row.bytes_per_param_with_grad) == (10, 12)
    assert (row.gpu_ms, row.wall_ms, row.host_ms, row.steps_per_round) == (0.5, 0.6, 0.4, 20)
    assert row.bytes_moved == 22 * 1000
    assert "adaptive_amp.optim.AdamW" in format_optim([row])
    assert isinstance(OptimRow("optim", "x", "eager", 1.0, 1, 1.0, 1.0, kind="copy").kind, str)


# ---- the command line: every suite is one of python -m adaptive_amp bench


def test_help_names_every_suite_and_how_to_launch_the_multi_gpu_ones(capsys):
    import pytest

    from adaptive_amp.bench import main
    from adaptive_amp.bench.cli import COMMANDS

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for suite in ("gpt2", "many", "sround", "optim", "e2e", *COMMANDS):
        assert f"\n  {suite} " in text or f"\n  {suite}\n" in text, suite
    assert "torchrun --standalone --nproc_per_node=2 -m adaptive_amp bench multi-gpu" in text


def test_each_suite_command_has_its_own_help(capsys):
    import pytest

    from adaptive_amp.bench import main
    from adaptive_amp.bench.cli import COMMANDS

    for suite in COMMANDS:
        with pytest.raises(SystemExit) as exit_info:
            main([suite, "--help"])
        assert exit_info.value.code == 0
        assert f"adaptive_amp bench {suite}" in capsys.readouterr().out


def test_suites_option_refuses_unknown_names_and_runs_a_command_suite_alone(capsys):
    import pytest

    from adaptive_amp.bench import main

    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--suites", "gpt2,warp"])
    assert "unknown suite(s) 'warp'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--suites", "tune,gpt2"])
    assert "tune runs alone" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--suites", "many", "--layers", "2"])
    assert "unrecognized arguments: --layers 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --suites scale hands its options to the suite, which checks them
        main(["--suites", "scale", "--tiny", "--device", "cpu", "--layers", "0"])
    assert "--layers" in capsys.readouterr().err
    for suite in ("tune", "scale"):  # a command suite's own help, and its own options
        with pytest.raises(SystemExit):
            main(["--suites", suite, "--help"])
        assert f"python -m adaptive_amp bench {suite}" in capsys.readouterr().out
