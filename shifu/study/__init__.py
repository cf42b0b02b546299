"""``shifu study frontier``: methods compared at matched KL and at matched compute over seeds (PPO, DPO, REINFORCE,
the critic-free estimators): the budgets of KL knobs per point, one trained point per (method, point, seed), and
the analysis of a finished study (aggregates, matched-KL gains with standard errors, the plot and table)."""
