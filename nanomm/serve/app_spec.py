"""nanomm on Ray Serve's arguments, checked: what `serve run nanomm.serve.ray:app key=value ...` (or a YAML's
`args:`) says, with no Ray and no server stack, so the autoscaling simulator reads the same arguments
(nanomm/sim/autoscaling.py).

Lesson: lessons/15-scaling-each-pool.md.
"""

from dataclasses import dataclass, fields

from nanomm.serve.autoscaling import POLICIES, replica_capacity
from nanomm.topology import parse_topology

# A prefill replica's engine has no fixed encoder: every request names the one it leased. A request that did
# not would fail against this address, which never resolves (RFC 2606's .invalid).
PER_REQUEST_ENCODER = "http://per-request-encoder.invalid"


@dataclass
class AppSpec:
    """The application's arguments, checked. Every field is a `key=value` of `serve run` (strings there)."""
    topology: str = "1e1p1d"  # the one grammar: integrated, dp<N> or <X>e<Y>p<Z>d; its counts, first replicas
    model: str | None = None  # a checkpoint folder or hub id; or demo=, or emulate=
    demo: str | None = None  # "trained" or "random": the shipped demo model
    emulate: str | None = None  # GPU:MODEL: every replica on the emulated device (nanomm/emulate)
    served_model_name: str | None = None
    policy: str = "default"
    min_replicas: int = 1
    max_replicas: int = 1
    initial_replicas: int | None = None
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 30.0
    metrics_interval_s: float = 1.0
    look_back_period_s: float = 5.0
    window_s: float = 10.0  # each replica's load window
    target_ongoing_requests: float = 4.0  # policy "default"
    utilization: float = 0.7  # policy "load": the share of a replica's capacity to plan for
    encoder_capacity: float | None = None  # policy "load": visual tokens/s one replica serves (emulate: computed)
    prefill_capacity: float | None = None
    decode_capacity: float | None = None  # running sequences one decode (or integrated) replica serves
    tpot_slo_s: float = 0.05  # policy "load": a decode replica holds the sequences whose step fits this
    ttft_slo_s: float = 2.0  # policy "slo": the TTFT target, each pool answering to its share (SLO_SHARES)
    max_num_seqs: int = 64
    max_pixels: int | None = None
    peer_timeout_s: float = 30.0
    kv_handoff_timeout_s: float = 30.0
    num_cpus: float = 0.0  # Ray resources per replica (a real model on a GPU: num_gpus=1)
    num_gpus: float = 0.0
    routing: str = "load"  # how the router's pools of whole engines and prefill instances pick (serve/affinity.py)
    affinity_slack: float = 8192.0  # routing "affinity": prompt tokens a replica may hold beyond the least loaded's
    host: str = "127.0.0.1"  # where each replica serves its connector port; a multi-node cluster: "node"

    @classmethod
    def from_args(cls, args: dict) -> "AppSpec":
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(args) - set(known))
        if unknown:
            raise ValueError(f"unknown argument(s) {unknown}; the arguments are {sorted(known)}")
        values = {}
        for name, value in args.items():
            kind = str(known[name].type)
            try:
                values[name] = (value if value is None or not isinstance(value, str) or "str" in kind
                                else float(value) if "float" in kind else int(value))
            except ValueError:
                raise ValueError(f"{name}={value!r} is not a number") from None
        spec = cls(**values)
        spec.check()
        return spec

    @property
    def pools(self) -> dict[str, int]:
        """Each pool's role and its first replicas, from the topology's name."""
        topology = parse_topology(self.topology)
        if topology.shape == "<X>e<Y>pd":
            raise ValueError(f"topology {self.topology!r}: nanomm on Ray serves dp<N> (integrated) and <X>e<Y>p<Z>d")
        if topology.shape == "dp<N>":
            return {"integrated": topology.prefill}
        return {"encoder": topology.encoders, "prefill": topology.prefill, "decode": topology.decode}

    @property
    def split(self) -> bool:
        return "prefill" in self.pools

    def initial_replicas_of(self, role: str) -> int:
        return self.initial_replicas or max(self.min_replicas, self.pools[role])

    def check(self) -> None:
        pools = self.pools  # an unknown topology raises here, naming the grammar
        if self.routing not in ("affinity", "load") or self.affinity_slack < 0:
            raise ValueError(f"routing={self.routing!r}, affinity_slack={self.affinity_slack}: the routings are "
                             f"'affinity' and 'load', the slack >= 0")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown autoscaling policy {self.policy!r}; the policies are {list(POLICIES)}")
        if sum(x is not None for x in (self.model, self.demo, self.emulate)) != 1:
            raise ValueError("give exactly one of model=FOLDER_OR_HUB_ID, demo=trained|random, emulate=GPU:MODEL")
        if self.emulate is not None:
            from nanomm.emulate import parse_emulate

            parse_emulate(self.emulate)
        if self.demo is not None:
            from rich.console import Console

            from nanomm.demo import demo_folder

            if self.demo not in ("trained", "random"):
                raise ValueError(f"demo={self.demo!r}: the demo models are 'trained' and 'random'")
            self.model = str(demo_folder(self.demo, Console(stderr=True)))
        elif self.model is not None:
            from nanomm.model.loader import resolve_checkpoint

            self.model = str(resolve_checkpoint(self.model))  # a missing folder or hub id fails here, once
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {self.min_replicas}, {self.max_replicas}")
        if max(pools.values()) > self.max_replicas:
            raise ValueError(f"topology {self.topology!r} starts a pool with more than max_replicas={self.max_replicas}")
        if self.policy == "load":
            for role in pools:
                self.capacity(role)  # raises if it cannot be known

    @property
    def name(self) -> str:
        return self.served_model_name or self.emulate or ("nanomm-demo" if self.demo else self.model)

    def instance(self, role: str):
        """What cli.build_server takes for one replica of the role (an `InstanceSpec`): the Starlette app of
        `nanomm-serve --role ROLE` (encoder: the encoder service). A prefill replica starts allowing no encoder: it
        allows each one it leases."""
        from nanomm.serve.cli import InstanceSpec  # the server stack, only where a replica is built

        engine_args = {"max_num_seqs": self.max_num_seqs, "max_pixels": self.max_pixels, "emulate": self.emulate,
                       "encoder_url": PER_REQUEST_ENCODER if role == "prefill" else None,
                       "encoder_timeout_s": self.peer_timeout_s, "kv_handoff_timeout_s": self.kv_handoff_timeout_s}
        model = None if self.emulate else self.model  # a folder by now (check), or None with emulate
        return InstanceSpec(self.name, model, engine_args, peer_timeout_s=self.peer_timeout_s)

    def capacity(self, role: str) -> float:
        """One replica's capacity in its pool's load unit: given, or from the emulated device's cost model."""
        given = {"encoder": self.encoder_capacity, "prefill": self.prefill_capacity,
                 "decode": self.decode_capacity, "integrated": self.decode_capacity}[role]
        if given is not None:
            return given
        if self.emulate is None:
            raise ValueError(f"policy=load needs {'decode' if role == 'integrated' else role}_capacity= for a real "
                             "model (with emulate=, the cost model gives it)")
        from nanomm.emulate import EmulatedDevice

        costs = EmulatedDevice.from_value(self.emulate).costs
        return replica_capacity(costs, role, self.max_num_seqs, self.tpot_slo_s)
