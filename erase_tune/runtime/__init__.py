"""The ERASE runtime: plans (where to cut) and the engine that trains a model under one."""

from erase_tune.runtime.engine import EraseEngine, LinearHead
from erase_tune.runtime.plan import DISPATCH_MODES, PLAN_VERSION, Cut, ErasePlan

__all__ = ["Cut", "ErasePlan", "EraseEngine", "LinearHead", "DISPATCH_MODES", "PLAN_VERSION"]
