"""experiments/stats.py and the claims' runs: Student's t from scipy.stats where the study pages once read a typed
table, and experiments/frontier/claims.py judging the runs a study's ``claims:`` section names."""

import json
import math

import pytest
from scipy import stats as distributions

from experiments.frontier import claims
from experiments.stats import paired_difference, t_quantile

#: The two-sided 95 % table the study pages were written with (t_{0.975, dof}, dof = 1…30), to three decimals.
PRINTED_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
                2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
                2.045, 2.042]


def test_the_t_quantile_is_scipys_rounded_as_the_printed_table_is():
    assert [t_quantile(dof) for dof in range(1, 31)] == PRINTED_T975
    for dof in (1, 2, 5, 30, 100):
        exact = t_quantile(dof, digits=None)
        assert exact == pytest.approx(float(distributions.t.ppf(0.975, dof)), abs=1e-12)
        assert abs(exact - t_quantile(dof)) <= 5e-4
    # beyond the table's 30 degrees of freedom it is Student's t too (the table fell back to the normal 1.96)
    assert t_quantile(39) == 2.023 and t_quantile(10_000) == 1.960
    assert t_quantile(2, level=0.99) == pytest.approx(9.925, abs=1e-3)
    with pytest.raises(ValueError, match="at least one degree of freedom"):
        t_quantile(0)


def test_a_paired_interval_of_forty_seeds_uses_t_with_39_degrees_of_freedom():
    diffs = [(-1) ** i * 0.5 + 1.0 for i in range(40)]
    pd = paired_difference(diffs)
    half = (pd["ci95"][1] - pd["ci95"][0]) / 2
    assert pd["n"] == 40 and half == pytest.approx(2.023 * pd["sd"] / math.sqrt(40))


def test_claims_judge_the_runs_the_study_names_by_role(tmp_path):
    # A study whose claims section names its own runs: the table compares those, by name, and says which are
    # missing; a folder without a study judges the frontier study's names.
    (tmp_path / "runs").mkdir()
    roles = {"dense": "d", "mod": "m", "sdt": "s", "stt": "t", "dynamic": "dyn", "larger_prior": "s4", "lora": "lt"}
    (tmp_path / "study.json").write_text(json.dumps({"claims": roles}))
    table = claims.claims_table(tmp_path)
    assert "| 2 · Fig. 2A: surprise trains as well as MoD | s − m | not run yet: s, m | inconclusive (0/3 seeds) |" in table
    assert "| 9 · Table 1: below dense | dyn − d | not run yet: dyn, d |" in table
    assert "mod_50" not in table
    (tmp_path / "study.json").write_text(json.dumps({"claims": {"dense": "d"}}))
    with pytest.raises(ValueError, match=r"names no run for \['mod', 'sdt', 'stt', 'dynamic', 'larger_prior', 'lora'\]"):
        claims.claims_table(tmp_path)
    (tmp_path / "study.json").unlink()
    assert "| 8 · Table 2: full fine-tuning beats LoRA | lora_stt_50 − stt_50 |" in claims.claims_table(tmp_path)
