"""`splicer ablate`: splice each row of a plan, score it against the base, time it, write results.json.

One invocation is one AblateRun (common.py), made once by run.prepare_run from the arguments, the settings
(AblateSettings, the backend's own options inside) and the plan; no stage changes it.

Stages under DIR, a module each (run.py is the straight line through them); what each writes, and who reads it:
  job.py        job.json                     inputs (with header digests), plan, corpora digest, backend settings;
                                             kept in results.json too, where a rerun finds the finished rows of the
                                             same job
  base_pass.py  cache/base-<key>/            the base's chat answers (corpora.json), per-corpus top-k / target
                                             log-probs and the noise pass, keyed by base digest, corpora and
                                             settings; read by every row's scoring and every rerun
  rows.py       variants/<splice>/           splices (reused while splice.json matches the inputs; the build and the
                                             base rows need none), each row's engine and its decode timing;
                                             RowSchedule says what is spliced or started ahead
  scores.py     scores/<row>/<corpus>.safetensors   per-position records (top1, KL, dlogp), read by the verdicts,
                                             `splicer compare` and the noise floor
  results.py    results.json, table.md, report.md   rewritten after every finished row; read by `table` and `report`
"""

from .base_pass import BASE_PASS_VERSION, base_cache, base_pass
from .common import RESULTS, AblateRun, AblateSettings
from .job import host_info, make_job, select_rows
from .run import run_ablate
from .scores import first_occurrence_weights, position_records

__all__ = [
    "BASE_PASS_VERSION",
    "RESULTS",
    "AblateRun",
    "AblateSettings",
    "base_cache",
    "base_pass",
    "first_occurrence_weights",
    "host_info",
    "make_job",
    "position_records",
    "run_ablate",
    "select_rows",
]
