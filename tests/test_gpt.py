import math

import pytest
import torch
from torch import nn

from lightning_async_pp import PipelineModule
from lightning_async_pp.models import GPT


def tiny_gpt(**overrides) -> GPT:
    kwargs = dict(block_size=16, n_layer=2, n_head=2, n_embd=32)
    kwargs.update(overrides)
    torch.manual_seed(0)
    return GPT(**kwargs)


def batch(b: int = 3, block_size: int = 16) -> torch.Tensor:
    return torch.randint(0, 256, (b, block_size + 1), generator=torch.Generator().manual_seed(1))


def test_layers_have_the_contract_names_and_no_weight_tying():
    m = tiny_gpt()
    assert isinstance(m, PipelineModule)
    assert isinstance(m.embedding.token, nn.Embedding) and isinstance(m.embedding.position, nn.Embedding)
    assert isinstance(m.blocks, nn.ModuleList) and len(m.blocks) == 2
    assert isinstance(m.head.norm, nn.LayerNorm)
    assert isinstance(m.head.proj, nn.Linear) and m.head.proj.bias is None
    assert list(m.pipeline_layers()) == [m.embedding, *m.blocks, m.head]
    # Every parameter belongs to exactly one pipeline layer (nothing shared across a possible stage boundary).
    layer_params = [id(p) for layer in m.pipeline_layers() for p in layer.parameters()]
    assert len(layer_params) == len(set(layer_params)) == len(list(m.parameters()))
    assert m.embedding.token.weight.data_ptr() != m.head.proj.weight.data_ptr()


def test_pipeline_layers_split_in_two_stages_compose_to_the_forward():
    m = tiny_gpt(dropout=0.1).eval()  # dropout on, eval mode: any hidden randomness would show up
    b = batch()
    layers = m.pipeline_layers()
    x = m.pipeline_input(b)
    assert torch.equal(x, b[:, :-1])
    for stage in (layers[:2], layers[2:]):  # as two pipeline stages would run them
        for layer in stage:
            x = layer(x)
    expected = m(b)
    assert x.shape == (3, 16, 256)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)


def test_attention_is_causal():
    m = tiny_gpt().eval()
    b = batch()
    changed = b.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    out, out_changed = m(b), m(changed)
    torch.testing.assert_close(out[:, :10], out_changed[:, :10])
    assert not torch.allclose(out[:, 10:], out_changed[:, 10:])


def test_loss_at_init_is_close_to_ln_vocab_size():
    m = tiny_gpt(n_layer=4, n_embd=64, n_head=4)
    b = torch.randint(0, 256, (16, 17), generator=torch.Generator().manual_seed(2))
    loss = m.pipeline_loss(m(b), b)
    assert abs(loss.item() - math.log(256)) < 0.1


def test_loss_targets_are_the_inputs_shifted_by_one():
    m = tiny_gpt()
    b = batch()
    # Logits that put all mass on the next token give (almost) zero loss; on the current token, a large loss.
    perfect = nn.functional.one_hot(b[:, 1:], 256).float() * 100
    wrong = nn.functional.one_hot(b[:, :-1], 256).float() * 100
    assert m.pipeline_loss(perfect, b).item() < 1e-3
    assert m.pipeline_loss(wrong, b).item() > 10


def test_residual_projections_get_the_scaled_init():
    m = tiny_gpt(n_layer=8, n_embd=128, n_head=4)
    std = m.blocks[0].mlp.out_proj.weight.std().item()
    assert std == pytest.approx(0.02 / math.sqrt(16), rel=0.1)
    assert m.blocks[0].mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_optimizer_decays_matrices_but_not_biases_or_norms():
    m = tiny_gpt(learning_rate=1e-3)
    opt = m.configure_optimizers()
    assert isinstance(opt, torch.optim.AdamW)
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() == 1 for p in plain["params"])
    name = {id(p): n for n, p in m.named_parameters()}
    decayed_names, plain_names = ({name[id(p)] for p in g["params"]} for g in (decayed, plain))
    assert decayed_names | plain_names == set(name.values())
    assert "head.norm.weight" in plain_names and "blocks.0.attn.qkv.bias" in plain_names
    assert opt.defaults["lr"] == 1e-3


def test_a_layer_unfrozen_by_base_finetuning_joins_the_models_adamw_and_steps_as_adamw():
    # Lightning's BaseFinetuning adds the layer it unfreezes as a parameter group without names: the model's own
    # groups must be without names too (torch refuses to mix), and the group then steps as a plain AdamW would.
    from lightning.pytorch.callbacks import BaseFinetuning

    m = tiny_gpt()
    BaseFinetuning.freeze(m.embedding)
    opt = m.configure_optimizers()
    BaseFinetuning.unfreeze_and_add_param_group(m.embedding, opt, lr=1e-2)
    before = [p.detach().clone() for p in m.embedding.parameters()]
    copies = [p.detach().clone().requires_grad_() for p in m.embedding.parameters()]
    reference = torch.optim.AdamW(copies, lr=1e-2, betas=(0.9, 0.95))  # the model's AdamW defaults
    m.pipeline_loss(m(batch()), batch()).backward()
    for copy, p in zip(copies, m.embedding.parameters()):
        copy.grad = p.grad.clone()
    opt.step()
    reference.step()
    for copy, p, was in zip(copies, m.embedding.parameters(), before):
        assert not torch.equal(p, was)  # it trained
        torch.testing.assert_close(p, copy, rtol=0, atol=0)


def test_a_few_steps_overfit_one_batch():
    m = tiny_gpt(learning_rate=3e-3)
    opt = m.configure_optimizers()
    b = batch()
    first = m.pipeline_loss(m(b), b).item()
    for _ in range(20):
        opt.zero_grad()
        loss = m.pipeline_loss(m(b), b)
        loss.backward()
        opt.step()
    assert loss.item() < first - 1.0


def test_sequences_longer_than_block_size_are_rejected():
    m = tiny_gpt()
    with pytest.raises(ValueError, match="block_size"):
        m(torch.zeros(1, 18, dtype=torch.long))
