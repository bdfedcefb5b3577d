"""`splicer budget DIR`, above ablate: the search over the budget model (analysis/budget.py) under the limits, and
`--verify N`, which adds the chosen points to DIR's job and measures them with ablate (`search`).
"""
