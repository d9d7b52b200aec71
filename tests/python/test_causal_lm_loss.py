"""kernelize's ForCausalLMLoss binding of transformers' causal-LM forward, against the model as transformers ships
it on the same weights (tiny random configs, no downloads): loss and every gradient for the seven families in
fp32, bf16 and fp16, ignored rows, every row ignored, tied embeddings, logits_to_keep, shift_labels,
num_items_in_batch, return_dict=False, autocast, calls that keep the model's own forward (no labels, eval mode,
generate, another loss function), the MoE router's auxiliary loss, peft LoRA, look-alikes that fall back, a
20-step AdamW lockstep, and the HF Trainer with gradient accumulation."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

import kernmap
from hf_models import FAMILIES, MOE_FAMILIES, VOCAB, batch, make_model
from kernmap.train.models import bind_layers
from tolerances import TRAINING_STEPS, loss_tol, model_gradient_bound, tol

LAYER = "ForCausalLMLoss"


def fused_copy(model):
    """A copy of `model` with only the causal-LM loss bound (the other layers keep transformers' forwards, so
    that every difference is the fused loss's)."""
    k = copy.deepcopy(model)
    report = bind_layers(k, frozenset({LAYER}), "cpu")
    (row,) = [r for r in report.rows if r.layer == LAYER]
    assert not row.fallback and row.kernel == "kernmap/linear_cross_entropy", row
    return k


def sft_labels(ids, prompt=5):
    """Labels as an SFT collator makes them: each sequence's prompt at ignore_index."""
    labels = ids.clone()
    labels[:, :prompt] = -100
    return labels


def run(model, *args, **kwargs):
    """One training forward and backward: the output and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    out = model(*args, **kwargs)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


def assert_gradients_match(got, want, dtype):
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        assert g is not None, name
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, **tol(torch.float32), msg=lambda m: f"{name}: {m}")
        else:
            bound = model_gradient_bound(dtype, w.float().abs().max().item()) + 1e-6
            diff = (g.float() - w.float()).abs().max().item()
            assert diff <= bound, f"{name}: max |diff| {diff} > {bound}"


@pytest.fixture
def chunks_of_16_rows(monkeypatch):
    """Several chunks of rows in the op even at these sizes (its chunks are ~L3 / (V x element size) rows)."""
    monkeypatch.setenv("KERNMAP_LCE_CHUNK_ROWS", "16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_loss_and_every_gradient_match_transformers(family, dtype, chunks_of_16_rows):
    model = make_model(family, dtype)
    fused = fused_copy(model)
    ids = batch(shape=(3, 17))
    want, want_grads = run(model, ids, labels=sft_labels(ids))
    got, got_grads = run(fused, ids, labels=sft_labels(ids))
    assert got.logits is None and want.logits.shape == (3, 17, VOCAB)
    assert got.loss.dtype == want.loss.dtype == torch.float32
    torch.testing.assert_close(got.loss, want.loss, **loss_tol(dtype))
    assert_gradients_match(got_grads, want_grads, dtype)


def test_every_row_ignored_is_what_transformers_gives():
    model = make_model("qwen2")
    fused = fused_copy(model)
    ids = batch()
    labels = torch.full_like(ids, -100)
    want, want_grads = run(model, ids, labels=labels)
    got, got_grads = run(fused, ids, labels=labels)
    assert want.loss.isnan() and got.loss.isnan()
    for name, w in want_grads.items():
        torch.testing.assert_close(got_grads[name], w, equal_nan=True, msg=name)


def test_tied_embeddings_accumulate_both_uses_of_the_shared_weight():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    fused = fused_copy(model)
    assert fused.lm_head.weight is fused.model.embed_tokens.weight
    ids = batch()
    want, want_grads = run(model, ids, labels=ids)
    got, got_grads = run(fused, ids, labels=ids)
    torch.testing.assert_close(got.loss, want.loss, **loss_tol(torch.float32))
    assert_gradients_match(got_grads, want_grads, torch.float32)
    # The shared weight's gradient holds the embedding's share too, not the head's alone.
    hidden = fused.model(ids).last_hidden_state[:, :-1].detach().reshape(-1, 32)
    head_loss = torch.ops.kernmap.linear_cross_entropy(hidden, fused.lm_head.weight, ids[:, 1:].reshape(-1))
    head_only = torch.autograd.grad(head_loss, fused.lm_head.weight)[0]
    assert (got_grads["model.embed_tokens.weight"] - head_only).abs().max() > 1e-4


def test_logits_to_keep():
    """Without labels the kept positions' logits, unchanged; with labels for the kept positions, the loss over them."""
    model = make_model("llama")
    fused = fused_copy(model)
    ids = batch(shape=(2, 12))
    torch.testing.assert_close(fused(ids, logits_to_keep=4).logits, model(ids, logits_to_keep=4).logits, rtol=0, atol=0)
    want, want_grads = run(model, ids, labels=ids[:, -4:], logits_to_keep=4)
    got, got_grads = run(fused, ids, labels=ids[:, -4:], logits_to_keep=4)
    assert got.logits is None
    torch.testing.assert_close(got.loss, want.loss, **loss_tol(torch.float32))
    assert_gradients_match(got_grads, want_grads, torch.float32)


def test_shift_labels_and_num_items_in_batch_as_transformers_takes_them():
    model = make_model("qwen3")
    fused = fused_copy(model)
    ids = batch(shape=(2, 10))
    shift = torch.roll(ids, 3, dims=1)  # not the labels shifted: the loss must come from these
    shift[0, :4] = -100
    for kwargs in ({"shift_labels": shift}, {"num_items_in_batch": torch.tensor(31)}, {"num_items_in_batch": 31},
                   {"shift_labels": shift, "num_items_in_batch": torch.tensor(7.0)}):
        want, want_grads = run(model, ids, labels=ids, **kwargs)
        got, got_grads = run(fused, ids, labels=ids, **kwargs)
        torch.testing.assert_close(got.loss, want.loss, **loss_tol(torch.float32), msg=str(kwargs))
        assert_gradients_match(got_grads, want_grads, torch.float32)
    plain = model(ids, labels=ids).loss
    assert abs(plain.item() - model(ids, labels=ids, shift_labels=shift).loss.item()) > 1e-3


def test_positional_labels_and_return_dict_false():
    model = make_model("mistral")
    fused = fused_copy(model)
    ids = batch()
    want = model(ids, None, None, None, None, ids, False, return_dict=False)
    got = fused(ids, None, None, None, None, ids, False, return_dict=False)
    assert isinstance(got, tuple) and len(got) == len(want) - 1  # (loss,): the logits are not there
    torch.testing.assert_close(got[0], want[0], **loss_tol(torch.float32))


def test_autocast_computes_the_head_in_the_autocast_dtype():
    model = make_model("qwen2")
    fused = fused_copy(model)
    ids = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_grads = run(model, ids, labels=ids)
        got, got_grads = run(fused, ids, labels=ids)
    torch.testing.assert_close(got.loss, want.loss, **loss_tol(torch.bfloat16))
    assert_gradients_match(got_grads, want_grads, torch.bfloat16)
    full = fused(ids, labels=ids).loss  # outside autocast: fp32 logits, another loss
    assert abs(full.item() - got.loss.item()) > 1e-5


def test_calls_that_keep_the_models_own_forward():
    """No labels (training or eval), labels in eval mode, generate, and a loss function the user set."""
    model = make_model("qwen2_moe")
    fused = fused_copy(model)
    ids = batch()
    torch.testing.assert_close(fused(ids).logits, model(ids).logits, rtol=0, atol=0)
    only_shift = fused(ids, shift_labels=ids)  # transformers computes a loss only when labels are given
    assert only_shift.loss is None and only_shift.logits is not None
    model.eval()
    fused.eval()
    want, got = model(ids, labels=ids), fused(ids, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
    torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)
    torch.testing.assert_close(fused.generate(ids, max_new_tokens=4, do_sample=False),
                               model.generate(ids, max_new_tokens=4, do_sample=False), rtol=0, atol=0)
    fused.train()
    calls = []

    def my_loss(logits, labels, vocab_size, **kwargs):
        calls.append(logits.shape)
        return logits.float().mean()

    fused.loss_function = my_loss
    out = fused(ids, labels=ids)
    assert calls == [(2, 9, VOCAB)] and out.logits.shape == (2, 9, VOCAB)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_router_auxiliary_loss_is_added(family):
    model = make_model(family)
    model.config.output_router_logits = True
    model.router_aux_loss_coef = 0.5  # large, so that a missing auxiliary loss cannot hide in the tolerance
    fused = fused_copy(model)
    ids = batch()
    want, want_grads = run(model, ids, labels=ids)
    got, got_grads = run(fused, ids, labels=ids)
    assert got.logits is None and got.aux_loss is not None
    torch.testing.assert_close(got.aux_loss, want.aux_loss, **loss_tol(torch.float32))
    torch.testing.assert_close(got.loss, want.loss, **loss_tol(torch.float32))
    assert_gradients_match(got_grads, want_grads, torch.float32)
    without = model(ids, labels=ids, output_router_logits=False).loss
    assert abs(want.loss.item() - without.item()) > 0.1


def test_a_copy_of_a_kernelized_model_is_bound_to_itself():
    model = make_model("qwen2")
    fused = fused_copy(model)
    twin = copy.deepcopy(fused)
    ids = batch()
    _, twin_grads = run(twin, ids, labels=ids)
    assert all(p.grad is None for p in fused.parameters())
    assert_gradients_match(twin_grads, run(model, ids, labels=ids)[1], torch.float32)


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_twenty_adamw_steps_in_lockstep(family):
    model = make_model(family)
    fused = fused_copy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01) for m in (model, fused)]
    for step in range(20):
        ids = batch(seed=100 + step)
        labels = sft_labels(ids, prompt=1 + step % 4)
        losses = []
        for m, opt in zip((model, fused), opts):
            opt.zero_grad(set_to_none=True)
            loss = m(ids, labels=labels).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=TRAINING_STEPS["loss_rtol"], abs=TRAINING_STEPS["loss_atol"]), \
            f"step {step}: {losses}"


