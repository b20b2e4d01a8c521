"""The data format between the learner's kernel and the grader: what travels, and what is refused."""
from __future__ import annotations

import json
import pickle
import struct
from fractions import Fraction

import numpy as np
import pytest
import torch

from labkit.grading import wire
from labkit.grading.proxy import Answer, LocalBackend, ReferenceImplementationUsed
from labkit.pipeline import Action


def test_values_round_trip_exactly():
    value = {"ints": [1, -2, 10 ** 30], "f": [2.5, float("inf")], "s": "x", "b": b"\x00\x01", "none": None,
             (1, "k"): (True, 3 + 4j), "frac": Fraction(2, 7), "r": range(1, 9, 3), "set": {1, 2},
             "t": torch.arange(6, dtype=torch.int64).reshape(2, 3), "bf": torch.tensor([1.5], dtype=torch.bfloat16),
             "view": torch.arange(10.0)[::3], "np": np.arange(4.0).reshape(2, 2), "npi": np.int64(7),
             "acts": [Action("F", 0, 2)], "size": torch.Size([3]), "dtype": torch.float16}
    back = wire.loads(wire.dumps(value))
    assert back.keys() == value.keys()
    for k, v in value.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(back[k], v) and back[k].dtype == v.dtype
        elif isinstance(v, np.ndarray):
            assert np.array_equal(back[k], v) and back[k].dtype == v.dtype
        else:
            assert back[k] == v and type(back[k]) is type(v), k
    leaf = torch.ones(2, requires_grad=True)
    assert leaf.requires_grad == wire.loads(wire.dumps(leaf)).requires_grad


def test_objects_that_are_not_data_become_named_placeholders():
    back = wire.loads(wire.dumps([torch.nn.Linear(2, 2), print, (x for x in ())]))
    assert [type(o).__name__ for o in back] == ["Linear", "builtin_function_or_method", "generator"]
    assert all(isinstance(o, wire.Opaque) and not callable(o) for o in back)


def _message(tree, blobs=()):
    head = json.dumps({"v": tree, "blobs": [len(b) for b in blobs]}).encode()
    return wire.MAGIC + struct.pack("<Q", len(head)) + head + b"".join(blobs)


@pytest.mark.parametrize("data, match", [
    (pickle.dumps({"a": 1}), "not a labkit wire message"),
    (_message(["A", "os:system", ["echo pwned"]]), "bad record"),
    (_message(["T", "float32", [1000], 0, False], [b"\x00" * 8]), "size does not match"),
    (_message(["N", "O", [1], 0], [b"\x00" * 8]), "not allowed"),
    (_message(["T", "qint8", [1], 0, False], [b"\x00"]), "not allowed"),
    (_message(["Q", "1", "0"]), "ZeroDivisionError"),
    (_message(["A", "labkit.pipeline.schedules:Action", [1, 2, 3, 4, 5]]), "bad value"),
    (_message(["L", [["L", [["L", [0]]]]]]) + b"junk", "trailing"),
])
def test_hostile_messages_are_refused(data, match):
    with pytest.raises(wire.WireError, match=match):
        wire.loads(data)


def test_size_and_depth_limits():
    with pytest.raises(wire.WireError, match="larger than"):
        wire.dumps(torch.zeros(2 ** 20), limit=2 ** 20)
    deep = []
    for _ in range(wire.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(wire.WireError, match="deeper"):
        wire.dumps(deep)
    big = wire.dumps(torch.zeros(1000))
    with pytest.raises(wire.WireError, match="larger than"):
        wire.loads(big, limit=100)


def test_the_proxy_carries_exceptions_by_name_and_catches_references():
    class Custom(ValueError):
        pass

    def answer(x):
        if x < 0:
            raise Custom("negative")
        return [x, torch.tensor([x])]

    a = Answer(LocalBackend(answer), "T.w")
    assert a(2)[0] == 2 and torch.equal(a(2)[1], torch.tensor([2]))
    with pytest.raises(ValueError, match="negative") as e:
        a(-1)
    assert type(e.value).__name__ == "Custom"
    with pytest.raises(AttributeError, match="answer.run"):
        a.apply  # noqa: B018 - the answer's attributes are not in the grader
    from labkit.pipeline.simulate import bubble_formula

    refs = Answer(LocalBackend(lambda K, M: float(bubble_formula(K, M))), "1.1",
                  ["labkit.pipeline.simulate:bubble_formula"])
    with pytest.raises(ReferenceImplementationUsed, match="bubble_formula"):
        refs(4, 8)
    assert float(bubble_formula(4, 8)) == 3 / 11  # the tripwire is gone after the call


def test_the_grader_asks_the_kernel_for_no_tripwire(monkeypatch):
    # a tripwire in the learner's kernel is the learner's to disable: the grader's requests name no
    # reference (the references are absent from the graded kernel's kit), only the interactive check's local ones do
    from labkit.grading import proxy

    sent = []

    def fake_request(kc, req, wait, alive=lambda: True):
        sent.append(req)
        return wire.dumps({"ok": 1})

    monkeypatch.setattr(proxy, "request_kernel", fake_request)
    backend = proxy.KernelBackend({}, None, "case-token")
    backend._client = lambda: None
    a = Answer(backend, "1.1", ["labkit.pipeline.simulate:bubble_formula"])
    assert a(4, 8) == 1
    assert sent[0]["references"] == [] and sent[0]["case"] == "case-token"
