"""A GPT-2-style block for tensor parallelism (attention + MLP, LayerNorms) and its column/row plan.

q, k and v are separate projections so that a column-parallel cut gives each TP rank whole heads (a fused
qkv cut by rows would hand one rank all of q and half of k); the attention infers its local head count.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, DIM, HEADS, HIDDEN, SEQ = 13, 16, 4, 24, 7
T = 2  # the tensor-parallel size of the tests' (data_parallel, tensor_parallel) mesh
CLIP = 0.05  # well below the gradient norm (~1): clipping bites every step


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        # no key bias: softmax ignores it, so its gradient is rounding noise that Adam would blow up to lr
        self.q, self.k, self.v = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, DIM)
        self.fc, self.proj = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(b, s, -1, DIM // HEADS).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.out(a)
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.block = Block()
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(self.block(self.emb(tokens))))


def make_gpt(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT()


def tp_plan(prefix: str = "block") -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    col = {f"{prefix}.{n}": ColwiseParallel() for n in ("q", "k", "v", "fc")}
    return {**col, f"{prefix}.out": RowwiseParallel(), f"{prefix}.proj": RowwiseParallel()}


def parallelize(model: nn.Module, tp_mesh, prefix: str = "block") -> nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, tp_mesh, tp_plan(prefix))


def global_batch(step: int, micro: int = 0, size: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)


def dp_batch(step: int, micro: int, dp_rank: int, dp_size: int, size: int = 8) -> torch.Tensor:
    """This data-parallel rank's rows of the global batch (every TP rank of a DP group sees the same)."""
    return global_batch(step, micro, size).chunk(dp_size)[dp_rank]


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def engine_step(model: nn.Module, engine, step: int, dp_rank: int, dp_size: int) -> float:
    """One ZeroEngine step on data-parallel rank ``dp_rank``'s batch of ``step``, clipped at CLIP."""
    loss = lm_loss(model, dp_batch(step, 0, dp_rank, dp_size))
    loss.backward()
    engine.clip_grad_norm_(CLIP)
    engine.step()
    return loss.item()


def fabric_step(fabric, model: nn.Module, opt, it) -> list[float]:
    """One Fabric optimizer step of 2 micro-batches from ``it`` (no sync on the first), clipped at CLIP: the
    micro-batches' losses."""
    losses = []
    for micro in range(2):
        with fabric.no_backward_sync(model, enabled=micro == 0):
            loss = lm_loss(model, next(it)) / 2
            fabric.backward(loss)
        losses.append(loss.item())
    fabric.clip_gradients(model, opt, max_norm=CLIP)
    opt.step()
    opt.zero_grad()
    return losses


def full_state(model: nn.Module) -> dict:
    """Every parameter's global value (DTensors gathered over their TP group: a collective)."""
    out = {}
    for k, v in model.state_dict().items():
        out[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
    return out


def tp_mesh(world_size: int):
    """The (data_parallel, tensor_parallel) mesh of ``world_size`` ranks, T wide in tensor_parallel."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size // T, T), mesh_dim_names=("data_parallel", "tensor_parallel"))


class TokenRows(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return global_batch(1000 + i, size=1)[0]


def tp_lightning_module(out: str, tag: str, tensor_parallel: bool):
    """The TP GPT-2 block as a LightningModule (cut in ``configure_model`` when ``tensor_parallel``) that saves
    its losses, full parameters and sampler arguments per rank."""
    import lightning.pytorch as pl

    from lightning_zero.engine.layout import tensor_parallel as TPM

    class TPModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_gpt()

        def setup(self, stage):
            torch.set_num_threads(1)  # see tests/helpers/lightning_models.py: forked ranks and OpenMP

        def configure_model(self):
            if tensor_parallel and not TPM.is_dtensor(self.net.block.q.weight):
                parallelize(self.net, self.device_mesh["tensor_parallel"])

        def train_dataloader(self):
            return torch.utils.data.DataLoader(TokenRows(), batch_size=4, shuffle=False)

        def val_dataloader(self):
            return torch.utils.data.DataLoader(TokenRows(), batch_size=4, shuffle=False)

        def validation_step(self, tokens, batch_idx):
            self.log("val_loss", lm_loss(self.net, tokens), sync_dist=True)

        def training_step(self, tokens, batch_idx):
            loss = lm_loss(self.net, tokens)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            # SGD: AdamW turns the last-bit differences of TP's split matmuls into ~1e-5 where its moments
            # nearly cancel (the engine tests above hold AdamW at rtol 1e-5 on their data)
            return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)

        def on_train_start(self):
            self.losses = []

        def on_train_end(self):
            engine = getattr(getattr(self.trainer.strategy, "model_side", None), "engine", None)  # ZeRO's only
            groups = {k: torch.distributed.get_process_group_ranks(getattr(engine, f"{k}_group"))
                      for k in ("shard", "replicate") if engine is not None and getattr(engine, f"{k}_group")}
            torch.save({"losses": self.losses, "params": full_state(self.net),
                        "sampler": self.trainer.strategy.distributed_sampler_kwargs, "groups": groups},
                       f"{out}/{tag}_rank{self.global_rank}.pt")

    return TPModule()


def fit_tp(out, tag: str, strategy, devices: int, tensor_parallel: bool):
    """Fit tp_lightning_module (3 steps, accumulation 2, clipped, a checkpoint at the end), then validate it:
    every rank's saved file, and the validation loss."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.helpers.lightning_models import trainer_kwargs

    saves = ModelCheckpoint(dirpath=f"{out}/{tag}_ckpts", save_last=True, every_n_train_steps=3)
    trainer = Trainer(strategy=strategy, **trainer_kwargs(devices=devices, max_steps=3, accum=2, clip=CLIP,
                                                          enable_checkpointing=True, callbacks=[saves],
                                                          limit_val_batches=2))
    module = tp_lightning_module(str(out), tag, tensor_parallel)
    trainer.fit(module)
    # the trained weights came back whole; an evaluation-only run cuts the module again (configure_model)
    val = trainer.validate(module, verbose=False)[0]["val_loss"]
    return [torch.load(f"{out}/{tag}_rank{r}.pt", weights_only=False) for r in range(devices)], val
