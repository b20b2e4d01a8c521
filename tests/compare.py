"""Comparison helpers shared by the equality tests (importable from any tests/ folder: conftest.py's
folder is on sys.path)."""
import torch


def merge_disjoint(results, key):
    """The ``key`` dicts of every rank's result merged; no name may come from two ranks."""
    merged = {}
    for r in results:
        assert not set(merged) & set(r[key])
        merged.update(r[key])
    return merged


def assert_all_close(got, want, what, rtol, atol):
    """Same names, and every tensor close to the reference's."""
    assert set(got) == set(want), what
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=rtol, atol=atol, msg=lambda m: f"{what} {n}: {m}")
