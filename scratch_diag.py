import json, random, sys, tempfile
from pathlib import Path
import torch
sys.path.insert(0, ".")
from elephant.config import load_config
from elephant.trainer import Trainer
from tests.test_gpu_trainer import short_documents

tmp = Path(tempfile.mkdtemp())
corpus = short_documents(tmp / "corpus")
def run(mode, groups, steps, extra=()):
    cfg = load_config(Path("configs/tiny.toml"), [
        "data.source=text", f"data.path={corpus}", "data.pack=true",
        f"data.cache_dir={tmp / 'cache'}", f"train.run_dir={tmp / (mode + str(groups) + str(len(extra)))}",
        f"train.compile={mode}", "train.dtype=fp32", "train.device=cuda",
        "train.tensorboard=false", "train.max_steps=8", f"train.grad_accum={groups}", *extra])
    tr = Trainer(cfg, progress=False)
    grads = []
    real = tr.opt.set_step
    def snap(*a, **k):
        grads.append({n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in tr.model.named_parameters()})
        return real(*a, **k)
    tr.opt.set_step = snap
    losses = [tr.train_step()["loss"] for _ in range(steps)]
    tr.close()
    return losses, grads
for groups, extra in ((2, ()), (1, ()), (2, ("data.pack=false",))):
    ref = run("off", groups, 3, extra)
    for mode in ("window", "graphs"):
        got = run(mode, groups, 3, extra)
        print(f"== groups {groups} {mode} {extra} losses", ["%.6f/%.6f" % (a, b) for a, b in zip(got[0], ref[0])])
        for s in range(3):
            worst = []
            for n, g in ref[1][s].items():
                h = got[1][s][n]
                if g is None or h is None:
                    if (g is None) != (h is None): worst.append((9.0, n + " NONE"))
                    continue
                worst.append(((h - g).norm().item() / (g.norm().item() + 1e-12), n))
            worst.sort(reverse=True)
            print("  step", s, [("%.2e" % w, n) for w, n in worst[:4]])
