"""The data format that carries arguments into the learner's kernel and results back out.

The grader never unpickles anything that comes from the kernel: a result is encoded here as
JSON (the structure) plus raw byte blobs (tensor and array contents), and decoding builds only
plain values from that. What can travel:

* ``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``; ``list``, ``tuple``,
  ``dict`` (any keys that can travel), ``set``, ``frozenset``, ``range``, ``Fraction``;
* ``torch.Tensor`` (dense, CPU or GPU; numeric and bool dtypes; ``requires_grad`` is kept as a
  flag on a leaf: the graph never travels), ``torch.Size``, ``torch.dtype``;
* ``numpy.ndarray`` (numeric and bool dtypes) and numpy scalars;
* labkit's own record types listed in :data:`RECORDS` (e.g. ``pipeline.Action``), rebuilt from
  their fields.

Anything else (a learner's class, a function, an ``nn.Module``, a generator) becomes an
:class:`Opaque` placeholder whose class name is the original type's name, so a check can say
"expected a list, got Foo" but cannot call it. Decoding refuses more than ``limit`` bytes,
nesting deeper than :data:`MAX_DEPTH`, more than :data:`MAX_NODES` values, or a blob whose size
does not match its dtype and shape (:class:`WireError`).

Decoding counts before it builds (the reply comes from a hostile kernel, and a 30-byte
``range(30_000_000)`` or a few MiB of ``[[],[],...]`` would otherwise become gigabytes in the
grader): the JSON header's structural tokens are counted on the raw bytes before it is parsed
(at most :data:`MAX_TOKENS`), a ``range`` counts as ``len(range)`` values, and string and bytes
lengths add up to at most :data:`MAX_TEXT` characters.
"""
from __future__ import annotations

import importlib
import json
import math
import re
import struct
from fractions import Fraction
from typing import Any

__all__ = ["dumps", "loads", "LearnerText", "Opaque", "WireError", "RECORDS", "MAX_BYTES"]

MAGIC = b"LKW1"
MAX_BYTES = 64 * 2 ** 20  # default limit of one message (64 MiB)
MAX_DEPTH = 64
MAX_NODES = 250_000  # values in one message (a range counts as len(range) values)
MAX_TOKENS = 4 * MAX_NODES + 64  # "[" and "," outside strings in the JSON header (an encoded value uses <= 4)
MAX_TEXT = 16 * 2 ** 20  # characters of all strings (and bytes of all bytes values) in one message
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string literal

# labkit record types (NamedTuples and dataclasses) that travel as themselves: their fields in
# order, rebuilt with cls(*fields). Only these names are ever imported while decoding; add a
# type here when a case passes one to the learner or expects one back.
RECORDS = {
    "labkit.pipeline.schedules:Action",
    "labkit.pipeline.simulate:TimedAction",
    "labkit.plan.spec:ModelSpec",
    "labkit.plan.params:ParamCount",
    "labkit.moe.experts:MoEConfig",
    "labkit.model:GPTConfig",
}

_TORCH_DTYPES = ("float16", "bfloat16", "float32", "float64", "complex64", "complex128", "int8", "int16",
                 "int32", "int64", "uint8", "bool")


class WireError(ValueError):
    """A message that does not follow this format, or breaks one of its limits."""


class Opaque:
    """Stands for an object that is not data (its class is named after the original type)."""

    type_name = "object"
    text = ""

    def __repr__(self) -> str:
        return self.text or f"<{self.type_name} object>"


_OPAQUE_CLASSES: dict[str, type] = {}


def _opaque(type_name: str, text: str) -> Opaque:
    name = type_name if type_name.isidentifier() and len(type_name) <= 80 else "object"
    cls = _OPAQUE_CLASSES.get(name)
    if cls is None:
        cls = _OPAQUE_CLASSES[name] = type(name, (Opaque,), {"type_name": name})
    o = cls()
    o.text = text[:200]
    return o


def _record_name(x) -> str | None:
    t = type(x)
    name = f"{t.__module__}:{t.__qualname__}"
    return name if name in RECORDS else None


# ----------------------------------------------------------------------------- encode


