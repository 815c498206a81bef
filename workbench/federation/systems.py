"""Where the clients run: device and network profiles, and the simulated clock of a fit.

`time/*` are this machine's seconds. A federation's round lasts as long as its slowest client
takes to download the broadcast, compute and upload on *its* link and device; `Systems` gives every
client such a profile and the engine keeps a simulated clock with it (`latency/round_s`,
`latency/total_s`):

    client i's latency = rtt + 8·bytes_down / down_bps_i + rows_i · row_s / speed_i + 8·bytes_up / up_bps_i
    round's latency    = when the server closes the round + the server's own seconds (measured here)

- the bytes are the round's messages as the protocol sends them (`comm/*`: the broadcast, and
  each client's upload on the wire, masked under secure aggregation);
- `row_s` is this machine's seconds per training row of the method's client step: measured once
  per fit on round 0's step of the cohort's largest client (a throwaway copy of its client half,
  the fastest of five after one to warm up), or set (`systems.row_s`) for clients' latencies that
  rerun bit for bit; `speed_i` scales it to the client's device (0.25: four times slower than this
  machine);
- the server closes the round when every surviving client has replied; with a `deadline_s` it
  waits until the deadline at most, and clients that would reply later are stragglers: they
  compute, their uploads are not used (the protocol's dropout machinery); with `over_select` o
  it asks ⌈m·(1 + o)⌉ clients for the m of `federation.sample_rate` and closes on the m-th reply;
- `availability` p: each round each client is online with probability p (seeded by (seed, round));
  clients offline are not asked.

The profiles are drawn per client from `seed`: each median below times exp(spread · z), one
z ~ N(0, 1) for the client's link (both directions) and another for its device. Without a
deadline, over-selection or availability below 1 the clock only observes: accuracy and bytes
are those of the fit without it.

Presets (medians; the spreads and device speeds are assumptions, to edit for a deployment):

| preset       | down Mbit/s | up Mbit/s | RTT ms | speed | spread |
|--------------|------------:|----------:|-------:|------:|-------:|
| `cellular`   | 36          | 11        | 40     | 0.25  | 1.0    |
| `wifi`       | 86          | 46        | 21     | 0.5   | 0.7    |
| `datacenter` | 1000        | 1000      | 30     | 1.0   | 0.1    |

Sources: `cellular` is the world median of mobile tests in Ookla's Speedtest Global Index (Sept.
2020), `wifi` the same index's fixed broadband median (a home's Wi-Fi rides on it); `datacenter`
is an assumed 1 Gbit/s cross-region link between silos. docs/latency.md says more.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from workbench.console import RunOutcome
from workbench.federation.protocol import Federation
from workbench.linalg import stream_generator

# random streams of the clock, beside the protocol's (`protocol.DROPOUT_STREAM` …)
PROFILE_STREAM, AVAILABILITY_STREAM = 10, 11


class EveryClientLate(RunOutcome):
    """No client of a round can reply before its deadline: the fit cannot go on (an outcome of the
    method's message size and the links, not a fault)."""


class EveryClientOffline(RunOutcome):
    """No client is online in a round (`availability`)."""


@dataclass(frozen=True)
class Profile:
    """One kind of client: medians of its link and device."""

    down_mbps: float
    up_mbps: float
    rtt_ms: float
    speed: float
    spread: float


PRESETS = {
    "cellular": Profile(down_mbps=36.0, up_mbps=11.0, rtt_ms=40.0, speed=0.25, spread=1.0),
    "wifi": Profile(down_mbps=86.0, up_mbps=46.0, rtt_ms=21.0, speed=0.5, spread=0.7),
    "datacenter": Profile(down_mbps=1000.0, up_mbps=1000.0, rtt_ms=30.0, speed=1.0, spread=0.1),
}


@dataclass(frozen=True)
class Systems:
    """The clients' devices and links, and the round's deadline (a config's `systems:` section).

    Args:
        preset: `cellular`, `wifi` or `datacenter` (None: no profiles, unless every link
            setting below is given).
        down_mbps, up_mbps, rtt_ms, speed, spread: override the preset's medians: download and
            upload bandwidth (Mbit/s), round-trip time (ms), compute speed relative to this
            machine, and the log-normal spread σ of the per-client draws (0: every client alike).
        availability: the probability that a client is online in a round, in (0, 1].
        deadline_s: simulated seconds the server waits for a round's replies; later ones are
            stragglers, dropped (None: it waits for every client).
        over_select: o ≥ 0: ask ⌈m·(1 + o)⌉ clients for the m of `federation.sample_rate` < 1
            and keep the first m replies.
        row_s: this machine's seconds per training row of the method's client step (None:
            measured once per fit).
        seed: the seed of the per-client draws and of availability.
    """

    preset: str | None = None
    down_mbps: float | None = None
    up_mbps: float | None = None
    rtt_ms: float | None = None
    speed: float | None = None
    spread: float | None = None
    availability: float = 1.0
    deadline_s: float | None = None
    over_select: float = 0.0
    row_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"systems.preset must be one of {', '.join(sorted(PRESETS))} (or unset with down_mbps, "
                             f"up_mbps and rtt_ms given), got {self.preset!r}")
        links = {"down_mbps": self.down_mbps, "up_mbps": self.up_mbps, "rtt_ms": self.rtt_ms}
        if self.preset is None and any(value is not None for value in links.values()):
            unset = [name for name, value in links.items() if value is None]
            if unset:
                raise ValueError(f"systems without a preset needs down_mbps, up_mbps and rtt_ms: set "
                                 f"{', '.join(unset)}, or a preset ({', '.join(sorted(PRESETS))})")
        for name in ("down_mbps", "up_mbps", "speed"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"systems.{name} must be > 0, got {value}")
        for name in ("rtt_ms", "spread", "over_select"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"systems.{name} must be ≥ 0, got {value}")
        if not 0 < self.availability <= 1:
            raise ValueError(f"systems.availability must be in (0, 1] (a client's chance to be online in a "
                             f"round), got {self.availability}")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(f"systems.deadline_s must be > 0 simulated seconds (or unset), got {self.deadline_s}")
        if self.row_s is not None and not self.row_s >= 0:
            raise ValueError(f"systems.row_s must be ≥ 0 seconds per row (or unset: measured), got {self.row_s}")
        if not 0 <= self.seed < 2 ** 63:
            raise ValueError(f"systems.seed must be an integer in [0, 2⁶³), got {self.seed}")
        acting = {"deadline_s": self.deadline_s is not None, "over_select": self.over_select > 0,
                  "availability": self.availability < 1, "speed": self.speed is not None,
                  "spread": self.spread is not None, "row_s": self.row_s is not None}
        if not self.active and any(acting.values()):
            named = ", ".join(name for name, is_set in acting.items() if is_set)
            raise ValueError(f"systems.{named} acts on the clients' profiles, and there are none: set "
                             f"systems.preset ({', '.join(sorted(PRESETS))}) or down_mbps, up_mbps and rtt_ms")

    @property
    def active(self) -> bool:
        """Whether the clients have profiles (and the fit a simulated clock)."""
        return self.preset is not None or self.down_mbps is not None

    @property
    def drops_stragglers(self) -> bool:
        """Whether late replies are dropped (a deadline, or over-selection's first replies kept):
        decided before the replies, from each client's predicted latency."""
        return self.deadline_s is not None or self.over_select > 0

    @property
    def decides(self) -> bool:
        """Whether the profiles change who takes part (else the clock only observes)."""
        return self.drops_stragglers or self.availability < 1

    def profile(self) -> Profile:
        """The medians: the preset's, overridden by what is set."""
        base = PRESETS[self.preset] if self.preset is not None else Profile(0.0, 0.0, 0.0, 1.0, 0.0)
        return Profile(*(base_value if value is None else float(value) for value, base_value in (
            (self.down_mbps, base.down_mbps), (self.up_mbps, base.up_mbps), (self.rtt_ms, base.rtt_ms),
            (self.speed, base.speed), (self.spread, base.spread))))

    def describe(self) -> str:
        """One line for the run's summary."""
        p = self.profile()
        name = self.preset or "custom"
        text = (f"{name}: {p.down_mbps:g}/{p.up_mbps:g} Mbit/s down/up, RTT {p.rtt_ms:g} ms, speed {p.speed:g}×, "
                f"spread {p.spread:g}")
        extras = [f"deadline {self.deadline_s:g} s" if self.deadline_s is not None else "",
                  f"over-selection {self.over_select:g}" if self.over_select else "",
                  f"availability {self.availability:g}" if self.availability < 1 else ""]
        return ", ".join([text, *filter(None, extras)])


