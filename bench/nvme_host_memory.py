"""Peak host memory per rank (VmHWM) of NVMe offload against CPU offload on an HF GPT-2 built from its config.

    PYTHONPATH=. python bench/nvme_host_memory.py [--embd 256 --layers 1 --positions 512] [--ranks 2]

Each setting runs in freshly spawned ranks (VmHWM is a process's lifetime peak): the model, ZeroEngine with
the setting, 3 steps of batch 2 x 32 tokens, then the rank's VmHWM and the engine's memory_report (ring,
NVMe bytes). docs/nvme_offload.md ("From which size NVMe pays") quotes it.
"""

from __future__ import annotations

import argparse
import tempfile

SETTINGS = {
    "zero2_offload": dict(stage=2, offload_optimizer=True),
    "zero2_offload_nvme": dict(stage=2, offload_optimizer="nvme"),
    "zero3_offload": dict(stage=3, offload_optimizer=True, offload_params=True),
    "zero3_offload_nvme": dict(stage=3, offload_optimizer="nvme", offload_params="nvme"),
}
MiB = 2**20


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _rank(rank: int, world_size: int, setting: str, dims: tuple, path: str) -> dict:
    import torch
    import transformers

    from lightning_zero.engine import ZeroConfig, ZeroEngine

    embd, layers, positions = dims
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=embd, n_layer=layers, n_head=4,
                                                                 n_positions=positions))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cfg = SETTINGS[setting]
    engine = ZeroEngine(model, opt, ZeroConfig(**cfg, nvme_path=path if "nvme" in setting else None))
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        engine.prepare_forward()
        ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=g)
        model(ids, labels=ids).loss.backward()
        engine.step()
    rep = engine.memory_report()
    out = dict(hwm=_vm_hwm(), ring=rep.ring, nvme=rep.nvme, host=rep.host,
               params=sum(p.numel() for p in model.parameters()))
    engine.remove(hand_back=False)
    return out


def main() -> None:
    from lightning_zero.tools.launch import run_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--positions", type=int, default=512)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    a = ap.parse_args()
    dims = (a.embd, a.layers, a.positions)
    print("| setting | params | peak RSS/rank (MiB) | ring/rank (MiB) | NVMe/rank (MiB) | host states/rank (MiB) |")
    print("|---|---|---|---|---|---|")
    for setting in a.settings.split(","):
        with tempfile.TemporaryDirectory() as path:
            res = run_ranks(_rank, a.ranks, (setting, dims, path), start_method="spawn", timeout_s=900)
        hwm = " / ".join(f"{r['hwm'] / MiB:.0f}" for r in res)
        r = res[0]
        print(f"| {setting} | {r['params'] / 1e6:.1f}M | {hwm} | {r['ring'] / MiB:.1f} | {r['nvme'] / MiB:.1f} | "
              f"{r['host'] / MiB:.1f} |", flush=True)


if __name__ == "__main__":
    main()
