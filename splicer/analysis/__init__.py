"""What a results folder says, read from its results.json and scores: the per-position metrics (`metrics`), verdicts
against the noise floor (`verdicts`), the table and the report (`table`, `report`), where the wall time went
(`breakdown`), the budget model over the measured rows (`budget`) and the plot (`plot`).
"""
