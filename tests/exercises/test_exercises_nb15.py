"""Exercises of notebook 15_sharded_data_parallel: the solutions pass, plausible wrong answers fail a
public case with a message that names the mistake."""
import pytest
import torch

from labkit.grading.testing import assert_check_passes, assert_public_case_fails


def shard_flat(flat, d):
    size = -(-flat.numel() // d)
    padded = torch.cat([flat, flat.new_zeros(size * d - flat.numel())])
    return [padded[r * size:(r + 1) * size].clone() for r in range(d)]


def shard_chunk(flat, d):
    return list(torch.chunk(flat, d))


def shard_tensor_split(flat, d):
    return list(torch.tensor_split(flat, d))


def shard_pad_front(flat, d):
    size = -(-flat.numel() // d)
    padded = torch.cat([flat.new_zeros(size * d - flat.numel()), flat])
    return [padded[r * size:(r + 1) * size] for r in range(d)]


def shard_floor(flat, d):
    size = flat.numel() // d
    return [flat[r * size:(r + 1) * size] for r in range(d)]


def unshard_flat(shards, numel):
    return torch.cat(list(shards))[:numel]


def unshard_keep_padding(shards, numel):
    return torch.cat(list(shards))


def unshard_reversed(shards, numel):
    return torch.cat(list(shards)[::-1])[:numel]


def unshard_interleaved(shards, numel):
    return torch.stack(list(shards), 1).reshape(-1)[:numel]


def unshard_strip_front(shards, numel):
    return torch.cat(list(shards))[-numel:]


def unshard_minus_pad(shards, numel):
    flat = torch.cat(list(shards))
    return flat[:-(flat.numel() - numel)]


def unshard_drop_zeros(shards, numel):
    """Wrong: the padding told apart by value: every zero dropped (issue 36: passed every case)."""
    flat = torch.cat(list(shards))
    return flat[flat != 0]


def unshard_strip_trailing_zeros(shards, numel):
    """Wrong: trailing zeros stripped, the parameter's own last zeros with them (issue 36)."""
    flat = torch.cat(list(shards))
    nz = flat.nonzero()
    return flat[:int(nz.max()) + 1] if nz.numel() else flat[:0]


def zero_memory(psi, d, stage):
    p, g, k = 2 * psi, 2 * psi, 12 * psi
    return (p / d if stage >= 3 else p) + (g / d if stage >= 2 else g) + (k / d if stage >= 1 else k)


def zero_memory_off_by_one(psi, d, stage):
    return zero_memory(psi, d, min(3, stage + 1)) if stage else zero_memory(psi, d, 0)


def zero_memory_k8(psi, d, stage):
    p, g, k = 2 * psi, 2 * psi, 8 * psi
    return (p / d if stage >= 3 else p) + (g / d if stage >= 2 else g) + (k / d if stage >= 1 else k)


def comm_volume(psi, d, stage):
    return (3 if stage == 3 else 2) * (d - 1) / d * psi


def comm_volume_like_dp(psi, d, stage):
    return 2 * (d - 1) / d * psi


def comm_volume_no_ring(psi, d, stage):
    return (3 if stage == 3 else 2) * psi


def gathered_peak(units, d, reshard_after_forward):
    pads = [-(-n // d) * d for n in units]
    if not reshard_after_forward:
        return sum(pads)
    return max([pads[0]] + [a + b for a, b in zip(pads, pads[1:])])


def peak_one_unit(units, d, reshard):
    return max(-(-n // d) * d for n in units)


def peak_unpadded(units, d, reshard):
    return max([units[0]] + [a + b for a, b in zip(units, units[1:])]) if reshard else sum(units)


def peak_two_largest(units, d, reshard):
    return sum(sorted(-(-n // d) * d for n in units)[-2:])


def peak_wrapped(units, d, reshard):
    """Wrong: units as a ring, the last paired with the first (issue 36: told "the two largest units")."""
    pads = [-(-n // d) * d for n in units]
    if not reshard:
        return sum(pads)
    return max(pads[i] + pads[(i + 1) % len(pads)] for i in range(len(pads))) if len(pads) > 1 else pads[0]


def peak_numpy(units, d, reshard):
    import numpy as np
    return np.int64(gathered_peak(units, d, reshard))


def peak_float_off(units, d, reshard):
    """Wrong: half an element too many; int() in the check used to truncate it to the right answer."""
    return gathered_peak(units, d, reshard) + 0.5


def peak_all(units, d, reshard):
    return sum(-(-n // d) * d for n in units)


def test_solutions_pass():
    assert_check_passes("15.1", shard_flat)
    assert_check_passes("15.2", zero_memory)
    assert_check_passes("15.3", comm_volume)
    assert_check_passes("15.4", gathered_peak)
    assert_check_passes("15.4", peak_numpy)
    assert_check_passes("15.5", unshard_flat)


@pytest.mark.parametrize("wrong, case, contains", [
    (shard_chunk, "n = 10 over d = 4", "not all the same size"),
    (shard_tensor_split, "n = 10 over d = 4", "not all the same size"),
    (shard_pad_front, "n = 10 over d = 4", "the zeros went in front"),
    (shard_floor, "n = 10 over d = 4", "rounded down"),
])
def test_shard_mistakes_are_named(wrong, case, contains):
    assert_public_case_fails("15.1", wrong, case, contains=contains)


@pytest.mark.parametrize("wrong, case, contains", [
    (unshard_keep_padding, "n = 10 from d = 4", "the padding is still there"),
    (unshard_reversed, "n = 10 from d = 4", "reverse order"),
    (unshard_interleaved, "n = 10 from d = 4", "interleaved"),
    (unshard_strip_front, "n = 10 from d = 4", "first elements were dropped"),
    (unshard_minus_pad, "n = 12 from d = 4", "minus zero"),
    (unshard_drop_zeros, "n = 6 from d = 4 shards, a parameter with zeros", "own zeros were dropped"),
    (unshard_strip_trailing_zeros, "n = 6 from d = 4 shards, a parameter with zeros",
     "zeros at the end of the parameter"),
])
def test_unshard_mistakes_are_named(wrong, case, contains):
    assert_public_case_fails("15.5", wrong, case, contains=contains)


@pytest.mark.parametrize("wrong, case, contains", [
    (zero_memory_off_by_one, "the ZeRO paper's Figure 1", "that is stage 2's memory"),
    (zero_memory_k8, "the ZeRO paper's Figure 1", "K = 8 counts only"),
])
def test_memory_mistakes_are_named(wrong, case, contains):
    assert_public_case_fails("15.2", wrong, case, contains=contains)


@pytest.mark.parametrize("wrong, case, contains", [
    (comm_volume_like_dp, "Psi = 1e9, d = 8", "this is plain DP's volume"),
    (comm_volume_no_ring, "Psi = 1e9, d = 8", "(d-1)/d"),
])
def test_volume_mistakes_are_named(wrong, case, contains):
    assert_public_case_fails("15.3", wrong, case, contains=contains)


@pytest.mark.parametrize("wrong, case, contains", [
    (peak_one_unit, "4 units", "one unit only"),
    (peak_unpadded, "4 units", "not padded"),
    (peak_two_largest, "4 units", "the two largest units"),
    (peak_all, "4 units", "every unit"),
    (peak_wrapped, "4 units", "the last unit was paired with the first"),
    (peak_float_off, "4 units", "expected a whole number of elements, got float 7362.5"),
])
def test_peak_mistakes_are_named(wrong, case, contains):
    assert_public_case_fails("15.4", wrong, case, contains=contains)


def test_volume_learner_round_mistakes_are_named():
    """Issue 36's learner round: stages 1-2 given stage 3's volume, or half of DP's."""
    assert_public_case_fails("15.3", lambda psi, d, st: (3 if st >= 1 else 2) * (d - 1) / d * psi, "Psi = 1e9",
                             contains="that is stage 3's volume: stage 1 keeps whole parameters")
    assert_public_case_fails("15.3", lambda psi, d, st: (1 if st in (1, 2) else 3 if st == 3 else 2) * (d - 1) / d
                             * psi, "Psi = 1e9", contains="half: a reduce-scatter of the gradients alone")


def test_strided_shards_are_named():
    """Issue 36's learner round: every d-th element per rank instead of a contiguous piece."""
    assert_public_case_fails("15.1", lambda flat, d: list(torch.cat([flat, flat.new_zeros((-flat.numel()) % d)])
                                                          .view(-1, d).t()),
                             "n = 10 over d = 4", contains="every d-th element: rank r's shard must be one contiguous")


def zero_memory_optimizer_in_gb(psi, d, stage):
    """Wrong: the weights and gradients in bytes, the optimizer state in GB."""
    return ((2 / d if stage >= 3 else 2) * psi + (2 / d if stage >= 2 else 2) * psi
            + (12 / d if stage >= 1 else 12) * psi / 1e9)


def zero_memory_in_gib(psi, d, stage):
    """Wrong: all of it in GiB."""
    return zero_memory(psi, d, stage) / 2 ** 30


@pytest.mark.parametrize("wrong, contains", [
    (zero_memory_optimizer_in_gb, "the fp32 optimizer state counted in GB, the rest in bytes"),
    (zero_memory_in_gib, "that is the memory in GiB: the number of bytes is asked"),
])
def test_memory_with_a_part_in_gigabytes_is_named(wrong, contains):
    """Issue 36: 15.2 with one part in GB got its value and no mistake."""
    assert_public_case_fails("15.2", wrong, "the ZeRO paper's Figure 1", contains=contains)
