"""The workbench: what drives real servers and the simulators from the command line, behind `nanomm-bench`.

Lessons: lessons/11-serving-under-load.md, lessons/13-three-topologies.md, lessons/15-scaling-each-pool.md,
lessons/16-long-conversations.md.

- cli.py: `nanomm-bench` and its subcommands;
- load.py: the load generator (mixes, traces, multi-turn sessions, clusters of nanomm-serve started here);
- simulate.py, autoscale.py: the simulators of nanomm/sim/ from the command line;
- stage_costs.py, validate.py: the simulators' costs measured, and their predictions checked against the twin;
- day.py: the shifting day on Ray Serve, one run per autoscaling policy;
- soak.py, long_chats.py: a server held under many clients; long chats under each old-picture policy;
- machine.py, requests.py, probes.py: the machine and its roofline, what benchmarks send, in-process probes.

Needs the `serve` extra (httpx, prometheus-client); `day` needs `ray`. The runtime never imports this package.
"""
