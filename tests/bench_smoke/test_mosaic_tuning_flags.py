"""The bench-only `--mosaic-decode-tuning` / `--mosaic-offset-decode-tuning` /
`--mosaic-prefill-tuning` / `--mosaic-prefill6-tuning` flags (bench/common.py):
fields parsed by the type of the tuning's own, unknown fields and bad values refused, and the
process's default tunings replaced (and restored here)."""

from __future__ import annotations

import argparse

import pytest

from bench import common
from pallas_kernels import mgpu_tuning


def test_fields_are_read_as_the_tunings_types():
    base = mgpu_tuning.DEFAULT_TUNING
    assert common.parse_tuning_fields("even_split=true, stages=6", base) == {"even_split": True, "stages": 6}
    assert common.parse_tuning_fields("fold_offsets=0", base) == {"fold_offsets": False}
    assert common.parse_tuning_fields("", base) == {}
    for bad in ("no_such_field=1", "stages", "even_split=maybe", "stages=six"):
        with pytest.raises(ValueError):
            common.parse_tuning_fields(bad, base)


def test_flags_replace_the_default_tunings(monkeypatch):
    monkeypatch.setattr(mgpu_tuning, "DEFAULT_TUNING", mgpu_tuning.DEFAULT_TUNING)  # restored after the test
    monkeypatch.setattr(mgpu_tuning, "PREFILL_TUNING", mgpu_tuning.PREFILL_TUNING)
    monkeypatch.setattr(mgpu_tuning, "OFFSET_DECODE_TUNING", mgpu_tuning.OFFSET_DECODE_TUNING)
    monkeypatch.setattr(mgpu_tuning, "PREFILL6_TUNING", mgpu_tuning.PREFILL6_TUNING)
    ap = argparse.ArgumentParser()
    common.add_mosaic_tuning_arguments(ap)
    assert mgpu_tuning.default_tuning(8, offsets=True).fold_scales  # folded by default
    args = ap.parse_args(["--mosaic-decode-tuning", "even_split=true", "--mosaic-prefill-tuning", "fold_offsets=false",
                          "--mosaic-offset-decode-tuning", "fold_scales=false,fold_offsets=false",
                          "--mosaic-prefill6-tuning", "m_tile=64"])
    assert common.apply_mosaic_tuning_arguments(args) == {"decode": {"even_split": True},
                                                         "offset-decode": {"fold_scales": False, "fold_offsets": False},
                                                         "prefill": {"fold_offsets": False},
                                                         "prefill6": {"m_tile": 64}}
    assert mgpu_tuning.default_tuning(8).even_split and not mgpu_tuning.default_tuning(8).fold_scales
    assert not mgpu_tuning.default_tuning(8, offsets=True).fold_scales
    assert mgpu_tuning.default_tuning(8, offsets=True).fuse_offsets
    assert not mgpu_tuning.default_tuning(512).fold_offsets and mgpu_tuning.default_tuning(512).fold_scales
    six = mgpu_tuning.default_tuning(512, fmt="q6_k_split6")
    assert six.m_tile == 64 and six.tile_k == mgpu_tuning.MIN_TILE_K6 and six.fold_offsets  # its own tuning, replaced
    assert mgpu_tuning.default_tuning(512).m_tile == 256
    assert mgpu_tuning.split_for(6144, 4096, mgpu_tuning.default_tuning(8)) == 4  # 3 without even_split
    assert common.apply_mosaic_tuning_arguments(ap.parse_args([])) == {}
