# Two commands do everything on a fresh machine (each runs the idempotent set-up first):
#   make demo   - a real tuning job on the CTR smoke space (local Ray, SQLite, CPU; one trial at a
#                 time so two CPU trials do not share the two cores while they are timed)
#   make test   - the test suite; its set-up also starts PostgreSQL on 127.0.0.1:5432 if it is down
#                 and installs the browser the dashboard test drives (scripts/setup.sh says what
#                 it does at each step; nothing is done twice)
.PHONY: setup setup-python demo test

setup:
	@bash scripts/setup.sh test

setup-python:
	@bash scripts/setup.sh python

demo: setup-python
	.venv/bin/erase-tune start --space search_spaces/ctr-smoke.yaml --study demo --trials 8 --slots 1 --repeats 3
	.venv/bin/erase-tune status --study demo
	.venv/bin/erase-tune export --study demo -o best.yaml --repeats 3 || { \
	  echo "(no plan showed a confirmed gain on this CPU: writing the best one anyway, marked unconfirmed)"; \
	  .venv/bin/erase-tune export --study demo -o best.yaml --repeats 3 --force; }
	.venv/bin/python examples/train_ctr.py --plan best.yaml --steps 200

# Three pytest-xdist workers, whole files each (a module's shared job is made once), the files
# on the shared Ray and the longest first (tests/conftest.py): many tests wait on Ray,
# PostgreSQL, a browser or a child process, so three share two cores best (pytest on two idle
# cores, one checkout: 561 s with two workers, 513 s with three, 544 s with four). Every test
# job times a fixed number of windows, so a loaded machine makes a test slower, never longer.
test: setup
	.venv/bin/python -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder --durations=30
