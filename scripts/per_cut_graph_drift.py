"""Per-cut graphs against blocking on the small ctr workload (three cuts on streams 1, 2, 1):
the weights after 12 steps, relative drift, three repetitions, with one change at a time (D:
aliases instead of the class swap; E: record_stream of inputs; F/G: a sync after / before
replayed cuts), then as shipped. Exact (0.0) is right; see docs/benchmarks.md 00.7 and 00.8.

    PYTHONPATH=. python3 scripts/per_cut_graph_drift.py
"""
import sys, torch
sys.path.insert(0, ".")
from tests.runtime.test_workloads_gpu import two_stream_cuts
from erase_tune.runtime import join as joinmod, pieces as pc

plans, run = two_stream_cuts()
ref = run(plans["blocking"])
def drift(tag):
    out = []
    for rep in range(3):
        w = run(plans["per-cut graphs"])
        out.append(f"{float((w - ref).norm() / ref.norm()):.1e}")
    print(f"{tag:<40}", out, flush=True)


import inspect, textwrap
Tensor = torch.Tensor
add_src = textwrap.dedent(inspect.getsource(joinmod.LazyJoin.add)).replace("if type(t) is Tensor:", "if False:")
ns = {}
exec(add_src, {**joinmod.__dict__}, ns)
orig_add = joinmod.LazyJoin.add
joinmod.LazyJoin.add = ns["add"]
drift("D: aliases, no class swap")
joinmod.LazyJoin.add = orig_add

def add_rs(self, outputs, inputs, done, stream, written=()):
    inputs = list(inputs)
    for t in inputs:
        if stream is not None: t.record_stream(stream)
    return orig_add(self, outputs, inputs, done, stream, written)
joinmod.LazyJoin.add = add_rs
drift("E: record_stream of inputs")
joinmod.LazyJoin.add = orig_add

orig_call = pc.CutRunner.__call__
def synced_replay(self, *a, **k):
    out = orig_call(self, *a, **k)
    if self.graph is not None: torch.cuda.synchronize()
    return out
pc.CutRunner.__call__ = synced_replay
drift("F: sync after replayed cuts only")
def synced_before(self, *a, **k):
    if self.graph is not None: torch.cuda.synchronize()
    return orig_call(self, *a, **k)
pc.CutRunner.__call__ = synced_before
drift("G: sync before replayed cuts only")
pc.CutRunner.__call__ = orig_call
drift("as is, again")
