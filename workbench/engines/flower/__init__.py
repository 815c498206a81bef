"""The Flower engine (`--engine flower`): a method's rounds with its clients on Flower SuperNodes.

The server runs `LightningEngine` as in process (Lightning's loop, the protocol: dropouts,
secure aggregation, noise; logging, timing, checkpoints of the global model); only its clients
transport differs: `FlowerClients` (`transport`) introduces itself to every SuperNode (one per
client, `partition-id` k) with the run's spec (method and data classes with their init
arguments), which the node keeps in its `context.state`; then it sends each round's cohort a
Message with only what the round needs: the round index, the plan's broadcast (not the learned
state), the fit's session and the spec's digest and, under secure aggregation, the round's
participants, seed and fixed-point bits. The ClientApp (`client_app`) builds the method and the
client half for its client from the kept spec once per node and run (the process keeps them;
a new fit or changed settings rebuild), keeps the half's buffers and parameters in the node's
own `context.state` (so clients keep their state across rounds: DeepAFL's Φ cache, Ditto's
personal heads, error feedback; a process that finds the node's state moved on restores it into
a fresh half), runs `client_update` on its own rows and replies with its uploads (symmetric ones
as upper triangles, `workbench.federation.codec`) or its masked ring vector. Dropped clients get the
message and compute too; their replies carry no upload. The server combines the survivors'
replies in client order (sums; stacked uploads concatenated). After the last round every client
gets the final broadcast and runs `finish`; for the local tests of personalized methods each
client scores its own local test split (`evaluate` messages; `LightningEngine` asks a transport
with `local_accuracy`). No method-specific code: any `FederatedMethod` runs.

Secure aggregation. Flower 1.42 ships `SecAggPlusWorkflow` with `secaggplus_mod`, but they do
not fit this engine: the workflow drives the legacy Strategy/`FitIns` path (it requires a
`LegacyContext` and a `NumPyClient`-style `FitRes` with `num_examples`), it clips and quantizes
floats to a small range (approximate sums; it also weights by num_examples) and it runs its own
four message stages per round. So our own masks travel in the Messages: each ClientApp builds
the round's `SecureAggregator` from the settings it receives and sends
`masked_upload(k, upload)` (int64 ring elements) with its layout (names, shapes, dtypes); the
server ring-sums the survivors' vectors and the round (`run_round`) unmasks the exact sum as in
process. As in process, the seeds derive from the federation seed; under SecAgg+
(`secure_aggregation_graph: sparse`) the settings carry the round's k and t, each ClientApp masks
along the same graph with its self-mask, and the server reconstructs the secrets it needs from
Shamir shares (simulated on the server: the share messages do not travel).

Metrics: the engine's own (`comm/*` count the arrays' payload bytes: the same as in process), and
`flower/bytes_up`, `flower/bytes_down` (the serialized arrays actually carried: numpy .npy bytes
with headers and names; downlink = the broadcast + that framing, per message) and
`flower/client_compute_s` and `flower/client_cpu_s` (the ClientApp handlers' wall seconds and
their threads' CPU seconds, message in to reply, state restored and saved included, summed).
`time/client_s` is the server's wait for its clients, transport included.

Running: `simulation.fit(trainer, engine, datamodule)` runs the fit and the test in a local Ray
simulation (one SuperNode per client; Ray's and Flower's files under the run folder), or on the
deployed grid inside `server_app`. `simulation.fit_over_flower(method, datamodule, ...)` is the
one-call form for tests. Deployed, a SuperLink and SuperNodes run `server_app:app` and
`client_app:app` (`write_app` writes the Flower App that `server_app submit` or `flwr run`
submits; `node` is a long-lived ClientApp for SuperNodes isolated by process; `local_deployment`
starts them all on loopback). The clients' state lives on their nodes while the Flower run lives:
checkpoints (`last.ckpt` every round) hold the global model and round, and a resumed fit's clients
start afresh on its new nodes.

Lost nodes: a round waits at most `FlowerSettings.deadline_s` for its replies; a client whose
reply does not come is dropped from the round (`Replies.missing`) and away until its node's late
reply or a new node holding its partition brings it back (`FlowerClients`, `rejoined`).
"""
INSTALL_HINT = ("the Flower engine needs Flower, an optional extra: pip install -e '.[flower]' "
                "(it installs flwr[simulation], which brings Ray)")

try:
    import flwr  # noqa: F401
except ImportError:  # the extra is not installed: the hint alone, not the import's traceback beside it
    raise ImportError(INSTALL_HINT) from None

from workbench.engines.flower.spec import RunSpec  # noqa: E402
from workbench.engines.flower.transport import FlowerClients, FlowerTraffic  # noqa: E402

__all__ = ["INSTALL_HINT", "FlowerClients", "FlowerTraffic", "RunSpec"]