def check_systems(systems: Systems, federation: Federation, in_process: bool = True) -> None:
    """Refuse, before any round, systems settings the protocol cannot honour."""
    if systems.over_select > 0 and not (federation.sample_rate < 1 and federation.sampling == "fixed"):
        raise ValueError(f"systems.over_select asks more clients than a round's cohort: set federation.sample_rate "
                         f"< 1 with sampling=fixed (the cohort it over-selects), got sample_rate = "
                         f"{federation.sample_rate}, sampling = {federation.sampling}")
    if systems.over_select > 0 and federation.client_level_dp:
        raise ValueError("systems.over_select keeps the fastest clients, which breaks the uniform sampling that "
                         "client-level DP's accounting assumes: set systems.over_select=0 or federation.dp_clip=0")
    if not in_process and (systems.drops_stragglers or systems.row_s is None):
        raise ValueError("the simulated clock measures the client step in process, and its deadline and "
                         "over-selection decide before the clients reply: with clients in other processes or "
                         "on Flower, set systems.row_s (seconds per training row) and leave deadline_s and "
                         "over_select unset (Flower's real deadline is flower.deadline_s)")


@dataclass(frozen=True)
class ClientProfiles:
    """Every client's link and device, (K,) float64 each: bits per second down and up, round-trip
    seconds, compute speed relative to this machine."""

    down_bps: Tensor
    up_bps: Tensor
    rtt_s: Tensor
    speed: Tensor

    @classmethod
    def draw(cls, systems: Systems, num_clients: int) -> ClientProfiles:
        """The K clients' profiles: the medians times exp(spread · z), z ~ N(0, 1) drawn from
        `systems.seed` (one z for the link, one for the device)."""
        p = systems.profile()
        z = torch.randn(2, num_clients, generator=stream_generator(systems.seed, PROFILE_STREAM), dtype=torch.float64)
        link, device = torch.exp(p.spread * z[0]), torch.exp(p.spread * z[1])
        return cls(down_bps=p.down_mbps * 1e6 * link, up_bps=p.up_mbps * 1e6 * link,
                   rtt_s=torch.full((num_clients,), p.rtt_ms / 1e3, dtype=torch.float64), speed=p.speed * device)


