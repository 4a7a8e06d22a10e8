"""`vartrace.staging.dense`: the keys of plain dense CPU records, compared bit for bit."""

from __future__ import annotations

import torch

from vartrace.staging.dense import DenseCopy, keyed, unchanged
from vartrace.tensors import same


def test_a_plain_record_is_keyed_and_a_complex_one_is_compared_by_value() -> None:
    real = torch.arange(6.0).reshape(2, 3)
    assert isinstance(keyed(real, real.nbytes), DenseCopy)
    complex_record = torch.ones(3, dtype=torch.complex64)
    assert keyed(complex_record, complex_record.nbytes) is complex_record


def test_keys_compare_as_same_does_bit_for_bit() -> None:
    nan, other_nan = torch.tensor([float("nan")]), torch.tensor([float("nan")])
    other_nan.view(torch.int32).add_(1)  # another NaN payload
    pairs = [
        (torch.zeros(4), torch.zeros(4)),
        (torch.zeros(4), torch.tensor([0.0, 0.0, 0.0, -0.0])),
        (nan, nan.clone()),
        (nan, other_nan),
        (torch.zeros(4), torch.zeros(2, 2)),  # the same bytes in another shape
        (torch.zeros(4), torch.zeros(4, dtype=torch.int32)),  # ... of another dtype
        (torch.zeros(0), torch.zeros(0)),
        (torch.ones(3, dtype=torch.bool), torch.ones(3, dtype=torch.bool)),
    ]
    for a, b in pairs:
        verdict = same(a, b)
        assert unchanged(keyed(a, a.nbytes), keyed(b, b.nbytes)) is verdict, (a, b)
        assert unchanged(keyed(a, a.nbytes), b) is verdict  # one side a plain tensor
        assert unchanged(a, keyed(b, b.nbytes)) is verdict


def test_a_last_record_resized_in_place_is_compared_as_it_is_now() -> None:
    last = keyed(torch.ones(4), 16)
    last.tensor.resize_(1 << 16)  # a callback's resize_: the bytes move
    last.tensor.fill_(1.0)
    assert unchanged(keyed(torch.ones(4), 16), last) is False  # its shape now differs
    last.tensor.resize_(4)  # back to the shape of the key, in the new storage
    assert unchanged(keyed(torch.ones(4), 16), last) is True
