"""`vartrace.staging.ring.HostRing`: slots of host memory for records, returned when their
last view dies, and the stager's own small tensors beside them."""

from __future__ import annotations

import torch

from vartrace.staging.ring import HostRing

MIB = 1 << 20


def _records(ring: HostRing, count: int) -> list[torch.Tensor]:
    """`count` float32 records of 1 MiB, each a slot of `ring`, written through."""
    records = [ring.tensor((MIB // 4,), torch.float32) for _ in range(count)]
    for index, record in enumerate(records):
        record.fill_(index)
    return records


def test_records_fill_the_capacity_and_their_slots_come_back_when_their_views_die() -> None:
    ring = HostRing(4 * MIB, pin=False)
    records = _records(ring, 4)
    assert ring.used == ring.peak == 4 * MIB and ring.overflows == 0
    assert len({record.data_ptr() for record in records}) == 4
    assert [record[-1].item() for record in records] == [0.0, 1.0, 2.0, 3.0]  # no overlap
    view = records[1][:8]  # a view keeps its slot, whoever holds it
    del records[:2]
    assert ring.used == 3 * MIB
    del view
    assert ring.used == 2 * MIB
    records += _records(ring, 2)  # the freed slots, reused
    assert ring.used == 4 * MIB and ring.overflows == 0


def test_a_record_past_the_capacity_gets_memory_of_its_own() -> None:
    ring = HostRing(4 * MIB, pin=False)
    records = _records(ring, 5)
    assert ring.overflows == 1 and ring.used == 4 * MIB
    assert all(record[0].item() == index for index, record in enumerate(records))


def test_the_stagers_own_small_tensors_never_take_a_records_room() -> None:
    """A ring holding exactly the records its capacity was sized for (the step's bound on
    records in flight, and the chunk and saver's share) has room for a batch's change flags:
    they once took a record's 256 bytes, and the record then overflowed."""
    ring = HostRing(4 * MIB, pin=False)
    flags = [ring.bookkeeping((3,), torch.bool) for _ in range(2)]
    records = _records(ring, 4)
    flags.append(ring.bookkeeping((300,), torch.bool))
    assert ring.overflows == 0 and ring.used == 4 * MIB
    addresses = {tensor.data_ptr() for tensor in flags}
    assert len(addresses) == 3
    assert not any(
        record.data_ptr() <= address < record.data_ptr() + MIB
        for record in records
        for address in addresses
    )
    del flags
    assert ring.used == 4 * MIB
    del records
    assert ring.used == 0


def test_small_tensors_past_their_segment_come_from_the_records_capacity() -> None:
    ring = HostRing(4 * MIB, pin=False)
    large = ring.bookkeeping((256 << 10,), torch.bool)  # more than the bookkeeping segment
    assert ring.used == 256 << 10 and ring.overflows == 0
    del large
    assert ring.used == 0
