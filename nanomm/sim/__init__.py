"""The system's models: what a cluster of nanomm instances would do with a workload, without running one.

Lessons: lessons/13-three-topologies.md (topologies, the simulator against the twin) and
lessons/15-scaling-each-pool.md (autoscaling).

- workload.py: mixes, arrivals, replayed load runs (topologies are named in nanomm/topology.py's grammar);
- stats.py: the one percentile;  events.py: the clock;
- stages.py: the stage model (a roofline sketch per stage), with the pool search;
- twin.py: the engine-faithful model: nanomm's scheduler on the emulated device's cost model, plus the host;
- autoscaling.py: the twin's engines in pools that Ray Serve's policies grow and shrink.

No sockets, no subprocesses, no Ray, and none of the engine's runtime: the runtime never imports this package,
and `nanomm-bench` (nanomm/bench/) drives it from the command line.
"""
