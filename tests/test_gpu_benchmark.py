"""benchmarks/gpu.py at smoke sizes on the CPU: every part runs and reports sane ratios."""
import math
import re

import pytest

gpu = pytest.importorskip("benchmarks.gpu")  # (benchmarks/ is a folder of scripts, not installed)

TINY = dict(gpu.SMOKE, images=4, batch=2, backbones=(("efficientnet_lite0", 32, True),))


def ratios(rows: list[str]) -> list[float]:
    return [float(row.rstrip(" |").rsplit("|", 1)[1]) for row in rows]


def test_extraction_rows_compare_with_the_bare_forward():
    rows = gpu.extraction_rows(TINY, "cpu", repeats=1)
    assert [re.split(r"\s*\|\s*", row)[3] for row in rows] == ["float32", "bf16"]
    assert all(0 < r and math.isfinite(r) for r in ratios(rows))


def test_every_method_part_runs_at_smoke_sizes():
    lines = gpu.main(["--device", "cpu", "--smoke", "--parts", "afl,deepafl,fedavg"])
    rows = [line for line in lines if line.startswith(("| AFL", "| DeepAFL", "| FedAvg"))]
    assert len(rows) == 3
    cells = [[cell.strip() for cell in row.strip(" |").split("|")] for row in rows]
    assert all(float(row[4]) > 0 and math.isfinite(float(row[4])) for row in cells)  # fit / bare
    assert [row[5] for row in cells] == ["—"] * 3  # host syncs are counted on CUDA only
    assert lines[-1].startswith("Machine:")


def test_bad_settings_fail_with_the_fix(capsys):
    with pytest.raises(SystemExit):
        gpu.main(["--device", "cpu", "--smoke", "--parts", "afl,gemm"])
    assert "choose from extraction,afl,deepafl,fedavg" in capsys.readouterr().err


def test_the_smoke_leaves_out_emulated_bf16(monkeypatch):
    monkeypatch.setattr(gpu, "native_bf16", lambda device: False)
    monkeypatch.setattr(gpu, "SMOKE", TINY)
    lines = gpu.main(["--device", "cpu", "--smoke", "--parts", "extraction"])
    rows = [line for line in lines if line.startswith("| efficientnet_lite0")]
    assert [re.split(r"\s*\|\s*", row)[3] for row in rows] == ["float32"]
    assert any("bf16 left out" in line for line in lines)