def test_hf_trainer_with_gradient_accumulation_matches_the_unfused_run(tmp_path):
    """Two micro-batches a step with different counts of labelled tokens: the Trainer passes num_items_in_batch
    (the whole step's count), which the fused loss must divide by for the step to equal the unfused one."""
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(3)
    data = []
    for i in range(8):
        ids = torch.randint(0, VOCAB, (9,), generator=g)
        data.append({"input_ids": ids, "labels": sft_labels(ids[None], prompt=1 + 2 * (i % 4))[0]})
    seen = []

    def recording(hidden, weight, labels, bias, ignore_index, num_items_in_batch):
        seen.append(num_items_in_batch)
        return torch.ops.kernmap.linear_cross_entropy(hidden, weight, labels, bias, ignore_index, num_items_in_batch)

    kernel = kernmap.Kernel(name="test/recording_linear_cross_entropy", layer=LAYER, fn=recording,
                            devices=("cpu",), has_backward=True)
    model = make_model("qwen2")
    fused = copy.deepcopy(model)
    with kernmap.use_mapping({LAYER: {"cpu": kernel}}):
        report = bind_layers(fused, frozenset({LAYER}), "cpu")
    assert [r.kernel for r in report.rows if r.layer == LAYER] == [kernel.name]
    losses = []
    for m in (model, fused):
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, max_steps=2, learning_rate=1e-3, logging_steps=1,
                                 save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
        trainer = Trainer(model=m, args=args, train_dataset=data)
        trainer.train()
        losses.append([h["loss"] for h in trainer.state.log_history if "loss" in h])
    assert len(seen) == 4 and all(n is not None for n in seen)  # 2 steps x 2 micro-batches, each with the count
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    bound = TRAINING_STEPS["param_fraction_of_lr"] * args.learning_rate  # AdamW's steps (test_kernelize_models)
    for (name, p), q in zip(model.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q, p, rtol=bound, atol=bound, msg=lambda m: f"{name}: {m}")


LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False)


def lora(model, targets):
    torch.manual_seed(7)
    return get_peft_model(model, LoraConfig(target_modules=targets, **LORA))


def test_lora_without_the_head_is_fused_and_trains_the_adapters():
    base = make_model("qwen2")
    plain = lora(copy.deepcopy(base), "all-linear")  # peft's all-linear leaves the output layer out
    model = lora(copy.deepcopy(base), "all-linear")
    report = kernmap.kernelize(model, mode="training")
    (row,) = [r for r in report.rows if r.layer == LAYER]
    assert row.path == "base_model.model" and not row.fallback
    ids = batch()
    want, want_grads = run(plain, ids, labels=ids)
    got, got_grads = run(model, ids, labels=ids)
    assert got.logits is None
    torch.testing.assert_close(got.loss, want.loss, **loss_tol(torch.float32))
    trained = {n: g for n, g in want_grads.items() if g is not None}
    assert trained and all("lora_" in n for n in trained)
    assert_gradients_match({n: got_grads[n] for n in trained}, trained, torch.float32)


def test_lora_on_the_head_falls_back_with_the_reason():
    base = make_model("qwen2")
    model = lora(copy.deepcopy(base), ["q_proj", "lm_head"])
    report = kernmap.kernelize(model, mode="training")
    (row,) = [r for r in report.rows if r.layer == LAYER]
    assert row.fallback and row.reason.startswith("lm_head is wrapped by peft (peft.tuners.lora.layer.Linear)")
    # Kernelized before peft wrapped the head: each call sees the LoRA head and runs the model's own forward.
    before = copy.deepcopy(base)
    kernmap.kernelize(before, mode="training")
    before = lora(before, ["q_proj", "lm_head"])
    plain = lora(copy.deepcopy(base), ["q_proj", "lm_head"])
    ids = batch()
    want, got = plain(ids, labels=ids), before(ids, labels=ids)
    assert got.logits is not None
    torch.testing.assert_close(got.loss, want.loss, **loss_tol(torch.float32))  # its other layers are kernelized


