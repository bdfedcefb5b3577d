"""Files in and out, at the bottom of every stage: safetensors headers and shards (`safetensors_io`, `dtypes`), a
checkpoint folder opened and its config.json checked (`checkpoint`, `config_schema`), output folders written atomically
(`outputs`), a run's results.json read and written (`results_record`), progress lines and the console (`progress`, `console`), and the reliability tests' kill points (`faults`).

It imports nothing, so that reading a header does not load the stages above.
"""