def dumps(obj: Any, limit: int = MAX_BYTES) -> bytes:
    """Encode ``obj``; raises :class:`WireError` when the message would exceed ``limit`` bytes."""
    blobs: list[bytes] = []
    size = [0]

    def blob(b: bytes) -> int:
        size[0] += len(b)
        if size[0] > limit:
            raise WireError(f"the value is larger than {limit // 2 ** 20} MiB")
        blobs.append(b)
        return len(blobs) - 1

    def enc(x, depth):
        if depth > MAX_DEPTH:
            raise WireError(f"the value is nested deeper than {MAX_DEPTH} levels")
        if x is None or isinstance(x, (bool, str)):
            return x
        if type(x) is int:
            return x if abs(x) < 2 ** 63 else ["I", str(x)]
        if type(x) is float:
            return x if math.isfinite(x) else ["F", repr(x)]
        if isinstance(x, complex):
            return ["C", repr(x.real), repr(x.imag)]
        if isinstance(x, (bytes, bytearray)):
            return ["B", blob(bytes(x))]
        rec = _record_name(x)
        if rec is not None:
            if isinstance(x, tuple):
                values = tuple(x)
            else:
                import dataclasses

                values = [getattr(x, f.name) for f in dataclasses.fields(x) if f.init]
            return ["A", rec, [enc(v, depth + 1) for v in values]]
        mod = type(x).__module__
        if mod.startswith("torch"):
            import torch

            if isinstance(x, torch.Size):
                return ["Z", [int(d) for d in x]]
            if isinstance(x, torch.dtype):
                return ["Y", str(x).replace("torch.", "")]
            if isinstance(x, torch.Tensor):
                return enc_tensor(x)
        if mod == "numpy":
            import numpy as np

            if isinstance(x, np.ndarray):
                return enc_array(x, depth)
            if isinstance(x, np.generic) and x.dtype.kind in "biufc":
                return ["n", x.dtype.str, enc(x.item(), depth + 1)]
        if isinstance(x, Fraction):
            return ["Q", str(x.numerator), str(x.denominator)]
        if isinstance(x, range):
            return ["R", x.start, x.stop, x.step]
        if isinstance(x, (int, float)) and not isinstance(x, bool):  # int/float subclasses: plain values
            return enc(int(x) if isinstance(x, int) else float(x), depth)
        if isinstance(x, tuple):  # namedtuples and other subclasses travel as plain tuples
            return ["U", [enc(v, depth + 1) for v in x]]
        if isinstance(x, list):
            return ["L", [enc(v, depth + 1) for v in x]]
        if isinstance(x, dict):
            return ["D", [[enc(k, depth + 1), enc(v, depth + 1)] for k, v in x.items()]]
        if isinstance(x, (set, frozenset)):
            return ["G" if isinstance(x, frozenset) else "S", [enc(v, depth + 1) for v in x]]
        return ["O", type(x).__name__, _safe_repr(x)]

    def enc_tensor(t):
        import torch

        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            return ["O", "Tensor", f"a {t.layout} tensor"]
        dt = str(t.dtype).replace("torch.", "")
        if dt not in _TORCH_DTYPES:
            return ["O", "Tensor", f"a tensor of dtype {dt}"]
        flat = t.detach().cpu().contiguous().reshape(-1)
        data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        return ["T", dt, [int(d) for d in t.shape], blob(data), bool(t.requires_grad)]

    def enc_array(a, depth):
        if a.dtype.kind not in "biufc" or a.dtype.hasobject:
            return ["O", "ndarray", f"an array of dtype {a.dtype}"]
        import numpy as np

        return ["N", a.dtype.str, [int(d) for d in a.shape], blob(np.ascontiguousarray(a).tobytes())]

    tree = enc(obj, 0)
    header = json.dumps({"v": tree, "blobs": [len(b) for b in blobs]}, separators=(",", ":")).encode()
    if len(header) + size[0] > limit:
        raise WireError(f"the value is larger than {limit // 2 ** 20} MiB")
    return MAGIC + struct.pack("<Q", len(header)) + header + b"".join(blobs)


def _safe_repr(x) -> str:
    try:
        name = getattr(x, "__qualname__", None) or getattr(x, "__name__", None)
        kind = type(x).__name__
        return f"<{kind} {name}>" if isinstance(name, str) else f"<{kind} object>"
    except Exception:  # noqa: BLE001 - a hostile __getattr__
        return "<object>"


# ----------------------------------------------------------------------------- decode


