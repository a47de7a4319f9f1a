"""QAT of the MTP head's 4-bit weights by KL to the float head (paper Table 4, scaled to the fixtures).

Recipe: start from the float head; per-channel MSE clipping search (ratio 1.0 .. 0.6) fixes each linear
layer's W4 scale; every linear layer (output layer included) is fake-quantized with a straight-through
estimator; only linear weights train (norms frozen); loss = KL(p_float || p_quant) over the keep set on
teacher-forced step inputs; AdamW (0.9, 0.95), no weight decay, gradient-norm clip 1.0, linear warm-up then
cosine decay, 2 accumulation steps, fp32. The paper's lr is 1e-5 for 100 steps on a 420M head; tiny
fixtures need a larger lr (``lr`` is a parameter).

The measurement (top-1 agreement of the quantized head with the float head, the paper's 87.4 % -> 91.0 %)
only means something on a trained head and real captures: ``python -m mobile_client.quant.qat
--assistant DIR --verifier DIR [--keep-ids FILE]`` runs it on the fixtures' verifier captures.

>>> from mobile_client.drafters.spec import toy_mtp_spec
>>> lr_at(0, steps=100, warmup=10, lr=1.0), round(lr_at(10, steps=100, warmup=10, lr=1.0), 3)
(0.1, 1.0)
"""

from __future__ import annotations

import argparse
import copy
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from mobile_client.drafters.mtp import MTP_INPUTS
from mobile_client.quant.fakequant import QLinear, quantize_linears


@dataclass
class QatReport:
    steps: int
    kl_before: float
    kl_after: float
    agree_before: float  # top-1 agreement quant vs float on the evaluation feeds
    agree_after: float


def lr_at(step: int, *, steps: int, warmup: int, lr: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine to 0 at ``steps``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def _logits(head: nn.Module, feeds: list[dict[str, np.ndarray]]) -> torch.Tensor:
    """[N, Vk] logits of ``head`` over a list of step feeds (batched by stacking calls)."""
    return torch.cat([head(*(torch.from_numpy(f[n]) for n in MTP_INPUTS))[0] for f in feeds])


def kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """mean over rows of KL(p_teacher || p_student)."""
    lt, ls = torch.log_softmax(teacher_logits, -1), torch.log_softmax(student_logits, -1)
    return (lt.exp() * (lt - ls)).sum(-1).mean()


@torch.no_grad()
def agreement(float_head: nn.Module, quant_head: nn.Module, feeds: list[dict[str, np.ndarray]]) -> float:
    """Share of feeds whose top-1 (first among equals) is the same for both heads."""
    a, b = _logits(float_head, feeds), _logits(quant_head, feeds)
    return float((a.argmax(-1) == b.argmax(-1)).float().mean())


def qat(
    float_head: nn.Module,
    train: list[dict[str, np.ndarray]],
    evaluate: list[dict[str, np.ndarray]],
    *,
    steps: int = 100,
    lr: float = 1e-5,
    warmup: int = 50,
    accum: int = 2,
    batch: int = 8,
    seed: int = 0,
) -> tuple[nn.Module, QatReport]:
    """Return the W4 QAT head (QLinear layers) and the before/after report.

    Runs with one torch thread (tiny steps; extra threads only contend on a shared CPU), restored after.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _qat(
            float_head,
            train,
            evaluate,
            steps=steps,
            lr=lr,
            warmup=warmup,
            accum=accum,
            batch=batch,
            seed=seed,
        )
    finally:
        torch.set_num_threads(threads)


def _qat(
    float_head, train, evaluate, *, steps, lr, warmup, accum, batch, seed
) -> tuple[nn.Module, QatReport]:
    teacher = float_head.eval()
    student = quantize_linears(copy.deepcopy(float_head).train())  # MSE clip search happens here
    params = [m.weight for m in student.modules() if isinstance(m, QLinear)]
    for p in student.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    with torch.no_grad():
        t_train, t_eval = _logits(teacher, train), _logits(teacher, evaluate)
        kl0 = float(kl(t_eval, _logits(student, evaluate)))
    agree0 = agreement(teacher, student, evaluate)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps=steps, warmup=min(warmup, steps // 2 or 1), lr=lr)
        opt.zero_grad(set_to_none=True)
        for _ in range(accum):
            idx = torch.randint(len(train), (min(batch, len(train)),), generator=g).tolist()
            loss = kl(t_train[idx], _logits(student, [train[i] for i in idx])) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    student.eval()
    with torch.no_grad():
        kl1 = float(kl(t_eval, _logits(student, evaluate)))
    return student, QatReport(steps, kl0, kl1, agree0, agreement(teacher, student, evaluate))


def main(argv: list[str] | None = None) -> int:
    """Measure top-1 agreement before/after QAT on a fixture pair (verifier captures, held-out split)."""
    import json
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from mobile_client.quant.capture import capture_feeds, head_from_dir

    ap = argparse.ArgumentParser(prog="python -m mobile_client.quant.qat")
    ap.add_argument("--assistant", type=Path, required=True)
    ap.add_argument("--verifier", type=Path, required=True)
    ap.add_argument("--keep-ids", type=Path)
    ap.add_argument("--texts", type=Path, help="UTF-8 file, one training text per line (default: random ids)")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--out", type=Path, help="write the report JSON here")
    args = ap.parse_args(argv)
    verifier = AutoModelForCausalLM.from_pretrained(args.verifier, torch_dtype=torch.float32).eval()
    vocab = verifier.config.get_text_config().vocab_size
    keep = np.load(args.keep_ids).tolist() if args.keep_ids else list(range(vocab))
    spec, head = head_from_dir(args.assistant, keep)
    seqs = _sequences(args.texts, args.verifier, vocab)
    half = len(seqs) // 2
    train = capture_feeds(spec, verifier, seqs[:half], keep, args.window)
    held = capture_feeds(spec, verifier, seqs[half:], keep, args.window)
    _, rep = qat(head, train, held, steps=args.steps, lr=args.lr, warmup=max(1, args.steps // 2))
    print(json.dumps(rep.__dict__, indent=1))
    if args.out:
        args.out.write_text(json.dumps(rep.__dict__, indent=1))
    return 0


def _sequences(texts, verifier_dir, vocab: int, n: int = 8, length: int = 96) -> list[list[int]]:
    if texts is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(verifier_dir)
    lines = [ln for ln in texts.read_text().splitlines() if ln.strip()]
    return [tok(ln)["input_ids"][:512] for ln in lines]


if __name__ == "__main__":
    raise SystemExit(main())
