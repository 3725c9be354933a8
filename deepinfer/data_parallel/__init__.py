"""Attention data parallelism, pure Python: the request deltas that ranks send back, and
the front-end engine over the ranks, which places requests with a router of
deepinfer.routing (the policy the simulator's ranks and clusters use too);
executors/distributed launches real ranks (torch.multiprocessing) behind it."""