class LearnerText(str):
    """A string decoded from the learner's kernel (``loads(..., text=LearnerText)``): equal to,
    hashed and sliced as the str it holds, but shown only by its length wherever the grader
    formats it (``repr``, ``str``, f-strings, and the messages of ``int(x)`` / ``float(x)``), so no
    message can echo text the learner's code chose (issue 16: a visible message must not carry
    what the kernel read). A short name (at most 24 characters, dotted identifiers: ``"F"``,
    ``"SEND_F"``, ``"softmax"``, ``"MoELayer.forward"``) is a word of the exercise's vocabulary,
    not free text, and is shown as it is."""

    def _word(self) -> bool:
        return len(self) <= 24 and all(part.isidentifier() for part in str.split(self, "."))

    def __repr__(self) -> str:
        return str.__repr__(self) if self._word() else f"<a str of length {len(self)}>"

    def __str__(self) -> str:
        return str.__str__(self) if self._word() else f"<a str of length {len(self)}>"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def loads(data: bytes, limit: int = MAX_BYTES, text_class: type = str) -> Any:
    """Decode a message made by :func:`dumps`; raises :class:`WireError` on anything else.
    ``text_class``: the class of decoded strings (:class:`LearnerText` for values from the kernel)."""
    if not isinstance(data, (bytes, bytearray)):
        raise WireError("a message must be bytes")
    if len(data) > limit:
        raise WireError(f"the message is larger than {limit // 2 ** 20} MiB")
    if len(data) < 12 or data[:4] != MAGIC:
        raise WireError("not a labkit wire message")
    (hlen,) = struct.unpack("<Q", data[4:12])
    if hlen > len(data) - 12:
        raise WireError("truncated message")
    data = bytes(data)
    end = 12 + hlen
    tokens = sum(data.count(c, 12, end) for c in (b"[", b",", b"{"))  # counted in place: no copy
    if tokens > MAX_TOKENS:  # only what lies outside strings is structure
        for m in _JSON_STRING.finditer(data, 12, end):
            s = m.group()
            tokens -= s.count(b"[") + s.count(b",") + s.count(b"{")
        if tokens > MAX_TOKENS:
            raise WireError(f"more than {MAX_NODES} values (the header holds {tokens} items)")
    try:
        head = json.loads(data[12:end].decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise WireError(f"bad header: {e}") from None
    if not isinstance(head, dict) or not isinstance(head.get("blobs"), list):
        raise WireError("bad header")
    offsets, pos = [], 12 + hlen
    for n in head["blobs"]:
        if type(n) is not int or n < 0 or pos + n > len(data):
            raise WireError("bad blob table")
        offsets.append((pos, n))
        pos += n
    if pos != len(data):
        raise WireError("trailing bytes")
    nodes = [0]
    text = [0]

    def count(n: int, what: str = "values") -> None:
        if what == "values":
            nodes[0] += n
            if nodes[0] > MAX_NODES:
                raise WireError(f"more than {MAX_NODES} values")
        else:
            text[0] += n
            if text[0] > MAX_TEXT:
                raise WireError(f"more than {MAX_TEXT} characters of strings and bytes")

    def get_blob(i) -> bytes:
        if type(i) is not int or not 0 <= i < len(offsets):
            raise WireError("bad blob index")
        start, n = offsets[i]
        return bytes(data[start:start + n])

    def shape_of(s):
        if not isinstance(s, list) or len(s) > 32 or any(type(d) is not int or d < 0 for d in s):
            raise WireError("bad shape")
        return tuple(s)

    def dec(x, depth):
        count(1)
        if depth > MAX_DEPTH + 2:
            raise WireError("nested too deep")
        if isinstance(x, str):
            count(len(x), "text")
            return x if text_class is str else text_class(x)
        if x is None or isinstance(x, (bool, int, float)):
            return x
        if not isinstance(x, list) or not x or not isinstance(x[0], str):
            raise WireError("bad value")
        tag, rest = x[0], x[1:]
        if tag in ("L", "U", "S", "G"):
            items = _list(rest, 1)[0]
            vals = [dec(v, depth + 1) for v in items]
            return {"L": list, "U": tuple, "S": set, "G": frozenset}[tag](vals)
        if tag == "D":
            pairs = _list(rest, 1)[0]
            out = {}
            for p in pairs:
                if not isinstance(p, list) or len(p) != 2:
                    raise WireError("bad dict item")
                out[dec(p[0], depth + 1)] = dec(p[1], depth + 1)
            return out
        if tag == "I":
            return int(_str(rest))
        if tag == "F":
            v = _str(rest)
            if v not in ("inf", "-inf", "nan"):
                raise WireError("bad float")
            return float(v)
        if tag == "C":
            if len(rest) != 2:
                raise WireError("bad complex")
            return complex(float(rest[0]), float(rest[1]))
        if tag == "B":
            b = get_blob(rest[0] if len(rest) == 1 else None)
            count(len(b), "text")
            return b
        if tag == "Q":
            if len(rest) != 2:
                raise WireError("bad fraction")
            return Fraction(int(rest[0]), int(rest[1]))
        if tag == "R":
            if len(rest) != 3 or any(type(v) is not int for v in rest):
                raise WireError("bad range")
            r = range(*rest)
            count(max(0, (r.stop - r.start + r.step - (1 if r.step > 0 else -1)) // r.step))  # len(r), counted
            return r
        if tag == "Z":
            import torch

            return torch.Size(shape_of(_list(rest, 1)[0]))
        if tag == "Y":
            import torch

            name = _str(rest)
            if name not in _TORCH_DTYPES:
                raise WireError(f"dtype {name!r} is not allowed")
            return getattr(torch, name)
        if tag == "T":
            return dec_tensor(rest)
        if tag == "N":
            return dec_array(rest)
        if tag == "n":
            if len(rest) != 2:
                raise WireError("bad numpy scalar")
            dt = _np_dtype(rest[0])
            return dt.type(dec(rest[1], depth + 1))
        if tag == "A":
            if len(rest) != 2 or rest[0] not in RECORDS or not isinstance(rest[1], list):
                raise WireError("bad record")
            mod, qual = rest[0].split(":")
            cls = getattr(importlib.import_module(mod), qual)
            return cls(*[dec(v, depth + 1) for v in rest[1]])
        if tag == "O":
            if len(rest) != 2 or not all(isinstance(v, str) for v in rest):
                raise WireError("bad opaque value")
            return _opaque(rest[0], rest[1])
        raise WireError(f"unknown tag {tag!r}")

    def dec_tensor(rest):
        import torch

        if len(rest) != 4:
            raise WireError("bad tensor")
        dt, shape, b, rg = rest
        if dt not in _TORCH_DTYPES:
            raise WireError(f"dtype {dt!r} is not allowed")
        dtype = getattr(torch, dt)
        shape = shape_of(shape)
        raw = get_blob(b)
        numel = math.prod(shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if len(raw) != numel * itemsize:
            raise WireError("tensor size does not match its shape")
        if numel == 0:
            t = torch.empty(shape, dtype=dtype)
        else:
            t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
        if rg is True and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        return t

    def dec_array(rest):
        import numpy as np

        if len(rest) != 3:
            raise WireError("bad array")
        dt = _np_dtype(rest[0])
        shape = shape_of(rest[1])
        raw = get_blob(rest[2])
        if len(raw) != math.prod(shape) * dt.itemsize:
            raise WireError("array size does not match its shape")
        return np.frombuffer(raw, dtype=dt).reshape(shape).copy()

    try:
        return dec(head.get("v"), 0)
    except WireError:
        raise
    except (ValueError, TypeError, ZeroDivisionError, OverflowError, RecursionError, AttributeError,
            ImportError) as e:  # e.g. Fraction(1, 0), a record whose fields do not fit
        raise WireError(f"bad value: {type(e).__name__}: {e}") from None


def _np_dtype(s):
    import numpy as np

    if not isinstance(s, str) or len(s) > 8:
        raise WireError("bad numpy dtype")
    try:
        dt = np.dtype(s)
    except TypeError:
        raise WireError("bad numpy dtype") from None
    if dt.kind not in "biufc" or dt.hasobject:
        raise WireError(f"numpy dtype {s!r} is not allowed")
    return dt


def _list(rest, n):
    if len(rest) != n or not all(isinstance(v, list) for v in rest):
        raise WireError("bad list")
    return rest


def _str(rest):
    if len(rest) != 1 or not isinstance(rest[0], str) or len(rest[0]) > 5000:
        raise WireError("bad string")
    return rest[0]
