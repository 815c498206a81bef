"""Several processes under Lightning's DDP: whole clients per process, uploads combined across processes.

A multi-process round is: every process runs the client updates of its own clients (a disjoint
set of whole clients, `client_shard`, each process keeping those clients' state), the partial
sums are all-reduced (stacked uploads gathered in client order, masked messages summed in the
ring), and every process runs the same server update on the same total, ending
with the same model (rank 0's model is then broadcast, so GPU kernels that are not bitwise
reproducible cannot make processes drift apart). Features are extracted once: with several
processes the data module's `prepare_data` extracts and caches them on one process per node
while the others wait, and every process's `setup` reads the cache.

Whole clients matter: a client cut across processes would add a per-client term (AFL's γI) twice,
and Lightning's DistributedSampler pads its shards by repeating samples, which a sum would count
twice. `FederatedDDPStrategy` is therefore Lightning's `DDPStrategy` (the process launch, the
process group — gloo on CPUs, NCCL on GPUs — and the collectives) with two changes: the data
module splits clients itself, so every loader reaches each process whole (no sampler cut, no
padding); and the module is not wrapped in `DistributedDataParallel`, which exists to all-reduce
gradients and would broadcast every buffer before each step (and refuses modules without
trainable parameters, such as every analytic method).

On the command line `--trainer.strategy=ddp` selects it; in Python pass
`Trainer(strategy=FederatedDDPStrategy(), devices=2, accelerator="cpu")` or
`strategy="federated_ddp"`.
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, cast

import torch
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch import Tensor, nn

from workbench.engines.local import LocalClients
from workbench.engines.round import Replies, RoundRequest, add_metrics, layout_of
from workbench.federation.secure_aggregation import ring_sum

if TYPE_CHECKING:
    from workbench.engines.lightning import LightningEngine


class FederatedDDPStrategy(DDPStrategy):
    """Lightning's DDP for federated methods: whole clients per process, no gradient wrapper."""

    strategy_name = "federated_ddp"

    def configure_ddp(self) -> None:
        # No DistributedDataParallel: rounds synchronize their own statistics. Start every
        # process from rank 0's global model (each process keeps its own clients' state).
        broadcast_module_state(cast("LightningEngine", self.model).method)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # Clients, not samples, are split across processes (by the data module): a sampler
        # Lightning injects then passes each loader through whole.
        return {"num_replicas": 1, "rank": 0}


if FederatedDDPStrategy.strategy_name not in StrategyRegistry:
    StrategyRegistry.register(FederatedDDPStrategy.strategy_name, FederatedDDPStrategy,
                              description="DDP for federated methods: whole clients per process")


def client_shard(client_ids: Tensor, rank: int, world_size: int) -> slice:
    """The rows of the whole clients process `rank` of `world_size` runs, as one slice.

    client_ids: (n,) ordered by client (as the data module keeps them). The rows are cut into
    `world_size` equal runs and each client goes to the run its middle row falls in, so
    processes get about n / world_size rows each and no client is split; that choice is bounded
    so that every process gets at least one client (owners never skip a process, and enough
    clients are left for the processes after).
    """
    n = len(client_ids)
    if n and bool((client_ids[1:] < client_ids[:-1]).any()):
        raise ValueError("client_shard needs the training rows ordered by client id")
    changes = (client_ids[1:] != client_ids[:-1]).nonzero().squeeze(1) + 1
    starts = torch.cat([changes.new_zeros(1), changes]).tolist() if n else []
    ends = [*starts[1:], n]
    if len(starts) < world_size:
        raise ValueError(
            f"process {rank} of {world_size} would get no client: only {len(starts)} clients hold training "
            f"data; run on fewer devices (trainer.devices), or partition the data into more clients")
    owners, previous = [], -1  # the first client goes to process 0
    for k, (start, end) in enumerate(zip(starts, ends, strict=True)):
        balanced = (start + end) * world_size // (2 * n)
        lowest = max(previous, world_size - len(starts) + k)  # the clients left must cover the processes left
        owners.append(previous := min(max(balanced, lowest), previous + 1, world_size - 1))
    mine = [k for k, owner in enumerate(owners) if owner == rank]
    return slice(starts[mine[0]], ends[mine[-1]])


def sum_across_processes(tensor: Tensor, strategy) -> Tensor:
    """Σ over processes of `tensor` (all-reduce, the same result on every process)."""
    return strategy.reduce(tensor, reduce_op="sum")


