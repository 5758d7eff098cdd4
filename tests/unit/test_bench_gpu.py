"""bench/gpu.py's code path on the CPU (--smoke): the GPU run must not be the first time it runs."""

from __future__ import annotations

import json

from bench import gpu


def test_gpu_bench_smoke_on_cpu(tmp_path):
    gpu.main(["--preset", "tiny", "--device", "cpu", "--smoke", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "results.json").read_text())
    assert not data["skipped"], data["skipped"]
    seen = {(r["workload"].split(" ")[0], r["system"]) for r in data["rows"]}
    for workload in ("prefill", "decode"):
        assert (workload, "radixserve") in seen and (workload, "transformers") in seen
    shared = [r for r in data["rows"] if r["workload"].startswith("shared prefix")]
    on = next(r for r in shared if r["system"].endswith("cache on"))
    off = next(r for r in shared if r["system"].endswith("cache off"))
    assert "cached 0/" in off["notes"] and "cached 0/" not in on["notes"]
    decode = [r for r in data["rows"] if r["workload"].startswith("decode") and r["system"] == "radixserve"]
    assert all(r["x_floor"] > 0 and r["vs_hf"] > 0 for r in decode)
    assert "| workload | system |" in (tmp_path / "results.md").read_text()
