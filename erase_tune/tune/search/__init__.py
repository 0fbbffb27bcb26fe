"""The search: which plans a study may propose, and the Optuna study that proposes them.

``space_file`` reads a search-space file (the schema, field by field); ``space`` is the
validated space and its codec between Optuna parameters and plans; ``checks`` binds a space to
its workload's model before any trial runs; ``samplers`` holds erase-tune's default sampler;
``study`` the Optuna side (objectives, attributes, the Pareto front within the NE budget);
``hypervolume`` and ``replay`` measure how well a sampler searches.
"""
