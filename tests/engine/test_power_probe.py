"""bench/power_probe.py's parsing of nvidia-smi samples (pure Python: runs without a GPU)."""

from __future__ import annotations

from bench.power_probe import parse_samples, summarize


def test_samples_parse_and_bad_rows_are_dropped():
    text = ("1980, 3201, 650.25, 61, 0x0000000000000000\n"
            "1755, 3201, 699.80, 63, 0x0000000000000004\n"
            "[N/A], 3201, 700.00, 63, 0x0000000000000004\n"   # a field the driver could not read
            "1710, 3201, 701.10, 64\n")                        # a row cut short when the sampler stopped
    rows = parse_samples(text)
    assert rows == [{"sm_mhz": 1980.0, "mem_mhz": 3201.0, "power_w": 650.25, "temp_c": 61.0, "reasons": 0},
                    {"sm_mhz": 1755.0, "mem_mhz": 3201.0, "power_w": 699.8, "temp_c": 63.0, "reasons": 4}]


def test_summary_has_means_extremes_and_reason_shares():
    rows = parse_samples("1980, 3201, 600, 60, 0x0\n1700, 3201, 700, 62, 0x4\n1800, 3201, 700, 64, 0x44\n"
                         "1900, 3201, 690, 63, 0x1\n")
    got = summarize(rows)
    assert got["samples"] == 4
    assert got["sm_mhz"] == {"mean": 1845.0, "min": 1700.0, "max": 1980.0}
    assert got["power_w"]["max"] == 700.0 and got["temp_c"]["max"] == 64.0
    assert got["reasons"] == {"gpu_idle": 0.25, "sw_power_cap": 0.5, "hw_thermal": 0.25}
    assert summarize([]) == {"samples": 0}
