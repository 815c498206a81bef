"""Per-client state kept only for the clients that have one.

Under cohort sampling most of K clients may never take part, so a dense (K, P) buffer of personal
models, control variates or error-feedback residuals holds K copies of the model where only the
sampled clients' ever change. A `ClientTable` stores the rows of the clients written so far
(`ids`, sorted, and `rows`) and reads every other client as `initial`. Its buffers change size as
clients are added: a checkpoint (or a Flower node's kept state) holds exactly the written rows,
and loading one resizes the table to them.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


class ClientTable(nn.Module):
    """Rows of shape `initial.shape` for the clients written so far; `initial` for the others."""

    initial: Tensor  # (*shape,)
    ids: Tensor  # (k,) sorted client ids
    rows: Tensor  # (k, *shape)

    def __init__(self, initial: Tensor) -> None:
        super().__init__()
        self.register_buffer("initial", initial.detach().clone(), persistent=False)
        self.register_buffer("ids", torch.zeros(0, dtype=torch.long, device=initial.device))
        self.register_buffer("rows", initial.new_zeros((0, *initial.shape)))

    def __len__(self) -> int:
        return len(self.ids)

    def _find(self, clients: Tensor) -> tuple[Tensor, Tensor]:
        """Positions of `clients` (m,) in `ids` and whether each is there: (m,), (m,) bool."""
        clients = clients.to(self.ids.device, torch.long)
        positions = torch.searchsorted(self.ids, clients)
        inside = positions < len(self.ids)
        present = torch.zeros_like(inside)
        present[inside] = self.ids[positions[inside]] == clients[inside]
        return positions, present

    def read(self, clients: Tensor) -> Tensor:
        """Each client's row, `initial` for one never written: (m,) -> (m, *shape) (a copy)."""
        positions, present = self._find(clients)
        values = self.initial.expand(len(clients), *self.initial.shape).clone()
        values[present] = self.rows[positions[present]]
        return values

    @torch.no_grad()
    def write(self, clients: Tensor, values: Tensor) -> None:
        """Set the rows of `clients` (m,) distinct ids to `values` (m, *shape), adding new clients."""
        positions, present = self._find(clients)
        values = values.to(self.rows)
        self.rows[positions[present]] = values[present]
        new = ~present
        if new.any():  # one sorted merge per call: rows are copied once per round, not per client
            ids = torch.cat([self.ids, clients.to(self.ids)[new]])
            order = torch.argsort(ids)
            self.ids, self.rows = ids[order], torch.cat([self.rows, values[new]])[order]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # the saved table may hold more or fewer clients than this one: take its size first
        for name in ("ids", "rows"):
            saved = state_dict.get(prefix + name)
            if isinstance(saved, Tensor):
                current = getattr(self, name)
                setattr(self, name, current.new_empty(saved.shape))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
