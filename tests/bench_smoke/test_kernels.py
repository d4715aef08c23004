"""bench/kernels.py on the CPU (interpret mode): the Q4_K and Q6_K rows include their splits
(for the Q4_0 kernels, for the Mosaic kernel's 8-bit path), checked against the unsplit reference
like every other implementation; `--device-time` keeps the wall clock where the trace has no
device events, and its per-matmul figures from a trace's events."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from bench.kernels import fmt_row, mosaic_impls, offset_split_impls, parse_variants, per_matmul

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "kernels.py"


def test_split_rows(tmp_path):
    subprocess.run([sys.executable, str(SCRIPT), "--interpret", "--formats", "q4_k,q6_k", "--impls", "reference",
                    "--shapes", "64x512", "--ms", "1,8", "--runs", "1", "--mats", "1", "--copy-gb", "0.01",
                    "--out", str(tmp_path)], check=True, timeout=600)
    (path,) = tmp_path.glob("kernels-*.json")
    rows = [r for r in json.loads(path.read_text())["rows"] if r["impl"] == "reference:q4_k_split"]
    assert [r["m"] for r in rows] == [1, 8]
    for r in rows:  # its bf16 scales and offsets: 1.9e-3 measured
        assert r["ok"] and 0 < r["rel_err"] < 5e-3 and r["us"] > 0
        # the split's bytes: 0.625 per weight against Q4_K's 0.5625
        assert r["gbps"] * r["us"] * 1e3 >= 64 * 512 * 0.625
    rows = [r for r in json.loads(path.read_text())["rows"] if r["impl"] == "reference:q6_k_split"]
    assert [r["m"] for r in rows] == [1, 8]
    for r in rows:  # 1.125 bytes per weight against Q6_K's 0.8203
        assert r["ok"] and 0 < r["rel_err"] < 1e-3 and r["gbps"] * r["us"] * 1e3 >= 64 * 512 * 1.125


def test_device_time_falls_back_to_the_wall_clock_without_device_events(tmp_path):
    subprocess.run([sys.executable, str(SCRIPT), "--interpret", "--formats", "q4_0", "--impls", "reference",
                    "--shapes", "64x512", "--ms", "8", "--runs", "1", "--mats", "1", "--copy-gb", "0.01",
                    "--device-time", "--out", str(tmp_path)], check=True, timeout=600)
    (path,) = tmp_path.glob("kernels-*.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert row["ok"] and row["us"] == row["us_wall"] > 0 and row["device_error"]  # the CPU trace has none
    assert "us: wall clock per matmul" in next(tmp_path.glob("kernels-*.md")).read_text().splitlines()[0]


def test_per_matmul_takes_the_longest_kernel_and_sums_them_all():
    events = [{"name": "permute", "dur": 1.0}, {"name": "mosaic", "dur": 6.0}, {"name": "sum", "dur": 2.0}] * 4
    assert per_matmul(events, 4) == {"us_kernel": 6.0, "us_device": 9.0, "kernel": "mosaic"}
    assert per_matmul([], 4) == {}


def test_a_row_notes_the_time_of_all_its_kernels_where_the_kernel_alone_flatters_it():
    row = {"format": "q4_k", "impl": "mosaic_gpu:q4_k_split:offsets_after", "m": 8, "n": 64, "k": 512, "us": 10.0,
           "us_device": 12.0, "pct_hbm_device": 90.0, "tflops_device": 1.5}
    assert "all kernels 12.0 us, 90.0% of copy, 1.50 TFLOP/s" in fmt_row(row)
    assert "all kernels" not in fmt_row({**row, "us_device": 10.2})
    assert "all kernels" not in fmt_row({k: v for k, v in row.items() if k != "us_device"})


def test_jax_triton_sweep_neighbours_tile_the_shape():
    """`--sweep` with `--impls jax_triton`: the default first, then distinct neighbours, each a
    tuning the kernel takes for the shape (no GPU needed to build the list)."""
    from bench.kernels import jax_triton_impls
    from pallas_kernels import matmul_jax_triton

    for m, n, k in ((8, 4096, 4096), (8, 4096, 11008), (512, 1024, 2048)):
        impls = jax_triton_impls(m, n, k, sweep=True)
        names = [i.name for i in impls]
        assert names[0] == "jax_triton" and len(names) == len(set(names)) > 5, names
        assert len({i.tuning for i in impls}) == len(impls)
        assert impls[0].tuning.startswith(f"bm{matmul_jax_triton.default_tuning(m, n, k).block_m} ")
    assert [i.name for i in jax_triton_impls(8, 4096, 4096)] == ["jax_triton"]


def test_mosaic_variants_are_fields_over_the_rows_default():
    """--mosaic-variants: each tag's fields replace those of the default tuning for the rows of x
    (decode or prefill), after the default itself; malformed items and unknown fields refuse."""
    from pallas_kernels import mgpu_tuning

    assert parse_variants("", mgpu_tuning.DEFAULT_TUNING) == []
    assert parse_variants("ev:even_split=1; c:target_ctas=264,stages=3", mgpu_tuning.DEFAULT_TUNING) == [
        ("ev", {"even_split": True}), ("c", {"target_ctas": 264, "stages": 3})]
    names = [i.name for i in mosaic_impls(False, 8, "ev:even_split=1")]
    assert names == ["mosaic_gpu", "mosaic_gpu:ev"]
    tuning = [i for i in mosaic_impls(False, 512, "c:stages=3")][1].tuning
    assert "stages=3" in tuning and "fold_scales=True" in tuning  # over the prefill tuning
    for bad in ("even_split=1", ":stages=3", "x:no_such=1", "x:stages=three"):
        with pytest.raises(ValueError):
            parse_variants(bad, mgpu_tuning.DEFAULT_TUNING)


def test_offset_split_extras_are_the_variant_rows():
    # the split's default row alone without extras; the extra rows are all "<impl>:<form>:<tag>"
    names = [i.name for i in offset_split_impls("q4_k", ["mosaic_gpu"], False, 8)]
    assert names[0] == "mosaic_gpu:q4_k_split" and len(names) > 1
    assert all(n.startswith("mosaic_gpu:q4_k_split:") for n in names[1:])
    assert [i.name for i in offset_split_impls("q4_k", ["mosaic_gpu"], False, 8, extras=False)] == ["mosaic_gpu:q4_k_split"]


def test_defaults_only_run(tmp_path):
    # the Triton kernel's --sweep neighbours are rows the flag must leave out (they exist: checked first)
    import jax.numpy as jnp

    from bench.kernels import triton_impls
    assert len(triton_impls("q4_0", 8, 64, 512, jnp.bfloat16, True, True)) > 1
    subprocess.run([sys.executable, str(SCRIPT), "--interpret", "--formats", "q4_0,q4_k", "--impls",
                    "triton,mosaic_gpu,reference", "--sweep", "--shapes", "64x512", "--ms", "8", "--runs", "1", "--mats", "1", "--copy-gb", "0.01",
                    "--defaults-only", "--out", str(tmp_path)], check=True, timeout=600)
    (path,) = tmp_path.glob("kernels-*.json")
    names = [(r["format"], r["impl"]) for r in json.loads(path.read_text())["rows"]]
    # no bare Mosaic row for Q4_K, which the kernel takes only split (on the CPU the split's
    # Mosaic rows are not made, and Q4_0's Mosaic row is an error row)
    assert names == [("q4_0", "triton"), ("q4_0", "mosaic_gpu"), ("q4_0", "reference"),
                     ("q4_k", "triton"), ("q4_k", "reference"), ("q4_k", "reference:q4_k_split")]