def _row(model):
    (row,) = [r for r in kernmap.kernelize(model, mode="training").rows if r.layer == LAYER]
    return row


def test_look_alikes_fall_back_with_the_reason():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8)
    gemma = _row(Gemma2ForCausalLM(Gemma2Config(**small)))
    assert gemma.fallback and gemma.reason == ("Gemma2ForCausalLM: its forward assigns logits again "
                                               "(logits = logits / self.config.final_logit_softcapping)")

    custom = make_model("qwen2")
    custom.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.sum()
    row = _row(custom)
    assert row.fallback and row.reason.startswith("Qwen2ForCausalLM.loss_function is <lambda>, not transformers'")

    class ScaledHead(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    scaled = make_model("qwen2")
    scaled.lm_head = ScaledHead(32, VOCAB, bias=False)
    row = _row(scaled)
    assert row.fallback and row.reason == "lm_head is ScaledHead, whose forward is not nn.Linear's (weight @ hidden + bias)"
    ids = batch()
    assert scaled(ids, labels=ids).logits is not None


def test_the_report_says_what_changes_and_disabling_restores_the_forward(monkeypatch):
    model = make_model("qwen2")
    row = _row(model)
    assert row.reason.endswith("training calls with labels: loss fused from lm_head.weight, outputs.logits None")
    ids = batch()
    assert model(ids, labels=ids).logits is None
    monkeypatch.setenv("KERNMAP_DISABLE", LAYER)
    row = _row(model)
    assert row.fallback and "forward" not in model.__dict__
    assert model(ids, labels=ids).logits is not None