def end_processes() -> None:
    """Destroys this process's process group, if any: a group left to the interpreter's exit can
    abort the process ("terminate called without an active exception", gloo's threads still
    running) after its work is done. Every process of a multi-process run calls it last.

    Before torch 2.8 the `ProcessGroup` wrapper was freed with the GIL held while gloo's
    destructor joins its worker threads, and a worker still freeing the tensors of a finished
    collective (Lightning's `broadcast_object_list` of `trainer.log_dir`, a moment earlier) waits
    for the GIL: both wait forever (pytorch#56297, fixed by #154976). The gloo backend's own
    binding releases the GIL when it is freed, so this holds the backend past the group and lets
    go of it last: the group's last reference (`world`) goes first, then the backend's. (Freeing
    them the other way round hung about one two-process fit in five under torch 2.4.1.)"""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    world = torch.distributed.group.WORLD
    gloo = (world._get_backend(torch.device("cpu"))
            if world is not None and torch.distributed.get_backend() == "gloo" else None)
    torch.distributed.destroy_process_group()
    del world  # the group first: it drops its reference to the backend, not the last one
    del gloo  # the last reference: ~ProcessGroupGloo joins its threads with the GIL released


def broadcast_module_state(module: nn.Module) -> None:
    """Overwrite every parameter and buffer with rank 0's (no-op without a process group)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    with torch.no_grad():
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            torch.distributed.broadcast(tensor, src=0)


class ProcessClients:
    """This process's whole clients (`LocalClients`) as one `Transport` of a multi-process round:
    each process runs its own clients' step, and what reached the server is combined across the
    processes (`combine_replies`), so every process runs the same server update on the same total."""

    def __init__(self, local: LocalClients, strategy) -> None:
        self.local, self.strategy = local, strategy

    @property
    def half(self):
        return self.local.half

    @property
    def served(self) -> Tensor:
        return self.local.served

    def update(self, request: RoundRequest) -> Replies:
        replies = self.local.update(request)
        return combine_replies(replies, request.spec, self.strategy, request.secure is not None)

    def finish(self, broadcast) -> tuple[dict[str, float], float]:
        metric_sums, seconds = self.local.finish(broadcast)
        total = sum_metrics(metric_sums, seconds, self.strategy)
        return total, total.pop("__client_s")

    def predict(self, features: Tensor, client_ids: Tensor) -> Tensor:
        return self.local.predict(features, client_ids)


def combine_replies(replies: Replies, spec, strategy, masked: bool) -> Replies:
    """One process's `Replies` -> every process's, combined: sums all-reduced, stacks gathered in
    client order (processes hold increasing client ids), masked ring sums summed in the ring."""
    import torch.distributed as dist

    world = strategy.world_size
    gathered: list = [None] * world
    mine_layout = replies.layout or (layout_of(replies.uploads) if replies.uploads else None)
    dist.all_gather_object(gathered, (mine_layout is not None and
                                      {n: (tuple(v.shape), v.dtype) for n, v in mine_layout.items()},
                                      replies.metric_sums, replies.client_s, replies.bytes_up))
    shapes = next((shapes for shapes, *_ in gathered if shapes), None)
    if shapes is None:
        raise RuntimeError("no process received an upload this round")
    layout = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in shapes.items()}
    combined = Replies(layout=layout, client_s=sum(seconds for _, _, seconds, _ in gathered),
                       bytes_up=sum(sent for *_, sent in gathered))
    for _, metrics, _, _ in gathered:
        add_metrics(combined.metric_sums, metrics)
    if masked:
        elements = replies.masked if replies.masked is not None else torch.zeros(0, dtype=torch.int64)
        parts: list = [None] * world
        dist.all_gather_object(parts, elements.cpu())
        combined.masked = ring_sum([part for part in parts if len(part)])
        return combined
    uploads = {}
    for name in sorted(layout):  # the same order of collectives everywhere
        if spec[name].stacked:
            rows: list = [None] * world
            mine = replies.uploads[name].cpu() if replies.uploads else None
            dist.all_gather_object(rows, mine)
            uploads[name] = torch.cat([part for part in rows if part is not None]).to(strategy.root_device)
        else:  # a process whose clients all dropped out adds zero
            mine = (replies.uploads[name] if replies.uploads
                    else torch.zeros(layout[name].shape, dtype=layout[name].dtype))
            uploads[name] = sum_across_processes(mine.to(strategy.root_device), strategy)
    combined.uploads = uploads
    return combined


def sum_metrics(metric_sums: dict[str, float], seconds: float, strategy) -> dict[str, float]:
    """Metric sums and seconds (as `__client_s`) summed over processes."""
    import torch.distributed as dist

    gathered: list = [None] * strategy.world_size
    dist.all_gather_object(gathered, {**metric_sums, "__client_s": seconds})
    total: dict[str, float] = {}
    for part in gathered:
        add_metrics(total, part)
    return total
