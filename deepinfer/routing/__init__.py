"""Routing requests over instances: one interface for the simulated cluster and the real
data-parallel front-end (docs/design.md, "Clusters")."""

from deepinfer.routing.instance_view import InstanceLoad, InstanceView
from deepinfer.routing.policies import ROUTERS, make_router
from deepinfer.routing.router import Router

__all__ = ["ROUTERS", "InstanceLoad", "InstanceView", "Router", "make_router"]
