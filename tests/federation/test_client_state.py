"""ClientTable: per-client state for the clients that have one, read as `initial` for the rest,
checkpointed at its current size and loaded into a table of any size."""
from __future__ import annotations

import torch

from workbench.federation.client_state import ClientTable


def test_unwritten_clients_read_the_initial_row_and_written_ones_their_own():
    table = ClientTable(torch.tensor([1.0, 2.0]))
    assert len(table) == 0
    torch.testing.assert_close(table.read(torch.tensor([7, 3])), torch.tensor([[1.0, 2.0], [1.0, 2.0]]))
    table.write(torch.tensor([9, 3]), torch.tensor([[9.0, 9.0], [3.0, 3.0]]))
    table.write(torch.tensor([5, 9]), torch.tensor([[5.0, 5.0], [-9.0, -9.0]]))  # one new, one updated
    assert table.ids.tolist() == [3, 5, 9] and len(table) == 3
    read = table.read(torch.tensor([9, 0, 3, 5, 12]))
    torch.testing.assert_close(read, torch.tensor([[-9.0, -9.0], [1.0, 2.0], [3.0, 3.0], [5.0, 5.0], [1.0, 2.0]]))
    read[0] = 100.0  # a copy: the table is not changed through it
    assert table.read(torch.tensor([9]))[0, 0] == -9.0


def test_a_table_holds_only_the_clients_written_however_many_there_could_be():
    """10,000 possible clients, 3 cohorts of 50: at most 150 rows, never 10,000."""
    table = ClientTable(torch.zeros(1000))
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(3):
        cohort = torch.randperm(10_000, generator=gen)[:50].sort().values
        table.write(cohort, torch.randn(50, 1000, generator=gen))
        seen |= set(cohort.tolist())
    assert table.ids.tolist() == sorted(seen) and table.rows.shape == (len(seen), 1000)


def test_state_dict_round_trip_resizes_the_table_it_loads_into():
    saved = ClientTable(torch.zeros(2, 3, dtype=torch.float64))
    saved.write(torch.tensor([4, 1]), torch.arange(12, dtype=torch.float64).reshape(2, 2, 3))
    state = saved.state_dict()
    assert set(state) == {"ids", "rows"}  # `initial` is rebuilt from the settings, not saved
    for fresh in (ClientTable(torch.zeros(2, 3, dtype=torch.float64)), saved_with_more_rows()):
        fresh.load_state_dict(state)
        assert fresh.ids.tolist() == [1, 4]
        torch.testing.assert_close(fresh.read(torch.tensor([1, 4, 0])),
                                   torch.cat([saved.read(torch.tensor([1, 4])),
                                              torch.zeros(1, 2, 3, dtype=torch.float64)]))


def saved_with_more_rows() -> ClientTable:
    table = ClientTable(torch.zeros(2, 3, dtype=torch.float64))
    table.write(torch.arange(5), torch.ones(5, 2, 3, dtype=torch.float64))
    return table