@dataclass
class RoundClock:
    """What the clock decided of one round: who was late, and when the server closed it."""

    stragglers: Tensor  # (m,) bool over the cohort
    close_s: float | None  # the deadline or the m-th reply where they closed the round, else None
    first_s: float  # the earliest reply's latency


class SimulatedClock:
    """The simulated clock of one fit: the clients' profiles, their training rows, this
    machine's seconds per row of the method's client step and the last upload's size.

    rows: (K,) training rows per client; row_s, upload_bytes: a resumed fit's measurements.
    """

    def __init__(self, systems: Systems, rows: Tensor, row_s: float | None = None,
                 upload_bytes: float | None = None) -> None:
        self.systems = systems
        self.profiles = ClientProfiles.draw(systems, len(rows))
        self.rows = rows.detach().to("cpu", torch.float64)
        self.row_s = systems.row_s if systems.row_s is not None else row_s
        self.upload_bytes = upload_bytes  # one client's message, as last sent

    def online(self, round_index: int, available: Tensor) -> Tensor:
        """The `available` clients online in round `round_index` (each with probability p)."""
        p = self.systems.availability
        if p == 1:
            return available
        stream = stream_generator(self.systems.seed, AVAILABILITY_STREAM, round_index)
        draws = torch.rand(len(self.rows), generator=stream)
        online = available[(draws < p).to(available.device)[available]]
        if len(online) == 0:
            raise EveryClientOffline(f"round {round_index}: no client is online (systems.availability = {p}, "
                                     f"{len(available)} clients): raise the availability")
        return online

    def asked(self, target: int, available: int) -> int:
        """How many clients to ask for `target` replies out of `available` (over-selection)."""
        return min(available, math.ceil(target * (1 + self.systems.over_select)))

    def latencies(self, clients: Tensor, bytes_down: float, bytes_up: float) -> Tensor:
        """(m,) float64: each client's simulated seconds from the broadcast to its reply."""
        ids = clients.cpu()
        p = self.profiles
        compute = self.rows[ids] * (self.row_s or 0.0) / p.speed[ids]
        return p.rtt_s[ids] + 8 * bytes_down / p.down_bps[ids] + compute + 8 * bytes_up / p.up_bps[ids]

    def decide(self, cohort: Tensor, replying: Tensor, target: int | None, bytes_down: float) -> RoundClock:
        """Who of the `cohort` (sorted ids) misses the round: with a deadline, those replying after
        it; with over-selection, all but the `target` first replies. `replying` (m,) bool: the
        clients that would reply at all (not the protocol's dropouts)."""
        late = torch.zeros(len(cohort), dtype=torch.bool)
        arrival = self.latencies(cohort, bytes_down, self.upload_bytes or 0.0)
        replying = replying.cpu()
        close = None
        deadline = self.systems.deadline_s
        if deadline is not None:
            late = replying & (arrival > deadline)
            if late.any() or not replying.all():  # the server cannot know they will not come: it waits
                close = deadline
        if target is not None and self.systems.over_select > 0:
            on_time = torch.nonzero(replying & ~late).flatten()
            order = on_time[torch.argsort(arrival[on_time], stable=True)]
            if len(order) >= target:
                late[order[target:]] = True
                close = float(arrival[order[target - 1]])
        return RoundClock(late, close, float(arrival.min()) if len(arrival) else math.inf)

    def round_seconds(self, survivors: Tensor, bytes_down: float, bytes_up: float, decided: RoundClock | None,
                      server_s: float) -> float:
        """The round's simulated seconds: the latest survivor's reply, or when the server closed
        it, plus the server's seconds."""
        last = float(self.latencies(survivors, bytes_down, bytes_up).max()) if len(survivors) else 0.0
        close = decided.close_s if decided is not None and decided.close_s is not None else last
        return max(close, last) + server_s  # a round cannot close before the last reply it used
