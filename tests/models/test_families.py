"""More HuggingFace families beyond the decoders, as their authors wrote them: an encoder (BERT), an
encoder-decoder (T5), a vision transformer (ViT) and a speech encoder-decoder (Whisper), trained a
step on 4 simulated ranks -- data parallel (the batch split) and Megatron tensor parallel (DTensor's
styles by module name, ``gt.nn.from_parallel_styles``: q/k/v and the first MLP layer column, the
attention output and the second MLP layer row) -- with no fallback, the loss and every gradient
equal to one device's in float64 (models_helpers.TOL: the same sums in another order)."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers

import globaltensor as gt
import globaltensor.nn as gnn
from models_helpers import TOL, no_fallback

S, B = gt.sbp.split, gt.sbp.broadcast
H, HEADS, FFN = 32, 4, 64


def _bert():
    model = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=64, hidden_size=H, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=FFN,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    ids = torch.randint(1, 64, (8, 12), generator=torch.Generator().manual_seed(1))
    layer = "bert.encoder.layer.*"
    styles = {f"{layer}.attention.self.query": "colwise", f"{layer}.attention.self.key": "colwise",
              f"{layer}.attention.self.value": "colwise", f"{layer}.attention.output.dense": "rowwise",
              f"{layer}.intermediate.dense": "colwise", f"{layer}.output.dense": "rowwise"}
    return model, (ids,), lambda m, ids: m(input_ids=ids).logits.square().mean(), styles


def _t5():
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=H, d_kv=H // HEADS, d_ff=FFN, num_layers=1, num_decoder_layers=1, num_heads=HEADS,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))
    gen = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(1, 64, (8, 10), generator=gen), torch.randint(1, 64, (8, 6), generator=gen)
    styles = {}
    for attention in ("SelfAttention", "EncDecAttention"):
        styles.update({f"*.{attention}.{p}": "colwise" for p in "qkv"})
        styles[f"*.{attention}.o"] = "rowwise"
    styles.update({"*.DenseReluDense.wi": "colwise", "*.DenseReluDense.wo": "rowwise"})
    return model, (ids, labels), lambda m, ids, labels: m(input_ids=ids, labels=labels).logits.square().mean(), styles


def _vit():
    model = transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=H, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=FFN, image_size=16,
        patch_size=4, num_channels=3, num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    pixels = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    layer = "vit.layers.*"
    styles = {**{f"{layer}.attention.{p}_proj": "colwise" for p in "qkv"}, f"{layer}.attention.o_proj": "rowwise",
              f"{layer}.mlp.fc1": "colwise", f"{layer}.mlp.fc2": "rowwise"}
    return model, (pixels,), lambda m, x: m(pixel_values=x).logits.square().mean(), styles


def _whisper():
    model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        vocab_size=64, d_model=H, encoder_layers=1, decoder_layers=1, encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, num_mel_bins=8,
        max_source_positions=16, max_target_positions=16, pad_token_id=0, bos_token_id=0, eos_token_id=0,
        decoder_start_token_id=0, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0))
    gen = torch.Generator().manual_seed(1)
    features, ids = torch.randn(8, 8, 32, generator=gen), torch.randint(1, 64, (8, 6), generator=gen)
    styles = {}
    for attention in ("self_attn", "encoder_attn"):
        styles.update({f"*.{attention}.{p}_proj": "colwise" for p in "qkv"})
        styles[f"*.{attention}.out_proj"] = "rowwise"
    styles.update({"*.fc1": "colwise", "*.fc2": "rowwise"})
    return model, (features, ids), \
        lambda m, f, ids: m(input_features=f, decoder_input_ids=ids).logits.square().mean(), styles


FAMILIES = {"bert": _bert, "t5": _t5, "vit": _vit, "whisper": _whisper}


@pytest.mark.parametrize("layout", ["dp", "tp"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_trains_a_step_like_one_device(p1, family, layout):
    torch.manual_seed(0)
    model, args, loss_of, styles = FAMILIES[family]()
    model = model.double().train()
    args = tuple(a.double() if a.is_floating_point() else a for a in args)
    reference = copy.deepcopy(model)
    gnn.distribute_module(model, p1, styles if layout == "tp" else {})
    batch = S(0) if layout == "dp" else B
    with no_fallback():
        loss = loss_of(model, *(gt.distribute(a, p1, batch) for a in args))
        loss.backward()
    want = loss_of(reference, *args)
    want.backward()
    torch.testing.assert_close(loss.full_tensor(), want, **TOL)
    split = 0
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        split += any(v.is_split for v in p.sbp)
        if q.grad is None:                              # frozen (Whisper's sinusoidal positions)
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, **TOL, msg=lambda m: f"{name}: {m}")
    assert (split > 0) == (layout == "tp")
