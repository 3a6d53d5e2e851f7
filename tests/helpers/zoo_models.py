"""Third-party and hand-written models built from configs (no downloads), each with a batch and a loss.

Used by the model-zoo parity tests (tests/test_model_zoo.py) and the unit-policy tests. Dropout is off
everywhere so that DDP and ZeRO runs consume the same random numbers.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

VOCAB, SEQ, BATCH = 100, 8, 2


def _tokens(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _hf():
    warnings.filterwarnings("ignore", message=".*torchvision.*")
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def gpt2(width: int = 32):
    t = _hf()
    return t.GPT2LMHeadModel(t.GPT2Config(n_embd=width, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=32,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def bert():
    t = _hf()
    return t.BertForMaskedLM(t.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                          intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=32,
                                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def t5():
    t = _hf()
    return t.T5ForConditionalGeneration(t.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16,
                                                   vocab_size=VOCAB, dropout_rate=0.0, feed_forward_proj="relu",
                                                   decoder_start_token_id=0, pad_token_id=0))


def llama():
    t = _hf()
    return t.LlamaForCausalLM(t.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                                            max_position_embeddings=32))


def mixtral():
    """transformers 5.x fuses Mixtral's experts into 3-D parameters (MixtralExperts): see MoE below."""
    t = _hf()
    return t.MixtralForCausalLM(t.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                                                num_local_experts=4, num_experts_per_tok=2,
                                                max_position_embeddings=32))


def resnet():
    t = _hf()
    return t.ResNetForImageClassification(t.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                                                         depths=[1, 1], num_labels=3))


class Expert(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class MoEBlock(nn.Module):
    """Top-1 routing over an nn.ModuleList of experts: an expert no token picks gets no gradient."""

    def __init__(self, d: int, n_experts: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, n_experts)
        self.experts = nn.ModuleList(Expert(d) for _ in range(n_experts))

    def forward(self, x):
        h = self.norm(x)
        weight, pick = self.router(h).softmax(-1).max(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            sel = pick == i
            if sel.any():
                out[sel] = expert(h[sel]) * weight[sel, None]
        return x + out


class BlockStack(nn.Module):
    """Embedding -> blocks (in order) -> head; subclasses build ``emb``, ``blocks`` and ``head``."""

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class MoE(BlockStack):
    def __init__(self, d: int = 32, n_layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(MoEBlock(d) for _ in range(n_layers))
        self.head = nn.Linear(d, VOCAB)


class SharedBlock(nn.Module):
    def __init__(self, d: int, shared: nn.Linear, tied: nn.Parameter | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.shared = shared  # the same module registered in every block
        if tied is not None:
            self.fc.weight = tied  # a Parameter registered in two blocks

    def forward(self, x):
        return x + self.shared(torch.tanh(self.fc(x)))


class SharedModel(BlockStack):
    """Blocks that call a Linear owned by another block, and share a Parameter between two blocks."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        shared = nn.Linear(d, d)
        first = SharedBlock(d, shared)
        self.blocks = nn.ModuleList([first, SharedBlock(d, shared, tied=first.fc.weight), SharedBlock(d, shared)])
        self.head = nn.Linear(d, VOCAB)


class TorchTransformer(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.transformer = nn.Transformer(d_model=d, nhead=2, num_encoder_layers=2, num_decoder_layers=2,
                                          dim_feedforward=64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, ids):
        x = self.emb(ids)
        return self.head(self.transformer(x, x))


class Uneven(nn.Module):
    """No declaration, no repeated blocks: the size rule decides (several units at default settings)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.a = nn.Linear(16, 128)
        self.b = nn.Conv1d(128, 64, 3, padding=1)
        self.c = nn.LayerNorm(64)
        self.d = nn.Linear(64, VOCAB)

    def forward(self, ids):
        h = torch.relu(self.a(self.emb(ids)))
        h = self.b(h.transpose(1, 2)).transpose(1, 2)
        return self.d(self.c(h))


def _lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _ce(model, ids):
    logits = model(ids)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1))


def _t5_loss(model, ids):
    return model(input_ids=ids, labels=ids.flip(1)).loss


def _images(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, 3, 16, 16, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def _resnet_loss(model, batch):
    x, y = batch
    return model(pixel_values=x, labels=y).loss


# name -> (builder, batch(step, rank), loss(model, batch))
ZOO = {
    "gpt2": (gpt2, _tokens, _lm_loss),
    "bert": (bert, _tokens, _lm_loss),
    "t5": (t5, _tokens, _t5_loss),
    "llama": (llama, _tokens, _lm_loss),
    "mixtral": (mixtral, _tokens, _lm_loss),
    "moe": (MoE, _tokens, _ce),
    "resnet": (resnet, _images, _resnet_loss),
    "nn_transformer": (TorchTransformer, _tokens, _ce),
    "shared": (SharedModel, _tokens, _ce),
    "uneven": (Uneven, _tokens, _ce),
}


def zoo_adamw(model: nn.Module, fused: bool = False) -> torch.optim.AdamW:
    """torch's AdamW as users write it; ``fused``: torch's fused CPU kernel, the one an offloaded engine steps
    with (on the attention key biases, whose true gradient is 0, Adam turns the kernels' last-bit differences
    into 1e-5, so the reference must use the same kernel)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=fused or None)


def zoo_ddp_reference(rank: int, name: str, steps: int, fused: bool = False) -> dict:
    """``ZOO[name]`` trained ``steps`` steps under torch DDP (``find_unused_parameters=True``) on rank ``rank``'s
    batches, from seed 0: the per-step losses and the final state dict."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    builder, make_batch, loss_fn = ZOO[name]
    torch.manual_seed(0)
    model = builder()
    opt = zoo_adamw(model, fused)
    ddp = DDP(model, find_unused_parameters=True)
    losses = []
    for step in range(steps):
        loss = loss_fn(ddp, make_batch(step, rank))
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


class ZooTokens(torch.utils.data.Dataset):
    """64 fixed token rows of the zoo's VOCAB and SEQ (each row seeded by its index: any sampler, same rows)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(31 * i + 7))
