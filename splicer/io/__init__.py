"""Files in and out, at the bottom of every stage: safetensors headers and shards (`safetensors_io`, `dtypes`), the JSON
types and ranges of config.json's fields (`config_schema`), output folders written atomically (`outputs`), a run's
results.json read and written (`results_record`), progress lines and the console (`progress`, `console`), and the
reliability tests' kill points (`faults`). Opening a checkpoint folder is a stage above formats/ (`splicer.checkpoint`):
it checks the config's quantization fields through the format registry.

It imports nothing, so that reading a header does not load the stages above.
"""
