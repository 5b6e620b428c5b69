"""The SLA autoscaler: observe the cluster (observe.py, live.py), predict TTFT and ITL for
candidate pool sizes from the engine step model (model.py), decide with hysteresis
(decide.py), and explain (service.py: `pdserve autoscale`). The offline simulator drives the
same controller (bench/sim/scaling.py)."""
