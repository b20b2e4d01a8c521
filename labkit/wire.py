"""Bytes on the wire of the ring algorithms: a leaf module (no imports), shared by the runs' counters
and the planner."""


def ring_bytes(kind: str, p: int, t: int) -> int:
    """Bytes one rank sends for one collective of ``kind`` with a P-byte argument ``p`` over
    ``t`` ranks under the ring algorithms (Patarasuk & Yuan 2009; Megatron-LM sec. 3):
    all-reduce ``2 (t-1)/t P`` (a reduce-scatter then an all-gather), reduce-scatter of a P-byte
    input ``(t-1)/t P``, all-gather of a P-byte shard ``(t-1) P``, all-to-all ``(t-1)/t P`` (its
    own block stays), send P, recv 0, broadcast P (a chain). Integer division: exact whenever t
    divides the payload. The one home of this formula: :mod:`labkit.comm` (the runs' counted bytes)
    and :mod:`labkit.plan.comm` (the planner, which needs no torch) import it."""
    if kind == "all_reduce":
        return 2 * (t - 1) * p // t
    if kind in ("reduce_scatter", "all_to_all"):
        return (t - 1) * p // t
    if kind == "all_gather":
        return (t - 1) * p
    if kind == "recv":
        return 0
    return p
