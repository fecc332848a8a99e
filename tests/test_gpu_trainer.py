"""train.py's default step on a GPU: `Trainer.train_step` with train.compile=auto (a BPTT window's
chunks as one CUDA graph, the clipping and update as another) against the eager trainer, on packed
short documents (data.pack, as configs/fineweb-124m.toml trains). Run on a CUDA machine:
`python -m pytest -m gpu tests/test_gpu_trainer.py`."""
import json
import random
from pathlib import Path

import pytest
import torch

from elephant.config import load_config
from elephant.trainer import Trainer

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]


def short_documents(folder: Path) -> Path:
    """Documents of 20-150 bytes: several start inside every 64-token chunk when packed."""
    rng = random.Random(0)
    words = ["elephant", "memory", "state", "chunk", "lane", "document", "token", "carry"]
    folder.mkdir()
    for split, n in (("train", 400), ("valid", 8)):
        with open(folder / f"{split}.jsonl", "w") as f:
            for _ in range(n):
                text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 20)))
                f.write(json.dumps({"text": text}) + "\n")
    return folder


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("groups", [1, 2])
def test_default_cuda_graph_trainer_steps_equal_the_eager_trainer_on_packed_documents(tmp_path, groups):
    # groups: train.grad_accum, lane groups that take turns on the same CUDA graphs (each group's
    # state and gradients moved out of the graphs' memory before the next group's replay)
    corpus = short_documents(tmp_path / "corpus")
    runs = {}
    for mode in ("off", "auto"):
        cfg = load_config(ROOT / "configs/tiny.toml", [
            "data.source=text", f"data.path={corpus}", "data.pack=true",
            f"data.cache_dir={tmp_path / 'cache'}", f"train.run_dir={tmp_path / mode}",
            f"train.compile={mode}", "train.dtype=fp32", "train.device=cuda",
            "train.tensorboard=false", "train.max_steps=4", f"train.grad_accum={groups}"])
        trainer = Trainer(cfg, progress=False)
        try:
            if mode == "auto":
                assert trainer.compile == "window"
            start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            losses = [trainer.train_step()["loss"] for _ in range(4)]
            runs[mode] = (losses, {n: p.detach() - start[n]
                                   for n, p in trainer.model.named_parameters()})
            fills = [b.last_fill for b in trainer.batchers]
        finally:
            trainer.close()
        assert min(fills) > 0.9, fills   # packed: the rows full (unpacked, these would be ~0.4)
    # the same start (the run's seed); the compiled update rounds its fused passes differently and
    # Muon iterates in bf16, so the weights' moves agree to ~1e-3, not bit for bit (as in
    # test_gpu_optim.py::test_compiled_graphed_step_follows_the_eager_step)
    (eager_losses, eager_moves), (losses, moves) = runs["off"], runs["auto"]
    assert torch.allclose(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-3), \
        (losses, eager_losses)
    for name, want in eager_moves.items():
        diff = (moves[name].double() - want.double()).norm().item()
        assert diff <= 2e-2 * want.double().norm().item() + 1e-7, (name, diff)
