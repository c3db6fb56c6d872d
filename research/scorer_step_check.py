"""Does `kvpop adapt`'s scorer step alone degrade the shipped scorer (e.g. because it trains on
2,048-token sequences where `kvpop train` used 4,096)?

One arm: SEQ-token training sequences from the train split, the base model (no LoRA), the shipped
mLSTM scorer, `kvpop.adapt.loop.scorer_step` + AdamW(LR) + the adapt schedule for STEPS steps;
retention of 2 validation documents at 4,096 tokens under the real KVpopCache at B = 512 / 1,024,
before (BEFORE=1) and after. Writes OUT/scorer_step_seq{SEQ}_lr{LR}.json (wall time in it).

    OMP_NUM_THREADS=1 python research/scorer_step_check.py 2048 40 5e-4 1 results/adapt
    OMP_NUM_THREADS=1 python research/scorer_step_check.py 4096 40 5e-4 0 results/adapt
"""

import json
import random
import sys
import time

import torch

import kvpop
from kvpop.adapt.config import AdaptConfig
from kvpop.adapt.loop import scorer_step
from kvpop.checkpoint import default_scorer_path, load_scorer
from kvpop.train.config import TrainConfig
from kvpop.train.data import SequenceSource, capture_example
from kvpop.train.quality import RetentionProbe
from kvpop.train.runs import cosine_schedule

torch.set_num_threads(1)
SEQ, STEPS, LR, BEFORE = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "1"
out = f"{sys.argv[5] if len(sys.argv) > 5 else '.'}/scorer_step_seq{SEQ}_lr{LR}.json"
model, tok = kvpop.load_model(progress=False)
scorer, meta = load_scorer(default_scorer_path("mlstm"), model=model)
tcfg = TrainConfig(scorer="mlstm", seq_len=SEQ, budgets=(512, 1024), val_docs=2)
vcfg = TrainConfig(scorer="mlstm", seq_len=4096, budgets=(512, 1024), val_docs=2)
acfg = AdaptConfig(out="/tmp/x", seq_len=SEQ, budgets=(512, 1024), scorer_lr=LR)
probe = RetentionProbe(model, tok, vcfg)
res = {"seq": SEQ, "steps": STEPS, "lr": LR}
t0 = time.time()
if BEFORE:
    res["before"] = probe(scorer, (512, 1024))
    print("before", res["before"]["mean_retention"], flush=True)
opt = torch.optim.AdamW(scorer.parameters(), lr=LR, weight_decay=0.0)
sched = cosine_schedule(opt, STEPS)
src = SequenceSource(tcfg, tok, "train")
losses = []
for step in range(STEPS):
    corpus, ids = src.get(step)
    budget = random.Random(acfg.seed * 100003 + step).choice(acfg.budgets)
    ev = acfg.eviction(budget)
    obs = tuple(scorer.config.observed)
    ex = capture_example(model, ids.view(1, -1), [ev.window], ev.sinks, obs, [corpus]).float(torch.device("cpu"))
    opt.zero_grad(set_to_none=True)
    losses.append(scorer_step(scorer, ex, ev, acfg))
    torch.nn.utils.clip_grad_norm_(scorer.parameters(), 1.0)
    opt.step()
    sched.step()
    print(step, budget, round(losses[-1], 4), round(time.time() - t0), flush=True)
res["losses"] = losses
res["after"] = probe(scorer, (512, 1024))
print("after", res["after"]["mean_retention"], flush=True)
res["wall_s"] = time.time() - t0
with open(out, "w") as f:
    json.dump(res, f, indent=1)
