"""Attention data parallelism, pure Python: the balancer that places requests on ranks,
the request deltas that ranks send back, and the front-end engine over the ranks. The
simulator drives the same balancer over in-process ranks; executors/distributed launches
real ones (torch.multiprocessing) behind the same front-end."""

from deepinfer.data_parallel.balancer import LeastLoadBalancer, RankLoad

__all__ = ["LeastLoadBalancer", "RankLoad"]
