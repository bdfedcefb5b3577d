"""On the GPU machine: a short run of splicer.trained.train's `small` recipe on the demo texts (no data stage needed),
to see that it runs with the machine's transformers and how many tokens per second it trains."""

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from splicer.corpora.demo_tokenizer import demo_texts, write_tokenizer  # noqa: E402
from splicer.fixtures.core import CHAT_TEMPLATE  # noqa: E402
from splicer.trained import train as T  # noqa: E402

work = Path(sys.argv[1])
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 40
d = work / "data"
(d / "heldout").mkdir(parents=True, exist_ok=True)
texts = demo_texts()
write_tokenizer(d / "tokenizer", 2048, CHAT_TEMPLATE)
paras = [p for t in texts for p in t.split("\n\n") if p.strip()] * 50
(d / "train.jsonl").write_text("".join(json.dumps({"text": p, "source": "demo"}) + "\n" for p in paras))
(d / "heldout" / "en.txt").write_text(texts[0])
for bs in (64,):
    r = T.recipe("small", steps=steps, batch_size=bs, max_seconds=120)
    t0 = time.time()
    model, rep = T.train(d, r, torch.device("cuda"), log=print)
    print(
        f"batch {bs}: {rep['steps_done']} steps in {rep['train_seconds']} s; total incl. eval {time.time() - t0:.1f} s; "
        f"peak mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB; params {rep['parameters']:,}"
    )
    t1 = time.time()
    T.write_trained_base(work / f"base{bs}", d, model, rep, r)
    print(f"written in {time.time() - t1:.1f} s; held-out {rep['heldout']}")
    print(json.dumps(rep["samples"], ensure_ascii=False)[:600])
