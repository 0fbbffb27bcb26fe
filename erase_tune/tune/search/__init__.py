"""The search: which plans a study may propose, and the Optuna study that proposes them.

``space`` is the search space's one typed schema (``SearchSpace``, nested as the file is),
read and checked field by field from a search-space file; ``checks`` checks a space against its
workload's model before any trial runs and binds it: ``codec``'s ``BoundSpace``, the one
object that turns Optuna parameters into plans and back; ``samplers`` holds erase-tune's
default sampler; ``study`` the Optuna side (objectives, attributes, the Pareto front within the NE budget);
``hypervolume`` and ``replay`` measure how well a sampler searches.
"""
