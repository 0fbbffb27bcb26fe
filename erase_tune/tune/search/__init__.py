"""The search: which plans a study may propose, and the Optuna study that proposes them.

``space_file`` reads a search-space file (the schema, field by field) into typed sections;
``space`` is the validated space built from them; ``checks`` checks a space against its
workload's model before any trial runs and binds it: ``codec``'s ``BoundSpace``, the one
object that turns Optuna parameters into plans and back; ``samplers`` holds erase-tune's
default sampler; ``study`` the Optuna side (objectives, attributes, the Pareto front within the NE budget);
``hypervolume`` and ``replay`` measure how well a sampler searches.
"""
