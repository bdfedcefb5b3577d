"""`splicer ablate`: splice each row of a plan, score it against the base, time it, write results.json.

Stages under DIR, each a module here that reads the previous stage's files (run.py is the straight line through them):
  job.py        job.json                     inputs (with header digests), plan, corpora digest, backend settings
  base_pass.py  cache/base-<key>/            the base's chat answers, per-corpus top-k / target log-probs and the
                                             noise pass (keyed by base digest, corpora and settings; reused by every
                                             row and every rerun)
  rows.py       variants/<row>/              splices (reused while splice.json matches the inputs), each row's engine,
                                             its decode timing; RowSchedule says what is spliced or started ahead
  scores.py     scores/<row>/<corpus>.safetensors   per-position records (top1, KL, dlogp) for paired statistics
  results.py    results.json, table.md, report.md   rewritten after every finished row
A rerun skips rows whose results match the current job.
"""

from .base_pass import BASE_PASS_VERSION, base_cache, base_pass
from .common import RESULTS, AblateSettings, _digest
from .job import host_info, make_job, select_rows
from .run import run_ablate
from .scores import first_occurrence_weights, position_records

__all__ = ["BASE_PASS_VERSION", "RESULTS", "AblateSettings", "base_cache", "base_pass", "first_occurrence_weights",
           "host_info", "make_job", "position_records", "run_ablate", "select_rows", "_digest"]
