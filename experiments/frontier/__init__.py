"""The frontier study's scripts: the issue's targets (``targets``), the papers' claims (``claims``) and the probes."""
