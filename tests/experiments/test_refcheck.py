"""The reference-hash check used to prove optimisations change no result (issue #8)."""

from __future__ import annotations

from kvsched.experiments import refcheck


def test_fast_forward_on_and_off_hash_the_same_and_compare_flags_a_change():
    on, off = refcheck.run("blis-1k"), refcheck.run("blis-1k-noff")
    assert all(on[f] == off[f] for f in refcheck.RESULT_FIELDS)
    assert on["stats"]["steps"] == off["stats"]["steps"] and on["stats"]["events"] < off["stats"]["events"] / 3
    assert refcheck.compare({"blis-1k": on}, {"blis-1k": off}) == []
    changed = dict(off, records="0" * 16)
    assert refcheck.compare({"blis-1k": on}, {"blis-1k": changed}) == [
        f"blis-1k: records {on['records']} -> {'0' * 16}"]
    assert refcheck.compare({"blis-1k": on}, {}) == ["blis-1k: missing"]


def test_every_reference_run_builds():
    for name, build in refcheck.RUNS.items():
        workload, spec, n, policy, metrics, oracle, ff, kw = build()
        assert len(workload) > 0 and n >= 1 and isinstance(ff, bool), name
