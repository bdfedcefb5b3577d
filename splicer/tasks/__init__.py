"""Task accuracy through lm-evaluation-harness, per variant of a results folder.

cloze.py   text files -> multiple-choice cloze items (JSON lines) and the lm-eval task YAML that reads them
run.py     `splicer tasks DIR --tasks NAMES`: every finished row of DIR through lm-eval, DIR/tasks.json
"""
