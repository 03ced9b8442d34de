"""The study driver: named studies of routed-model runs, composed from named parts, trained, scored and written up.

Run it from the repository root (every path in a study file and in the configs it names is relative to there)::

    python experiments/study.py run STUDY.yaml [--only NAME ...] [--seeds 0 1 2] [--no-aggregate] [--dry-run]
    python experiments/study.py aggregate OUT_DIR
    python experiments/study.py show STUDY.yaml          # the runs as the parts resolve them, nothing trained

Modules, in the order a study passes through them:

- :mod:`experiments.spec`: the study file (schema, validation, absolute paths, ``runs_from``);
- :mod:`experiments.parts`: runs composed from named parts (configs, techniques, placements planned by
  ``torchtune_dtf.plan``) and the names generated from them;
- :mod:`experiments.training`: what a run trains (its command, whether a result is stale) and resumable training;
- :mod:`experiments.evaluation`: held-out and test scoring, closed-form compute, the training log's curves;
- :mod:`experiments.eleuther`: the stock ``eleuther_eval`` step and its results table;
- :mod:`experiments.driver`: one (run, seed) end to end, its result JSON, and the ``run`` command;
- :mod:`experiments.results`: the run JSONs read back (curves, per-layer values, table columns);
- :mod:`experiments.stats`: paired differences with Student's t, the seed × window bootstrap;
- :mod:`experiments.plots` and :mod:`experiments.pages`: the figures and the study page ``aggregate`` writes;
- :mod:`experiments.subprocesses`: child processes offline, their logs, atomic JSON writes.

Scripts beside the studies (``experiments/frontier/targets.py``, ``claims.py``, the probes) import these modules
as a package (``from experiments import stats``). The folder is deliberately not named ``recipes``: torchtune
installs a top-level package of that name.
"""


class StudyError(RuntimeError):
    """A study file that cannot be run as written, or a step of a run that failed (the message says which)."""
